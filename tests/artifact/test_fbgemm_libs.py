"""fbgemm's operators for a TorchScript model: ``load`` registers the operator libraries a C++ host loads
(``REQUIRED_LIBRARIES``) without importing the fbgemm_gpu package, and the model answers as the independent
reference does, before and after a later ``import fbgemm_gpu`` (which loads the same libraries again)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from infer.artifact.export import export
from infer.artifact.fbgemm_libs import REQUIRED_LIBRARIES, fbgemm_library_dir
from infer.quant.quantize import quantize
from infer.weights import random_weights
from tests.conftest import random_batch
from tests.support.call_contract import NUM_DENSE, Reference, assert_matches, contract_spec


def test_a_torchscript_load_needs_the_operator_libraries_only(tmp_path):
    spec = contract_spec()
    model = quantize(spec, random_weights(spec, seed=51))
    path = export(model, tmp_path / "model")
    batch = random_batch(spec, 7, max_len=5, weighted=True, seed=3)
    dense = torch.randn(7, NUM_DENSE, generator=torch.Generator().manual_seed(4))
    torch.save({"batch": (batch.keys, batch.values, batch.lengths, batch.weights), "dense": dense}, tmp_path / "in.pt")
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        from infer.artifact.load import load
        from infer.features import SparseFeatures
        inputs = torch.load({str(tmp_path / "in.pt")!r})
        batch = SparseFeatures(*inputs["batch"])
        runtime = load({str(path)!r})
        before = (runtime.lookup(batch), runtime.predict(batch, inputs["dense"]))
        imported = sorted(m for m in sys.modules if m.split(".")[0] == "fbgemm_gpu")
        import fbgemm_gpu  # the whole package after the libraries: they load again, harmlessly
        after = (runtime.lookup(batch), runtime.predict(batch, inputs["dense"]))
        again = load({str(path)!r}).lookup(batch)
        out = {{"before": before, "after": after, "again": again, "imported": imported}}
        torch.save(out, {str(tmp_path / "out.pt")!r})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["imported"] == []
    reference = Reference(spec, model)
    for pooled, scores in (out["before"], out["after"]):
        assert_matches(pooled, reference.pooled(batch))
        assert_matches(scores, reference.scores(batch, dense))
    assert torch.equal(out["again"], out["before"][0])


def test_the_library_folder_is_found_without_importing_the_package():
    script = "import sys; from infer.artifact.fbgemm_libs import fbgemm_library_dir as d; f = d(); "
    script += "print(f, 'fbgemm_gpu' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    folder, imported = done.stdout.split()
    assert imported == "False"
    assert folder == str(fbgemm_library_dir())
    assert all((fbgemm_library_dir() / name).is_file() for name in REQUIRED_LIBRARIES)
