"""Export after training: a TorchRec DLRM trained for a few steps on CPU, exported with embserve (INT8, one FP16
table, 2 CPU shards), served over gRPC, queried (metadata, Lookup, Predict) and checked against TorchRec.

    python examples/export_after_training.py [--out artifacts/dlrm] [--steps 20]

Needs the ``embserve[torchrec]`` extra (``make test`` installs it). Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.ao.quantization as tq
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import QuantConfig

import infer
from infer.planner.types import ComputeDevice, Topology
from server.client import EmbserveClient
from server.launch import spawn_server

NUM_DENSE = 8
DIM = 16
BATCH = 64
FP16_TABLE = "city"


def build_dlrm() -> DLRM:
    """Five tables: ``item`` read by two features, ``category`` MEAN-pooled, every table DIM wide (DLRM's rule)."""
    tables = [
        EmbeddingBagConfig(name="user", num_embeddings=2_000, embedding_dim=DIM, feature_names=["user_id"]),
        EmbeddingBagConfig(
            name="item", num_embeddings=5_000, embedding_dim=DIM, feature_names=["item_id", "last_item"]
        ),
        EmbeddingBagConfig(
            name="category",
            num_embeddings=100,
            embedding_dim=DIM,
            feature_names=["category_id"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="city", num_embeddings=300, embedding_dim=DIM, feature_names=["city_id"]),
        EmbeddingBagConfig(name="query", num_embeddings=3_000, embedding_dim=DIM, feature_names=["query_id"]),
    ]
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, DIM],
        over_arch_layer_sizes=[32, 1],
    )


def random_batch(model: DLRM, generator: torch.Generator) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Dense features, a KJT of 0-6 ids per bag, and click labels."""
    configs = model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    keys = [f for c in configs for f in c.feature_names]
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}
    lengths = torch.randint(0, 7, (len(keys) * BATCH,), generator=generator)
    values = torch.cat(
        [
            torch.randint(0, rows[k], (int(n),), generator=generator)
            for k, n in zip(keys, lengths.view(len(keys), BATCH).sum(1).tolist())
        ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    dense = torch.randn(BATCH, NUM_DENSE, generator=generator)
    labels = torch.randint(0, 2, (BATCH,), generator=generator).float()
    return dense, kjt, labels


def train(model: DLRM, steps: int) -> None:
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    for step in range(steps):
        dense, kjt, labels = random_batch(model, generator)
        loss = loss_fn(model(dense, kjt).squeeze(1), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step in (0, steps - 1):
            print(f"step {step + 1:>3}/{steps}: loss {loss.item():.4f}")
    model.eval()


def torchrec_quantized(model: DLRM) -> DLRM:
    """TorchRec's own quantized model: INT8 tables, FP16 for FP16_TABLE, the dense part unchanged."""
    qconfig = QuantConfig(
        activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
        weight=tq.PlaceholderObserver.with_args(dtype=torch.qint8),
        per_table_weight_dtype={FP16_TABLE: torch.float16},
    )
    return tq.quantize_dynamic(
        model,
        qconfig_spec={EmbeddingBagCollection: qconfig},
        mapping={EmbeddingBagCollection: QuantEmbeddingBagCollection},
        inplace=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="artifact folder (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.manual_seed(0)

    # 1. train with TorchRec
    model = build_dlrm()
    train(model, args.steps)

    # 2. import into embserve: spec, tables and the DLRM's dense part; INT8 with one FP16 table; 2 CPU shards
    imported = infer.from_torchrec(model)
    quantized = imported.quantize(overrides={FP16_TABLE: "fp16"})
    plan = infer.plan_for_inference(quantized.spec, Topology(2, ComputeDevice.CPU))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="embserve-dlrm-")) / "artifact"
    path = infer.export(infer.shard_model(quantized, plan), out, plan=plan)
    kinds = sorted({t.sharding_type.value for t in plan.tables})
    print(f"exported {path}: {len(imported.spec.tables)} tables, 2 CPU shards ({', '.join(kinds)}), dense part")

    # 3. serve it and query it with the Python client
    generator = torch.Generator().manual_seed(123)
    dense, kjt, _ = random_batch(model, generator)
    features = infer.SparseFeatures.from_kjt(kjt)
    server, port = spawn_server(path)
    try:
        with EmbserveClient(f"127.0.0.1:{port}") as client:
            metadata = client.metadata()
            pooled = client.lookup(features)
            scores = client.predict(features, dense)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    print(f"served on 127.0.0.1:{port}: features {list(metadata.feature_order)}")

    # 4. check against TorchRec: its quantized EBC (Lookup) and its DLRM on quantized tables (Predict)
    reference = torchrec_quantized(model)
    with torch.no_grad():
        expected_pooled = reference.sparse_arch.embedding_bag_collection(kjt).to_dict()
        expected_scores = reference(dense, kjt).flatten()
    ok = list(metadata.feature_order) == list(model.sparse_arch.embedding_bag_collection(kjt).keys())
    worst = 0.0
    for feature in imported.spec.features:
        served = pooled[:, feature.column_start : feature.column_end]
        diff = float((served - expected_pooled[feature.name]).abs().max())
        worst = max(worst, diff)
        ok &= torch.allclose(served, expected_pooled[feature.name], rtol=1e-5, atol=1e-5)
    score_diff = float((scores - expected_scores).abs().max())
    ok &= torch.allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
    print(f"Lookup  [{pooled.shape[0]}, {pooled.shape[1]}] vs TorchRec quantized EBC: max abs diff {worst:.3g}")
    print(f"Predict [{scores.shape[0]}] vs TorchRec DLRM on quantized tables: max abs diff {score_diff:.3g}")
    print("matches TorchRec" if ok else "MISMATCH with TorchRec")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
