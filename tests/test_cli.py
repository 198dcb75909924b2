"""The ``embserve`` command line, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from infer.artifact.load import load
from infer.cli import main
from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.weights import random_weights


def _write_inputs(tmp_path):
    spec = ModelSpec(
        (
            TableConfig("users", 500, 32, ("user",)),
            TableConfig("items", 300, 16, ("item", "clicked"), PoolingType.MEAN),
        )
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save(random_weights(spec), tmp_path / "ckpt.pt")
    return spec


def test_export_then_inspect(tmp_path, capsys):
    _write_inputs(tmp_path)
    out = tmp_path / "art"
    code = main(
        [
            "export",
            "--spec", str(tmp_path / "spec.json"),
            "--weights", str(tmp_path / "ckpt.pt"),
            "--out", str(out),
            "--dtype", "int4",
            "--table-dtype", "items=fp16",
        ]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "users" in printed and "int4" in printed and "exported" in printed
    runtime = load(out)
    assert [t.data_type for t in runtime.spec.tables] == [DataType.INT4, DataType.FP16]
    assert main(["inspect", str(out)]) == 0
    table = capsys.readouterr().out
    assert "users" in table and "clicked" in table and "32:48" in table and "sha256" in table
    assert main(["inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["input_schema"]["feature_order"] == ["user", "item", "clicked"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--table-dtype", "nosuch=fp16"], "unknown table"),
        (["--table-dtype", "users"], "NAME=DTYPE"),
        (["--dtype", "int3"], "unknown data type"),
    ],
)
def test_export_errors_are_one_line_messages(tmp_path, capsys, extra, message):
    _write_inputs(tmp_path)
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt")]
    code = main([*args, "--out", str(tmp_path / "art"), *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("embserve: error:") and message in err
    assert not (tmp_path / "art").exists()


def test_export_with_mismatched_checkpoint_names_the_table(tmp_path, capsys):
    spec = _write_inputs(tmp_path)
    weights = random_weights(spec)
    weights["items"] = torch.randn(299, 16)
    torch.save(weights, tmp_path / "ckpt.pt")
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt")]
    assert main([*args, "--out", str(tmp_path / "art")]) == 2
    assert "'items'" in capsys.readouterr().err


def test_inspect_of_a_non_artifact_fails_cleanly(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "manifest.json" in capsys.readouterr().err


@pytest.mark.slow
def _native_binary_built() -> bool:
    from infer.errors import ConfigError
    from server.native import find_binary

    try:
        find_binary()
    except ConfigError:
        return False
    return True


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "infer.cli", "demo", "--out", str(tmp_path / "demo"), "--batch-size", "64"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "rel. error vs fp32" in out
    for table in ("user_id", "ad_id", "query_token"):
        assert table in out
    assert "M lookups/s" in out and "predict: scores [64]" in out
    # embserve serve, then embserve-server when it is built (make server): each answers equal, each drains
    servers = 2 if _native_binary_built() else 1
    assert out.count("equal to the in-process runtime: True") == servers, out
    assert out.count("server stopped on SIGTERM with exit code 0") == servers, out
    assert ("with the native binary embserve-server" in out) == (servers == 2), out
    runtime = load(tmp_path / "demo")
    assert runtime.has_dense and len(runtime.spec.tables) == 8


def test_inspect_prints_binary_sizes_with_binary_units(tmp_path, capsys):
    """Issue 39 item 7: sizes divided by 1024**2 are MiB, not MB (a 2 MB table is 1.9 MiB)."""
    import re

    spec = ModelSpec((TableConfig("big", 30_000, 64, ("f",)), TableConfig("small", 100, 8, ("g",))))
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.save(random_weights(spec), tmp_path / "ckpt.pt")
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt")]
    assert main([*args, "--world-size", "2", "--out", str(tmp_path / "art")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "art")]) == 0
    printed = capsys.readouterr().out
    # the big table's INT8 rows: 30,000 x (64 codes + 4 bytes scale/bias) = 2,040,000 bytes = 1.95 MiB (2.04 MB)
    found = re.search(r"big\s+resident\s+([\d.]+) (\w+) resident", printed)
    assert found is not None, printed
    assert found[2] == "MiB" and abs(float(found[1]) - 30_000 * 68 / 1024**2) < 0.1
    assert "GiB" in printed  # the memory tiers line
    assert not re.search(r"\d (MB|GB|KB)\b", printed.split("\nfile ")[0]), printed


def _parsers(parser, name="embserve"):
    """Every parser of the CLI with its command path, subparsers (server.cli's too) included."""
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, child in action.choices.items():
                yield from _parsers(child, f"{name} {command}")


def test_every_option_with_a_default_shows_it_in_its_help():
    """Issue 39 item 7: `--help` of every subcommand shows each option's default (a flag's off, None, an empty
    list and suppressed help have none to show)."""
    import argparse

    from infer.cli import build_parser

    checked = []
    for command, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            default = action.default
            if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0:
                continue
            if default is None or default is argparse.SUPPRESS or default in ("", []):
                continue
            shown = " ".join(formatter._expand_help(action).split())
            assert "default" in shown and str(default) in shown, f"{command} {action.option_strings[0]}: {shown!r}"
            checked.append(f"{command} {action.option_strings[0]}")
    assert "embserve serve --port" in checked and "embserve plan --batch-size" in checked and len(checked) > 40


def test_serve_help_shows_port_and_max_batch_defaults(capsys):
    """In this process (the demo test runs ``python -m infer.cli`` itself): a second torch import is not needed
    to print the help."""
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert "(default: 50051)" in flat and "examples per batched forward (default: 4096)" in flat


def test_a_streamed_export_prints_the_measured_error_of_what_it_wrote(tmp_path, capsys):
    """Issue 39 item 7: a streamed export (mapped, the default) printed no accuracy table; it now prints each
    table's error on a probe batch, which must equal fp32 embedding_bag over the full weights vs the artifact."""
    import re

    import torch.nn.functional as F

    from infer.features import SparseFeatures

    spec = _write_inputs(tmp_path)  # users SUM; items MEAN, read by two features
    weights = torch.load(tmp_path / "ckpt.pt")
    args = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "ckpt.pt")]
    assert main([*args, "--table-dtype", "items=int4", "--out", str(tmp_path / "art")]) == 0
    printed = capsys.readouterr().out
    assert "streamed 2 tables" in printed and "accuracy of the exported artifact vs fp32" in printed
    shown = {m[1]: float(m[2]) / 100 for m in re.finditer(r"^(users|items)\s+int[48]\s+([\d.]+)%", printed, re.M)}
    # the same probe the table names: 256 bags x 20 ids per feature, the seeded random batch
    batch = SparseFeatures.random(spec)
    got = load(tmp_path / "art").lookup(batch)
    ids = batch.values.view(len(spec.features), -1)
    for table in spec.tables:
        expected, served = [], []
        for f, info in enumerate(spec.features):
            if info.table == table.name:
                mode = info.pooling.value
                offsets = torch.arange(0, ids.shape[1], 20)
                expected.append(F.embedding_bag(ids[f], weights[table.name], offsets, mode=mode))
                served.append(got[:, info.column_start : info.column_end])
        error = torch.linalg.vector_norm(torch.cat(served) - torch.cat(expected)) / torch.linalg.vector_norm(
            torch.cat(expected)
        )
        assert shown[table.name] == pytest.approx(float(error), abs=1e-5)
    assert shown["users"] < 0.01 < shown["items"]  # INT8 ~0.5 %, INT4 several %


