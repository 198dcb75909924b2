"""``import infer`` stays light: no fbgemm, no CUDA initialisation."""

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
        import infer.config, infer.features, infer.errors, infer.manifest, infer.runtime, infer.export, infer.quant
        from infer import ModelSpec, SparseFeatures, TableConfig
        loaded = sorted(m for m in sys.modules if m.startswith("fbgemm"))
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
