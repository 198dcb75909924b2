"""A design candidate for issue 43's lookup target: tables in precision blocks pooled in one pass by a kernel of our
own (``bench/block_kernel.cpp``, built here with ``torch.utils.cpp_extension``; not part of the product), against
fbgemm's INT4 TBE on the same table in one type and against the served block path (remap op, split op, one TBE call
over both levels, the levels added). W128 shapes as ``bench/lookup.py --blocks``: 8 tables of 1M rows, dim 128,
batch 2048, 20 ids a bag, Zipf(1.05) ids, 1/32 of each table's rows INT8 ranked from a sample of the same traffic,
the rest INT4. One thread for every case (the prototype is one loop). The prototype reads the served model's own TBE
buffers; its output is checked against the served path's (fp32 reassociation apart) before anything is timed.

    python bench/block_kernel.py              # one JSON line per case; needs AVX-512 and a C++ compiler
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lookup import Workload, block_specs, measure, random_bytes_model, rank_blocks, zipf_index_sets  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "block_kernel.cpp"


def has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "f16c", "fma"))


def build():  # type: ignore[no-untyped-def]
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.gettempdir()) / "embserve-block-kernel"
    folder.mkdir(exist_ok=True)
    flags = ["-O3", "-mavx512f", "-mavx512bw", "-mf16c", "-mfma"]
    return load("embserve_block_kernel", [str(SOURCE)], extra_cflags=flags, build_directory=str(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=100, help="timed calls of each case (median)")
    args = parser.parse_args()
    if not has_avx512():
        print(json.dumps({"bench": "block_kernel", "skipped": "needs AVX-512 (the prototype's only path)"}))
        return
    torch.set_num_threads(1)
    kernel = build()
    w = Workload("W128", 8, args.rows, 128, 2048, 20)
    hot, one_type, blocked = block_specs(w)
    drawn = zipf_index_sets(w, 8, seed=1)
    sets, sample = drawn[:4], drawn[4:]
    plain = random_bytes_model(one_type)
    model = random_bytes_model(blocked)
    rank_blocks(model, w, sample)
    plain_script = torch.jit.script(plain)
    served = torch.jit.script(model)
    collection = model.embeddings
    # each feature's INT8 and INT4 blocks in the TBE buffer (kernel tables: per table its hot block, then its cold)
    weights = collection.table_weights()
    hot_rows = torch.tensor([weights[2 * f][1].data_ptr() for f in range(w.num_tables)], dtype=torch.int64)
    cold_rows = torch.tensor([weights[2 * f + 1][1].data_ptr() for f in range(w.num_tables)], dtype=torch.int64)
    hot_stride, cold_stride = weights[0][1].stride(0), weights[1][1].stride(0)
    assert weights[0][0].shape == (hot, w.dim) and weights[1][0].shape == (w.rows - hot, w.dim // 2)
    offsets = [torch.cat([torch.zeros(1, dtype=torch.int64), lengths.to(torch.int64).cumsum(0)]) for _, lengths in sets]

    def one_pass(i: int) -> torch.Tensor:
        return kernel.pool_blocks(
            sets[i][0], offsets[i], collection.block_lookup, collection.block_lookup_offsets,
            collection.block_sizes, hot_rows, cold_rows, hot_stride, cold_stride,
        )  # fmt: skip

    with torch.inference_mode():
        for i in range(len(sets)):
            expected = served(sets[i][0], sets[i][1], None)
            got = one_pass(i)
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-4):
                raise SystemExit(f"prototype differs from the served path: max |diff| {(got - expected).abs().max()}")
        cases: dict[str, Callable[[int], object]] = {
            "one_type_int4_tbe": lambda i: plain_script.embeddings.kernel(sets[i][0], offsets[i], None),
            "one_type_int4_forward": lambda i: plain_script(sets[i][0], sets[i][1], None),
            "blocks_served_forward": lambda i: served(sets[i][0], sets[i][1], None),
            "blocks_one_pass_prototype": one_pass,
        }
        median = measure(cases, len(sets), args.rounds, {})
    for name, value in median.items():
        print(
            json.dumps(
                {
                    "bench": "block_kernel",
                    "case": name,
                    "rows": w.rows,
                    "hot_rows": hot,
                    "ms_per_call": round(1e3 * value, 3),
                    "ratio_to_one_type_tbe": round(median["one_type_int4_tbe"] / value, 3),
                    "ratio_to_one_type_forward": round(median["one_type_int4_forward"] / value, 3),
                    "threads": 1,
                    "host_load_1m": round(os.getloadavg()[0], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
