"""A serving binary uses the loader as the docs' C++ page (docs/cpp.md) shows, both ways: the installed CMake package
(cpp_loader/examples/consumer, ``find_package(embserve_loader CONFIG REQUIRED)``; built and run, compiling its
``main.cpp`` only) and ``add_subdirectory`` of the checkout (configured; its link line checked)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infer.artifact.load import load
from tests.cpp.conftest import CPP, INSTALL, ROOT

CONSUMER = CPP / "examples" / "consumer"
SUBDIRECTORY_PLACEHOLDER = "path/to/embserve/cpp_loader"


def _readme_cmake_blocks() -> list[str]:
    page = (ROOT / "docs" / "cpp.md").read_text()
    assert "## The installed package" in page
    return re.findall(r"```cmake\n(.*?)```", page, flags=re.S)


def test_readme_shows_the_consumer_cmakelists():
    assert (CONSUMER / "CMakeLists.txt").read_text() in _readme_cmake_blocks()


def _cmake(*args: object) -> subprocess.CompletedProcess[str]:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    result = subprocess.run(["cmake", *map(str, args)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _link_line(build: Path) -> str:
    return (build / "CMakeFiles" / "my_server.dir" / "link.txt").read_text()


def _assert_links_the_loader(link: str) -> None:
    """The target's link interface: the archive, libtorch kept (--no-as-needed), RUNPATH to torch and fbgemm."""
    assert "libembserve_loader.a" in link, link
    assert "--no-as-needed" in link, link
    assert "--enable-new-dtags" in link, link
    assert re.search(r"-rpath,\S*/torch/lib\b", link), link
    assert re.search(r"-rpath,\S*/fbgemm_gpu\b", link), link


def test_installed_package_has_its_config_version_and_header(cpp_build):
    package = INSTALL / "lib" / "cmake" / "embserve_loader"
    for name in ("embserve_loaderConfig.cmake", "embserve_loaderConfigVersion.cmake", "embserve_loaderTargets.cmake"):
        assert (package / name).is_file(), name
    assert (INSTALL / "lib" / "libembserve_loader.a").is_file()
    assert (INSTALL / "include" / "embserve" / "loader.h").read_bytes() == (
        CPP / "include" / "embserve" / "loader.h"
    ).read_bytes()
    assert "embserve::embserve_loader" in (package / "embserve_loaderTargets.cmake").read_text()


@pytest.mark.slow
def test_consumer_project_builds_against_the_package_and_runs(cpp_build, unsharded_artifact, tmp_path):
    build = tmp_path / "build"
    _cmake("-S", CONSUMER, "-B", build, "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_PREFIX_PATH={INSTALL}")
    _cmake("--build", build, "-j2")
    # the package's archive is linked, not rebuilt: main.cpp is the one translation unit compiled
    assert sorted(path.name for path in build.rglob("*.o")) == ["main.cpp.o"]
    _assert_links_the_loader(_link_line(build))
    env = {key: value for key, value in os.environ.items() if key != "LD_LIBRARY_PATH"}  # RUNPATH finds torch
    result = subprocess.run(
        [str(build / "my_server"), str(unsharded_artifact)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr
    runtime = load(unsharded_artifact)
    assert f"features: {' '.join(runtime.feature_names)}" in result.stdout
    assert f"output [2, {runtime.output_dim}]" in result.stdout


@pytest.mark.slow
def test_readme_add_subdirectory_project_configures_with_the_same_link_interface(tmp_path):
    """The page's other way, configured as written (building it would compile the loader again: the package's
    test above runs the binary); its link line carries what the package's target carries."""
    [snippet] = [block for block in _readme_cmake_blocks() if "add_subdirectory(" in block]
    assert SUBDIRECTORY_PLACEHOLDER in snippet
    project = tmp_path / "project"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(snippet.replace(SUBDIRECTORY_PLACEHOLDER, CPP.as_posix()))
    shutil.copy(CONSUMER / "main.cpp", project / "main.cpp")
    build = tmp_path / "build"
    configured = _cmake("-S", project, "-B", build, "-DCMAKE_BUILD_TYPE=Release", f"-DEMBSERVE_PYTHON={sys.executable}")
    assert "embserve: torch libs" in configured.stdout
    _assert_links_the_loader(_link_line(build))
    assert (
        not (build / "embserve_loader" / "cmake_install.cmake").is_file()
        or "embserve_loaderTargets" not in (build / "embserve_loader" / "cmake_install.cmake").read_text()
    )  # a parent project installs nothing of the loader unless it asks
