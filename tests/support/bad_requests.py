"""The shared bad-request corpus: each case a malformed lookup batch and the fragment its error must carry.

Every entry point runs the whole corpus and asserts the same fragment: the in-process ``Runtime``,
the scripted model called directly (the TorchScript path C++ hosts use), the gRPC server and the C++
``embserve_run``. The fragments are written here by hand from the rules' wording (``request_rules``),
not produced by the code under test. A per-feature form (the Open Inference Protocol's ``<f>__values`` /
``<f>__lengths`` tensors, split as ``tests.server.oip_support.corpus_inputs`` splits a case) says more: each
feature is checked against its own tensors, so where counts disagree it names the feature and its own counts
(``per_feature``); elsewhere it says what every entry point says.

The model: ``CORPUS_SPEC`` (two features; batches of 2 in feature-major order ``f0``, ``f1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.config import ModelSpec, PoolingType, TableConfig

CORPUS_SPEC = ModelSpec(
    (
        TableConfig("t0", 10, 8, ("f0",)),
        TableConfig("t1", 20, 8, ("f1",), PoolingType.MEAN),
    )
)


@dataclass(frozen=True)
class BadRequest:
    name: str
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None
    fragment: str  # the error message of every entry point contains this
    per_feature: str | None = None  # ... of a per-feature form, where it differs (None: ``fragment``)

    @property
    def per_feature_fragment(self) -> str:
        return self.per_feature if self.per_feature is not None else self.fragment

    def __repr__(self) -> str:  # pytest ids
        return self.name


def _case(
    name: str,
    ids: list[int],
    lengths: list[int],
    fragment: str,
    weights: int | None = None,
    per_feature: str | None = None,
) -> BadRequest:
    """A case of int64 ids and int32 lengths; ``weights``: that many unit weights."""
    return BadRequest(
        name,
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int32),
        None if weights is None else torch.ones(weights),
        fragment,
        per_feature,
    )


BAD_REQUESTS: tuple[BadRequest, ...] = (
    _case("id_past_the_table", [1, 2, 3, 20], [1, 1, 1, 1], "feature 'f1': id 20 is out of range [0, 20)"),
    _case("negative_id", [1, -3, 3, 4], [1, 1, 1, 1], "feature 'f0': id -3 is out of range [0, 10)"),
    # 15 is a valid row of t1 but not of t0
    _case("id_legal_elsewhere", [15, 2, 3, 4], [1, 1, 1, 1], "feature 'f0': id 15 is out of range [0, 10)"),
    _case("negative_length", [1, 2, 3], [2, -1, 1, 1], "feature 'f0': bag 1 has negative length -1"),
    _case(
        "length_past_every_id",  # a sum of such lengths can wrap around; no entry point may sum them first
        [1, 2, 3],
        [2**31 - 1, 1, 1, 1],
        "feature 'f0': bag 0 has length 2147483647 but the batch has only 3 ids",
    ),
    # per feature: f0 takes lengths [1, 1] and ids [1, 2]; f1 lengths [1, 1] and the 3 ids left
    _case(
        "lengths_short_of_ids",
        [1, 2, 3, 4, 5],
        [1, 1, 1, 1],
        "lengths sum to 4 but there are 5 ids",
        per_feature="feature 'f1': lengths sum to 2 but there are 3 ids",
    ),
    _case(
        "lengths_past_ids",
        [1, 2],
        [1, 1, 1, 1],
        "lengths sum to 4 but there are 2 ids",
        per_feature="feature 'f1': lengths sum to 2 but there are 0 ids",
    ),
    _case(
        "uneven_batch",
        [1, 2, 3],
        [1, 1, 1],
        "lengths has 3 entries, not a multiple of the 2 features ['f0', 'f1']: it holds one bag length per example "
        "and feature (batch size x 2 entries, feature-major), so the features have inconsistent batch sizes",
        per_feature="feature 'f1' has 1 bags but feature 'f0' has 2: the features have inconsistent batch sizes",
    ),
    _case(
        "weights_short",
        [1, 2, 3, 4],
        [1, 1, 1, 1],
        "weights has 3 entries but there are 4 ids",
        weights=3,
        per_feature="feature 'f1': weights has 1 entries but there are 2 ids",
    ),
)
