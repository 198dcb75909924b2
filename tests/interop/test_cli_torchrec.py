"""`embserve spec --from-torchrec`, `embserve export --from-torchrec`, --dense-arch/--no-dense, --force and the
plan/dtype conflict, run as a user runs them (``infer.cli.main``) on a real TorchRec DLRM checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from torchrec.models.dlrm import DLRM

import infer
from infer.cli import main
from infer.config import DataType, ModelSpec, RowBlock
from infer.features import SparseFeatures
from infer.interop.torchrec import from_torchrec
from tests.interop.torchrec_models import float_ebc, random_kjt

NUM_DENSE = 5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A TorchRec DLRM, its torch.save'd state dict, its DCP folder, the edited spec and its dense part."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    dlrm = DLRM(
        embedding_bag_collection=float_ebc(seed=0),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[16, 1],
    ).eval()
    torch.save(dlrm.state_dict(), folder / "model.pt")
    dcp.save(dlrm.state_dict(), checkpoint_id=str(folder / "dcp"), no_dist=True)
    imported = from_torchrec(dlrm)
    torch.jit.save(torch.jit.script(imported.dense_arch), str(folder / "dense.pt"))
    (folder / "spec.json").write_text(json.dumps({**imported.spec.to_dict(), "num_dense_features": NUM_DENSE}))
    return dlrm, imported, folder


def _error(capsys) -> str:
    return capsys.readouterr().err


def test_spec_from_torchrec_writes_an_editable_spec(trained, tmp_path, capsys):
    _, imported, folder = trained
    for source in (folder / "model.pt", folder / "dcp"):
        out = tmp_path / f"{source.stem}.json"
        assert main(["spec", "--from-torchrec", str(source), "--out", str(out)]) == 0
        spec = ModelSpec.load(out)
        assert spec.num_dense_features == NUM_DENSE
        assert [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in spec.tables] == [
            (t.name, t.num_embeddings, t.embedding_dim, (t.name,)) for t in imported.spec.tables
        ]
        assert spec.unstated_pooling == tuple(t.name for t in spec.tables)  # a state dict does not say it
    assert main(["spec", "--from-torchrec", str(folder / "model.pt"), "--out", str(out)]) == 2
    assert "--force" in _error(capsys)


@pytest.mark.parametrize("source", ["model.pt", "dcp"])
def test_export_from_torchrec_with_dense_arch(trained, tmp_path, source):
    dlrm, imported, folder = trained
    out = tmp_path / "art"
    args = ["export", "--from-torchrec", str(folder / source), "--spec", str(folder / "spec.json"), "--out", str(out)]
    assert main([*args, "--dense-arch", str(folder / "dense.pt"), "--table-dtype", "city=fp16"]) == 0
    runtime = infer.load(out)
    assert runtime.has_dense and runtime.spec.table("city").data_type == DataType.FP16
    kjt = random_kjt(list(imported.spec.feature_names), {f.name: f.num_embeddings for f in imported.spec.features})
    dense = torch.randn(kjt.stride(), NUM_DENSE)
    reference = infer.quantize(imported.spec.with_data_types(overrides={"city": "fp16"}), imported.weights)
    expected = reference.predict(dense, kjt.values(), kjt.lengths().to(torch.int32), None)
    assert torch.equal(runtime.predict(SparseFeatures.from_kjt(kjt), dense), expected)
    with torch.no_grad():
        torch.testing.assert_close(
            runtime.predict(SparseFeatures.from_kjt(kjt), dense), dlrm(dense, kjt)[:, 0], atol=0.05, rtol=0
        )


def test_export_onnx_with_the_readmes_scripted_dense_part(trained, tmp_path):
    """`--onnx` with `dense.pt = torch.jit.script(from_torchrec(dlrm).dense_arch)`, as the README writes it: the
    ONNX model's scores equal the TorchScript artifact's (issue 39 item 3: torch.onnx refused the ScriptModule)."""
    pytest.importorskip("onnxruntime")
    _, imported, folder = trained
    out = tmp_path / "art"
    args = ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(folder / "spec.json")]
    assert main([*args, "--out", str(out), "--dense-arch", str(folder / "dense.pt"), "--onnx"]) == 0
    assert (out / "dense.onnx").is_file()
    scripted, onnx_runtime = infer.load(out), infer.load(out, backend="onnxruntime")
    for seed, batch in ((1, 1), (2, 9)):
        generator = torch.Generator().manual_seed(seed)
        rows = {f.name: f.num_embeddings for f in imported.spec.features}
        kjt = random_kjt(list(imported.spec.feature_names), rows, batch, seed=seed)
        dense = torch.randn(kjt.stride(), NUM_DENSE, generator=generator)
        expected = scripted.predict(SparseFeatures.from_kjt(kjt), dense)
        got = onnx_runtime.predict(SparseFeatures.from_kjt(kjt), dense)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(expected.abs().max()) + 1e-6)


def test_dense_features_without_dense_arch_is_an_error(trained, tmp_path, capsys):
    _, _, folder = trained
    args = ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(folder / "spec.json")]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    message = _error(capsys)
    assert "num_dense_features=5" in message and "--dense-arch FILE" in message and "--no-dense" in message
    assert not (tmp_path / "a").exists()
    assert main([*args, "--out", str(tmp_path / "b"), "--no-dense"]) == 0
    assert not infer.load(tmp_path / "b").has_dense


def test_wrong_dense_arch_signature_names_the_file(trained, tmp_path, capsys):
    _, _, folder = trained
    wrong = torch.jit.script(torch.nn.Linear(3, 1))
    torch.jit.save(wrong, str(tmp_path / "wrong.pt"))
    args = ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(folder / "spec.json")]
    assert main([*args, "--out", str(tmp_path / "a"), "--dense-arch", str(tmp_path / "wrong.pt")]) == 2
    message = _error(capsys)
    assert "wrong.pt" in message and "num_dense_features=5" in message and "output_dim=112" in message


def test_export_into_existing_folder_needs_force(trained, tmp_path, capsys):
    _, _, folder = trained
    out = tmp_path / "art"
    args = ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(folder / "spec.json")]
    args += ["--out", str(out), "--no-dense"]
    assert main(args) == 0
    before = (out / "manifest.json").read_text()
    assert main([*args, "--dtype", "fp16"]) == 2
    assert "--force" in _error(capsys) and (out / "manifest.json").read_text() == before
    assert main([*args, "--dtype", "fp16", "--force"]) == 0
    assert infer.load(out).spec.table("user").data_type == DataType.FP16


def test_plan_and_dtype_flags_that_disagree_are_an_error(trained, tmp_path, capsys, caplog):
    _, _, folder = trained
    plan = tmp_path / "plan.json"
    plan_args = ["plan", "--spec", str(folder / "spec.json"), "--world-size", "2", "--compute-device", "cpu"]
    assert main([*plan_args, "--out", str(plan)]) == 0
    args = ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(folder / "spec.json"), "--no-dense"]
    args += ["--plan", str(plan)]
    assert main([*args, "--out", str(tmp_path / "a"), "--table-dtype", "user=fp16"]) == 2
    message = _error(capsys)
    assert "table 'user': --table-dtype user=fp16 disagrees with the plan" in message and "sized for int8" in message
    assert main([*args, "--out", str(tmp_path / "b"), "--dtype", "int4"]) == 2
    assert "--dtype int4 disagrees" in _error(capsys)
    assert main([*args, "--out", str(tmp_path / "c"), "--dtype", "int8"]) == 0  # agreeing flags are fine
    assert infer.load(tmp_path / "c").manifest.world_size == 2
    # a plan made here from constraints that set a table's type: the same rule
    (tmp_path / "constraints.json").write_text(json.dumps({"query": {"data_type": "int4"}}))
    made = ["--world-size", "2", "--constraints", str(tmp_path / "constraints.json"), "--out", str(tmp_path / "d")]
    base = [a for a in args if a not in ("--plan", str(plan))]
    assert main([*base, *made, "--table-dtype", "query=fp16"]) == 2
    assert "table 'query': --table-dtype query=fp16 disagrees with the plan made with --constraints" in _error(capsys)
    # without flags the plan's type is exported, and the difference from the spec is said
    made[-1] = str(tmp_path / "e")
    assert main([*base, *made]) == 0
    assert infer.load(tmp_path / "e").spec.table("query").data_type == DataType.INT4
    assert "table query: the spec says int8" in caplog.text and "exporting int4" in caplog.text


def test_weights_and_from_torchrec_are_exclusive(trained, tmp_path, capsys):
    _, _, folder = trained
    args = ["export", "--spec", str(folder / "spec.json"), "--out", str(tmp_path / "a"), "--no-dense"]
    assert main(args) == 2
    assert "exactly one of --weights" in _error(capsys)
    assert main([*args, "--weights", str(folder / "model.pt"), "--from-torchrec", str(folder / "model.pt")]) == 2


# --- issue 24: errors a user can act on ---------------------------------------------------------------------


def test_spec_from_a_pickled_object_says_what_the_file_is_and_how_to_make_a_state_dict(tmp_path, capsys):
    torch.save(torch.nn.Linear(3, 1), tmp_path / "pickled.pt")  # a whole module, not a state dict, and no TorchRec
    assert main(["spec", "--from-torchrec", str(tmp_path / "pickled.pt")]) == 2
    captured = capsys.readouterr()
    message = captured.err
    assert "pickled.pt" in message and "torch.nn.modules.linear.Linear" in message
    assert "not a state dict" in message and "torch.save(model.state_dict(), path)" in message
    assert "\x1b[" not in message and "Traceback" not in message and "WeightsUnpickler" not in message
    assert captured.out == ""


class _RunsCode:
    """Pickles as a call of ``open(marker, "w")``: unpickling it the ordinary way creates the file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def test_spec_from_a_pickled_torchrec_model_reads_its_configs_without_running_it(trained, tmp_path, capsys):
    """Issue 39 item 1: a pickled DLRM carries each EmbeddingBagConfig's pooling; the spec states it (and the
    features), so the state dict exports with no flag and serves the MEAN table as trained."""
    dlrm, imported, _ = trained
    torch.save(dlrm, tmp_path / "dlrm.pt")
    torch.save(dlrm.state_dict(), tmp_path / "dlrm_state.pt")
    spec = tmp_path / "spec.json"
    assert main(["spec", "--from-torchrec", str(tmp_path / "dlrm.pt"), "--out", str(spec)]) == 0
    assert "pooling as the model's EmbeddingBagConfigs say" in capsys.readouterr().out
    written = ModelSpec.load(spec)
    assert written == imported.spec and written.num_dense_features == NUM_DENSE and not written.unstated_pooling
    export = ["export", "--spec", str(spec), "--from-torchrec", str(tmp_path / "dlrm_state.pt"), "--no-dense"]
    assert main([*export, "--out", str(tmp_path / "art")]) == 0
    _served_equals_torchrec(infer.load(tmp_path / "art"), dlrm)
    # nothing in the file is run: a pickle that would create a file is refused, and the file is not created
    marker = tmp_path / "ran"
    torch.save({"model": dlrm.sparse_arch, "hook": _RunsCode(str(marker))}, tmp_path / "hostile.pt")
    assert main(["spec", "--from-torchrec", str(tmp_path / "hostile.pt"), "--out", str(tmp_path / "h.json")]) == 0
    assert not marker.exists()
    assert ModelSpec.load(tmp_path / "h.json").table("category").pooling.value == "mean"
    torch.save(_RunsCode(str(marker)), tmp_path / "only_code.pt")
    assert main(["spec", "--from-torchrec", str(tmp_path / "only_code.pt")]) == 2
    assert "not a state dict" in _error(capsys) and not marker.exists()


