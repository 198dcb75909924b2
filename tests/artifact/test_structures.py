"""Structure reuse (infer.artifact.structures): versions of one layout (other weights, other saves) share one
structure digest and load as copies of one compiled model, each answering with its own weights (checked against the
fp32 reference on its dequantized tables); a dense part with other weights, or another layout, is loaded afresh."""

from __future__ import annotations

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.artifact.structures import StructureCache, structure_digest
from infer.config import ModelSpec, TableConfig
from infer.quant.quantize import dequantized_weights, quantize
from infer.reference import FloatEmbeddingBagCollection
from infer.weights import random_weights
from tests.conftest import TinyOverArch, mixed_spec, random_batch

NUM_DENSE = 3


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """(spec, quantized model, artifact) of two versions of one sparse layout, and of one dense model twice."""
    store = tmp_path_factory.mktemp("structures")
    spec = mixed_spec()
    found = {}
    for name, seed in (("a", 1), ("b", 2)):
        model = quantize(spec, random_weights(spec, seed=seed))
        found[name] = (spec, model, export(model, store / name))
    for name, seed in (("dense_a", 3), ("dense_b", 4)):
        torch.manual_seed(seed)  # the dense part's weights differ
        dense_spec = spec.with_dense_arch(TinyOverArch(NUM_DENSE, spec.output_dim), NUM_DENSE)
        model = quantize(dense_spec, random_weights(dense_spec, seed=seed))
        found[name] = (dense_spec, model, export(model, store / name))
    return found


def test_versions_of_one_layout_share_a_structure_and_answer_with_their_own_weights(versions):
    (_, _, a), (_, _, b) = versions["a"], versions["b"]
    assert (a / "model.pt").read_bytes() != (b / "model.pt").read_bytes()  # each save has its own ids
    assert structure_digest(a / "model.pt") == structure_digest(b / "model.pt")
    cache = StructureCache()
    batch = random_batch(versions["a"][0], batch_size=12, weighted=True, seed=8)
    for name in ("a", "b", "a"):
        spec, model, artifact = versions[name]
        runtime = load(artifact, structures=cache)
        reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
        torch.testing.assert_close(runtime.lookup(batch), reference(batch), rtol=1e-5, atol=1e-5)
    assert cache.hits == 2  # b and the second a were copies


def test_a_dense_part_with_other_weights_or_another_layout_is_loaded_afresh(versions, tmp_path):
    digests = {name: structure_digest(versions[name][2] / "model.pt") for name in ("a", "dense_a", "dense_b")}
    assert len(set(digests.values())) == 3
    other = ModelSpec((TableConfig("t", 50, 8, ("f",)),))
    other_artifact = export(quantize(other, random_weights(other, seed=1)), tmp_path / "other")
    assert structure_digest(other_artifact / "model.pt") not in digests.values()
    cache = StructureCache()
    dense = torch.randn(5, NUM_DENSE, generator=torch.Generator().manual_seed(2))
    for name in ("dense_a", "dense_b"):
        spec, model, artifact = versions[name]
        batch = random_batch(spec, batch_size=5, seed=9)
        runtime = load(artifact, structures=cache)
        reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
        with torch.no_grad():
            expected = spec.dense_arch(dense, reference(batch))
        torch.testing.assert_close(runtime.predict(batch, dense), expected, rtol=1e-5, atol=1e-5)
    assert cache.hits == 0


def test_an_embedded_artifact_never_enters_the_cache(versions, tmp_path):
    """Its model file holds the tables: a copy would double them and keeping one would hold them for good."""
    spec, model, _ = versions["a"]
    embedded = export(model, tmp_path / "embedded", weights="embedded")
    cache = StructureCache()
    batch = random_batch(spec, batch_size=4, seed=10)
    runtime = load(embedded, structures=cache)
    reference = FloatEmbeddingBagCollection(spec, dequantized_weights(spec, model))
    torch.testing.assert_close(runtime.lookup(batch), reference(batch), rtol=1e-5, atol=1e-5)
    assert len(cache) == 0
