"""Lookup throughput of the exported model against a direct fbgemm TBE call, fp32 embedding_bag and a gather probe.

Prints one JSON line per (workload, case) with M lookups/s and the ratio to the exported model measured
in the same run, then one line per sharded variant (1, 2, 4 CPU shards; table-, row-, column-wise
plans) with its ratio to the unsharded exported model. Cases are interleaved round by round so
machine noise hits all of them alike.

    python bench/lookup.py                 # W128 and W64 at full size
    python bench/lookup.py --rows 100000   # smaller tables, for a quick look
    python bench/lookup.py --mapped-only   # mapped weights vs copied into RAM only (random INT8 bytes, no fp32)
    python bench/lookup.py --blocks --workload W128   # precision blocks (INT8 hot, INT4 rest) vs INT4 alone

``exported_mapped``: the same model exported with ``weights="mapped"`` and loaded (its weight file mapped
read-only, every page read once first so that the weights are resident), against ``exported_model`` (the
embedded artifact, its weights copied into the process by ``torch.jit.load``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

# Before torch loads OpenMP: its idle workers otherwise spin after every parallel region (the fp32 and gather
# probes run at 2 torch threads) and steal the core from whichever case runs next, skewing the ratios.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from infer.artifact.export import export
from infer.artifact.kernels import kernel_holders, model_tbes
from infer.artifact.load import load
from infer.config import DataType, ModelSpec, TableConfig
from infer.planner.planner import plan_for_inference
from infer.planner.types import ComputeDevice, ParameterConstraints, ShardingPlan, ShardingType, Topology
from infer.quant.quantize import quantize
from infer.shard.builder import shard_model
from infer.shard.plans import make_plan


@dataclass(frozen=True)
class Workload:
    name: str
    num_tables: int
    rows: int
    dim: int
    batch_size: int
    ids_per_bag: int


def workloads(rows: int) -> list[Workload]:
    return [Workload("W128", 8, rows, 128, 2048, 20), Workload("W64", 8, rows, 64, 512, 20)]


def make_index_sets(w: Workload, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``count`` batches of uniform ids: (values int64, lengths int32, offsets int64)."""
    generator = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(count):
        values = torch.randint(0, w.rows, (w.num_tables * w.batch_size * w.ids_per_bag,), generator=generator)
        lengths = torch.full((w.num_tables * w.batch_size,), w.ids_per_bag, dtype=torch.int32)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        sets.append((values, lengths, offsets))
    return sets


