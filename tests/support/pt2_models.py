"""The models compiled to ``model.pt2`` (AOTInductor) that several test files share, each compiled once per session
(``tests.support.once.built_once``: across pytest-xdist workers too). A compile costs about 10 CPU-s a program
(most of it g++ on the generated wrapper), so each kind below proves several files' things at once:

- ``compiled_pt2(..., "unsharded")``: ``pt2_spec()`` (INT8, INT4, INT2, FP16, FP32 tables; SUM and MEAN features;
  a table read by two features) with a DLRM-like dense part returning ``[B, 1]`` (``ColumnScores``), exported as a
  user does: ``embserve export --spec --weights --dense-arch dense.pt --pt2`` with the dense part
  ``torch.jit.script``ed (two programs: lookups and dense). tests/artifact/test_pt2.py (against the TorchScript
  artifact), test_pt2_weights.py, test_pt2_contract.py (``contract_pt2``: the call contract's cases on it),
  tests/server/test_pt2_serving.py and the C++ loader's pt2 and contract tests.
- ``compiled_pt2(..., "mixed_sharding")``: the same tables over 4 CPU devices, every routing the program has (a
  table's columns from two devices, tables replicated over two and three devices, table-wise tables: a device
  reading non-consecutive features, one reading a run of features that starts mid-request): test_pt2.py,
  test_pt2_weights.py and the C++ loader's pt2 tests.
- ``embedded_pt2(...)``: the bad-request corpus's model (``tests.support.bad_requests.CORPUS_SPEC``: an INT8 SUM
  and an INT8 MEAN table) with every table inside model.pt2 (``weights="embedded"``, no weight files, as every
  model.pt2 was before mapped weight files): the C++ loader's pt2 corpus test (its requests never reach the
  program, so how the program holds its tables does not matter to it) and the embedded-format tests of
  tests/artifact/test_pt2_weights.py and tests/cpp/test_cpp_pt2.py (a kernel's tables are one byte buffer
  whatever their types: where the package keeps that buffer is what they check).

(test_pt2_weights.py compiles a 300x bigger table of its own.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.planner.types import ShardingType
from tests.conftest import mixed_spec
from tests.support.call_contract import NUM_DENSE, ColumnScores
from tests.support.once import built_once, digest

TABLE_WISE = ShardingType.TABLE_WISE
PT2_SEED = 41  # random_weights' seed of every compiled_pt2 model (quantize is deterministic)
DENSE_SEED = 0  # the unsharded model's dense part (torch.manual_seed before ColumnScores); NUM_DENSE inputs


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


# Every routing the program has, at once, over 4 devices. Device 0: t_int8's first columns, replicas of t_fp16 and
# t_fp16_sum, and the unlisted tables (table-wise): features that are not consecutive, some for a slice of the
# batch, gathered with a mask. Device 1: the other columns of t_int8 and replicas. Device 2: a replica of t_fp16
# alone (a third of the batch). Device 3: t_int4 and t_int2 table-wise, the consecutive features f_int4, f_int2:
# a run that starts mid-request, read through its slice of the bag offsets (a data-dependent slice of the ids
# would miscompile in AOTInductor, torch 2.13; this run is what would show it).
MIXED_LAYOUT = {
    "t_int8": (ShardingType.COLUMN_WISE, (0, 1)),
    "t_int4": (TABLE_WISE, (3,)),
    "t_int2": (TABLE_WISE, (3,)),
    "t_fp16": (ShardingType.REPLICATED, (0, 1, 2)),
    "t_fp16_sum": (ShardingType.REPLICATED, (0, 1)),
}
MIXED_DEVICES = 4
PT2_KINDS = ("unsharded", "mixed_sharding")


def compiled_spec(kind: str) -> ModelSpec:
    """``pt2_spec()``, with its dense part (``ColumnScores``, seeded) for the unsharded kind."""
    spec = pt2_spec()
    if kind == "unsharded":
        torch.manual_seed(DENSE_SEED)
        spec = spec.with_dense_arch(ColumnScores(NUM_DENSE, spec.output_dim).eval(), NUM_DENSE)
    return spec


def compiled_pt2(tmp_path_factory: pytest.TempPathFactory, kind: str) -> tuple[ModelSpec, Path]:
    """(spec, artifact folder): model.pt and model.pt2, mapped weight files (export's default). ``spec`` holds
    the dense part as a module (the reference's); the unsharded artifact's own is the scripted one it was given."""
    from infer.weights import random_weights

    spec = compiled_spec(kind)
    weights = random_weights(spec, seed=PT2_SEED)
    if kind == "unsharded":
        build = _cli_export(spec, weights)
        plan_dict = None
    else:
        assert kind == "mixed_sharding", kind
        from infer.shard.plans import make_plan

        plan = make_plan(spec, MIXED_DEVICES, MIXED_LAYOUT)
        build = _sharded_export(spec, weights, plan)
        plan_dict = plan.to_dict()
    key = digest("pt2", kind, spec.to_dict(), spec.dense_arch, weights, plan_dict)
    return spec, built_once(tmp_path_factory, f"pt2-{kind}-{key}", build)


def _cli_export(spec: ModelSpec, weights: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    """``embserve export --spec spec.json --weights weights.pt --dense-arch dense.pt --pt2`` (dense.pt: the dense
    part ``torch.jit.script``ed, as the README shows)."""

    def build(folder: Path) -> Path:
        from infer.cli import main

        torch.save(weights, folder / "weights.pt")
        (folder / "spec.json").write_text(json.dumps(spec.to_dict()))
        assert spec.dense_arch is not None
        torch.jit.save(torch.jit.script(spec.dense_arch), str(folder / "dense.pt"))
        args = ["export", "--spec", str(folder / "spec.json"), "--weights", str(folder / "weights.pt")]
        args += ["--dense-arch", str(folder / "dense.pt"), "--pt2", "--out", str(folder / "unsharded")]
        print("compiling model.pt2 for pt2_spec with its dense part, lookups and dense (about a minute)", flush=True)
        assert main(args) == 0
        return folder / "unsharded"

    return build


def _sharded_export(spec: ModelSpec, weights: dict[str, torch.Tensor], plan):  # type: ignore[no-untyped-def]
    def build(folder: Path) -> Path:
        from infer.artifact.export import export
        from infer.quant.quantize import quantize
        from infer.shard.builder import shard_model

        print("compiling model.pt2 for pt2_spec over 4 devices (about a minute)", flush=True)
        return export(shard_model(quantize(spec, weights), plan), folder / "mixed_sharding", plan=plan, pt2=True)

    return build


def embedded_pt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSpec, Path]:
    """(spec, artifact folder "embedded"): ``CORPUS_SPEC`` (no dense part) with its tables compiled into model.pt2,
    weights ``random_weights(spec, seed=PT2_SEED)``."""
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.support.bad_requests import CORPUS_SPEC

    spec = CORPUS_SPEC
    weights = random_weights(spec, seed=PT2_SEED)

    def build(folder: Path) -> Path:
        print("compiling model.pt2 for the corpus's model with its tables inside (about a minute)", flush=True)
        return export(quantize(spec, weights), folder / "embedded", pt2=True, weights="embedded")

    key = digest("pt2-embedded", spec.to_dict(), weights)
    return spec, built_once(tmp_path_factory, f"pt2-embedded-{key}", build)


@dataclass(frozen=True)
class ContractArtifact:
    """A model with a dense part exported with ``--pt2``: its spec, fp32 weights and the artifact folder."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    path: Path


def contract_pt2(tmp_path_factory: pytest.TempPathFactory) -> ContractArtifact:
    """The call contract's pt2 model: the unsharded ``compiled_pt2`` (exported as the user did, ``embserve export
    --pt2 --dense-arch dense.pt``, a scripted dense part returning ``[B, 1]``; its tables hold every case the
    contract's own model has: a SUM table read by two features, a MEAN FP16 table)."""
    from infer.weights import random_weights

    spec, path = compiled_pt2(tmp_path_factory, "unsharded")
    return ContractArtifact(spec, random_weights(spec, seed=PT2_SEED), path)


@dataclass(frozen=True)
class BlocksArtifact:
    """A model with tables in precision blocks exported with ``--pt2`` (mapped weights): spec, fp32 weights, each
    block table's ranking (``block_orders``) and the artifact folder."""

    spec: ModelSpec
    weights: dict[str, torch.Tensor]
    orders: dict[str, torch.Tensor]
    path: Path


def blocks_pt2(tmp_path_factory: pytest.TempPathFactory) -> BlocksArtifact:
    """tests.modules.test_blocks' ``block_spec`` (a table in three blocks read by two features, one in two blocks,
    one plain table) with SUM and MEAN tables, its rows ranked by a random sample: tests/artifact/test_pt2_blocks.py
    and the C++ loader's pt2 block test."""
    from infer.quant.blocks import rank_rows
    from infer.weights import random_weights
    from tests.modules.test_blocks import block_spec

    spec = block_spec(PoolingType.MEAN).with_pooling({"plain": "sum", "two": "sum"})
    weights = random_weights(spec, seed=PT2_SEED)
    generator = torch.Generator().manual_seed(PT2_SEED)
    orders = {
        t.name: rank_rows(t.num_embeddings, torch.randint(0, t.num_embeddings, (400,), generator=generator).numpy())
        for t in spec.tables
        if t.blocks
    }

    def build(folder: Path) -> Path:
        from infer.artifact.export import export
        from infer.quant.quantize import quantize

        print("compiling model.pt2 for a model with tables in precision blocks (about half a minute)", flush=True)
        return export(quantize(spec, weights, block_orders=orders), folder / "blocks", pt2=True)

    key = digest("pt2-blocks", spec.to_dict(), weights, orders)
    return BlocksArtifact(spec, weights, orders, built_once(tmp_path_factory, f"pt2-blocks-{key}", build))
