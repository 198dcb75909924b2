"""Fixtures for the C++ loader tests: one build of cpp_loader/ per session, and small artifacts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.config import ModelSpec
from tests.support.call_contract import NUM_DENSE, ColumnScores
from tests.support.pt2_models import compiled_pt2, contract_pt2, embedded_pt2

ROOT = Path(__file__).resolve().parents[2]
CPP = ROOT / "cpp_loader"
BUILD = CPP / "build"
INSTALL = BUILD / "install"  # `make cpp` installs the loader's CMake package here too


def build_cpp_loader() -> Path:
    """Configure (once), build and install cpp_loader/build (into INSTALL); incremental when `make cpp` already
    did it."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    if not (BUILD / "CMakeCache.txt").is_file():
        subprocess.run(
            [
                "cmake",
                "-S",
                str(CPP),
                "-B",
                str(BUILD),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DEMBSERVE_PYTHON={sys.executable}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    for step in (["--build", str(BUILD), "-j2"], ["--install", str(BUILD), "--prefix", str(INSTALL)]):
        result = subprocess.run(["cmake", *step], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return BUILD


@pytest.fixture(scope="session")
def cpp_build() -> Path:
    return build_cpp_loader()


@pytest.fixture(scope="session")
def embserve_run(cpp_build: Path) -> Path:
    return cpp_build / "embserve_run"


def _unsharded(folder: Path, weights: str) -> Path:
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.conftest import mixed_spec

    spec = mixed_spec()
    return export(quantize(spec, random_weights(spec, seed=3)), folder / "unsharded", weights=weights)


@pytest.fixture(scope="session")
def unsharded_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mixed_spec unsharded, in export's default format (mapped: weights-0.bin beside model.pt)."""
    return _unsharded(tmp_path_factory.mktemp("cpp"), "mapped")


@pytest.fixture(scope="session")
def embedded_unsharded_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with every weight inside model.pt (format_version 2): for tests of model.pt's weight buffer."""
    return _unsharded(tmp_path_factory.mktemp("cpp"), "embedded")


@pytest.fixture(scope="session")
def sharded_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mixed_spec over 3 CPU devices, one table of each sharding type, in export's default format (mapped)."""
    return _sharded(tmp_path_factory.mktemp("cpp"), "mapped")


@pytest.fixture(scope="session")
def embedded_sharded_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same sharded model with every weight inside model.pt (format_version 2: replicas' shared_storage)."""
    return _sharded(tmp_path_factory.mktemp("cpp"), "embedded")


def _sharded(folder: Path, weights: str) -> Path:
    from infer.artifact.export import export
    from infer.planner.types import ShardingType
    from infer.quant.quantize import quantize
    from infer.shard.builder import shard_model
    from infer.shard.plans import make_plan
    from infer.weights import random_weights
    from tests.conftest import mixed_spec

    spec = mixed_spec()
    model = quantize(spec, random_weights(spec, seed=5))
    layout = {  # world size 3, one of each sharding type
        "t_int8": (ShardingType.COLUMN_WISE, (0, 1)),
        "t_int4": (ShardingType.ROW_WISE, (0, 1, 2)),
        "t_int2": (ShardingType.REPLICATED, (0, 1, 2)),
        "t_fp16": (ShardingType.TABLE_WISE, (2,)),
        "t_fp32": (ShardingType.TABLE_WISE, (1,)),
    }
    plan = make_plan(spec, 3, layout)
    return export(shard_model(model, plan), folder / "sharded", plan=plan, weights=weights)


@pytest.fixture(scope="session")
def onnx_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An unsharded artifact that also carries model.onnx (the manifest's optional `onnx` section)."""
    from infer.artifact.export import export
    from infer.quant.quantize import quantize
    from infer.weights import random_weights
    from tests.conftest import mixed_spec

    spec = mixed_spec()
    return export(quantize(spec, random_weights(spec, seed=7)), tmp_path_factory.mktemp("cpp") / "onnx", onnx=True)


@pytest.fixture(scope="session")
def pt2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pt2_spec (INT8, INT4, INT2, FP16, FP32 tables; SUM and MEAN) unsharded, with a dense part; model.pt and
    model.pt2 (lookup and dense programs), compiled once per session with tests/artifact/test_pt2.py's
    (tests/support/pt2_models.py). dense_pt2_artifact is the same folder."""
    return compiled_pt2(tmp_path_factory, "unsharded")[1]


@pytest.fixture(scope="session")
def sharded_pt2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pt2_spec over 4 CPU devices (column-wise, replicated over two and three devices, table-wise), with model.pt
    and model.pt2 (one program)."""
    return compiled_pt2(tmp_path_factory, "mixed_sharding")[1]


@pytest.fixture(scope="session")
def corpus_pt2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bad-request corpus's model (tests/support/bad_requests.py) with model.pt2: pt2_models.embedded_pt2's
    (its tables inside the package), compiled once per session with the embedded-format tests'."""
    return embedded_pt2(tmp_path_factory)[1]


DENSE_INPUTS = NUM_DENSE  # the call contract's dense inputs, which dense_pt2_artifact takes


@dataclass(frozen=True)
class DenseArtifact:
    """An exported model with a dense part, and the quantized model it was exported from (for the reference)."""

    spec: ModelSpec
    model: Any
    path: Path


@pytest.fixture(scope="session")
def dense_pt2_artifact(tmp_path_factory: pytest.TempPathFactory) -> DenseArtifact:
    """The call contract's pt2 model (pt2_spec: an INT8 SUM table read by two features, an FP16 MEAN table and
    more; the contract's dense part returning ``[B, 1]``) exported with ``embserve export --pt2 --dense-arch``:
    model.pt and model.pt2 (its lookup and dense programs), pt2_artifact's folder, compiled once per session with
    tests/artifact/test_pt2_contract.py's."""
    from infer.quant.quantize import quantize

    artifact = contract_pt2(tmp_path_factory)
    return DenseArtifact(artifact.spec, quantize(artifact.spec, artifact.weights), artifact.path)


@pytest.fixture(scope="session")
def dense_artifact(tmp_path_factory: pytest.TempPathFactory) -> DenseArtifact:
    """An INT8 SUM table and an FP16 MEAN table under a dense part returning ``[B, 1]``; model.pt only (no compile)."""
    from infer.artifact.export import export
    from infer.config import DataType, PoolingType, TableConfig
    from infer.quant.quantize import quantize
    from infer.weights import random_weights

    spec = ModelSpec(
        (
            TableConfig("t_sum", 50, 8, ("f_sum",)),
            TableConfig("t_mean", 30, 16, ("f_mean",), PoolingType.MEAN, DataType.FP16),
        )
    )
    torch.manual_seed(25)
    spec = spec.with_dense_arch(ColumnScores(DENSE_INPUTS, spec.output_dim).eval(), DENSE_INPUTS)
    model = quantize(spec, random_weights(spec, seed=26))
    return DenseArtifact(spec, model, export(model, tmp_path_factory.mktemp("cpp") / "dense"))
