"""Reading a trained model's tables from TorchRec checkpoints, against the usual way, in the same run.

A DLRM-like state dict (embedding tables + an optimizer-sized copy of them + a dense MLP) is written as a
``torch.save`` file and as a DCP folder. Cases, one JSON line each:
- ``dcp``: ``infer.load_torchrec_checkpoint(folder, spec)`` (only the tables are read) vs the baseline
  ``dcp_to_torch_save`` + ``torch.load`` (the documented no-process-group route; reads everything);
- ``state_dict``: ``load_torchrec_checkpoint(file, spec)`` (memory-mapped, then every table summed once) vs
  ``torch.load`` of the whole file into memory. The file is in the page cache in both (warm reads).
``ratio`` is baseline seconds / ours (higher is better); best of ``--repeats``.

    python bench/torchrec_import.py [--tables 4 --rows 200000 --dim 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from infer.config import ModelSpec, TableConfig
from infer.interop.torchrec import load_torchrec_checkpoint

PREFIX = "sparse_arch.embedding_bag_collection.embedding_bags"


def state_dict(tables: int, rows: int, dim: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for t in range(tables):
        state[f"{PREFIX}.t{t}.weight"] = torch.randn(rows, dim, generator=generator)
        # an optimizer state the size of the table (e.g. a momentum), saved beside the model by trainers
        state[f"optim.{PREFIX}.t{t}.momentum"] = torch.randn(rows, dim, generator=generator)
    state["dense_arch.model._mlp.0._linear.weight"] = torch.randn(512, 13, generator=generator)
    return state


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
        del result
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    spec = ModelSpec(tuple(TableConfig(f"t{t}", args.rows, args.dim, (f"f{t}",)) for t in range(args.tables)))
    state = state_dict(args.tables, args.rows, args.dim)
    table_mb = args.tables * args.rows * args.dim * 4 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.save(state, folder / "model.pt")
        dcp.save(state, checkpoint_id=str(folder / "dcp"), no_dist=True)
        del state

        def baseline_dcp() -> object:
            dcp_to_torch_save(folder / "dcp", folder / "converted.pt")
            return torch.load(folder / "converted.pt", weights_only=True)

        def full_load() -> object:
            return torch.load(folder / "model.pt", weights_only=True)

        def ours_file() -> object:
            weights = load_torchrec_checkpoint(folder / "model.pt", spec)
            return {k: v.sum() for k, v in weights.items()}  # touch every table once

        def ours_dcp() -> object:
            return load_torchrec_checkpoint(folder / "dcp", spec)

        for case, ours, baseline in (("dcp", ours_dcp, baseline_dcp), ("state_dict", ours_file, full_load)):
            ours_s = best(ours, args.repeats)
            base_s = best(baseline, args.repeats)
            print(
                json.dumps(
                    {
                        "case": case,
                        "tables_mb": round(table_mb, 1),
                        "checkpoint_mb": round(2 * table_mb, 1),
                        "ours_s": round(ours_s, 4),
                        "baseline_s": round(base_s, 4),
                        "ratio": round(base_s / ours_s, 2),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
