"""The hot-row cache behind both servers: ``embserve serve`` of a runtime loaded with ``hot_rows`` (Python's
``PagedModel``) and ``embserve-server --hot-rows-file`` (the C++ loader's cache, the same rows), both reading each
batch's pages ahead (``--prefetch on``). Lookups and
predictions over embserve.v1 and OIP equal the in-process ``infer.load(dir, hot_rows=...)`` bit for bit, and the
fp32 ``F.embedding_bag`` reference on the dequantized tables within fp32 tolerance; a bad hot-rows file or a
repository is refused at start naming the flag.

The model is the mixed-dtype spec (INT8/INT4/INT2/FP16/FP32, SUM and MEAN) with a dense part, exported mapped;
four of its five tables are cached in part, so batches mix hot and cold ids in one bag.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.runtime import Runtime
from infer.commands.hot_rows import describe_hot_rows
from infer.features import SparseFeatures
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.client import EmbserveClient
from tests.conftest import TinyOverArch, mixed_spec, random_batch
from tests.server.native_support import SERVER_KINDS, NativeServed, native_binary
from tests.server.oip_support import client, requested, triton_inputs
from tests.server.support import CALL_TIMEOUT, NUM_DENSE, Served, local_config
from tests.support.call_contract import Reference, assert_matches

# rows of each table held by the cache (t_fp32 stays uncached): half of t_int8, the even rows of the MEAN t_int4,
# the first third of t_int2, the upper two thirds of the MEAN t_fp16
HOT_ROWS = {
    "t_int8": list(range(500)),
    "t_int4": list(range(0, 500, 2)),
    "t_int2": list(range(100)),
    "t_fp16": list(range(299, 99, -1)),  # any order: the cache sorts
}


@pytest.fixture(scope="module")
def hot_model(tmp_path_factory) -> tuple[Any, Any, Path, Path]:
    """(spec, quantized model, mapped artifact, hot-rows file)."""
    torch.manual_seed(0)
    spec = mixed_spec()
    spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
    model = quantize(spec, random_weights(spec, seed=11))
    folder = tmp_path_factory.mktemp("hot-rows")
    path = export(model, folder / "artifact")
    rows_file = folder / "hot_rows.json"
    rows_file.write_text(json.dumps(HOT_ROWS))
    return spec, model, path, rows_file


@pytest.fixture(scope="module")
def cached_runtime(hot_model) -> Runtime:
    """The in-process Python cache over the same rows: what every answer must equal, bit for bit."""
    return load(hot_model[2], hot_rows={name: torch.tensor(rows) for name, rows in HOT_ROWS.items()})


@pytest.fixture(scope="module", params=SERVER_KINDS)
def hot_server(request, loop_thread, hot_model) -> Iterator[Any]:
    spec, _, path, rows_file = hot_model
    # with the pages read ahead too (--prefetch on), as the paged tier serves: the answers do not change
    if request.param == "native":
        served: Any = NativeServed(path, hot_rows_file=rows_file, prefetch="on", max_delay_us=2000)
    else:  # the Python server of a runtime loaded with the cache, as `embserve serve --hot-rows` loads it
        runtime = load(path, hot_rows={name: torch.tensor(rows) for name, rows in HOT_ROWS.items()}, prefetch="on")
        served = Served.start(loop_thread, runtime, local_config(max_delay_us=2000))
        served.kind = "python"
    yield served
    served.close_channels()
    served.stop(grace=1.0)


def _dense(batch_size: int, seed: int) -> torch.Tensor:
    return torch.randn(batch_size, NUM_DENSE, generator=torch.Generator().manual_seed(seed))


def _mixed_bags(spec: Any) -> SparseFeatures:
    """Bags of hot ids only, cold ids only, both interleaved, and empty ones, in every feature."""
    per_feature = {
        "f_int8": ([1, 2, 3], [700, 999], [4, 800, 5, 499, 500], []),
        "f_int8_b": ([499], [], [0, 999, 0], [998]),
        "f_int4": ([2, 4], [1, 3, 5], [6, 7, 8, 9], []),
        "f_int2": ([0, 99], [100, 299], [], [50, 150, 51]),
        "f_fp16": ([299], [0, 99], [100, 5, 200], [150]),
        "f_fp32": ([0], [199, 1], [], [7, 7]),
    }
    values, lengths = [], []
    for feature in spec.feature_names:
        for bag in per_feature[feature]:
            values += bag
            lengths.append(len(bag))
    return SparseFeatures(spec.feature_names, torch.tensor(values), torch.tensor(lengths, dtype=torch.int32))


def long_bags(spec: Any, weighted: bool) -> SparseFeatures:
    return random_batch(spec, batch_size=64, max_len=30, weighted=weighted, seed=3, id_dtype=torch.int32)


def test_the_cache_changes_the_order_of_the_sums(hot_model, cached_runtime):
    """Without the cache the same model rounds some sums differently: bit-equality below tells the paths apart."""
    plain = load(hot_model[2])
    batch = long_bags(hot_model[0], weighted=False)
    assert not torch.equal(plain.lookup(batch), cached_runtime.lookup(batch))


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_lookups_and_predictions_equal_the_python_cache(hot_server, hot_model, cached_runtime, weighted):
    spec = hot_model[0]
    cases = [(random_batch(spec, batch_size=n, max_len=8, weighted=weighted, seed=s), s) for s, n in ((1, 1), (2, 9))]
    # long bags: the cache's split changes the order of the sums (the test below proves these differ without it)
    cases.append((long_bags(spec, weighted), 3))
    mixed = _mixed_bags(spec)
    if weighted:
        mixed = SparseFeatures(mixed.keys, mixed.values, mixed.lengths, torch.rand(mixed.values.numel()))
    cases.append((mixed, 4))
    # every id hot: the model's share is empty
    hot_only = SparseFeatures(
        spec.feature_names, torch.tensor([1, 2, 499, 4, 0, 150]), torch.tensor([2, 1, 1, 1, 1, 0], dtype=torch.int32)
    )
    if weighted:
        hot_only = SparseFeatures(hot_only.keys, hot_only.values, hot_only.lengths, torch.rand(6))
    cases.append((hot_only, 5))
    with EmbserveClient(hot_server.address, timeout=CALL_TIMEOUT) as v1:
        for batch, seed in cases:
            dense = _dense(batch.lengths.numel() // len(spec.features), seed)
            assert torch.equal(v1.lookup(batch), cached_runtime.lookup(batch))
            assert torch.equal(v1.predict(batch, dense), cached_runtime.predict(batch, dense))


def test_lookups_match_the_fp32_reference_on_the_dequantized_tables(hot_server, hot_model):
    spec, model = hot_model[0], hot_model[1]
    reference = Reference(spec, model)
    with EmbserveClient(hot_server.address, timeout=CALL_TIMEOUT) as v1:
        for batch in (_mixed_bags(spec), random_batch(spec, batch_size=33, max_len=9, weighted=True, seed=7)):
            assert_matches(v1.lookup(batch), reference.pooled(batch))
            dense = _dense(batch.lengths.numel() // len(spec.features), 8)
            with torch.no_grad():  # the dense part on the reference's pooled rows (TinyOverArch gives [B])
                expected = spec.dense_arch(dense, reference.pooled(batch)).reshape(-1)
            assert_matches(v1.predict(batch, dense), expected)


def test_oip_infer_equals_the_python_cache(hot_server, hot_model, cached_runtime):
    spec = hot_model[0]
    batch = random_batch(spec, batch_size=16, weighted=True, seed=9)
    dense = _dense(16, 9)
    with client("grpc", hot_server.address) as c:
        result = c.infer(
            "artifact", triton_inputs("grpc", batch, dense), outputs=requested("grpc", "embeddings", "scores")
        )
    assert torch.equal(torch.from_numpy(np.array(result.as_numpy("embeddings"))), cached_runtime.lookup(batch))
    assert torch.equal(torch.from_numpy(np.array(result.as_numpy("scores"))), cached_runtime.predict(batch, dense))


def test_concurrent_calls_merged_into_one_forward_each_get_their_rows(hot_server, hot_model, cached_runtime):
    spec = hot_model[0]
    batches = [random_batch(spec, batch_size=1 + i % 5, weighted=i % 2 == 0, seed=200 + i) for i in range(24)]

    def call(index: int) -> bool:
        with EmbserveClient(hot_server.address, timeout=CALL_TIMEOUT) as v1:
            return torch.equal(v1.lookup(batches[index]), cached_runtime.lookup(batches[index]))

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert all(pool.map(call, range(len(batches))))


def random_advised(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` maps a weight file of ``folder`` advised MADV_RANDOM (smaps VmFlags ``rr``): the
    prefetcher's first step, so a fault reads its own page, not a readahead window."""
    blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path(f"/proc/{pid}/smaps").read_text())
    mapped = [block for block in blocks if str(folder / "weights-") in block.split("\n", 1)[0]]
    assert mapped, "the weight file is not mapped"
    return any(line.startswith("VmFlags") and " rr" in line for block in mapped for line in block.splitlines())


