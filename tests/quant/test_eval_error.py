"""Model-level measured error on an evaluation sample: AUC and log loss by hand, the file's checks, the planner."""

from __future__ import annotations

import itertools

import pytest
import torch

from infer.config import DataType, ModelSpec, PoolingType, TableConfig
from infer.errors import FileFormatError
from infer.quant.eval_error import load_eval_sample, measure_eval_errors, roc_auc
from infer.quant.measured_error import rows_from_weights
from infer.quant.rowwise import dequantize_rows, quantize_rows


class LinearDense(torch.nn.Module):
    """logit = dense . a + pooled . b: the pooled columns of table "mute" get weight 0."""

    def __init__(self, num_dense: int, pooled_weights: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("a", torch.linspace(-1, 1, num_dense))
        self.register_buffer("b", pooled_weights)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return dense @ self.a + pooled @ self.b


def small_model(seed: int = 0):
    tables = (
        TableConfig("loud", 500, 8, ("fl",)),
        TableConfig("mute", 3000, 8, ("fm", "fm2"), PoolingType.MEAN),
    )
    generator = torch.Generator().manual_seed(seed)
    b = torch.cat([torch.randn(8, generator=generator), torch.zeros(16)])
    spec = ModelSpec(tables, 3, torch.jit.script(LinearDense(3, b)))
    weights = {t.name: torch.randn(t.num_embeddings, 8, generator=generator) for t in tables}
    return spec, weights


def eval_file(spec: ModelSpec, path, count: int = 400, seed: int = 1, **overrides):
    generator = torch.Generator().manual_seed(seed)
    features = {}
    for table in spec.tables:
        for feature in table.feature_names:
            lengths = torch.randint(0, 5, (count,), generator=generator)
            ids = torch.randint(0, table.num_embeddings, (int(lengths.sum()),), generator=generator)
            features[feature] = {"ids": ids, "lengths": lengths}
    data = {"features": features, "dense": torch.randn(count, 3, generator=generator),
            "labels": torch.randint(0, 2, (count,), generator=generator).float()}  # fmt: skip
    data.update(overrides)
    torch.save(data, path)
    return data


def test_auc_equals_pair_counting_with_ties():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 12, (60,), generator=generator).float()  # many ties
    labels = torch.randint(0, 2, (60,), generator=generator).float()
    pairs = [(p, n) for p, n in itertools.product(range(60), range(60)) if labels[p] == 1 and labels[n] == 0]
    wins = sum(1.0 if scores[p] > scores[n] else 0.5 if scores[p] == scores[n] else 0.0 for p, n in pairs)
    assert roc_auc(scores, labels) == pytest.approx(wins / len(pairs), abs=1e-12)


def reference_logits(spec, weights, data, quantized=None):
    """fp32 embedding_bag over whole tables (one of them dequantized), then the dense part's formula by hand."""
    pooled = []
    for table in spec.tables:
        rows = weights[table.name]
        if quantized is not None and quantized[0] == table.name:
            data_bytes, scale_bias = quantize_rows(rows, quantized[1])
            rows = dequantize_rows(data_bytes, scale_bias, quantized[1], table.embedding_dim)
        for feature in table.feature_names:
            values, lengths = data["features"][feature]["ids"], data["features"][feature]["lengths"]
            bags = []
            for bag in torch.split(values, lengths.tolist()):
                total = rows[bag].sum(0) if bag.numel() else torch.zeros(table.embedding_dim)
                bags.append(total / max(bag.numel(), 1) if table.pooling == PoolingType.MEAN else total)
            pooled.append(torch.stack(bags))
    return data["dense"] @ spec.dense_arch.a + torch.cat(pooled, 1) @ spec.dense_arch.b


def hand_log_loss(logits, labels):
    p = torch.sigmoid(logits.double())
    return float(-(labels * torch.log(p) + (1 - labels) * torch.log(1 - p)).mean())


@pytest.mark.parametrize("measure", ["logloss", "output", "auc"])
def test_one_table_quantized_at_a_time_against_a_hand_computation(tmp_path, measure):
    spec, weights = small_model()
    data = eval_file(spec, tmp_path / "eval.pt")
    sample = load_eval_sample(tmp_path / "eval.pt", spec)
    measured = {m.table: m for m in measure_eval_errors(spec, rows_from_weights(weights), sample, measure)}
    labels = data["labels"]
    base = reference_logits(spec, weights, data)
    for data_type in (DataType.INT2, DataType.INT4, DataType.FP32):
        q = reference_logits(spec, weights, data, ("loud", data_type))
        if measure == "logloss":
            want = hand_log_loss(q, labels) - hand_log_loss(base, labels)
        elif measure == "output":
            want = float((q - base).double().norm() / base.double().norm())
        else:
            want = roc_auc(base, labels) - roc_auc(q, labels)
        assert measured["loud"].error(data_type) == pytest.approx(max(want, 0.0), rel=1e-4, abs=1e-6)
        # the dense part ignores the "mute" table: no type of it changes the output
        assert measured["mute"].error(data_type) == pytest.approx(0.0, abs=1e-6)
    if measure != "auc":
        assert measured["loud"].error(DataType.INT2) > measured["loud"].error(DataType.INT4) > 0


