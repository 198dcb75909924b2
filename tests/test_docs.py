"""The docs' generated reference pages say what the code says: every flag of every ``embserve`` command, every
rpc/message/field of the protos, every metric of the server's registry and every error kind, each read
independently of the generator (argparse's own help, protobuf's descriptors, a scrape of a live registry, the
error enums)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import infer.errors as errors
from infer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sections(markdown: str) -> dict[str, str]:
    """``## `embserve X` `` heading -> its text."""
    parts = re.split(r"^## `([^`]+)`\n", markdown, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _parsers(parser: argparse.ArgumentParser, path: str = "embserve"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_cli_reference_lists_every_flag_of_every_command():
    sections = _sections(_generate().cli_reference())
    commands = {path: parser for path, parser in _parsers(build_parser()) if path != "embserve"}
    assert set(sections) == set(commands)
    for path, parser in commands.items():
        text = sections[path]
        rows = [line for line in text.splitlines() if line.startswith("| ")]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue  # --help, and flags a supervisor passes to its own workers
            names = action.option_strings or [action.metavar or action.dest.upper()]
            row = [r for r in rows if all(f"`{name}`" in r.split("|")[1] for name in names)]
            assert len(row) == 1, f"{path}: {names} not listed once"
            assert action.help, f"{path} {names}: no help= (the reference would show an empty row)"
            if action.help:
                words = re.sub(r"%\([a-z]+\)s", "", action.help).split()[:4]
                assert " ".join(words).replace("|", "\\|") in row[0], f"{path} {names}: its help is not shown"


def test_cli_reference_shows_the_defaults_help_shows():
    """``embserve serve --help`` (argparse's own formatting) and the reference agree on a default."""
    sections = _sections(_generate().cli_reference())
    serve = dict(_parsers(build_parser()))["embserve serve"]
    assert "(default: 50051)" in " ".join(serve.format_help().split())
    port_row = next(line for line in sections["embserve serve"].splitlines() if line.startswith("| `--port`"))
    assert "(default: 50051)" in port_row


def test_protos_reference_lists_every_rpc_message_and_field():
    from server.proto import inference_pb2, open_inference_grpc_pb2

    text = _generate().protos_reference()
    for module in (inference_pb2, open_inference_grpc_pb2):
        descriptor = module.DESCRIPTOR
        for service in descriptor.services_by_name.values():
            assert f"### service `{service.name}`" in text
            for method in service.methods:
                assert f"| `{method.name}` | `{method.input_type.name}` |" in text

        def walk(message, prefix=""):
            name = prefix + message.name
            if message.GetOptions().map_entry:
                return
            assert f"### message `{name}`" in text, name
            body = text.split(f"### message `{name}`\n", 1)[1].split("\n### ", 1)[0]
            for field in message.fields:
                assert f"| `{field.name}` |" in body and f"| {field.number} |" in body, (name, field.name)
            for nested in message.nested_types:
                walk(nested, name + ".")

        for message in descriptor.message_types_by_name.values():
            walk(message)
        for enum in descriptor.enum_types_by_name.values():
            for value in enum.values:
                assert f"| `{value.name}` | {value.number} |" in text


def test_protos_reference_carries_the_comments():
    text = _generate().protos_reference()
    assert "Sparse features -> pooled embeddings" in text  # an rpc's comment above it
    assert "one bag length per example" in text  # a field's comment beside it


def test_metrics_reference_lists_every_metric_a_server_exports():
    from prometheus_client import generate_latest

    from server.metrics import ServerMetrics

    text = _generate().metrics_reference()
    scraped = generate_latest(ServerMetrics().registry).decode()
    families = set(re.findall(r"^# TYPE (\w+) (\w+)", scraped, flags=re.M))
    families = {(name, kind) for name, kind in families if not name.endswith("_created")}  # prometheus_client's
    assert families
    for name, kind in families:
        shown = name + "_total" if kind == "counter" and not name.endswith("_total") else name
        assert f"| `{shown}` | {kind} |" in text, name


def test_troubleshooting_lists_every_error_kind_with_a_fix():
    text = _generate().errors_reference()
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.EmbserveError)]
    for cls in classes:
        assert f"| `{cls.__name__}` |  |" in text
    for cls, kinds in (
        ("ArtifactError", errors.ArtifactErrorKind),
        ("PlanError", errors.PlanErrorKind),
        ("ServerError", errors.ServerErrorKind),
    ):
        for kind in kinds:
            row = next(line for line in text.splitlines() if line.startswith(f"| `{cls}` | `{kind.name}` |"))
            assert row.rstrip(" |").split("|")[-1].strip(), f"{cls}.{kind.name} has no fix in infer/errors.py"