@pytest.mark.parametrize("hot_server", ["native"], indirect=True)
def test_the_native_server_reports_the_cache_python_reports(hot_server, hot_model, cached_runtime):
    """The start-up line names the same rows, tables and bytes as the Python server's (describe_hot_rows); the
    mapping is read ahead with --prefetch on (the shared server), and not without it (auto: no paged plan)."""
    assert random_advised(hot_server.process.pid, hot_model[2])
    served = NativeServed(hot_model[2], hot_rows_file=hot_model[3])
    try:
        assert describe_hot_rows(cached_runtime) in served.stderr_path.read_text()
        assert not random_advised(served.process.pid, hot_model[2])
    finally:
        served.stop(grace=1.0)


def _refusal(artifact: Path, rows_file: Path | str, *flags: str) -> str:
    completed = subprocess.run(
        [native_binary(), str(artifact), "--hot-rows-file", str(rows_file), "--port", "0", "--host", "127.0.0.1"]
        + list(flags),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    lines = [line for line in completed.stderr.splitlines() if line.startswith("embserve-server: error: ")]
    assert len(lines) == 1, completed.stderr[-2000:]
    return lines[0]


def test_bad_hot_rows_files_are_refused_naming_the_flag(hot_model, tmp_path):
    _, _, path, _ = hot_model
    missing = tmp_path / "nope.json"
    message = _refusal(path, missing)
    assert "--hot-rows-file" in message and str(missing) in message and "write JSON" in message
    (tmp_path / "garbage.json").write_bytes(b"\x00{not json")
    assert "is not JSON" in _refusal(path, tmp_path / "garbage.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    assert "holds array, not an object" in _refusal(path, tmp_path / "list.json")
    (tmp_path / "floats.json").write_text(json.dumps({"t_int8": [1.5]}))
    assert "'t_int8' must map to a list of integer row ids" in _refusal(path, tmp_path / "floats.json")
    (tmp_path / "unknown.json").write_text(json.dumps({"nobody": [1]}))
    assert "hot_rows names table 'nobody', which the model does not have" in _refusal(path, tmp_path / "unknown.json")
    (tmp_path / "wide.json").write_text(json.dumps({"t_int4": [3, 500]}))
    message = _refusal(path, tmp_path / "wide.json")
    assert "hot_rows of table 't_int4' has row 500, outside [0, 500)" in message and "--hot-rows-file" in message
    (tmp_path / "empty.json").write_text(json.dumps({"t_int4": []}))
    assert "hot_rows names no rows" in _refusal(path, tmp_path / "empty.json")
    (tmp_path / "good.json").write_text(json.dumps({"t_int4": [1]}))
    assert "applies to the torchscript backend" in _refusal(path, tmp_path / "good.json", "--backend", "pt2")
    (tmp_path / "repo" / "model").mkdir(parents=True)
    (tmp_path / "repo" / "model" / "1").symlink_to(path, target_is_directory=True)
    message = _refusal(tmp_path / "repo", tmp_path / "good.json")
    assert "--hot-rows-file applies to one artifact served whole" in message and "is a repository" in message


def test_serve_native_hands_over_the_rows_python_chooses(hot_model, tmp_path):
    """``embserve serve --native --hot-rows N --hot-rows-sample FILE --prefetch on``: the rows are chosen by
    ``hot_rows_from_sample`` (the Python server's choice) and handed to the binary as a memory file."""
    from infer.artifact.manifest import Manifest
    from infer.artifact.paged import hot_rows_from_sample
    from infer.cli import build_parser
    from server.native import native_command

    native_binary()
    path = hot_model[2]
    sample = tmp_path / "sample.json"
    sample.write_text(json.dumps({"f_int8": [7, 7, 7, 3, 3, 900], "f_int8_b": [3, 11], "f_fp16": [5, 5, 5, 5]}))
    argv = ["serve", str(path), "--native", "--hot-rows", "3", "--hot-rows-sample", str(sample), "--prefetch", "on"]
    command = native_command(build_parser().parse_args(argv))
    assert command[2] == "--hot-rows-file" and command[-2:] == ["--prefetch", "on"]
    handed = json.loads(Path(command[3]).read_text())  # /proc/self/fd/N: this process's memory file
    expected = hot_rows_from_sample(Manifest.read(path).spec, sample, 3)
    assert handed == {table: rows.tolist() for table, rows in expected.items()} == {"t_fp16": [5], "t_int8": [3, 7]}
    os.close(int(command[3].rsplit("/", 1)[1]))


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_serve_refuses_the_cache_and_prefetch_flags_for_a_repository(hot_model, tmp_path, capsys, monkeypatch, native):
    """Both servers' command lines refuse --hot-rows and --prefetch on/off for a repository, naming the flag."""
    from infer.cli import main

    def no_exec(*_: Any) -> None:  # a refusal that regressed would replace this test process with the binary
        raise AssertionError("embserve serve --native started the binary instead of refusing")

    monkeypatch.setattr(os, "execv", no_exec)

    (tmp_path / "repo" / "model").mkdir(parents=True)
    (tmp_path / "repo" / "model" / "1").symlink_to(hot_model[2], target_is_directory=True)
    serve = ["serve", str(tmp_path / "repo"), *(["--native"] if native else [])]
    for flags, fragment in (
        (["--hot-rows", "5", "--hot-rows-sample", str(hot_model[3])], "--hot-rows applies to one artifact"),
        (["--prefetch", "on"], "--prefetch on applies to one artifact"),
    ):
        assert main([*serve, *flags]) == 2
        assert fragment in capsys.readouterr().err
