"""The README's CMake snippet is cpp_loader/examples/consumer/CMakeLists.txt, and that project builds and runs."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from infer.artifact.load import load
from tests.cpp.conftest import CPP, ROOT

CONSUMER = CPP / "examples" / "consumer"


def test_readme_shows_the_consumer_cmakelists():
    cmakelists = (CONSUMER / "CMakeLists.txt").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "## C++ loader" in readme
    assert f"```cmake\n{cmakelists}```" in readme


@pytest.mark.slow
def test_consumer_project_builds_and_runs(unsharded_artifact, tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(CONSUMER), "-B", str(build), f"-DEMBSERVE_PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
    )
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    built = subprocess.run(["cmake", "--build", str(build), "-j2"], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    result = subprocess.run(
        [str(build / "my_server"), str(unsharded_artifact)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    runtime = load(unsharded_artifact)
    assert f"features: {' '.join(runtime.feature_names)}" in result.stdout
    assert f"output [2, {runtime.output_dim}]" in result.stdout
