"""``bench/planner.py --eval``'s synthetic examples (no training here; the bench itself trains): issue 28's model
draws the same examples as before ``--eval-ids`` existed, and issue 43's ``--eval-ids zipf`` draws Zipf(1.05)-skewed
ids over each table's rows, the labels following the hidden values of the ids."""

from __future__ import annotations

import numpy as np
import torch

from bench.planner import EVAL_DENSE, EVAL_MODEL, _eval_examples, eval_model


def _hidden(tables) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(rows) for name, rows, _ in tables}


def test_uniform_examples_are_issue_28s() -> None:
    """The default model's examples, computed as issue 28's bench wrote them (two signal tables x 2, six noise
    tables x 0.05, uniform ids from one generator): its figures do not move."""
    hidden = _hidden(EVAL_MODEL.tables)
    dense_weight = torch.linspace(-0.3, 0.3, EVAL_DENSE)
    ids, dense, labels = _eval_examples(500, hidden, dense_weight, 7)

    generator = torch.Generator().manual_seed(7)
    signal, noise = (("s0", 20_000), ("s1", 5_000)), tuple((f"n{i}", 60_000) for i in range(6))
    expected_ids = {name: torch.randint(0, rows, (500,), generator=generator) for name, rows in signal + noise}
    expected_dense = torch.randn(500, EVAL_DENSE, generator=generator)
    logit = expected_dense @ dense_weight
    for name, _ in signal:
        logit = logit + 2.0 * hidden[name][expected_ids[name]]
    for name, _ in noise:
        logit = logit + 0.05 * hidden[name][expected_ids[name]]
    expected_labels = torch.bernoulli(torch.sigmoid(logit), generator=generator)
    assert ids.keys() == expected_ids.keys()
    for name in ids:
        assert torch.equal(ids[name], expected_ids[name])
    assert torch.equal(dense, expected_dense) and torch.equal(labels, expected_labels)
    assert eval_model().dim == 16 and eval_model().tables == EVAL_MODEL.tables


def test_zipf_ids_are_skewed_like_zipf_and_labels_follow_them() -> None:
    model = eval_model("zipf")
    assert model.dim == 64 and max(rows for _, rows, _ in model.tables) == 1_000_000
    hidden = _hidden(model.tables)
    count = 200_000
    ids, _, labels = _eval_examples(count, hidden, torch.zeros(EVAL_DENSE), 3, model)
    rows = dict((name, r) for name, r, _ in model.tables)
    for name, values in ids.items():
        assert values.shape == (count,) and int(values.min()) >= 0 and int(values.max()) < rows[name]
    # the most read rows' share of reads against discrete Zipf(1.05) over the table's rows (the draw inverts the
    # continuous CDF: within a few percent)
    counts = np.sort(np.bincount(ids["s0"].numpy(), minlength=rows["s0"]))[::-1]
    zipf = np.arange(1, rows["s0"] + 1, dtype=np.float64) ** -1.05
    zipf /= zipf.sum()
    for top in (10, 1000):
        assert abs(counts[:top].sum() / count - zipf[:top].sum()) < 0.05
    assert counts[:1000].sum() / count > 0.5  # a thousandth of a percent of the rows takes most reads
    # the same seed draws the same ids; the hot rows are spread over the table, not its first ids
    again, _, _ = _eval_examples(count, hidden, torch.zeros(EVAL_DENSE), 3, model)
    assert all(torch.equal(ids[n], again[n]) for n in ids)
    hottest = np.argsort(-np.bincount(ids["s0"].numpy(), minlength=rows["s0"]))[:100]
    assert hottest.max() > rows["s0"] // 2
    # labels follow the signal tables' hidden values of the ids drawn
    signal = sum(w * hidden[n][ids[n]] for n, _, w in model.tables if w == 1.0)
    assert float(labels[signal > 1].mean()) > 0.7 > 0.3 > float(labels[signal < -1].mean())
