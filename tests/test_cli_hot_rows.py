"""The hot-row cache from the command line: ``embserve serve|run --hot-rows N --hot-rows-sample FILE``.

A real server on loopback (``python -m infer.cli serve``) with the cache on answers lookups equal to fp32
``F.embedding_bag`` on the dequantized tables; the cache is observed from the line the command prints about it.
Bad flags and samples are one-line errors naming the flag, file, feature and table, and the fix.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.cli import main
from infer.config import ModelSpec, PoolingType, TableConfig
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.app import SERVING_LINE
from server.client import EmbserveClient
from tests.conftest import random_batch
from tests.server.native_support import SERVER_KINDS, native_binary
from tests.support.call_contract import Reference, assert_matches

ROOT = Path(__file__).resolve().parents[1]


def hot_spec() -> ModelSpec:
    return ModelSpec(
        (
            TableConfig("users", 2000, 32, ("user",)),
            TableConfig("items", 900, 16, ("item", "clicked"), PoolingType.MEAN),
        )
    )


@pytest.fixture(scope="module")
def mapped(tmp_path_factory):  # type: ignore[no-untyped-def]
    """(spec, fp32 reference, mapped artifact, sample file): the sample reads rows 0..39 of users and rows 5..14 of
    items (through both of its features) often, a few others once."""
    spec = hot_spec()
    model = quantize(spec, random_weights(spec, seed=5))
    folder = tmp_path_factory.mktemp("hot")
    path = export(model, folder / "artifact")
    sample = {
        "user": [*range(40)] * 5 + [1500, 1999],
        "item": [*range(5, 15)] * 3 + [800],
        "clicked": [*range(5, 15)] * 2,
    }
    (folder / "sample.json").write_text(json.dumps(sample))
    return spec, Reference(spec, model), path, folder / "sample.json"


@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_serve_with_hot_rows_answers_the_fp32_reference(mapped, tmp_path, kind):
    spec, reference, path, sample = mapped
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "infer.cli", "serve", str(path), "--host", "127.0.0.1", "--port", "0"]
    if kind == "native":  # the rows chosen by the same Python code, served by embserve-server
        native_binary()
        command.append("--native")
    else:
        command.append("--python")
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [*command, "--hot-rows", "50", "--hot-rows-sample", str(sample)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(SERVING_LINE), (line, log.read_text()[-2000:])
        port = int(line.rsplit(" ", 1)[1])
        # 40 user rows + 10 item rows are the 50 most read: all of them cached, over both tables
        assert "hot-row cache: 50 rows of 2 tables resident" in log.read_text()
        hot = {"user": list(range(40)), "item": list(range(5, 15)), "clicked": list(range(5, 15))}
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            for seed in range(3):
                batch = random_batch(spec, 33, max_len=9, weighted=seed == 2, seed=seed)
                assert_matches(client.lookup(batch), reference.pooled(batch))
            # bags of hot rows only, and hot and cold rows mixed
            values = torch.tensor(hot["user"][:6] + [1999, 3] + hot["item"][:3] + [899] + hot["clicked"][:2])
            lengths = torch.tensor([6, 2, 3, 1, 2, 0], dtype=torch.int32)
            batch = SparseFeatures(spec.feature_names, values, lengths)
            assert_matches(client.lookup(batch), reference.pooled(batch))
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def test_run_with_hot_rows_reports_the_cache(mapped, capsys):
    _, _, path, sample = mapped
    assert main(["run", str(path), "--iterations", "1", "--hot-rows", "12", "--hot-rows-sample", str(sample)]) == 0
    assert "hot-row cache: 12 rows of 1 tables resident" in capsys.readouterr().out  # the 12 most read are users'


def test_hot_rows_from_an_npz_sample(mapped, tmp_path, capsys):
    _, _, path, _ = mapped
    np.savez(tmp_path / "sample.npz", item=np.array([3, 3, 3, 7], dtype=np.int64))
    assert (
        main(
            [
                "run",
                str(path),
                "--iterations",
                "1",
                "--hot-rows",
                "5",
                "--hot-rows-sample",
                str(tmp_path / "sample.npz"),
            ]
        )
        == 0
    )
    assert "hot-row cache: 2 rows of 1 tables resident" in capsys.readouterr().out


def _error(capsys, *argv: str) -> str:  # type: ignore[no-untyped-def]
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("embserve: error: "), err
    return err[0]


@pytest.mark.parametrize("command", ["run", "serve --python", "serve --native"])
def test_bad_hot_row_flags_are_one_line_errors(mapped, tmp_path, capsys, command):
    spec, _, path, sample = mapped
    # --native: the same checks, before the binary is looked for (in this process, so every case here is refused)
    verb, *native = command.split()

    def error(*flags: str) -> str:
        return _error(capsys, verb, str(path), *native, *flags)

    message = error("--hot-rows", "0", "--hot-rows-sample", str(sample))
    assert "--hot-rows must be at least 1, got 0" in message
    message = error("--hot-rows", "10")
    assert "--hot-rows N and --hot-rows-sample FILE go together" in message
    missing = tmp_path / "nope.json"
    message = error("--hot-rows", "10", "--hot-rows-sample", str(missing))
    assert str(missing) in message and "write JSON" in message
    (tmp_path / "garbage.json").write_bytes(b"\x00 not json")
    message = error("--hot-rows", "10", "--hot-rows-sample", str(tmp_path / "garbage.json"))
    assert str(tmp_path / "garbage.json") in message and "hot-row sample" in message
    (tmp_path / "wide.json").write_text(json.dumps({"clicked": [5, 900]}))
    message = error("--hot-rows", "10", "--hot-rows-sample", str(tmp_path / "wide.json"))
    assert "'clicked' has ids outside [0, 900) (the rows of its table 'items'); fix the sample" in message
    (tmp_path / "other.json").write_text(json.dumps({"nobody": [1]}))
    message = error("--hot-rows", "10", "--hot-rows-sample", str(tmp_path / "other.json"))
    assert "unknown feature 'nobody'" in message


def test_hot_rows_need_the_torchscript_backend_and_a_mapped_artifact(mapped, tmp_path, capsys):
    spec, _, path, sample = mapped
    flags = ("--hot-rows", "5", "--hot-rows-sample", str(sample))
    message = _error(capsys, "run", str(path), "--backend", "onnxruntime", *flags)
    assert "hot_rows applies to the torchscript backend" in message
    embedded = export(quantize(spec, random_weights(spec, seed=5)), tmp_path / "embedded", weights="embedded")
    message = _error(capsys, "run", str(embedded), *flags)
    assert "hot_rows needs a mapped artifact" in message
