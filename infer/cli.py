"""The ``embserve`` command line: demo, export, spec, inspect, plan, run (``infer.commands``, one module each) and
serve, query (``server.cli``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from infer.commands import demo, export, inspect, plan, run, spec
from infer.commands.common import _server_cli
from infer.errors import EmbserveError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embserve", description="Quantize, export and serve embedding tables.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo.add_parser(sub)
    export.add_parser(sub)
    spec.add_parser(sub)
    inspect.add_parser(sub)
    plan.add_parser(sub)
    server_cli = _server_cli()
    if server_cli is not None:
        server_cli.add_subcommands(sub)

    run.add_parser(sub)
    _show_defaults(parser)
    return parser


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: ``(default: 50051)`` after the help of an option whose default is a
    value (not None, not an empty list, not a flag's off), unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if shows_default(action) and "%(default)" not in text and f"default: {action.default}" not in text:
            text += " (default: %(default)s)"
        return text


def shows_default(action: argparse.Action) -> bool:
    """Whether ``action``'s help must show its default: an option with a value for a default (a flag's off, None,
    an empty list or string and suppressed help say nothing)."""
    default = action.default
    return (
        bool(action.option_strings)
        and action.help != argparse.SUPPRESS
        and action.nargs != 0  # store_true/store_false/store_const: absent is the default
        and default is not None
        and default is not argparse.SUPPRESS
        and default not in ("", [])
    )


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every parser and subparser (server.cli's too) formats its help with ``DefaultsHelpFormatter``."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Root at WARNING keeps fbgemm's per-library load messages quiet; embserve's own logs at INFO.
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    for package in ("infer", "server"):
        logging.getLogger(package).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return int(args.func(args))
    except EmbserveError as err:
        print(f"embserve: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"embserve: error: {err}", file=sys.stderr)
        return 2
    except _grpc_error() as err:
        print(f"embserve: error: {err.code().name}: {err.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 2


def _grpc_error() -> type[Exception]:
    """grpc.RpcError when grpc is loaded (query/serve), else a type nothing raises."""
    grpc = sys.modules.get("grpc")
    return grpc.RpcError if grpc is not None else _NeverRaised  # type: ignore[no-any-return]


class _NeverRaised(Exception):
    pass


if __name__ == "__main__":
    sys.exit(main())
