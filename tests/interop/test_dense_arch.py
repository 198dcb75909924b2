"""Dense parts from files (`--dense-arch`): TorchScript and torch.export programs, checked against the spec."""

from __future__ import annotations

import pytest
import torch

from infer.config import ModelSpec, TableConfig
from infer.errors import ConfigError
from infer.interop.dense_arch import load_dense_arch

SPEC = ModelSpec((TableConfig("t", 10, 8, ("f", "g")),), num_dense_features=3)


class OverArch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3 + 16, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense, pooled], dim=1)).squeeze(1)


@pytest.fixture(scope="module")
def over_arch():
    torch.manual_seed(0)
    return OverArch().eval()


def _probe():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(7, 3, generator=generator), torch.randn(7, 16, generator=generator)


def test_torchscript_file(over_arch, tmp_path):
    torch.jit.save(torch.jit.script(over_arch), str(tmp_path / "dense.pt"))
    module = load_dense_arch(tmp_path / "dense.pt", SPEC)
    assert torch.equal(module(*_probe()), over_arch(*_probe()))


def test_torch_export_program_with_dynamic_batch(over_arch, tmp_path):
    batch = torch.export.Dim("batch", min=1)
    program = torch.export.export(
        over_arch, (torch.zeros(4, 3), torch.zeros(4, 16)), dynamic_shapes=({0: batch}, {0: batch})
    )
    torch.export.save(program, str(tmp_path / "dense.pt2"))
    module = load_dense_arch(tmp_path / "dense.pt2", SPEC)
    torch.testing.assert_close(module(*_probe()), over_arch(*_probe()), rtol=0, atol=1e-6)
    torch.jit.script(torch.nn.ModuleList([module]))  # it goes inside the scripted artifact


def test_errors_name_the_file_and_the_fix(over_arch, tmp_path):
    static = torch.export.export(over_arch, (torch.zeros(4, 3), torch.zeros(4, 16)))
    torch.export.save(static, str(tmp_path / "static.pt2"))
    with pytest.raises(ConfigError, match=r"static.pt2.*dynamic batch dimension"):
        load_dense_arch(tmp_path / "static.pt2", SPEC)
    torch.jit.save(torch.jit.script(over_arch), str(tmp_path / "dense.pt"))
    wider = ModelSpec(SPEC.tables, num_dense_features=4)
    with pytest.raises(ConfigError, match=r"dense.pt' cannot be called as .*num_dense_features=4.*output_dim=16"):
        load_dense_arch(tmp_path / "dense.pt", wider)
    with pytest.raises(ConfigError, match="declares no dense features"):
        load_dense_arch(tmp_path / "dense.pt", ModelSpec(SPEC.tables))
    with pytest.raises(ConfigError, match="does not exist"):
        load_dense_arch(tmp_path / "nope.pt", SPEC)
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="neither a TorchScript file"):
        load_dense_arch(tmp_path / "junk.pt", SPEC)
    scalar = torch.jit.script(_Scalar())
    torch.jit.save(scalar, str(tmp_path / "scalar.pt"))
    with pytest.raises(ConfigError, match=r"returned \[\] for a batch of 2"):
        load_dense_arch(tmp_path / "scalar.pt", SPEC)


class _Scalar(torch.nn.Module):
    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return dense.sum() + pooled.sum()
