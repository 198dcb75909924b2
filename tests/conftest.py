"""Shared fixtures: small specs covering every dtype, both poolings and a shared table."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# AOTInductor's compile cache (/tmp/torchinductor_<user>) is shared by every process: two pytest-xdist workers
# compiling models whose generated code is the same (mapped models differing only in weights) raced on it and
# one loaded a half-written wrapper.so ("file too short"). Each worker, and the processes it starts, keep their own.
if os.environ.get("PYTEST_XDIST_WORKER") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_embserve_{os.environ['PYTEST_XDIST_WORKER']}"
    )

# AOTInductor compiles a package's wrapper (the C++ that checks inputs, allocates buffers and calls the generated
# kernels and fbgemm's operators; the kernels, defined in their own file, stay at -O3) at -O1 with line tables:
# about 5 CPU-s of g++ a program on this 2-core kind of host. At -O0 without line tables a model of two programs
# compiles in 18 % less CPU (16.4 -> 13.4 CPU-s, self + children, warm caches). Read when torch._inductor.config is
# first imported (by a compile); set for this process and those it starts, unless the caller set them. A user's
# export keeps torch's defaults.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
os.environ.setdefault("AOT_INDUCTOR_ENABLE_LINE_TABLES", "0")

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.features import SparseFeatures

# fbgemm's CUDA kernels round differently from its CPU kernels: on an H200 (torch 2.11, fbgemm-gpu 1.6) INT8 pooled
# sums of a CUDA model differed from the CPU model's by up to 1.1e-3 relative (0.7604 vs 0.7598). CUDA results are
# compared with CPU ones within this tolerance, and with other CUDA results (the same kernel) exactly or at 1e-6.
CUDA_TOLERANCE = 2e-3


def small_spec(data_type: DataType = DataType.INT8, pooling: PoolingType = PoolingType.SUM) -> ModelSpec:
    """Two tables of ``data_type``/``pooling``: one shared by two features, one with its own."""
    return ModelSpec(
        (
            TableConfig("shared", 997, 64, ("a", "b"), pooling, data_type),
            TableConfig("single", 301, 32, ("c",), pooling, data_type),
        )
    )


def mixed_spec() -> ModelSpec:
    """Every data type and both poolings in one model."""
    return ModelSpec(
        (
            TableConfig("t_int8", 1000, 64, ("f_int8", "f_int8_b"), PoolingType.SUM, DataType.INT8),
            TableConfig("t_int4", 500, 32, ("f_int4",), PoolingType.MEAN, DataType.INT4),
            TableConfig("t_int2", 300, 16, ("f_int2",), PoolingType.SUM, DataType.INT2),
            TableConfig("t_fp16", 300, 8, ("f_fp16",), PoolingType.MEAN, DataType.FP16),
            TableConfig("t_fp32", 200, 12, ("f_fp32",), PoolingType.SUM, DataType.FP32),
        )
    )


def cuda_mixed_spec(device: str = "cuda:0") -> ModelSpec:
    """``mixed_spec`` with the tables whose type fbgemm's CUDA kernel gets wrong on this GPU stored as INT4 instead
    (``infer.modules.cuda_probe`` refuses them; tests/quant/test_quantize_gpu.py checks the refusal): the same
    features, rows and dims, so requests written for ``mixed_spec`` (tests/cpp's parity requests) still fit."""
    import dataclasses

    from infer.modules.cuda_probe import kernel_type_error

    return ModelSpec(
        tuple(
            t if kernel_type_error(t.data_type, device) is None else dataclasses.replace(t, data_type=DataType.INT4)
            for t in mixed_spec().tables
        )
    )


def random_batch(
    spec: ModelSpec,
    batch_size: int = 16,
    max_len: int = 6,
    weighted: bool = False,
    seed: int = 0,
    id_dtype: torch.dtype = torch.int64,
) -> SparseFeatures:
    """Random bag lengths in [0, max_len] (so some bags are empty) and uniform ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (len(spec.features) * batch_size,), generator=generator, dtype=torch.int32)
    lengths[::5] = 0  # make sure empty bags are present
    per_feature = lengths.view(len(spec.features), batch_size).sum(1).tolist()
    values = torch.cat(
        [
            torch.randint(0, info.num_embeddings, (int(n),), generator=generator)
            for info, n in zip(spec.features, per_feature)
        ]
    ).to(id_dtype)
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    return SparseFeatures(spec.feature_names, values, lengths, weights)


# The modules whose native servers run under the sanitizer build when $EMBSERVE_SANITIZED_SERVER_BIN names it (make
# test builds cpp_loader/build/server/embserve-server-asan and sets it; `make server-asan` runs only these, -m
# sanitized -k native): the bad-request corpus (v1 and OIP, gRPC and REST), malformed HTTP, the OIP (REST token and
# TLS included), contract, service, hardening, native, repository, pt2 and stop-race tests (the slower build widened
# a race of the stop that lost REST calls). NativeServed and the stop race fail a test on any sanitizer line in the
# server's log.
SANITIZED_MODULES = frozenset(
    {
        "tests/test_bad_requests.py",
        "tests/server/test_protocol_contract.py",
        "tests/server/test_service.py",
        "tests/server/test_hardening.py",
        "tests/server/test_native_server.py",
        "tests/server/test_oip_http.py",
        "tests/server/test_oip.py",
        "tests/server/test_oip_security.py",
        "tests/server/test_repository.py",
        "tests/server/test_pt2_serving.py",
        "tests/server/test_native_hot_rows.py",
        "tests/server/test_stop_race.py",
    }
)
# leak reports are off: libtorch and gRPC keep process-lifetime singletons, and the server leaves with _exit after
# its drain; a report aborts nothing (the test reads it from the server's log)
SANITIZER_ENV = {"ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}


def sanitizer_reported(log: str) -> bool:
    """Whether AddressSanitizer or UndefinedBehaviorSanitizer reported an error in a server's log."""
    return "ERROR: AddressSanitizer" in log or "runtime error:" in log


_ROOT = Path(__file__).resolve().parent.parent


def _module_path(path) -> str:
    return Path(str(path)).resolve().relative_to(_ROOT).as_posix()


# The longest modules (pytest --durations, a full run), started first: pytest-xdist hands out whole modules
# (--dist loadfile) in collection order, so a long module collected last keeps one worker busy alone at the end.
# Within a module the order stays as written.
LONGEST_MODULES = (
    "tests/server/test_hot_reload.py",
    "tests/artifact/test_pt2.py",
    "tests/distributed/test_serving.py",
    "tests/server/test_hardening.py",
    "tests/distributed/test_launch.py",
    "tests/distributed/test_replica_group.py",
    "tests/artifact/test_mapped.py",
    "tests/cpp/test_cpp_mapped.py",
    "tests/cpp/test_cpp_pt2.py",
    "tests/cpp/test_cpp_integrity.py",
    "tests/server/test_workers.py",
    "tests/shard/test_sharded.py",
)


def pytest_collection_modifyitems(config, items):
    module = {item.nodeid: _module_path(item.path) for item in items}
    first = {name: rank for rank, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: first.get(module[item.nodeid], len(first)))  # stable: the rest keep their order
    for item in items:
        if module[item.nodeid] in SANITIZED_MODULES:
            item.add_marker(pytest.mark.sanitized)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def _sanitized_server_binary(request) -> Iterator[None]:
    """In SANITIZED_MODULES, point every native server the module starts at $EMBSERVE_SANITIZED_SERVER_BIN (autouse:
    set before the module's own server fixtures start one)."""
    binary = os.environ.get("EMBSERVE_SANITIZED_SERVER_BIN")
    if not binary or _module_path(request.path) not in SANITIZED_MODULES:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBSERVE_SERVER_BIN", binary)
        for key, value in SANITIZER_ENV.items():
            patch.setenv(key, value)
        yield


class TinyOverArch(torch.nn.Module):
    """A one-layer dense part ``(dense [B, n], pooled [B, d]) -> scores [B]`` for models with predict()."""

    def __init__(self, num_dense: int, pooled_dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(num_dense + pooled_dim, 1)

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense_features, pooled], dim=1)).squeeze(1)
