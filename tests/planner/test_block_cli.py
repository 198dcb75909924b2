"""``embserve plan/export --memory-budget --sample-ids`` choose precision blocks with no other flag (issue 43): the
stats and ``embserve inspect`` show each block table's blocks, and the exported model serves lookups equal to fp32
``embedding_bag`` over the table dequantized block by block."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from infer.artifact.load import load
from infer.config import ModelSpec, TableConfig
from infer.planner.types import ShardingPlan
from infer.quant.rowwise import dequantize_rows, quantize_rows


def zipf_ids(rows: int, count: int, rng: np.random.Generator) -> np.ndarray:
    ranks = np.minimum(rng.zipf(1.2, count) - 1, rows - 1)
    return rng.permutation(rows)[ranks]


def hot_and_small(
    tmp_path: Path, big_rows: int, seed: int
) -> tuple[ModelSpec, dict[str, torch.Tensor], list[str], np.random.Generator]:
    """A Zipf-read table of ``big_rows`` rows and a small one, written under ``tmp_path`` as spec.json, w.pt and a
    sample of ids (ids.npz); with the flags of a budget of 1.5x their INT4 bytes and that sample, and the generator
    that drew the sample (for the requests)."""
    spec = ModelSpec(
        (
            TableConfig("big", big_rows, 32, ("fb",), pooling="sum"),
            TableConfig("small", 64, 32, ("fs",), pooling="mean"),
        )
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    weights = {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=torch.Generator().manual_seed(i))
               for i, t in enumerate(spec.tables)}  # fmt: skip
    torch.save(weights, tmp_path / "w.pt")
    rng = np.random.default_rng(seed)
    np.savez(tmp_path / "ids.npz", fb=zipf_ids(big_rows, 20000, rng), fs=rng.integers(0, 64, 2000))
    int4_bytes = big_rows * (16 + 4) + 64 * (16 + 4)
    flags = ["--memory-budget", str(int(int4_bytes * 1.5)), "--sample-ids", str(tmp_path / "ids.npz")]
    return spec, weights, flags, rng


def test_export_with_a_budget_and_sample_ids_holds_tables_in_blocks(tmp_path, capsys):
    from infer.cli import main

    spec, weights, flags, rng = hot_and_small(tmp_path, 8192, seed=0)
    assert main(["plan", "--spec", str(tmp_path / "spec.json"), "--world-size", "1", "--compute-device", "cpu",
                 "--out", str(tmp_path / "plan.json"), *flags]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "blocks, hottest first:" in printed
    reasons = ShardingPlan.from_json((tmp_path / "plan.json").read_text()).planner["precision"]["tables"]
    chosen = {r["table"]: r.get("blocks") for r in reasons}
    assert chosen["big"] and sum(b["rows"] for b in chosen["big"]) == 8192

    art = tmp_path / "art"
    export = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt")]
    assert main([*export, "--out", str(art), *flags]) == 0
    printed = capsys.readouterr().out
    # a mapped one-host export streams its tables, blocks included (its accuracy table from the artifact written)
    assert "blocks, hottest first:" in printed and "streamed 2 tables (8,256 rows" in printed
    assert "accuracy of the exported artifact" in printed
    # the plan alone does not say which rows are hot: the sample it was made with must come along
    assert main([*export, "--out", str(tmp_path / "other"), "--plan", str(tmp_path / "plan.json")]) == 2
    assert "--sample-ids" in capsys.readouterr().err
    assert main(["inspect", str(art)]) == 0
    shown = capsys.readouterr().out
    assert "big in blocks, precise first:" in shown and "id remap" in shown

    runtime = load(art)
    big = runtime.spec.table("big")
    assert [(b.rows, b.data_type.value) for b in big.blocks] == [(b["rows"], b["data_type"]) for b in chosen["big"]]
    # the reference: every row quantized in the type of the block that holds it (the block's ids from the model)
    collection = runtime.module.embeddings
    from infer.modules.collection import decode_remap, stored_remaps

    starts = [sum(b.rows for b in big.blocks[:j]) for j in range(len(big.blocks))]
    ranks = decode_remap(stored_remaps(collection)[0][0], starts)
    stored = torch.empty_like(weights["big"])
    for j, block in enumerate(big.blocks):
        ids = torch.nonzero((ranks >= starts[j]) & (ranks < starts[j] + block.rows)).flatten()
        data, scale_bias = quantize_rows(weights["big"][ids], block.data_type)
        stored[ids] = dequantize_rows(data, scale_bias, block.data_type, 32)
    small = runtime.spec.table("small")
    data, scale_bias = quantize_rows(weights["small"], small.data_type)
    small_rows = dequantize_rows(data, scale_bias, small.data_type, 32)
    values_big = torch.from_numpy(zipf_ids(8192, 300, rng))
    values_small = torch.randint(0, 64, (40,))
    lengths = torch.tensor([100, 0, 200, 10, 0, 30])
    served = runtime.module(torch.cat([values_big, values_small]), lengths)
    bag = torch.tensor([0, 100, 100])
    expected_big = F.embedding_bag(values_big, stored, bag, mode="sum")
    expected_small = F.embedding_bag(values_small, small_rows, torch.tensor([0, 10, 10]), mode="mean")
    torch.testing.assert_close(served, torch.cat([expected_big, expected_small], 1), rtol=1e-5, atol=1e-4)


def test_export_on_two_devices_places_each_block_table_table_wise(tmp_path, capsys):
    """--world-size 2 with a budget and a sample: the planner holds the hot table in blocks and places it whole
    (table-wise) on one device, never row- or column-wise; the sharded artifact answers as the one-device export."""
    import json

    from infer.cli import main

    spec, weights, flags, rng = hot_and_small(tmp_path, 4096, seed=1)
    export = ["export", "--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt"), *flags]
    assert main([*export, "--out", str(tmp_path / "one")]) == 0
    assert main([*export, "--out", str(tmp_path / "two"), "--world-size", "2"]) == 0
    capsys.readouterr()
    plan = ShardingPlan.from_json((tmp_path / "two" / "plan.json").read_text())
    assert plan.topology.world_size == 2 and plan.table("big").sharding_type.value == "table_wise"
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert [t.get("blocks") is not None for t in manifest["tables"]] == [True, False]
    one, two = load(tmp_path / "one"), load(tmp_path / "two")
    assert two.spec.table("big").blocks == one.spec.table("big").blocks
    values = torch.cat([torch.from_numpy(zipf_ids(4096, 300, rng)), torch.randint(0, 64, (40,))])
    lengths = torch.tensor([100, 0, 200, 10, 0, 30])
    weights_ = torch.rand(values.numel())
    assert torch.equal(two.module(values, lengths, weights_), one.module(values, lengths, weights_))
