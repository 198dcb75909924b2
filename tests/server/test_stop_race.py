"""A stopping server refuses, never cancels: 16 clients (embserve.v1, OIP gRPC, OIP REST) send without pause
through SIGTERM until the `embserve serve` process has exited. Every call ends OK (equal to the in-process
runtime) or with a refusal clients retry (UNAVAILABLE, HTTP 503, connection refused): none CANCELLED, none
reset or hung; the process exits 0. The clients live in ``tests/support/stop_race.py`` (``bench/soak.py
--stop-rounds`` runs more rounds of the same)."""

from __future__ import annotations

import pytest

from tests.support.stop_race import PROTOCOLS, race_stop

CLIENTS = 16


def _check(result, rounds_label: str) -> None:
    summary = result.summary()
    assert result.exit_code == 0, (rounds_label, summary, result.log[-3000:])
    assert result.cancelled == 0 and result.lost == 0, (rounds_label, summary)
    for protocol in PROTOCOLS:  # every protocol was served before the stop (the race is real)
        assert result.outcomes[f"{protocol} OK"] > 0, (rounds_label, summary)
    assert "Traceback" not in result.log, result.log[-3000:]


# grace 0: the refusals start while every client's call is being served; 0.3 s: after a grace under load
@pytest.mark.parametrize("grace", ["0", "0.3"])
def test_sigterm_under_16_clients_cancels_nothing_and_loses_nothing(sparse_artifact, sparse_runtime, tmp_path, grace):
    result = race_stop(
        sparse_artifact,
        sparse_runtime,
        tmp_path / "serve.log",
        CLIENTS,
        ("--drain-grace-s", grace, "--max-delay-us", "500"),
    )
    _check(result, f"grace {grace}")


@pytest.mark.slow
def test_sigterm_under_16_clients_over_ten_rounds(sparse_artifact, sparse_runtime, tmp_path):
    for index in range(10):
        grace = ("0", "0.2", "1")[index % 3]
        result = race_stop(
            sparse_artifact, sparse_runtime, tmp_path / f"serve{index}.log", CLIENTS, ("--drain-grace-s", grace)
        )
        _check(result, f"round {index + 1}, grace {grace}")
