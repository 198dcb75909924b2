"""examples/export_after_training.py runs as a user runs it: TorchRec training, export, serving, checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "export_after_training.py"


@pytest.mark.slow
def test_export_after_training_example(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--out", str(tmp_path / "artifact")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "step  20/20" in out and "2 CPU shards" in out and "dense part" in out
    assert "Lookup  [64, 96] vs TorchRec quantized EBC" in out and "Predict [64] vs TorchRec DLRM" in out
    assert out.strip().endswith("matches TorchRec")
    assert (tmp_path / "artifact" / "manifest.json").is_file() and (tmp_path / "artifact" / "plan.json").is_file()
