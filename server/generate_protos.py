"""Generate the gRPC stubs in ``server/proto`` from ``protos/``: embserve.v1 and the Open Inference Protocol.

    python -m server.generate_protos            # rewrite the checked-in stubs
    python -m server.generate_protos --check    # exit 1 if they differ from a fresh generation

The stubs are checked in (so installing embserve needs no protoc); a test regenerates and compares.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTOS = ("embserve/v1/inference.proto", "inference/open_inference_grpc.proto")
OUT = Path(__file__).resolve().parent / "proto"
# protoc writes absolute imports of the proto's package path; the stubs live in server.proto
_IMPORTS = {
    "from embserve.v1 import inference_pb2": "from server.proto import inference_pb2",
    "from inference import open_inference_grpc_pb2": "from server.proto import open_inference_grpc_pb2",
}
# The OIP messages are named ``inference.*``, like the ones tritonclient registers in protobuf's default
# descriptor pool: ours go into a pool of their own, so a process can hold both (a test compares them).
_PRIVATE_POOL_STUB = "open_inference_grpc_pb2.py"
_DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile("


def _rewrite(name: str, text: str) -> str:
    for old, new in _IMPORTS.items():
        text = text.replace(old, new)
    if name == _PRIVATE_POOL_STUB:
        if _DEFAULT_POOL not in text:
            raise RuntimeError(f"protoc's {name} no longer registers with {_DEFAULT_POOL!r}; update generate_protos")
        text = text.replace(_DEFAULT_POOL, _PRIVATE_POOL)
    return text


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (grpcio-tools) into ``out_dir``; return the stub files written."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_ROOT / p) for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        produced_dirs = sorted({Path(tmp, p).parent for p in PROTOS})
        for produced in sorted(p for d in produced_dirs for p in d.iterdir() if p.is_file()):
            target = out_dir / produced.name
            target.write_text(_rewrite(produced.name, produced.read_text()))
            written.append(target)
    return sorted(written)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            p.name
            for p in generate(Path(tmp))
            if not (OUT / p.name).exists() or (OUT / p.name).read_text() != p.read_text()
        ]
    if stale:
        print(f"stale stubs in server/proto: {stale}; run python -m server.generate_protos", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