def direct_tbe(spec: ModelSpec, model: torch.nn.Module) -> torch.nn.Module:
    """One IntNBit TBE configured like the exported model's, holding a copy of the same quantized rows."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            (t.name, t.num_embeddings, t.embedding_dim, SparseType.INT8, EmbeddingLocation.HOST) for t in spec.tables
        ],
        pooling_mode=PoolingMode.SUM,
        device="cpu",
        bounds_check_mode=BoundsCheckMode.FATAL,
        output_dtype=SparseType.FP32,
    )
    tbe.initialize_weights()
    tbe.assign_embedding_weights(model.embeddings.table_weights())
    return tbe


def torchrec_baseline(
    spec: ModelSpec, weights: dict[str, torch.Tensor], device: str = "cpu"
) -> torch.jit.ScriptModule | None:
    """TorchRec's quantized EBC (``quantize_dynamic`` to INT8, as TorchRec users serve it) on the same fp32
    weights on ``device``, scripted, called with (values, lengths); None when torchrec is not installed."""
    try:
        import torch.ao.quantization as tq
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
        from torchrec.quant.embedding_modules import QuantConfig
    except ImportError:
        return None
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.feature_names),
        )
        for t in spec.tables
    ]
    # quantize_dynamic swaps children, never the root: the EBC goes in a container
    holder = torch.nn.ModuleDict({"ebc": EmbeddingBagCollection(tables=configs, device=torch.device(device))})
    with torch.no_grad():
        for name, bag in holder["ebc"].embedding_bags.items():
            bag.weight.copy_(weights[name])
    qconfig = QuantConfig(
        activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
        weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    mapping = {EmbeddingBagCollection: QuantEmbeddingBagCollection}
    qebc = tq.quantize_dynamic(holder, qconfig_spec={EmbeddingBagCollection: qconfig}, mapping=mapping)["ebc"]
    assert isinstance(qebc, QuantEmbeddingBagCollection)

    class Lookup(torch.nn.Module):
        def __init__(self, module: torch.nn.Module, keys: list[str]) -> None:
            super().__init__()
            self.module = module
            self.keys = keys

        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            kjt = KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)
            return self.module(kjt).values()

    # this file's annotations are strings (postponed); FX's code generation needs the types themselves
    Lookup.forward.__annotations__ = {"values": torch.Tensor, "lengths": torch.Tensor, "return": torch.Tensor}
    # TorchRec's inference path: FX-trace with torchrec.fx (KJT-aware), then TorchScript
    from torchrec.fx import symbolic_trace

    return torch.jit.script(symbolic_trace(Lookup(qebc, list(spec.feature_names))))


def measure(
    cases: dict[str, Callable[[int], object]], index_count: int, rounds: int, threads: dict[str, int]
) -> dict[str, float]:
    """Median seconds per call of each case; cases alternate within every round, each at its thread count."""
    default_threads = torch.get_num_threads()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for name, fn in cases.items():  # warm-up
        torch.set_num_threads(threads.get(name, default_threads))
        fn(0)
    names = list(cases)
    for r in range(rounds):
        # rotate the order every round: no case always runs right after the cache-thrashing one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = cases[name]
            torch.set_num_threads(threads.get(name, default_threads))
            started = time.perf_counter()
            fn(r % index_count)
            samples[name].append(time.perf_counter() - started)
    torch.set_num_threads(default_threads)
    return {name: statistics.median(s) for name, s in samples.items()}


def sharding_plan(kind: str, spec: ModelSpec, shards: int, w: Workload) -> ShardingPlan:
    """Table-wise: the planner's plan restricted to table-wise (what a user gets); row-/column-wise:
    every table split evenly over every device."""
    if kind == "table_wise":
        only = ParameterConstraints(sharding_types=(ShardingType.TABLE_WISE,))
        topology = Topology(shards, ComputeDevice.CPU)
        return plan_for_inference(spec, topology, {t.name: only for t in spec.tables}, batch_size=w.batch_size)
    sharding = ShardingType.ROW_WISE if kind == "row_wise" else ShardingType.COLUMN_WISE
    layout = {t.name: (sharding, tuple(range(shards))) for t in spec.tables}
    return make_plan(spec, shards, layout, column_unit=min(32, w.dim // shards))


def run_sharded(
    w: Workload,
    spec: ModelSpec,
    model: torch.nn.Module,
    baseline: torch.jit.ScriptModule,
    sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    rounds: int,
    index_count: int,
    torchrec: Callable[[int], object] | None,
) -> list[dict[str, object]]:
    """Every sharded variant against the unsharded exported model (and TorchRec's scripted QEBC when
    torchrec is installed), measured in the same rounds."""
    rows = []
    default_threads = torch.get_num_threads()
    for shards in (1, 2, 4):
        for kind in ("table_wise", "row_wise", "column_wise"):
            if kind != "table_wise" and shards == 1:
                continue
            plan = sharding_plan(kind, spec, shards, w)
            with tempfile.TemporaryDirectory() as tmp:
                runtime = load(export(shard_model(model, plan), f"{tmp}/sharded", plan=plan))
            # load() chose the intra-op threads for this artifact (one per core for the shards' own kernels);
            # both models run under that setting: the unsharded TBE is single-threaded either way
            sharded_threads = torch.get_num_threads()
            sharded = runtime.module

            def run_baseline(i: int) -> object:
                return baseline(sets[i][0], sets[i][1], None)

            def run_sharded_model(i: int, module: torch.jit.ScriptModule = sharded) -> object:
                return module(sets[i][0], sets[i][1], None)

            with torch.inference_mode():
                expected, got = run_baseline(0), run_sharded_model(0)
                assert isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)
                max_diff = float((expected - got).abs().max())
                cases: dict[str, Callable[[int], object]] = {"unsharded": run_baseline, "sharded": run_sharded_model}
                if torchrec is not None:
                    cases["torchrec_qebc"] = torchrec
                seconds = measure(cases, index_count, rounds, {})
            lookups = w.num_tables * w.batch_size * w.ids_per_bag
            rows.append(
                {
                    "bench": "lookup_sharded",
                    "workload": w.name,
                    "case": f"{kind}_{shards}",
                    "shards": shards,
                    "plan": kind,
                    "devices_of_tables": [[s.device for s in t.shards] for t in plan.tables],
                    "mlookups_per_s": round(lookups / seconds["sharded"] / 1e6, 2),
                    "unsharded_mlookups_per_s": round(lookups / seconds["unsharded"] / 1e6, 2),
                    "ratio_to_unsharded": round(seconds["unsharded"] / seconds["sharded"], 3),
                    "ratio_to_torchrec": (
                        round(seconds["torchrec_qebc"] / seconds["sharded"], 3) if torchrec is not None else None
                    ),
                    "max_abs_diff_vs_unsharded": max_diff,
                    "intra_op_threads": sharded_threads,
                    "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            del runtime, sharded
            torch.set_num_threads(default_threads)
    return rows


def load_mapped_resident(model: torch.nn.Module, folder: str) -> torch.jit.ScriptModule:
    """``model`` exported mapped into ``folder`` and loaded, every page of its weights read once (resident)."""
    runtime = load(export(model, folder, weights="mapped"), verify="none")
    for tbe in model_tbes(runtime.module):
        tbe.weights_host[::4096].sum()  # a byte of every page: no int64 copy of the table
    runtime.set_threads(runtime.thread_budget())
    return runtime.module


def random_int8_model(spec: ModelSpec) -> torch.nn.Module:
    """An INT8 model of ``spec`` with random bytes for rows and a fixed scale/bias (no fp32 tables to quantize)."""
    return random_bytes_model(spec)


def random_bytes_model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """A model of ``spec`` (blocks included) with random row bytes and a fixed scale/bias, and for each block table
    a random id remap: no fp32 tables to quantize."""
    from infer.modules.collection import EmbserveModel, QuantizedEmbeddingBagCollection

    collection = QuantizedEmbeddingBagCollection(spec)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for data, scale_bias in collection.table_weights():
            for first in range(0, data.shape[0], 1 << 18):
                data[first : first + (1 << 18)].random_(0, 256, generator=generator)
            if scale_bias is not None:
                scale_bias.copy_(
                    torch.tensor([0.01, -1.25], dtype=torch.float16).view(torch.uint8).expand_as(scale_bias)
                )
    for table in spec.tables:
        if table.blocks:
            collection.set_block_remap(table.name, torch.randperm(table.num_embeddings, generator=generator))
    return EmbserveModel(spec, collection)


def zipf_index_sets(w: Workload, count: int, seed: int, alpha: float = 1.05) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of Zipf(``alpha``) ids (ranks scattered over the rows by a fixed permutation)."""
    generator = torch.Generator().manual_seed(seed)
    scatter = torch.randperm(w.rows, generator=generator)
    sets = []
    for _ in range(count):
        u = torch.rand(w.num_tables * w.batch_size * w.ids_per_bag, generator=generator, dtype=torch.float64)
        ranks = torch.floor(((w.rows ** (1 - alpha) - 1) * u + 1) ** (1 / (1 - alpha))).to(torch.int64) - 1
        values = scatter[ranks.clamp(0, w.rows - 1)]
        lengths = torch.full((w.num_tables * w.batch_size,), w.ids_per_bag, dtype=torch.int32)
        sets.append((values, lengths))
    return sets


