"""``embserve serve --backend onnxruntime`` and ``embserve run --backend onnxruntime``: the ONNX model served
over gRPC with no fbgemm in the process, answering like the TorchScript artifact."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from infer.artifact.export import export
from infer.artifact.load import load
from infer.quant.quantize import quantize
from infer.weights import random_weights
from server.client import EmbserveClient
from server.launch import spawn_server
from tests.conftest import TinyOverArch, mixed_spec, random_batch

NUM_DENSE = 3
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory):
    torch.manual_seed(0)
    spec = mixed_spec().with_dense_arch(TinyOverArch(NUM_DENSE, mixed_spec().output_dim), NUM_DENSE)
    model = quantize(spec, random_weights(spec, seed=31))
    return spec, export(model, tmp_path_factory.mktemp("onnx-serve") / "artifact", onnx=True)


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return got.shape == expected.shape and float((got - expected).abs().max()) <= TOLERANCE * max(
        1.0, float(expected.abs().max())
    )


def test_serve_with_onnxruntime_answers_like_torchscript_without_fbgemm(onnx_artifact):
    spec, path = onnx_artifact
    scripted = load(path)
    server, port = spawn_server(path, "--python", "--backend", "onnxruntime", "--forward-threads", "1")
    try:
        maps = open(f"/proc/{server.pid}/maps").read()  # noqa: SIM115 - read once
        batch = random_batch(spec, 12, weighted=True, seed=4)
        dense = torch.randn(12, NUM_DENSE, generator=torch.Generator().manual_seed(1))
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            pooled = client.lookup(batch)
            scores = client.predict(batch, dense)
            with pytest.raises(Exception, match="out of range") as raised:
                client.lookup({name: [[0]] for name in spec.feature_names} | {"f_int2": [[300]]})
            assert "INVALID_ARGUMENT" in str(raised.value)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code == 0
    assert _close(pooled, scripted.lookup(batch))
    assert _close(scores, scripted.predict(batch, dense))
    # the serving process never mapped an fbgemm library (nor imported fbgemm_gpu, below)
    assert "fbgemm" not in maps and "onnxruntime" in maps


def test_server_in_a_process_without_fbgemm_modules(onnx_artifact):
    """create_server on the onnxruntime Runtime, queried, then ``sys.modules`` holds no fbgemm module."""
    spec, path = onnx_artifact
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import infer
        from server.app import ServerConfig, create_server
        from server.client import EmbserveClient

        async def main():
            runtime = infer.load({str(path)!r}, backend="onnxruntime")
            running = await create_server(runtime, ServerConfig(host="127.0.0.1", port=0, forward_threads=1))
            batch = infer.SparseFeatures.random(runtime.spec, batch_size=4, ids_per_bag=3)
            def query():
                with EmbserveClient(f"127.0.0.1:{{running.port}}") as client:
                    return client.lookup(batch)
            pooled = await asyncio.to_thread(query)
            assert (pooled - runtime.lookup(batch)).abs().max() == 0
            await running.stop(1.0)

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.startswith("fbgemm")))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_run_and_inspect_with_onnxruntime(onnx_artifact):
    _, path = onnx_artifact
    run = [sys.executable, "-m", "infer.cli", "run", str(path), "--backend", "onnxruntime", "--batch-size", "8"]
    result = subprocess.run([*run, "--iterations", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "onnxruntime) in" in result.stdout and "predict: scores [8]" in result.stdout
    inspect = subprocess.run(
        [sys.executable, "-m", "infer.cli", "inspect", str(path)], capture_output=True, text=True, timeout=60
    )
    assert "onnx         model.onnx (+ model.onnx.data), opset 18" in inspect.stdout
