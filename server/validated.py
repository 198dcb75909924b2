"""The server's one decode-and-validate step: request arrays -> a ``ValidatedBatch`` the kernel takes as it is.

Every protocol adapter hands its request's arrays (views of the message's bytes, no copy) to ``accept``: a
few vectorized checks that a valid batch always passes. What they accept is final: ids int32/int64 as sent,
int32 bag lengths, float32 weights, feature-major in the model's order; the batcher merges these and the
model's unchecked entry (``EmbserveModel.lookup_unchecked``) runs them with no further check or cast. What
they do not accept goes to the adapter's explaining path (``SparseFeatures.validate`` and the per-feature
checks of the codecs), which names the feature and the rule in ``infer.request_rules``' words (or accepts a
batch these checks were too strict for). The rules live there; this module only proves a batch obeys them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from infer.config import ModelSpec
from infer.features import SparseFeatures, narrow_lengths

# A batch's tensors may view the request's (immutable) bytes: nothing on the serving path writes its input
# (the kernel's FATAL bounds check reads; WARNING/IGNORE would write and are never used), so the copy that
# torch's warning asks for is not needed.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class RequestLayout:
    """What validation needs to know of a model, computed once per served model (not per request)."""

    feature_names: tuple[str, ...]
    feature_index: dict[str, int]  # feature -> its position in the model's order
    rows: np.ndarray  # int64 [num_features]: rows of each feature's table
    min_rows: int
    num_dense_features: int

    @classmethod
    def of(cls, spec: ModelSpec) -> RequestLayout:
        rows = np.array([f.num_embeddings for f in spec.features], dtype=np.int64)
        names = spec.feature_names
        return cls(names, {name: i for i, name in enumerate(names)}, rows, int(rows.min()), spec.num_dense_features)

    @property
    def num_features(self) -> int:
        return len(self.feature_names)


@dataclass(frozen=True)
class ValidatedBatch:
    """A request that passed validation, in the tensors the kernel takes (model feature order, feature-major):
    ``values`` int32/int64 ``[num_ids]``, ``lengths`` int32 ``[num_features * batch_size]``, ``weights`` float32
    ``[num_ids]`` or None, ``dense`` float32 ``[batch_size, num_dense]`` or None."""

    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None
    dense: torch.Tensor | None
    batch_size: int
    num_features: int

    @classmethod
    def of_features(cls, features: SparseFeatures, dense: torch.Tensor | None = None) -> ValidatedBatch:
        """A batch that ``SparseFeatures.validate`` returned (the explaining path, warm-up)."""
        lengths = narrow_lengths(features.lengths)  # validated lengths are <= the id count: they fit int32
        return cls(features.values, lengths, features.weights, dense, features.batch_size, len(features.keys))


def accept(
    layout: RequestLayout,
    values: Sequence[np.ndarray],
    lengths: Sequence[np.ndarray],
    weights: Sequence[np.ndarray | None] | None = None,
    dense: np.ndarray | None = None,
) -> ValidatedBatch | None:
    """The batch of one request's arrays, or None when it is not plainly valid (the caller then explains).

    ``values``/``lengths``/``weights``: one 1-D array per feature in the model's order, or one array in all
    (the packed form: the features' bags one after another); ``weights`` None when no feature is weighted,
    else one per feature (None: that feature's ids weigh 1). ``dense``: float32 ``[batch, num_dense]``.
    """
    num_features = layout.num_features
    per_feature = len(lengths) == num_features and len(lengths) > 1
    all_lengths = lengths[0] if len(lengths) == 1 else np.concatenate(lengths)
    if all_lengths.dtype.kind != "i" or all_lengths.size % num_features:
        return None
    batch = all_lengths.size // num_features
    if per_feature and any(part.size != batch for part in lengths):
        return None
    all_values = values[0] if len(values) == 1 else np.concatenate(values)
    num_ids = all_values.size
    if all_values.dtype.kind != "i" or num_ids > _INT32_MAX:
        return None
    if all_lengths.size:
        if int(all_lengths.min()) < 0 or int(all_lengths.max()) > num_ids:  # before any sum: none can wrap
            return None
        sums = all_lengths.reshape(num_features, batch).sum(1, dtype=np.int64)
    else:
        sums = np.zeros(num_features, dtype=np.int64)
    if per_feature:
        counts = np.fromiter((part.size for part in values), dtype=np.int64, count=num_features)
        if not np.array_equal(sums, counts):
            return None
    elif int(sums.sum()) != num_ids:
        return None
    if num_ids:
        low, high = int(all_values.min()), int(all_values.max())
        if low < 0:
            return None
        if high >= layout.min_rows and bool((all_values >= np.repeat(layout.rows, sums)).any()):
            return None
    all_weights = _weights(weights, values, sums, num_ids)
    if all_weights is False:
        return None
    if dense is not None and dense.shape != (batch, layout.num_dense_features):
        return None
    return ValidatedBatch(
        torch.from_numpy(all_values),
        torch.from_numpy(all_lengths.astype(np.int32, copy=False)),
        None if all_weights is None else torch.from_numpy(all_weights),
        None if dense is None else torch.from_numpy(dense),
        batch,
        num_features,
    )


def _weights(
    weights: Sequence[np.ndarray | None] | None, values: Sequence[np.ndarray], sums: np.ndarray, num_ids: int
) -> np.ndarray | None | bool:
    """All weights float32 ``[num_ids]``, None when unweighted, False when they do not match the ids."""
    if weights is None or all(w is None for w in weights):
        return None
    if len(weights) == 1:
        only = weights[0]
        assert only is not None
        return only if only.size == num_ids and only.dtype == np.float32 else False
    parts = [w if w is not None else np.ones(v.size, dtype=np.float32) for w, v in zip(weights, values)]
    if any(p.dtype != np.float32 or p.size != v.size for p, v in zip(parts, values)):
        return False
    return np.concatenate(parts)
