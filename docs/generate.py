"""The docs' reference pages, generated from the code so that nothing is documented by hand twice: the CLI from
the argparse parsers, the protos from their comments, the metrics from the server's registry, the error kinds
from ``infer.errors``. ``docs/hooks.py`` puts each where a page says ``<!-- generated: NAME -->``; the tests
compare them with the code (tests/test_docs.py)."""

from __future__ import annotations

import argparse
import ast
import enum
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


# --- the CLI ------------------------------------------------------------------------------------------------


def commands(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ("embserve",)) -> Iterator[
    tuple[tuple[str, ...], argparse.ArgumentParser]
]:  # fmt: skip
    """Every parser of the ``embserve`` command with its command path (subcommands of ``server.cli`` too)."""
    if parser is None:
        from infer.cli import build_parser

        parser = build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, (*path, name))


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    text = formatter._get_help_string(action) if hasattr(formatter, "_get_help_string") else (action.help or "")
    if not text or text == argparse.SUPPRESS:
        return ""
    params = {**vars(action), "prog": parser.prog}
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    return text % params


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest.upper()}`"
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar
    if metavar is None and action.choices is not None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    if metavar is None:
        metavar = action.dest.upper()
    return names + " " + (f"`[{metavar}]`" if action.nargs == "?" else f"`{metavar}`")


def cli_reference() -> str:
    """One section per command: what it does, its usage line, and a table of every argument."""
    out = []
    for path, parser in commands():
        if len(path) == 1:
            continue
        command = " ".join(path)
        out.append(f"## `{command}`\n")
        about = parser.description or _subcommand_help(path)
        if about:
            out.append(_cell(about) + "\n")
        usage = parser.format_usage().removeprefix("usage: ").strip()
        out.append("```text\n" + usage + "\n```\n")
        rows = [a for a in parser._actions if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS]
        if rows:
            out.append("| argument | what it sets |\n|---|---|")
            for action in rows:
                out.append(f"| {_flag_cell(action)} | {_cell(_help_of(parser, action))} |")
            out.append("")
    return "\n".join(out)


def _subcommand_help(path: tuple[str, ...]) -> str:
    parent = dict(commands())[path[:-1]]
    for action in parent._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == path[-1]:
                    return choice.help or ""
    return ""


# --- the protos ---------------------------------------------------------------------------------------------

_DECLARATION = re.compile(r"^\s*(service|message|enum)\s+(\w+)")
_RPC = re.compile(r"^\s*rpc\s+(\w+)\s*\((\w+)\)\s*returns\s*\((stream\s+)?(\w+)\)")
_FIELD = re.compile(r"^\s*((?:repeated\s+|optional\s+)?(?:map<[^>]+>|[\w.]+))\s+(\w+)\s*=\s*(\d+)")
_ENUM_VALUE = re.compile(r"^\s*(\w+)\s*=\s*(-?\d+)\s*;")
_ONEOF = re.compile(r"^\s*oneof\s+(\w+)")


def _trailing(line: str) -> str:
    return line.split("//", 1)[1].strip() if "//" in line else ""


def proto_reference(path: Path) -> str:
    """A proto file as Markdown: its header comment, then each service (its rpcs) and message or enum (its
    fields or values; a nested message as ``Outer.Inner``) with the comments written above or beside them."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = []
    for line in lines:
        if not line.startswith("//"):
            break
        header.append(line[2:].strip())
    sections: list[tuple[str, list[str]]] = []  # (heading and about, table rows), in declaration order
    stack: list[tuple[str, str, list[str]]] = []  # open declarations: kind, name, their rows
    comment: list[str] = []
    for line in lines[len(header) :]:
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped[2:].strip())
            continue
        about = _cell(" ".join([*comment, _trailing(line)]))
        comment = []
        declaration = _DECLARATION.match(line)
        rpc, oneof = _RPC.match(line), _ONEOF.match(line)
        inner = [entry for entry in stack if entry[0] != "oneof"]
        if declaration:
            kind, name = declaration.groups()
            qualified = ".".join([n for _, n, _ in inner] + [name])
            rows: list[str] = []
            sections.append((f"### {kind} `{qualified}`\n\n" + (about + "\n" if about else ""), rows))
            if not stripped.endswith("}"):  # ``message Empty {}`` opens and closes on one line
                stack.append((kind, name, rows))
            continue
        if oneof:
            stack.append(("oneof", oneof.group(1), stack[-1][2]))
        elif rpc and stack:
            name, request, stream, response = rpc.groups()
            stack[-1][2].append(f"| `{name}` | `{request}` | {'stream ' if stream else ''}`{response}` | {about} |")
        elif stack and stack[-1][0] == "enum" and _ENUM_VALUE.match(line):
            name, number = _ENUM_VALUE.match(line).groups()  # type: ignore[union-attr]
            stack[-1][2].append(f"| `{name}` | {number} | {about} |")
        elif stack and _FIELD.match(line) and not stripped.startswith(("}", "option", "reserved")):
            kind, name, number = _FIELD.match(line).groups()  # type: ignore[union-attr]
            if stack[-1][0] == "oneof":
                about = _cell(f"(one of `{stack[-1][1]}`) {about}")
            stack[-1][2].append(f"| `{name}` | `{_cell(kind)}` | {number} | {about} |")
        if stripped.startswith("}") and stack:
            stack.pop()
    heads = {
        "service": "| rpc | request | response | what it does |\n|---|---|---|---|",
        "enum": "| value | number | meaning |\n|---|---|---|",
        "message": "| field | type | number | meaning |\n|---|---|---|---|",
    }
    out = [f"## `{path.relative_to(ROOT)}`\n", _cell(" ".join(header)) + "\n"]
    for heading, rows in sections:
        out.append(heading)
        kind = heading.split()[1]
        out.append("\n".join([heads[kind], *rows]) + "\n" if rows else "(no fields)\n")
    return "\n".join(out)


def protos_reference() -> str:
    return "\n".join(proto_reference(path) for path in sorted((ROOT / "protos").rglob("*.proto")))


# --- the metrics --------------------------------------------------------------------------------------------


def metrics() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name as scraped, type, help, label names) of every metric of a server's registry."""
    from server.metrics import ServerMetrics

    found = []
    collectors: list[Any] = list(ServerMetrics().registry._collector_to_names)  # Counter, Gauge, Histogram
    for collector in collectors:
        kind = collector._type
        name = collector._name + ("_total" if kind == "counter" else "")
        found.append((name, kind, collector._documentation, tuple(collector._labelnames)))
    return sorted(found)


def metrics_reference() -> str:
    rows = ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
    for name, kind, about, labels in metrics():
        rows.append(f"| `{name}` | {kind} | {', '.join(f'`{label}`' for label in labels)} | {_cell(about)} |")
    return "\n".join(rows) + "\n"


# --- the errors ---------------------------------------------------------------------------------------------


def error_kinds() -> list[tuple[str, str, str]]:
    """(error class, kind or '', what it means and the fix) for every ``EmbserveError`` class and every kind
    of the classes that have kinds, read from ``infer/errors.py`` (docstrings, and the comment beside each
    kind)."""
    import infer.errors as errors

    source = (ROOT / "infer" / "errors.py").read_text(encoding="utf-8")
    lines = source.splitlines()
    comments: dict[tuple[str, str], str] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    above: list[str] = []
                    row = item.lineno - 2
                    while lines[row].strip().startswith("#"):
                        above.insert(0, lines[row].strip().lstrip("#").strip())
                        row -= 1
                    beside = lines[item.lineno - 1].partition("#")[2].strip()
                    comments[(node.name, item.targets[0].id)] = " ".join([*above, beside]).strip()
    kinds_of = {"ArtifactError": errors.ArtifactErrorKind, "PlanError": errors.PlanErrorKind,
                "ServerError": errors.ServerErrorKind}  # fmt: skip
    found = []
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.EmbserveError)]
    for cls in sorted(classes, key=lambda c: (len(c.__mro__), c.__name__)):
        found.append((cls.__name__, "", " ".join((cls.__doc__ or "").split())))
        kinds: type[enum.Enum] | None = kinds_of.get(cls.__name__)
        for member in kinds or ():
            found.append((cls.__name__, member.name, comments.get((kinds.__name__, member.name), "")))  # type: ignore[union-attr]
    return found


def errors_reference() -> str:
    rows = ["| error | kind | what it means, and the fix |", "|---|---|---|"]
    for name, kind, about in error_kinds():
        rows.append(f"| `{name}` | {f'`{kind}`' if kind else ''} | {_cell(about)} |")
    return "\n".join(rows) + "\n"


GENERATORS = {"cli": cli_reference, "protos": protos_reference, "metrics": metrics_reference,
              "errors": errors_reference}  # fmt: skip
MARKER = re.compile(r"<!-- generated: (\w+) -->")


def expand(markdown: str) -> str:
    """``markdown`` with every ``<!-- generated: NAME -->`` replaced by that reference."""
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)
