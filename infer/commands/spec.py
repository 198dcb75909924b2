"""``embserve spec``: a starting spec.json from a TorchRec checkpoint."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infer.errors import ConfigError

if TYPE_CHECKING:
    from infer.config import ModelSpec

logger = logging.getLogger(__name__)


def cmd_spec(args: argparse.Namespace) -> int:
    from infer.interop.torchrec import spec_from_checkpoint

    spec = spec_from_checkpoint(args.from_torchrec)
    text = spec.to_json() + "\n"
    if args.out is None:
        print(text, end="")
        if spec.unstated_pooling:
            print(_unstated_pooling_hint(spec, "the spec"), file=sys.stderr)
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        raise ConfigError(f"{str(out)!r} exists; pass --force to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if spec.unstated_pooling:
        print(
            f"wrote {out}: {len(spec.tables)} tables, one feature per table named like it, int8, "
            f"num_dense_features {spec.num_dense_features}; edit feature names and data types before exporting"
        )
        print(_unstated_pooling_hint(spec, str(out)))
    else:
        print(
            f"wrote {out}: {len(spec.tables)} tables with their features and pooling as the model's "
            f"EmbeddingBagConfigs say, int8, num_dense_features {spec.num_dense_features}; edit data types before "
            "exporting (the tables' rows come from a state dict or DCP folder: --from-torchrec)"
        )
    return 0


def _unstated_pooling_hint(spec: ModelSpec, spec_file: str) -> str:
    return (
        f"pooling: null for {list(spec.unstated_pooling)}: a state dict does not record it, and export refuses to "
        f'guess; set each table\'s "pooling" in {spec_file} to "sum" or "mean" as its EmbeddingBagConfig.pooling '
        "says (TorchRec's default is sum), or pass --pooling TABLE=sum|mean to export"
    )


def add_parser(sub: Any) -> None:
    """The ``spec`` subcommand."""
    spc = sub.add_parser("spec", help="write a starting spec.json from a TorchRec checkpoint")
    spc.add_argument("--from-torchrec", required=True, metavar="PATH", help="state dict file or DCP folder")
    spc.add_argument("--out", default=None, help="spec JSON to write (default: print it)")
    spc.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    spc.set_defaults(func=cmd_spec)
