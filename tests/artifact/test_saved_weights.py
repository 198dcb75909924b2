"""A mapped artifact's model file must carry no weights of its mapped kernels: one that does (a model re-saved after
a load, rehashed) is refused, naming the file, the kernel and the weight file, instead of being silently replaced by
the mapping. The C++ loader's verdict on the same artifacts is in tests/cpp/test_cpp_refusals.py."""

from __future__ import annotations

import pytest

from infer.artifact.export import export
from infer.artifact.hosts import export_hosts, load_host_part
from infer.artifact.load import load
from infer.errors import ArtifactError, ArtifactErrorKind
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import mixed_spec
from tests.support.artifacts import save_weights_in_model


@pytest.fixture(scope="module")
def model():
    spec = mixed_spec()
    return spec, quantize(spec, random_weights(spec, seed=31))


@pytest.mark.parametrize("verify", ["full", "none"])
def test_a_model_file_that_carries_a_mapped_kernels_weights_is_refused(model, tmp_path, verify):
    _, quantized = model
    artifact = export(quantized, tmp_path / "art")
    load(artifact, verify=verify)  # untouched, it loads
    resaved = save_weights_in_model(artifact, tmp_path / "resaved")
    with pytest.raises(ArtifactError) as caught:
        load(resaved, verify=verify)
    assert caught.value.kind is ArtifactErrorKind.MODEL
    message = str(caught.value)
    expected_bytes = (resaved / "weights-0.bin").stat().st_size
    assert f"{resaved / 'model.pt'} carries {expected_bytes} bytes of weights for kernel 0" in message
    assert "but the manifest maps them from weights-0.bin; re-export the artifact" in message


def test_a_host_part_that_carries_its_kernels_weights_is_refused(model, tmp_path):
    from tests.distributed.conftest import host_plan

    spec, quantized = model
    artifact = export_hosts(quantized, tmp_path / "art", host_plan(spec, "table", hosts=2, devices_per_host=1))
    resaved = save_weights_in_model(artifact, tmp_path / "resaved", model_file="hosts/1/model.pt")
    load_host_part(resaved, 0)  # host 0's part is untouched
    with pytest.raises(ArtifactError) as caught:
        load_host_part(resaved, 1)
    assert caught.value.kind is ArtifactErrorKind.MODEL
    assert f"{resaved / 'hosts/1/model.pt'} carries " in str(caught.value)
    assert "from hosts/1/weights-0.bin; re-export the artifact" in str(caught.value)
