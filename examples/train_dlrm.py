"""A stand-in for your training job: a small TorchRec DLRM trained a few steps on CPU, saved the way the
five-minute path of the README picks it up.

    python examples/train_dlrm.py --out trained [--steps 20]

writes ``trained/model.pt`` (the pickled module: ``embserve spec`` reads its EmbeddingBagConfigs as data, pooling
included), ``trained/state.pt`` (its state dict: the tables' rows, ``--from-torchrec``) and ``trained/dense.pt``
(its dense part, TorchScript: ``--dense-arch``). Needs the ``embserve[torchrec]`` extra.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_after_training import build_dlrm, train  # noqa: E402

import infer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write model.pt, state.pt and dense.pt into")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.manual_seed(0)
    model = build_dlrm()
    train(model, args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model, out / "model.pt")
    torch.save(model.state_dict(), out / "state.pt")
    torch.jit.save(torch.jit.script(infer.from_torchrec(model).dense_arch), str(out / "dense.pt"))
    print(f"wrote {out}/model.pt (the module), {out}/state.pt (its state dict), {out}/dense.pt (its dense part)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