def test_plan_with_eval_refuses_a_pooling_nobody_stated(tmp_path, capsys):
    """The model's loss depends on each table's pooling: --eval does not guess it either (issue 39 item 1)."""
    spec = ModelSpec((TableConfig("users", 50, 8, ("user",)),), num_dense_features=2)
    data = json.loads(spec.to_json())
    data["tables"][0]["pooling"] = None
    (tmp_path / "spec.json").write_text(json.dumps(data))
    torch.save(random_weights(spec), tmp_path / "ckpt.pt")
    args = ["plan", "--spec", str(tmp_path / "spec.json"), "--world-size", "1", "--compute-device", "cpu"]
    args += ["--weights", str(tmp_path / "ckpt.pt"), "--eval", str(tmp_path / "eval.pt"), "--memory-budget", "1MB"]
    assert main([*args, "--out", str(tmp_path / "plan.json")]) == 2
    message = capsys.readouterr().err
    assert "table(s) ['users'] is not stated" in message and '"pooling" to "sum" or "mean"' in message
    # the plan itself does not depend on the pooling: without --eval it is made
    assert main([*args[:-4], "--out", str(tmp_path / "plan.json")]) == 0


def test_the_parser_and_a_refused_flag_do_not_import_torch():
    """``import infer`` imports torch on first use of a name that needs it: building every subcommand's parser and
    refusing a bad flag run without it (each ``embserve`` that fails early would pay 2-3 CPU-s)."""
    script = (
        "import sys, infer, infer.cli\n"
        "infer.cli.build_parser()\n"
        "try:\n"
        "    infer.cli.main(['export', '--no-such-flag'])\n"
        "except SystemExit as done:\n"
        "    assert done.code == 2, done.code\n"
        "print(sorted(name for name in sys.modules if name.split('.')[0] in ('torch', 'numpy')))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_every_public_name_of_infer_resolves():
    """What the lazy ``infer`` offers is what it exports: ``from infer import NAME`` works for each of ``__all__``
    (in this process, where torch is already imported), and each is the object of the module that defines it."""
    import importlib

    import infer

    assert sorted(set(infer.__all__) - set(dir(infer))) == []
    for name in infer.__all__:
        value = getattr(infer, name)
        assert value is not None, name
        if not name.startswith("__"):
            assert value is vars(importlib.import_module(value.__module__))[name], name
    with pytest.raises(AttributeError, match="no_such_name"):
        infer.no_such_name  # noqa: B018
