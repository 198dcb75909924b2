"""Stand-in for `export(..., pt2=True)` until the Python export lands: add model.pt2 to an unsharded artifact.

The program is the TorchScript model's forward(values, lengths, weights) without its validation (the loader
validates): the unsharded TBE's buffers fed straight to fbgemm's lookup op, then MEAN, compiled with
AOTInductor for CPU. It is a test fixture only; the C++ tests compare its outputs with model.pt's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from infer.artifact.fbgemm_libs import load_fbgemm
from infer.artifact.manifest import sha256_file

PT2_FILE = "model.pt2"
PT2_INPUTS = ["values:int64", "lengths:int64", "weights:float32"]


class _LookupProgram(nn.Module):
    """fbgemm's lookup op on one TBE's buffers (SUM, fp32 out), then MEAN features divided by their bag lengths."""

    def __init__(self, tbe: torch.jit.ScriptModule, embeddings: torch.jit.ScriptModule) -> None:
        super().__init__()
        for name in ("weights_host", "weights_placements", "weights_offsets", "weights_tys", "D_offsets"):
            self.register_buffer(name, getattr(tbe, name).clone())
        self.ints = {
            name: int(getattr(tbe, name))
            for name in ("total_D", "max_int2_D", "max_int4_D", "max_int8_D", "max_float16_D", "max_float32_D")
        }
        self.ints["max_float8_D"] = int(getattr(tbe, "max_float8_D", 0))
        self.ints["fp8_exponent_bits"] = int(getattr(tbe, "fp8_exponent_bits", -1))
        self.ints["fp8_exponent_bias"] = int(getattr(tbe, "fp8_exponent_bias", -1))
        self.row_alignment = int(tbe.row_alignment)
        self.num_features = int(embeddings.num_features)
        self.mean_columns = [
            (f, int(embeddings.column_starts[f]), int(embeddings.column_starts[f]) + int(embeddings.feature_dims[f]))
            for f in embeddings.mean_features
        ]

    def forward(self, values: Tensor, lengths: Tensor, weights: Tensor) -> Tensor:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        out = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=self.weights_host,
            uvm_weights=torch.empty(0, dtype=torch.uint8),
            weights_placements=self.weights_placements,
            weights_offsets=self.weights_offsets,
            weights_tys=self.weights_tys,
            D_offsets=self.D_offsets,
            total_D=self.ints["total_D"],
            max_int2_D=self.ints["max_int2_D"],
            max_int4_D=self.ints["max_int4_D"],
            max_int8_D=self.ints["max_int8_D"],
            max_float16_D=self.ints["max_float16_D"],
            max_float32_D=self.ints["max_float32_D"],
            indices=values,
            offsets=offsets,
            pooling_mode=0,  # SUM
            indice_weights=weights,
            output_dtype=0,  # FP32
            lxu_cache_weights=torch.empty(0, 0, dtype=torch.uint8),
            lxu_cache_locations=torch.empty(0, dtype=torch.int32),
            row_alignment=self.row_alignment,
            max_float8_D=self.ints["max_float8_D"],
            fp8_exponent_bits=self.ints["fp8_exponent_bits"],
            fp8_exponent_bias=self.ints["fp8_exponent_bias"],
        )
        if self.mean_columns:
            batch = lengths.numel() // self.num_features
            counts = lengths.view(self.num_features, batch).to(torch.float32).clamp(min=1.0)
            parts = []
            column = 0
            for f, start, end in self.mean_columns:
                parts.append(out[:, column:start])
                parts.append(out[:, start:end] / counts[f].unsqueeze(1))
                column = end
            parts.append(out[:, column:])
            out = torch.cat(parts, 1)
        return out


def add_pt2(artifact: Path) -> Path:
    """Compile model.pt2 for the unsharded artifact at ``artifact`` and list it in its manifest (about 35 s)."""
    load_fbgemm()
    manifest_path = artifact / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["sharding"]["plan_file"] is None, "the stand-in compiles unsharded artifacts only"
    scripted = torch.jit.load(str(artifact / manifest["model_file"]))
    program = _LookupProgram(scripted.embeddings.tbe, scripted.embeddings).eval()
    num_features = program.num_features
    batch = torch.export.Dim("batch", min=1, max=1 << 24)
    ids = torch.export.Dim("ids", min=2, max=1 << 30)
    example_batch = 3
    lengths = torch.full((num_features * example_batch,), 2, dtype=torch.int64)
    values = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    example = (values, lengths, torch.ones(values.numel()))
    exported = torch.export.export(
        program,
        example,
        dynamic_shapes=({0: ids}, {0: num_features * batch}, {0: ids}),
        strict=False,
    )
    print(f"compiling {artifact / PT2_FILE} with AOTInductor (about 35 s)", flush=True)
    torch._inductor.aoti_compile_and_package(exported, package_path=str(artifact / PT2_FILE))
    manifest["pt2"] = {"file": PT2_FILE, "torch_version": torch.__version__, "device": "cpu", "inputs": PT2_INPUTS}
    path = artifact / PT2_FILE
    manifest["files"][PT2_FILE] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return artifact
