"""The models compiled to ``model.pt2`` (AOTInductor) that several test files share, each compiled once per session
(``tests.support.once.built_once``: across pytest-xdist workers too).

- ``compiled_pt2(..., kind)``: ``pt2_spec()`` (INT8, INT4, INT2, FP16, FP32 tables; SUM and MEAN features)
  ``"unsharded"`` with a dense part, ``"table_wise"`` over 2 CPU devices, ``"mixed_sharding"`` (column-wise,
  replicated and table-wise over 3): tests/artifact/test_pt2.py (against the TorchScript artifact) and the C++
  loader's pt2 tests (tests/cpp: the unsharded and table-wise ones).
- ``embedded_pt2(...)``: ``pt2_spec()`` unsharded with every table inside model.pt2 (``weights="embedded"``, no
  weight files): tests/artifact/test_pt2_weights.py and tests/cpp/test_cpp_pt2.py.
- ``contract_pt2(...)``: the call contract's model (``tests.support.call_contract.contract_spec``, a dense part
  returning ``[B, 1]``) exported as a user does, ``embserve export --pt2 --dense-arch dense.pt`` with the dense
  part ``torch.jit.script``ed: tests/artifact/test_pt2_contract.py and tests/cpp/test_cpp_contract.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.planner.types import ShardingType
from tests.conftest import TinyOverArch, mixed_spec
from tests.support.once import built_once, digest

TABLE_WISE = ShardingType.TABLE_WISE
NUM_DENSE = 4  # the unsharded pt2 model's dense inputs
PT2_SEED = 41  # random_weights' seed of every compiled_pt2 model (quantize is deterministic)
CONTRACT_SEED = 2  # contract_pt2's


def pt2_spec() -> ModelSpec:
    """INT8, INT4 and FP16 tables, each with SUM and MEAN features (plus INT2 and FP32): the shared mixed spec
    and one table of the other pooling for each of INT8, INT4 and FP16."""
    return ModelSpec(
        mixed_spec().tables
        + (
            TableConfig("t_int8_mean", 700, 32, ("f_int8_mean",), PoolingType.MEAN, DataType.INT8),
            TableConfig("t_int4_sum", 400, 16, ("f_int4_sum",), PoolingType.SUM, DataType.INT4),
            TableConfig("t_fp16_sum", 250, 16, ("f_fp16_sum",), PoolingType.SUM, DataType.FP16),
        )
    )


# Device 1 reads consecutive input features (f_int4, f_int2), device 0 the rest: the program gathers each
# device's ids with a mask (a data-dependent slice miscompiles in AOTInductor, torch 2.13).
TABLE_WISE_LAYOUT = {
    "t_int4": (TABLE_WISE, (1,)),
    "t_int2": (TABLE_WISE, (1,)),
    **{name: (TABLE_WISE, (0,)) for name in ("t_int8", "t_fp16", "t_fp32", "t_int8_mean", "t_int4_sum", "t_fp16_sum")},
}
# Every sharding the program takes at once: a table's columns from two devices, tables replicated over two
# and three devices (each replica serves a slice of the batch), table-wise tables on the third device.
MIXED_LAYOUT = {
    "t_int8": (ShardingType.COLUMN_WISE, (0, 1)),
    "t_int4": (TABLE_WISE, (2,)),
    "t_int2": (TABLE_WISE, (2,)),
    "t_fp16": (ShardingType.REPLICATED, (0, 1, 2)),
    "t_fp16_sum": (ShardingType.REPLICATED, (0, 1)),
}
PT2_KINDS = ("unsharded", "table_wise", "mixed_sharding")


def compiled_spec(kind: str) -> ModelSpec:
    """``pt2_spec()``, with its dense part (seeded) for the unsharded kind."""
    spec = pt2_spec()
    if kind == "unsharded":
        torch.manual_seed(0)
        spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    return spec


def compiled_pt2(tmp_path_factory: pytest.TempPathFactory, kind: str) -> tuple[ModelSpec, Path]:
    """(spec, artifact folder named ``kind``): model.pt and model.pt2, mapped weight files (export's default)."""
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.shard.builder import shard_model
    from infer.shard.plans import make_plan
    from infer.weights import random_weights

    spec = compiled_spec(kind)
    weights = random_weights(spec, seed=PT2_SEED)
    plan = None
    if kind == "table_wise":
        plan = make_plan(spec, 2, TABLE_WISE_LAYOUT)
    elif kind == "mixed_sharding":
        plan = make_plan(spec, 3, MIXED_LAYOUT)
    else:
        assert kind == "unsharded", kind

    def build(folder: Path) -> Path:
        model = quantize(spec, weights)
        print(f"compiling model.pt2 for pt2_spec, {kind} (about a minute)", flush=True)
        return export(shard_model(model, plan) if plan else model, folder / kind, plan=plan, pt2=True)

    key = digest("pt2", kind, spec.to_dict(), spec.dense_arch, weights, plan.to_dict() if plan else None)
    return spec, built_once(tmp_path_factory, f"pt2-{kind}-{key}", build)


def embedded_pt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSpec, Path]:
    """(spec, artifact folder "embedded"): ``pt2_spec()`` (no dense part) with its tables compiled into model.pt2."""
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.weights import random_weights

    spec = pt2_spec()
    weights = random_weights(spec, seed=PT2_SEED)

    def build(folder: Path) -> Path:
        print("compiling model.pt2 for pt2_spec with its tables inside (about a minute)", flush=True)
        return export(quantize(spec, weights), folder / "embedded", pt2=True, weights="embedded")

    key = digest("pt2-embedded", spec.to_dict(), weights)
    return spec, built_once(tmp_path_factory, f"pt2-embedded-{key}", build)


@dataclass(frozen=True)
class ContractArtifact:
    """The call contract's model exported with ``--pt2``: its spec, fp32 weights and the artifact folder."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    path: Path


def contract_pt2(tmp_path_factory: pytest.TempPathFactory) -> ContractArtifact:
    """``embserve export --spec spec.json --weights weights.pt --dense-arch dense.pt --pt2`` (about a minute)."""
    from infer.cli import main
    from infer.weights import random_weights
    from tests.support.call_contract import contract_spec

    spec = contract_spec()
    weights = random_weights(spec, seed=CONTRACT_SEED)

    def build(folder: Path) -> Path:
        torch.save(weights, folder / "weights.pt")
        (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
        assert spec.dense_arch is not None
        torch.jit.save(torch.jit.script(spec.dense_arch), str(folder / "dense.pt"))
        args = ["export", "--spec", str(folder / "spec.json"), "--weights", str(folder / "weights.pt")]
        args += ["--dense-arch", str(folder / "dense.pt"), "--pt2", "--out", str(folder / "art")]
        print("compiling model.pt2 for the call contract's model, lookups and dense (about a minute)", flush=True)
        assert main(args) == 0
        return folder / "art"

    key = digest("contract", spec.to_dict(), spec.dense_arch, weights)
    return ContractArtifact(spec, weights, built_once(tmp_path_factory, f"pt2-contract-{key}", build))
