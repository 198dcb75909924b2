"""One rank of the 2-process gloo DistributedModelParallel test (run by test_torchrec_dmp.py, not by pytest).

Shards a DLRM's six-table EBC row-wise and table-wise over 2 CPU ranks, loads the unsharded tables into it,
then writes what embserve imports: from the DMP model, from its sharded state_dict(), a DCP save, and the
imported dense part's output next to the DMP model's.
Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dmp_worker.py OUT_DIR [sharded_tensor|dtensor]...
Each kind (the type of the sharded state dict's values) builds its own DMP model in the one process group and
writes into OUT_DIR/KIND (one process start for both kinds: importing torchrec is most of a rank's CPU).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infer.interop.torchrec import from_torchrec, load_torchrec_checkpoint  # noqa: E402
from tests.interop.torchrec_models import float_ebc, random_kjt  # noqa: E402

NUM_DENSE = 5

# row-wise tables are split over both ranks; table-wise ones live whole on one
SHARDING = {
    "user": row_wise(),
    "item": row_wise(),
    "category": table_wise(rank=1),
    "city": table_wise(rank=0),
    "device": table_wise(rank=1),
    "query": row_wise(),
}


def _dtensor_blocks(value: DTensor) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """This rank's blocks of a TorchRec DTensor (a LocalShardsWrapper inside) and their offsets."""
    local = value.to_local()
    return [(t, (int(o[0]), int(o[1]))) for t, o in zip(local.local_shards(), local.local_offsets())]


def main(out: Path, kinds: list[str]) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    for kind in kinds:
        (out / kind).mkdir(parents=True, exist_ok=True)
        run_kind(out / kind, kind, dist.get_rank())
    dist.destroy_process_group()


def run_kind(out: Path, kind: str, rank: int) -> None:
    reference = float_ebc(seed=0)  # the unsharded model, identical on both ranks
    full = {name: bag.weight.detach().clone() for name, bag in reference.embedding_bags.items()}
    sharder = EmbeddingBagCollectionSharder()
    module_plan = construct_module_sharding_plan(
        reference, SHARDING, sharder=sharder, local_size=2, world_size=2, device_type="cpu"
    )
    torch.manual_seed(7)  # the same dense part on both ranks
    dlrm = DLRM(
        embedding_bag_collection=float_ebc(seed=1),  # other tables: the copy below must take effect
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[16, 1],
    )
    model = DistributedModelParallel(
        dlrm,
        env=ShardingEnv(2, rank, dist.GroupMember.WORLD, output_dtensor=kind == "dtensor"),
        device=torch.device("cpu"),
        plan=ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}),
        sharders=[sharder],
    )
    kinds = set()
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if ".embedding_bags." not in key:
                continue  # the dense part
            table = key.split(".")[-2]
            kinds.add(type(value).__name__)
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    shard.tensor.copy_(full[table][r0 : r0 + rows, c0 : c0 + cols])
                if table == "user":  # row-wise: this rank holds half the rows
                    assert [s.tensor.shape[0] for s in value.local_shards()] == [200], value.local_shards()
            elif isinstance(value, DTensor):
                for local, (r0, c0) in _dtensor_blocks(value):
                    local.copy_(full[table][r0 : r0 + local.shape[0], c0 : c0 + local.shape[1]])
            else:
                value.copy_(full[table])
    assert kinds == {"ShardedTensor" if kind == "sharded_tensor" else "DTensor"}, kinds

    imported = from_torchrec(model)
    torch.save(dict(imported.weights), out / f"from_model_rank{rank}.pt")
    gathered = load_torchrec_checkpoint(model.state_dict(), imported.spec)
    torch.save(gathered, out / f"from_state_dict_rank{rank}.pt")
    dcp.save(model.state_dict(), checkpoint_id=str(out / "dcp"))
    # the dense part taken from the sharded DLRM, fed the unsharded model's pooled output, against the DMP model
    model.eval()
    kjt = random_kjt(list(imported.spec.feature_names), {f.name: f.num_embeddings for f in imported.spec.features})
    dense = torch.randn(kjt.stride(), NUM_DENSE, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = imported.dense_arch(dense, reference(kjt).values())
        theirs = model(dense, kjt)
    torch.save({"ours": ours, "theirs": theirs}, out / f"dense_rank{rank}.pt")
    (out / "spec.json").write_text(imported.spec.to_json()) if rank == 0 else None
    dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["sharded_tensor"])