def test_a_torchrec_state_dict_given_to_weights_suggests_from_torchrec(trained, tmp_path, capsys):
    _, _, folder = trained
    args = ["export", "--spec", str(folder / "spec.json"), "--weights", str(folder / "model.pt"), "--no-dense"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    message = _error(capsys)
    assert "model.pt" in message and "TorchRec state dict" in message and "--from-torchrec" in message
    assert "embedding_bags." in message  # the key that gave it away
    assert not (tmp_path / "a").exists()


def test_table_mismatch_messages_leave_out_empty_lists(trained, tmp_path):
    from infer.errors import WeightsError
    from infer.interop.torchrec import load_torchrec_checkpoint
    from infer.weights import check_weights

    _, imported, folder = trained
    spec = imported.spec
    fewer = ModelSpec(spec.tables[:-1])  # the checkpoint has one table more than this spec: nothing is missing
    with pytest.raises(WeightsError) as info:
        load_torchrec_checkpoint(folder / "model.pt", fewer)
    message = str(info.value)
    assert f"not in the spec ['{spec.tables[-1].name}']" in message
    assert "missing" not in message and "[]" not in message
    weights = dict(imported.weights)
    del weights[spec.tables[0].name]  # one table missing, none unknown
    with pytest.raises(WeightsError) as info:
        check_weights(spec, weights)
    message = str(info.value)
    assert f"missing ['{spec.tables[0].name}']" in message and "unknown" not in message
    assert "not in the spec" not in message and "[]" not in message


def test_a_wrong_checkpoint_is_reported_before_the_dense_part_is_probed(trained, tmp_path, capsys):
    dlrm, _, folder = trained
    state = dict(dlrm.state_dict())
    state.pop("sparse_arch.embedding_bag_collection.embedding_bags.city.weight")
    torch.save(state, tmp_path / "wrong_ckpt.pt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 1)), str(tmp_path / "wrong_dense.pt"))
    args = ["export", "--from-torchrec", str(tmp_path / "wrong_ckpt.pt"), "--spec", str(folder / "spec.json")]
    assert main([*args, "--out", str(tmp_path / "a"), "--dense-arch", str(tmp_path / "wrong_dense.pt")]) == 2
    message = _error(capsys)
    # the pipeline reads the tables before it runs the dense part: the checkpoint is what is named
    assert "wrong_ckpt.pt" in message and "missing ['city']" in message
    assert "wrong_dense.pt" not in message


# --- issue 39 item 1: a pooling nobody stated is never guessed ------------------------------------------------


def _served_equals_torchrec(runtime, dlrm) -> None:
    """The artifact's lookups equal the trained EBC's own fp32 pooled output within INT8 error, MEAN table too."""
    ebc = dlrm.sparse_arch.embedding_bag_collection
    keys = [f for cfg in ebc.embedding_bag_configs() for f in cfg.feature_names]
    rows = {f: cfg.num_embeddings for cfg in ebc.embedding_bag_configs() for f in cfg.feature_names}
    kjt = random_kjt(keys, rows, max_len=6)
    with torch.no_grad():
        expected = ebc(kjt).values()
    torch.testing.assert_close(runtime.lookup(SparseFeatures.from_kjt(kjt)), expected, atol=0.05, rtol=0)


def _edit_spec(path, dlrm, pooling: bool, features: bool = True) -> None:
    """What a user does to the spec `embserve spec` wrote: the model's feature names, and its pooling if asked."""
    configs = {cfg.name: cfg for cfg in dlrm.sparse_arch.embedding_bag_collection.embedding_bag_configs()}
    data = json.loads(path.read_text())
    for table in data["tables"]:
        if features:
            table["feature_names"] = list(configs[table["name"]].feature_names)
        if pooling:
            table["pooling"] = configs[table["name"]].pooling.name.lower()
    path.write_text(json.dumps(data))


def test_a_state_dict_spec_is_refused_at_export_until_each_pooling_is_stated(trained, tmp_path, capsys):
    dlrm, _, folder = trained
    assert {c.pooling.name for c in dlrm.sparse_arch.embedding_bag_collection.embedding_bag_configs()} == {
        "SUM",
        "MEAN",
    }
    state, spec = tmp_path / "dlrm_state.pt", tmp_path / "spec.json"
    torch.save(dlrm.state_dict(), state)
    assert main(["spec", "--from-torchrec", str(state), "--out", str(spec)]) == 0
    said = capsys.readouterr().out
    assert "pooling: null" in said and "--pooling TABLE=sum|mean" in said
    tables = [t["name"] for t in json.loads(spec.read_text())["tables"]]
    assert all(t["pooling"] is None for t in json.loads(spec.read_text())["tables"])
    # exactly as the issue ran it: a summed MEAN table before; now refused, naming every table and the fixes
    export = ["export", "--spec", str(spec), "--from-torchrec", str(state), "--no-dense"]
    for extra in ([], ["--weights-format", "embedded"]):  # streamed and in-memory exports alike
        assert main([*export, "--out", str(tmp_path / "refused"), *extra]) == 2
        message = _error(capsys)
        assert f"the pooling of table(s) {tables} is not stated" in message
        assert '"pooling" to "sum" or "mean"' in message and str(spec) in message and "--pooling TABLE=" in message
        assert not (tmp_path / "refused").exists()
    # stating some but not all: the rest are still named
    pooled = ["--pooling", "category=mean", "--pooling", "user=sum"]
    assert main([*export, *pooled, "--out", str(tmp_path / "refused")]) == 2
    assert "table(s) ['item', 'city', 'device', 'query'] is not stated" in _error(capsys)
    _edit_spec(spec, dlrm, pooling=False)
    # every table stated with --pooling: exported, and served as trained (MEAN table included)
    pooled += [a for t in ("item", "city", "device", "query") for a in ("--pooling", f"{t}=sum")]
    assert main([*export, *pooled, "--out", str(tmp_path / "flags")]) == 0
    served = infer.load(tmp_path / "flags")
    assert served.spec.table("category").pooling.value == "mean"
    _served_equals_torchrec(served, dlrm)
    # the reviewed spec (each "pooling" filled in, as the hint says) exports without flags
    _edit_spec(spec, dlrm, pooling=True)
    assert main([*export, "--out", str(tmp_path / "edited")]) == 0
    _served_equals_torchrec(infer.load(tmp_path / "edited"), dlrm)


def test_a_dense_part_from_the_model_states_the_pooling(trained, tmp_path, capsys):
    dlrm, _, folder = trained
    spec = tmp_path / "spec.json"
    assert main(["spec", "--from-torchrec", str(folder / "model.pt"), "--out", str(spec)]) == 0
    _edit_spec(spec, dlrm, pooling=False)  # feature names only: "pooling" stays null
    args = ["export", "--spec", str(spec), "--from-torchrec", str(folder / "model.pt"), "--out", str(tmp_path / "a")]
    assert main([*args, "--dense-arch", str(folder / "dense.pt")]) == 0
    served = infer.load(tmp_path / "a")
    assert served.has_dense and served.spec.table("category").pooling.value == "mean"
    assert all(t.pooling.value == "sum" for t in served.spec.tables if t.name != "category")
    _served_equals_torchrec(served, dlrm)
    # a flag that contradicts the dense part's record is refused by the layout check, naming the table
    assert main([*args, "--force", "--dense-arch", str(folder / "dense.pt"), "--pooling", "category=sum"]) == 2
    assert "table 'category' is pooled mean in the trained model, sum in the spec" in _error(capsys)


def test_a_torchrec_model_with_a_budget_is_served_in_blocks_when_sample_ids_say_which_rows_are_hot(
    trained, tmp_path, capsys
):
    """Issue 43: --memory-budget alone prices blocks by the rows' ranges and says so (its N(0, 1) tables have no
    magnitude signal: whatever blocks it takes hold the rows of largest range, ranked here independently); with
    --sample-ids the same export holds the skewed table in blocks, and the served scores equal a model quantized
    from the TorchRec weights in the same blocks with its rows ranked by the same ids (an independent ranking)."""
    import numpy as np

    from infer.quant.blocks import rank_rows

    _, imported, folder = trained
    export = ["export", "--from-torchrec", str(folder / "model.pt"), "--spec", str(folder / "spec.json"), "--no-dense"]
    int4_bytes = sum(t.num_embeddings * (t.embedding_dim // 2 + 4) for t in imported.spec.tables)
    budget = ["--memory-budget", str(int(int4_bytes * 1.4))]
    features = {f.name: f.num_embeddings for f in imported.spec.features}
    kjt = random_kjt(list(imported.spec.feature_names), features)
    values, lengths = kjt.values(), kjt.lengths().to(torch.int32)
    assert main([*export, "--out", str(tmp_path / "whole"), *budget]) == 0
    assert "access model: 6 table(s) by their rows' ranges" in capsys.readouterr().out
    alone = infer.load(tmp_path / "whole")
    by_range = {t.name: _by_range(imported.weights[t.name]) for t in alone.spec.tables if t.blocks}
    reference = infer.quantize(alone.spec, imported.weights, block_orders=by_range)
    assert torch.equal(alone.module(values, lengths), reference(values, lengths))

    rng = np.random.default_rng(0)
    features = {f.name: f.num_embeddings for f in imported.spec.features}
    ids = {name: rng.integers(0, rows, 500) for name, rows in features.items()}
    ids["user_id"] = rng.permutation(400)[np.minimum(rng.zipf(1.2, 20000) - 1, 399)]  # a few users read most
    np.savez(tmp_path / "ids.npz", **ids)
    assert main([*export, "--out", str(tmp_path / "art"), *budget, "--sample-ids", str(tmp_path / "ids.npz")]) == 0
    assert "access model: sampled ids (6 table(s))" in capsys.readouterr().out
    runtime = infer.load(tmp_path / "art")
    held = {t.name: t for t in runtime.spec.tables if t.blocks}
    assert "user" in held
    orders = {}
    for table in held.values():
        sampled = np.concatenate([ids[f] for f in table.feature_names])
        orders[table.name] = rank_rows(table.num_embeddings, sampled, table.name)
    reference = infer.quantize(runtime.spec, imported.weights, block_orders=orders)
    assert torch.equal(runtime.module(values, lengths), reference(values, lengths))


def _by_range(weights: torch.Tensor) -> torch.Tensor:
    """The rows by range (max - min), largest first, ties in id order: computed here in fp64 with torch."""
    spread = (weights.amax(1) - weights.amin(1)).to(torch.float64)
    return torch.argsort(-spread, stable=True)


def test_a_torchrec_model_with_only_a_memory_budget_is_served_in_blocks_of_its_trained_rows(tmp_path, capsys):
    """Issue 43: a TorchRec EBC at TorchRec's own init (U(+-sqrt(1/rows))) with a few rows trained large goes in
    with --memory-budget alone (1.2x uniform INT4's bytes) and comes out in blocks, ranked by the rows' ranges (said in
    the output and the stats). Every served row and bag equals fp32 ``embedding_bag`` over the table dequantized
    block by block (ranking and codec applied here), and each block table's row-uniform error (dequantized against
    fp32) is below every whole-table type that fits in the blocks' bytes."""
    import torch.nn.functional as F
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

    from infer.quant.rowwise import CPU_ROW_ALIGNMENT, dequantize_rows, quantize_rows, table_bytes

    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="user", num_embeddings=2048, embedding_dim=32, feature_names=["user_id"]),
            EmbeddingBagConfig(
                name="ad",
                num_embeddings=1024,
                embedding_dim=32,
                feature_names=["ad_id", "last_ad"],
                pooling=PoolingType.MEAN,
            ),
        ]
    )
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():  # the rows training reached: orders larger than the init
            trained_rows = torch.randperm(bag.weight.shape[0])[: bag.weight.shape[0] // 32]
            bag.weight[trained_rows] = 0.3 * torch.randn(trained_rows.numel(), bag.weight.shape[1])
    imported = from_torchrec(ebc)
    torch.save(ebc.state_dict(), tmp_path / "ebc.pt")
    (tmp_path / "spec.json").write_text(imported.spec.to_json())
    spec = imported.spec
    int4 = sum(table_bytes(t.num_embeddings, t.embedding_dim, DataType.INT4, CPU_ROW_ALIGNMENT) for t in spec.tables)
    budget = int(1.2 * int4)  # room for the id remaps (4 B a row per feature) beside uniform INT4's bytes
    args = ["export", "--from-torchrec", str(tmp_path / "ebc.pt"), "--spec", str(tmp_path / "spec.json")]
    assert main([*args, "--out", str(tmp_path / "art"), "--memory-budget", str(budget)]) == 0
    printed = capsys.readouterr().out
    assert "access model: 2 table(s) by their rows' ranges" in printed
    assert "blocks, largest rows first (ranked by row ranges" in printed
    runtime = infer.load(tmp_path / "art")
    assert runtime.spec.table("user").blocks  # ad, read by two features, the MILP may keep whole at INT8

    stored = {}
    for table in runtime.spec.tables:
        weights = imported.weights[table.name]
        order, start, rows = _by_range(weights), 0, torch.empty_like(weights)
        for block in table.blocks or (RowBlock(table.num_embeddings, table.data_type),):
            ids = order[start : start + block.rows]
            data, scale_bias = quantize_rows(weights[ids], block.data_type)
            rows[ids] = dequantize_rows(data, scale_bias, block.data_type, table.embedding_dim)
            start += block.rows
        stored[table.name] = rows
        if not table.blocks:
            continue
        # row-uniform error against fp32, beside every whole-table type within the blocks' bytes (+ a 4 B/row remap)
        held = sum(table_bytes(b.rows, table.embedding_dim, b.data_type, CPU_ROW_ALIGNMENT) for b in table.blocks)
        held += 4 * table.num_embeddings * len(table.feature_names)
        error = float(torch.linalg.norm(rows - weights) / torch.linalg.norm(weights))
        whole = []
        for data_type in (DataType.FP16, DataType.INT8, DataType.INT4, DataType.INT2):
            if table_bytes(table.num_embeddings, table.embedding_dim, data_type, CPU_ROW_ALIGNMENT) <= held:
                data, scale_bias = quantize_rows(weights, data_type)
                restored = dequantize_rows(data, scale_bias, data_type, table.embedding_dim)
                whole.append(float(torch.linalg.norm(restored - weights) / torch.linalg.norm(weights)))
        assert whole and error < 0.5 * min(whole), (table.name, error, whole)
    # every row alone (one id a bag: user's rows, then ad's through ad_id), then SUM and MEAN bags, empty ones too
    for column, table in ((0, "user"), (1, "ad")):
        rows = spec.table(table).num_embeddings
        lengths = torch.zeros(3, rows, dtype=torch.int32)
        lengths[column] = 1
        served = runtime.module(torch.arange(rows), lengths.flatten())
        torch.testing.assert_close(served[:, 32 * column : 32 * (column + 1)], stored[table], rtol=1e-6, atol=1e-7)
    values = torch.cat([torch.randint(0, 2048, (20,)), torch.randint(0, 1024, (70,))])
    lengths = torch.tensor([20, 0, 30, 15, 25, 0], dtype=torch.int32)  # user_id, ad_id, last_ad; two bags each
    expected = torch.cat(
        [
            F.embedding_bag(values[:20], stored["user"], torch.tensor([0, 20]), mode="sum"),
            F.embedding_bag(values[20:65], stored["ad"], torch.tensor([0, 30]), mode="mean"),
            F.embedding_bag(values[65:], stored["ad"], torch.tensor([0, 25]), mode="mean"),
        ],
        1,
    )
    torch.testing.assert_close(runtime.module(values, lengths), expected, rtol=1e-5, atol=1e-6)
