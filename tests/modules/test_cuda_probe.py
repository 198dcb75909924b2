"""The probe of fbgemm's kernels (infer.modules.cuda_probe) on this machine: its lookup code runs CPU against CPU
(it must agree with itself), the CPU is never refused, and a loaded artifact's CPU kernels pass the load check. The
GPU cases (a refused type, a refused artifact) are in tests/quant/test_quantize_gpu.py."""

from __future__ import annotations

import pytest

from infer.artifact.kernel_types import Kernel, KernelTable
from infer.artifact.kernels import check_device_kernels
from infer.config import DataType
from infer.modules import cuda_probe


@pytest.mark.parametrize("data_type", list(DataType), ids=lambda d: d.value)
def test_the_probe_lookup_agrees_with_itself_on_the_cpu(data_type):
    assert cuda_probe._probe(data_type, "cpu") is None
    assert cuda_probe.kernel_type_error(data_type, "cpu") is None


def test_cpu_kernels_pass_the_load_check():
    tables = tuple(KernelTable(10, 32, d) for d in DataType)
    check_device_kernels([Kernel(0, "cpu", 1, tables, tuple(range(len(tables))))], {}, "artifact")