def block_specs(w: Workload, hot_share: float = 1 / 32) -> tuple[int, ModelSpec, ModelSpec]:
    """Issue 43's lookup case: ``w``'s tables in INT4 alone, and the same tables in precision blocks (``hot_share``
    of the rows INT8, the rest INT4); with the hot block's rows."""
    hot = max(1, int(w.rows * hot_share))
    one_type = ModelSpec(
        tuple(TableConfig(f"t{i}", w.rows, w.dim, (f"f{i}",), data_type=DataType.INT4) for i in range(w.num_tables))
    )
    blocked = ModelSpec(tuple(t.with_blocks(((hot, "int8"), (w.rows - hot, "int4"))) for t in one_type.tables))
    return hot, one_type, blocked


def rank_blocks(model: torch.nn.Module, w: Workload, sample: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Fill each block table of ``model`` hottest rows first, ranked from the ``sample`` batches (other batches of
    the same traffic than the timed ones, as the planner ranks them from ``--sample-ids``)."""
    from infer.quant.blocks import rank_rows

    per_table = w.batch_size * w.ids_per_bag
    for i, table in enumerate(model.spec.tables):
        ids = torch.cat([values[i * per_table : (i + 1) * per_table] for values, _ in sample])
        ranks = torch.empty(w.rows, dtype=torch.int64)
        ranks[rank_rows(w.rows, ids.numpy(), table.name)] = torch.arange(w.rows)
        model.embeddings.set_block_remap(table.name, ranks)


def run_blocks(w: Workload, rounds: int, index_count: int, hot_share: float = 1 / 32) -> list[dict[str, object]]:
    """Issue 43: every table in precision blocks (its ``hot_share`` of rows INT8, the rest INT4) against the same
    tables in INT4 alone, scripted, same Zipf(1.05) batches and kernel threads. ``blocks_int8_int4``: the hot rows
    ranked from a sample of the same traffic (other batches than the timed ones, as the planner ranks them from
    ``--sample-ids``); ``blocks_int8_int4_unranked``: a random ranking (few ids hot: the lookup's overhead alone);
    ``blocks_int8_int4_tw2``: the ranked block model sharded table-wise over 2 CPU devices (each device's kernel
    splits its own tables by block; one kernel thread each), its ratio to the unsharded block model in
    ``ratio_to_unsharded_blocks``."""
    from infer.planner.types import ShardingType
    from infer.shard.builder import shard_model
    from infer.shard.plans import make_plan

    hot, one_type, blocked = block_specs(w, hot_share)
    sample_count = 4
    drawn = zipf_index_sets(w, index_count + sample_count, seed=1)
    sets, sample = drawn[:index_count], drawn[index_count:]
    threads = torch.get_num_threads()
    models = {}
    for name, spec in (
        ("one_type_int4", one_type),
        ("blocks_int8_int4", blocked),
        ("blocks_int8_int4_unranked", blocked),
    ):
        model = random_bytes_model(spec)
        if name == "blocks_int8_int4":
            rank_blocks(model, w, sample)
            halves = {
                t.name: (ShardingType.TABLE_WISE, (i * 2 // len(spec.tables),)) for i, t in enumerate(spec.tables)
            }
            models["blocks_int8_int4_tw2"] = torch.jit.script(shard_model(model, make_plan(spec, 2, halves)))
        model.embeddings.threads = threads
        models[name] = torch.jit.script(model)
        del model
    hot_hits = {}
    for name in ("blocks_int8_int4", "blocks_int8_int4_unranked"):  # the tw2 model's split is the ranked one's
        _, block_lengths, _ = models[name].embeddings.split_blocks(sets[0][0], sets[0][1], None)
        cold = int(block_lengths[: sets[0][1].numel()].sum())
        hot_hits[name] = 1.0 - cold / sets[0][0].numel()
    cases: dict[str, Callable[[int], object]] = {
        name: (lambda i, m=m: m(sets[i][0], sets[i][1], None)) for name, m in models.items()
    }
    with torch.inference_mode():
        seconds = measure(cases, index_count, rounds, {})
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    rows: list[dict[str, object]] = []
    for name, secs in seconds.items():
        rows.append(
            {
                "workload": w.name,
                "case": name,
                "rows": w.rows,
                "hot_rows": hot if name != "one_type_int4" else 0,
                "ids_in_hot_block": round(hot_hits.get(name, hot_hits["blocks_int8_int4"]), 3)
                if name != "one_type_int4"
                else 0.0,
                "ms_per_call": round(1e3 * secs, 3),
                "mlookups_per_s": round(lookups / secs / 1e6, 2),
                "ratio_to_one_type": round(seconds["one_type_int4"] / secs, 3),
                "ratio_to_unsharded_blocks": round(seconds["blocks_int8_int4"] / secs, 3),
                "kernel_threads": 1 if name == "blocks_int8_int4_tw2" else threads,  # tw2: per device
                "host_load_1m": round(os.getloadavg()[0], 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_mapped_only(w: Workload, rounds: int, index_count: int) -> list[dict[str, object]]:
    """``exported_model`` (weights copied into RAM) against ``exported_mapped`` (weights mapped, resident)."""
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", w.rows, w.dim, (f"f{i}",), data_type=DataType.INT8) for i in range(w.num_tables))
    )
    model = random_int8_model(spec)
    sets = make_index_sets(w, index_count, seed=1)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        runtime = load(export(model, f"{tmp}/embedded", weights="embedded"), verify="none")
        copied = runtime.module
        mapped = load_mapped_resident(model, f"{tmp}/mapped")
        del model
        cases: dict[str, Callable[[int], object]] = {
            "exported_model": lambda i: copied(sets[i][0], sets[i][1], None),
            "exported_mapped": lambda i: mapped(sets[i][0], sets[i][1], None),
        }
        with torch.inference_mode():
            check = torch.equal(cases["exported_model"](0), cases["exported_mapped"](0))  # type: ignore[arg-type]
            seconds = measure(cases, index_count, rounds, {})
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    for name, secs in seconds.items():
        rows.append(
            {
                "bench": "lookup",
                "workload": w.name,
                "case": name,
                "rows": w.rows,
                "ms_per_call": round(1e3 * secs, 3),
                "mlookups_per_s": round(lookups / secs / 1e6, 2),
                "ratio_to_exported": round(seconds["exported_model"] / secs, 3),
                "outputs_equal": check,
                "kernel_threads": runtime.threads,
                "host_load_1m": round(os.getloadavg()[0], 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_workload(w: Workload, rounds: int, index_count: int, sharded: bool) -> list[dict[str, object]]:
    spec = ModelSpec(
        tuple(TableConfig(f"t{i}", w.rows, w.dim, (f"f{i}",), data_type=DataType.INT8) for i in range(w.num_tables))
    )
    generator = torch.Generator().manual_seed(0)
    weights = {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) for t in spec.tables}
    model = quantize(spec, weights)
    with tempfile.TemporaryDirectory() as tmp:
        runtime = load(export(model, f"{tmp}/artifact", weights="embedded"))
    exported = runtime.module
    mapped_folder = tempfile.TemporaryDirectory()  # the mapped weights' file lives as long as this run
    mapped = load_mapped_resident(model, f"{mapped_folder.name}/artifact")
    tbe = direct_tbe(spec, model)
    fp32_tables = [weights[t.name] for t in spec.tables]
    gather_table = tbe.split_embedding_weights(split_scale_shifts=False)[0][0]  # [rows, D+4] bytes of table 0
    sets = make_index_sets(w, index_count, seed=1)
    per_table = w.batch_size * w.ids_per_bag
    bag_offsets = torch.arange(0, per_table, w.ids_per_bag)

    def run_exported(i: int) -> object:
        values, lengths, _ = sets[i]
        return exported(values, lengths, None)

    holders = kernel_holders(exported)

    def run_single_call(i: int) -> object:
        """The exported model with its kernel called once per batch (threads=1): the pre-split behaviour."""
        values, lengths, _ = sets[i]
        for holder in holders:
            holder.threads = 1
        try:
            return exported(values, lengths, None)
        finally:
            for holder in holders:
                holder.threads = runtime.threads

    def run_tbe(i: int) -> object:
        values, _, offsets = sets[i]
        return tbe(values, offsets)

    def run_fp32(i: int) -> object:
        values = sets[i][0]
        return [
            F.embedding_bag(values[t * per_table : (t + 1) * per_table], table, bag_offsets, mode="sum")
            for t, table in enumerate(fp32_tables)
        ]

    # A preallocated output keeps page faults of a fresh 40 MB buffer out of the probe.
    gather_out = torch.empty(sets[0][0].numel(), gather_table.shape[1], dtype=gather_table.dtype)

    def run_gather(i: int) -> object:
        return torch.index_select(gather_table, 0, sets[i][0], out=gather_out)

    def run_mapped(i: int) -> object:
        values, lengths, _ = sets[i]
        return mapped(values, lengths, None)

    cases = {
        "exported_model": run_exported,
        "exported_mapped": run_mapped,
        "exported_single_call": run_single_call,
        "direct_tbe": run_tbe,
        "fp32_embedding_bag": run_fp32,
        "gather_probe": run_gather,
    }
    torchrec = torchrec_baseline(spec, weights)
    if torchrec is not None:
        cases["torchrec_qebc"] = lambda i: torchrec(sets[i][0], sets[i][1])
    with torch.inference_mode():
        check = torch.equal(run_exported(0), run_tbe(0)) and torch.equal(run_single_call(0), run_tbe(0))
        check = check and torch.equal(run_mapped(0), run_tbe(0))
        if torchrec is not None:
            check = check and torch.equal(cases["torchrec_qebc"](0), run_tbe(0))  # type: ignore[arg-type]
        seconds = measure(cases, index_count, rounds, {})
    lookups = w.num_tables * w.batch_size * w.ids_per_bag
    base = lookups / seconds["exported_model"]
    reference = seconds.get("torchrec_qebc")
    rows: list[dict[str, object]] = []
    for name, secs in seconds.items():
        rate = lookups / secs
        rows.append(
            {
                "bench": "lookup",
                "workload": w.name,
                "case": name,
                "tables": w.num_tables,
                "rows": w.rows,
                "dim": w.dim,
                "batch": w.batch_size,
                "ids_per_bag": w.ids_per_bag,
                "ms_per_call": round(1e3 * secs, 3),
                "mlookups_per_s": round(rate / 1e6, 2),
                "ratio_to_exported": round(rate / base, 3),
                "ratio_to_torchrec": round(reference / secs, 3) if reference else None,
                "outputs_equal_direct_tbe": check,
                "threads": torch.get_num_threads(),
                "kernel_threads": runtime.threads,
                "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    mapped_folder.cleanup()  # unlinked; the mapping keeps its pages until the module goes
    rows.append(run_batch1(w, exported, holders, runtime.threads, torchrec, rounds * 20))
    if sharded:
        del tbe, gather_table, gather_out
        rows += run_sharded(w, spec, model, exported, sets, rounds, index_count, cases.get("torchrec_qebc"))
    return rows


def run_batch1(
    w: Workload,
    exported: torch.jit.ScriptModule,
    holders: list[torch.jit.ScriptModule],
    threads: int,
    torchrec: torch.jit.ScriptModule | None,
    rounds: int,
) -> dict[str, object]:
    """Batch-1 latency: the exported model at its thread budget against the same model with its kernel
    called once (threads=1, the behaviour before batch splitting): the split must not tax small requests."""
    one = Workload(w.name, w.num_tables, w.rows, w.dim, 1, w.ids_per_bag)
    sets = make_index_sets(one, 8, seed=3)

    def run_budget(i: int) -> object:
        return exported(sets[i][0], sets[i][1], None)

    def run_single(i: int) -> object:
        for holder in holders:
            holder.threads = 1
        try:
            return exported(sets[i][0], sets[i][1], None)
        finally:
            for holder in holders:
                holder.threads = threads

    cases: dict[str, Callable[[int], object]] = {"budget": run_budget, "single_call": run_single}
    if torchrec is not None:
        module = torchrec
        cases["torchrec_qebc"] = lambda i: module(sets[i][0], sets[i][1])
    with torch.inference_mode():
        seconds = measure(cases, len(sets), rounds, {})
    row: dict[str, object] = {
        "bench": "lookup_batch1",
        "workload": w.name,
        "case": "exported_batch1",
        "us_p50": round(1e6 * seconds["budget"], 1),
        "single_call_us_p50": round(1e6 * seconds["single_call"], 1),
        "latency_ratio_to_single_call": round(seconds["budget"] / seconds["single_call"], 3),
        "kernel_threads": threads,
    }
    if "torchrec_qebc" in seconds:
        row["torchrec_us_p50"] = round(1e6 * seconds["torchrec_qebc"], 1)
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table (default 1,000,000)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per case")
    parser.add_argument("--index-sets", type=int, default=8, help="distinct id batches cycled through")
    parser.add_argument("--workload", choices=["W128", "W64"], action="append", help="run only these workloads")
    parser.add_argument("--no-sharded", action="store_true", help="skip the sharded cases")
    parser.add_argument("--mapped-only", action="store_true", help="only exported_model vs exported_mapped")
    parser.add_argument("--blocks", action="store_true", help="only precision blocks vs one type (issue 43)")
    args = parser.parse_args()
    for w in workloads(args.rows):
        if args.workload and w.name not in args.workload:
            continue
        if args.blocks:
            run_blocks(w, args.rounds * max(1, 2048 // w.batch_size), args.index_sets)
            continue
        if args.mapped_only:
            run_mapped_only(w, args.rounds * max(1, 2048 // w.batch_size), args.index_sets)
            continue
        # smaller batches are quicker calls: give them as many rounds as it takes for the same wall time
        rounds = args.rounds * max(1, 2048 // w.batch_size)
        run_workload(w, rounds, args.index_sets, not args.no_sharded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