def test_the_planner_spends_bytes_where_the_model_feels_them(tmp_path):
    from infer.planner.precision import plan_precision
    from infer.quant.measured_error import measure_errors

    spec, weights = small_model()
    eval_file(spec, tmp_path / "eval.pt")
    sample = load_eval_sample(tmp_path / "eval.pt", spec)
    by_model = measure_eval_errors(spec, rows_from_weights(weights), sample, "logloss")
    by_pooled = measure_errors(spec, rows_from_weights(weights), bags=64)
    # room for "mute" at INT4 and "loud" at INT2 (27,008 bytes), or "mute" at INT2 and "loud" at FP16 (26,112)
    budget = 27_200
    model_level = plan_precision(spec, by_model, budget, eval_measure="logloss", frontier_points=0).data_types()
    pooled = plan_precision(spec, by_pooled, budget, frontier_points=0).data_types()
    # the muted table takes the fewest bytes; the loud one what is left
    assert model_level == {"mute": DataType.INT2, "loud": DataType.FP16}
    # the pooled measure cannot tell that the table is muted: it weighs its two features' reads
    assert pooled == {"mute": DataType.INT4, "loud": DataType.INT2}


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d["features"].pop("fm2"), ["'fm2'", "missing"]),
        (lambda d: d["features"]["fl"].update(ids=d["features"]["fl"]["ids"] + 500), ["'fl'", "[0, 500)"]),
        (lambda d: d["features"]["fm"].update(lengths=d["features"]["fm"]["lengths"][:-1]), ["'fm'", "lengths"]),
        (lambda d: d.update(labels=d["labels"] * 2), ["0 or 1"]),
        (lambda d: d.update(dense=d["dense"][:, :2]), ["'dense'", "[400, 3]"]),
        (lambda d: d.pop("labels"), ["'labels'"]),
    ],
)
def test_a_bad_evaluation_file_is_a_typed_error_naming_the_feature(tmp_path, change, words):
    spec, _ = small_model()
    data = eval_file(spec, tmp_path / "good.pt")
    change(data)
    torch.save(data, tmp_path / "bad.pt")
    with pytest.raises(FileFormatError) as info:
        load_eval_sample(tmp_path / "bad.pt", spec)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_cli_export_with_eval_chooses_by_log_loss_and_records_it(tmp_path, capsys):
    from infer.artifact.manifest import Manifest
    from infer.cli import main
    from infer.planner.types import ShardingPlan

    spec, weights = small_model()
    (tmp_path / "spec.json").write_text(spec.to_json())
    torch.jit.save(spec.dense_arch, str(tmp_path / "dense.pt"))
    torch.save(weights, tmp_path / "w.pt")
    eval_file(spec, tmp_path / "eval.pt")
    common = ["--spec", str(tmp_path / "spec.json"), "--weights", str(tmp_path / "w.pt"), "--dense-arch",
              str(tmp_path / "dense.pt"), "--memory-budget", "27200"]  # fmt: skip
    assert main(["export", *common, "--out", str(tmp_path / "art"), "--eval", str(tmp_path / "eval.pt")]) == 0
    printed = capsys.readouterr().out
    assert "error measure: logloss" in printed
    tables = {t.name: t.data_type for t in Manifest.read(tmp_path / "art").spec.tables}
    assert tables == {"mute": DataType.INT2, "loud": DataType.FP16}
    plan = ShardingPlan.from_json((tmp_path / "art" / "plan.json").read_text())
    assert "logloss" in plan.planner["precision"]["access"]
    # a measure without its sample, and a bad file, are refused with the fix
    args = ["plan", *common, "--world-size", "1", "--compute-device", "cpu", "--out", str(tmp_path / "p.json")]
    assert main([*args, "--error-measure", "auc"]) == 2
    assert "--eval FILE" in capsys.readouterr().err
    torch.save({"features": {}, "dense": torch.zeros(1, 3), "labels": torch.tensor([0.0, 1.0])}, tmp_path / "bad.pt")
    assert main([*args, "--eval", str(tmp_path / "bad.pt")]) == 2
    assert "'dense'" in capsys.readouterr().err
