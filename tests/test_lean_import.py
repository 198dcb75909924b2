"""``import infer`` stays light: no fbgemm, no CUDA initialisation, no server, no optional extras."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_infer_does_not_load_fbgemm_or_cuda():
    script = textwrap.dedent(
        """
        import sys
        import torch
        import infer
        import infer.config, infer.features, infer.errors, infer.weights, infer.reference, infer.request_rules
        import infer.planner, infer.shard, infer.quant.rowwise, infer.quant.quantize, infer.quant.accuracy
        import infer.modules.tbe, infer.modules.collection, infer.modules.sharded
        import infer.artifact.manifest, infer.artifact.export, infer.artifact.load, infer.artifact.runtime
        import infer.artifact.cpp_io, infer.artifact.fbgemm_libs
        import infer.interop, infer.interop.torchrec, infer.interop.dlrm
        from infer import from_torchrec, load_torchrec_checkpoint
        from infer import ModelSpec, SparseFeatures, TableConfig
        from infer import plan_for_inference, shard_model, Topology, ComputeDevice, export, load
        heavy = ("fbgemm", "server", "grpc", "matplotlib", "torchrec", "onnx", "onnxruntime", "tritonclient")
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        assert not loaded, loaded
        assert not torch.cuda.is_initialized()
        print("lean")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lean"


def test_first_use_loads_fbgemm():
    script = textwrap.dedent(
        """
        import sys
        import infer
        spec = infer.ModelSpec((infer.TableConfig("t", 10, 4, ("f",)),))
        infer.quantize(spec, infer.random_weights(spec))
        print("fbgemm_gpu" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "True"
