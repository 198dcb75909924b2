"""Sparse input: a batch of jagged features, and the checks that run before any kernel sees it.

Layout (the same as TorchRec's KeyedJaggedTensor and the TBE's input): ``lengths`` holds
``batch_size`` bag lengths per feature, feature-major, and ``values`` the ids of all bags in
that order. Optional ``weights`` hold one float32 weight per id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from infer import request_rules as rules
from infer.errors import RequestError

if TYPE_CHECKING:
    from infer.config import ModelSpec

# One feature's bags: a list of id lists, or a pair of 1-D tensors (values, lengths).
FeatureBags = Sequence[Sequence[int]] | tuple[torch.Tensor, torch.Tensor]

FEATURES_FORMS = (
    "features must be a non-empty mapping of feature name -> bags, a SparseFeatures "
    "or a torchrec KeyedJaggedTensor (SparseFeatures.from_kjt)"
)


def is_kjt(obj: object) -> bool:
    """Whether ``obj`` is a TorchRec ``KeyedJaggedTensor``, told by its methods so that torchrec is not imported."""
    return not isinstance(obj, Mapping) and all(
        callable(getattr(obj, name, None)) for name in ("keys", "values", "lengths", "weights_or_none")
    )


def _kind_of(obj: object) -> str:
    return "an empty mapping" if isinstance(obj, Mapping) else type(obj).__name__


@dataclass(frozen=True)
class SparseFeatures:
    """A batch of jagged sparse features in a fixed feature order (``keys``)."""

    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        check_tensor("values", self.values)
        check_tensor("lengths", self.lengths)
        if self.weights is not None:
            check_tensor("weights", self.weights)
            if self.weights.numel() != self.values.numel():
                raise RequestError(
                    rules.weights_count(self.weights.numel(), self.values.numel())
                    + self._first_feature_past(self.weights.numel(), "weights")
                )
        if len(set(self.keys)) != len(self.keys):
            repeated = sorted(k for k, count in Counter(self.keys).items() if count > 1)
            raise RequestError(f"duplicate feature names {rules.clip_names(repeated)}; name each feature once")
        if not self.keys:
            raise RequestError("a batch needs at least one feature")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        bags: Mapping[str, FeatureBags],
        weights: Mapping[str, Sequence[Sequence[float]] | torch.Tensor] | None = None,
    ) -> SparseFeatures:
        """Build from ``{"f0": [[1, 2], [3]], ...}`` (or ``{"f0": (values, lengths)}``).

        ``weights``, when given, must cover every feature with one weight per id.
        """
        if not isinstance(bags, Mapping) or not bags:
            raise RequestError(FEATURES_FORMS + f", got {_kind_of(bags)}")
        keys = tuple(bags)
        values_parts: list[torch.Tensor] = []
        lengths_parts: list[torch.Tensor] = []
        batch_size: int | None = None
        first_key = keys[0]
        for key in keys:
            values, lengths = _feature_tensors(key, bags[key])
            if batch_size is None:
                batch_size = lengths.numel()
            elif lengths.numel() != batch_size:
                raise RequestError(
                    rules.bags_differ(rules.clip(key), lengths.numel(), rules.clip(first_key), batch_size), feature=key
                )
            values_parts.append(values)
            lengths_parts.append(lengths)
        id_dtype = torch.int64 if any(v.dtype == torch.int64 for v in values_parts) else torch.int32
        weight_tensor = None
        if weights is not None:
            missing = [k for k in keys if k not in weights]
            extra = [k for k in weights if k not in bags]
            if missing or extra:
                raise RequestError(
                    f"weights must cover exactly the batch's features; missing {missing}, unknown {extra}"
                )
            parts = []
            for key, vals, lengths in zip(keys, values_parts, lengths_parts):
                w = _feature_weights(key, weights[key], lengths)
                if w.numel() != vals.numel():
                    raise RequestError(
                        rules.feature_weights_count(rules.clip(key), w.numel(), vals.numel()), feature=key
                    )
                parts.append(w)
            weight_tensor = torch.cat(parts)
        return cls(
            keys,
            torch.cat([v.to(id_dtype) for v in values_parts]),
            narrow_lengths(torch.cat([n.to(torch.int64) for n in lengths_parts])),
            weight_tensor,
        )

    @classmethod
    def of(
        cls,
        features: SparseFeatures | Mapping[str, FeatureBags] | Any,
        weights: Mapping[str, Sequence[Sequence[float]] | torch.Tensor] | None = None,
    ) -> SparseFeatures:
        """Whatever an entry point takes as features: a ``SparseFeatures``, a TorchRec ``KeyedJaggedTensor``
        (``from_kjt``: its weights are the per-id weights) or a mapping (``from_dict``, with ``weights``).
        Per-id weights come one way: with the batch, or as ``weights`` beside a mapping."""
        if isinstance(features, SparseFeatures) or is_kjt(features):
            if weights is not None:
                raise RequestError(
                    f"weights given beside a {type(features).__name__}; put them in it (its weights) "
                    "or pass the features as a mapping"
                )
            return features if isinstance(features, SparseFeatures) else cls.from_kjt(features)
        return cls.from_dict(features, weights)

    @classmethod
    def random(cls, spec: ModelSpec, batch_size: int = 256, ids_per_bag: int = 20, seed: int = 0) -> SparseFeatures:
        """Seeded uniform random ids, ``ids_per_bag`` per bag, for every feature of ``spec`` (in its order):
        probe batches for warm-up, accuracy reports and benchmarks."""
        generator = torch.Generator().manual_seed(seed)
        values = [
            torch.randint(0, info.num_embeddings, (batch_size * ids_per_bag,), generator=generator)
            for info in spec.features
        ]
        lengths = torch.full((len(spec.features) * batch_size,), ids_per_bag, dtype=torch.int32)
        return cls(spec.feature_names, torch.cat(values), lengths)

    @classmethod
    def from_tensors(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> SparseFeatures:
        """Wrap tensors already in the feature-major jagged layout (nothing is copied)."""
        return cls(tuple(keys), values, narrow_lengths(lengths), weights)

    @classmethod
    def from_kjt(cls, kjt: Any) -> SparseFeatures:
        """Wrap a TorchRec ``KeyedJaggedTensor`` (same feature-major layout: keys, values, lengths, optional
        weights); lengths become int32 (``narrow_lengths``), nothing else is copied. Variable-batch (VBE) KJTs are
        refused."""
        if getattr(kjt, "variable_stride_per_key", lambda: False)():
            raise RequestError(
                "a variable-batch (VBE) KeyedJaggedTensor has a different batch size per feature; "
                "embserve serves one batch size for all features"
            )
        try:
            keys, values, lengths, weights = kjt.keys(), kjt.values(), kjt.lengths(), kjt.weights_or_none()
        except AttributeError:
            raise RequestError(f"expected a torchrec KeyedJaggedTensor, got {type(kjt).__name__}") from None
        return cls(tuple(keys), values, narrow_lengths(lengths), weights)

    def to_kjt(self) -> Any:
        """This batch as a TorchRec ``KeyedJaggedTensor`` (needs the ``embserve[torchrec]`` extra)."""
        try:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                f"{err}; SparseFeatures.to_kjt needs torchrec: pip install 'embserve[torchrec]'"
            ) from None
        return KeyedJaggedTensor.from_lengths_sync(
            keys=list(self.keys), values=self.values, lengths=self.lengths, weights=self.weights
        )

    # ------------------------------------------------------------------ accessors
    @property
    def batch_size(self) -> int:
        return self.lengths.numel() // len(self.keys)

    def num_ids(self) -> int:
        return self.values.numel()

    def examples(self, start: int, stop: int) -> SparseFeatures | None:
        """Examples ``[start, stop)`` of the batch: every feature's bags of them, with their ids and weights (a
        client splitting a batch larger than the server's). None when the lengths do not lay out a batch (a count
        not a multiple of the features, a negative length, a sum other than the ids): nothing to split."""
        num_features = len(self.keys)
        if self.lengths.numel() % num_features:
            return None
        batch = self.batch_size
        lengths = self.lengths.to(torch.int64)
        num_ids = self.values.numel()
        if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > num_ids):
            return None  # (checked before the sum, which such lengths could wrap around)
        if int(lengths.sum()) != num_ids or not 0 <= start <= stop <= batch:
            return None
        bag_starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).tolist()
        spans = [(bag_starts[f * batch + start], bag_starts[f * batch + stop]) for f in range(num_features)]
        values = torch.cat([self.values[lo:hi] for lo, hi in spans])
        weights = None if self.weights is None else torch.cat([self.weights[lo:hi] for lo, hi in spans])
        part_lengths = self.lengths.view(num_features, batch)[:, start:stop].reshape(-1)
        return SparseFeatures(self.keys, values, part_lengths, weights)

    def to_dict(self) -> dict[str, list[list[int]]]:
        """The batch as plain lists (for debugging and small tests)."""
        out: dict[str, list[list[int]]] = {}
        lengths = self.lengths.tolist()
        values = self.values.tolist()
        batch = self.batch_size
        pos = 0
        for f, key in enumerate(self.keys):
            bags = []
            for n in lengths[f * batch : (f + 1) * batch]:
                bags.append(values[pos : pos + n])
                pos += n
            out[key] = bags
        return out

    # ------------------------------------------------------------------ validation
    def validate(self, spec: ModelSpec) -> SparseFeatures:
        """Check the batch against ``spec``; return it in the spec's feature order.

        Raises ``RequestError`` naming the feature and the bad value. The caller's tensors
        are never modified; a reordered batch is a new one.
        """
        expected = spec.feature_names
        known = set(expected)
        unknown = [k for k in self.keys if k not in known]
        if unknown:
            raise RequestError(
                f"unknown feature(s) {rules.clip_names(unknown)}; the model's features are "
                f"{rules.clip_names(list(expected), 10)}",
                feature=rules.clip(unknown[0]),
            )
        present = set(self.keys)
        missing = [k for k in expected if k not in present]
        if missing:
            raise RequestError(
                f"missing feature(s) {rules.clip_names(missing)}; every request must carry all "
                f"{len(expected)} features of the model "
                "(send empty bags for a feature with no ids)",
                feature=missing[0],
            )
        num_features = len(self.keys)
        if self.lengths.numel() % num_features != 0:
            raise RequestError(rules.uneven_batch(self.lengths.numel(), list(self.keys)))
        batch = self.batch_size
        lengths = self.lengths.to(torch.int64)
        num_ids = self.values.numel()
        shortest, longest = (int(x) for x in torch.aminmax(lengths)) if lengths.numel() else (0, 0)
        if shortest < 0:
            position = int(torch.nonzero(lengths < 0)[0])
            key = self.keys[position // batch]
            raise RequestError(rules.negative_length(key, position % batch, int(lengths[position])), feature=key)
        if longest > num_ids:
            position = int(torch.nonzero(lengths > num_ids)[0])
            key = self.keys[position // batch]
            raise RequestError(
                rules.length_past_ids(key, position % batch, int(lengths[position]), num_ids), feature=key
            )
        per_feature = lengths.view(num_features, batch).sum(dim=1)
        total = int(per_feature.sum())
        if total != num_ids:
            raise RequestError(rules.lengths_sum(total, num_ids) + self._first_feature_past(num_ids, "ids"))
        ends = torch.cumsum(per_feature, 0).tolist()
        starts = [0] + ends[:-1]
        rows = {f.name: f.num_embeddings for f in spec.features}
        # one reduction over every id first: only a suspicious one pays the per-feature checks below
        low_id, high_id = (int(x) for x in torch.aminmax(self.values)) if num_ids else (0, -1)
        checks = () if low_id >= 0 and high_id < min(rows.values()) else zip(self.keys, starts, ends)
        for key, start, end in checks:
            if end == start:
                continue
            ids = self.values[start:end]
            low, high = torch.aminmax(ids)
            if int(low) < 0 or int(high) >= rows[key]:
                bad_mask = (ids < 0) | (ids >= rows[key])
                position = int(torch.nonzero(bad_mask)[0])
                raise RequestError(
                    rules.id_out_of_range(key, int(ids[position]), rows[key]) + f" (id #{position} of the feature)",
                    feature=key,
                )
        if self.keys == expected:
            return self
        return self._reordered(expected, starts, ends)

    def _first_feature_past(self, available: int, what: str) -> str:
        """Which feature's bags first reach past ``available`` ids (or weights), when lengths allow telling:
        the per-feature hint of a count mismatch in the packed form ("" when it cannot be told)."""
        num_features = len(self.keys)
        if not num_features or self.lengths.numel() % num_features or self.lengths.numel() > 1 << 24:
            return ""
        lengths = self.lengths.to(torch.int64)
        if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > self.values.numel()):
            return ""
        ends = torch.cumsum(lengths.view(num_features, -1).sum(1), 0).tolist() if lengths.numel() else []
        for key, end in zip(self.keys, ends):
            if end > available:
                return f" (feature '{rules.clip(key)}' is the first whose bags reach past the {available} {what})"
        if ends and ends[-1] < available:
            return (
                f" ({available - ends[-1]} {what} are left over after the last feature '{rules.clip(self.keys[-1])}')"
            )
        return ""

    def _reordered(self, order: Sequence[str], starts: list[int], ends: list[int]) -> SparseFeatures:
        batch = self.batch_size
        index = {k: i for i, k in enumerate(self.keys)}
        values, lengths, weights = [], [], []
        for key in order:
            i = index[key]
            values.append(self.values[starts[i] : ends[i]])
            lengths.append(self.lengths[i * batch : (i + 1) * batch])
            if self.weights is not None:
                weights.append(self.weights[starts[i] : ends[i]])
        return SparseFeatures(
            tuple(order),
            torch.cat(values),
            torch.cat(lengths),
            torch.cat(weights) if self.weights is not None else None,
        )


def _feature_tensors(key: str, bags: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(bags, tuple) and len(bags) == 2 and all(isinstance(t, torch.Tensor) for t in bags):
        values, lengths = bags
        check_tensor("values", values, key)
        check_tensor("lengths", lengths, key)
        return values, lengths
    if isinstance(bags, (str, bytes)) or not isinstance(bags, Sequence):
        raise RequestError(
            f"feature '{rules.clip(key)}': expected a list of bags (lists of int ids), got {type(bags).__name__}",
            feature=key,
        )
    flat: list[int] = []
    lengths_list: list[int] = []
    for b, bag in enumerate(bags):
        if isinstance(bag, (str, bytes)) or not isinstance(bag, Sequence):
            raise RequestError(
                f"feature '{rules.clip(key)}': bag {b} must be a list of int ids, got {rules.clip(repr(bag))}",
                feature=key,
            )
        for item in bag:
            if isinstance(item, bool) or not isinstance(item, int):
                raise RequestError(
                    f"feature '{rules.clip(key)}': bag {b} holds non-integer id {rules.clip(repr(item))}", feature=key
                )
        flat.extend(bag)
        lengths_list.append(len(bag))
    try:
        values = torch.tensor(flat, dtype=torch.int64)
    except (RuntimeError, ValueError, OverflowError):
        raise RequestError(f"feature '{rules.clip(key)}': an id does not fit in int64", feature=key) from None
    return values, torch.tensor(lengths_list, dtype=torch.int32)


def _feature_weights(key: str, weights: Any, lengths: torch.Tensor) -> torch.Tensor:
    """One feature's weights as float32: a 1-D tensor, or lists shaped exactly like its bags."""
    if isinstance(weights, torch.Tensor):
        check_tensor("weights", weights, key)
        return weights
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise RequestError(f"feature '{rules.clip(key)}': weights must be a list of bags of floats", feature=key)
    bag_lengths = lengths.tolist()
    if len(weights) != len(bag_lengths):
        raise RequestError(
            f"feature '{rules.clip(key)}': {len(weights)} bags of weights for {len(bag_lengths)} bags of ids",
            feature=key,
        )
    flat: list[float] = []
    for b, (bag, expected) in enumerate(zip(weights, bag_lengths)):
        if isinstance(bag, (str, bytes)) or not isinstance(bag, Sequence) or len(bag) != expected:
            raise RequestError(
                f"feature '{rules.clip(key)}': bag {b} needs {expected} weights (one per id), "
                f"got {rules.clip(repr(bag))}",
                feature=key,
            )
        for w in bag:
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise RequestError(
                    f"feature '{rules.clip(key)}': bag {b} holds non-numeric weight {rules.clip(repr(w))}", feature=key
                )
            flat.append(float(w))
    return torch.tensor(flat, dtype=torch.float32)


_INT32 = torch.iinfo(torch.int32)


def narrow_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """int64 lengths as int32 when every one fits; otherwise as they are (validation then names the bad length):
    a cast would wrap a huge length around into a plausible one."""
    if lengths.dtype != torch.int64:
        return lengths
    if lengths.numel() and (int(lengths.min()) < _INT32.min or int(lengths.max()) > _INT32.max):
        return lengths
    return lengths.to(torch.int32)


def check_tensor(name: str, tensor: Any, feature: str | None = None) -> None:
    """``RequestError`` in the call contract's words (``request_rules.tensor_error``) unless ``tensor`` is a 1-D
    tensor of a dtype ``name`` accepts (``dense_features``: 2-D); ``feature`` names the feature it belongs to."""
    dims = 2 if name == rules.CONTRACT_TENSORS[3] else 1
    if not isinstance(tensor, torch.Tensor):
        error: str | None = rules.dtype_error(name, type(tensor).__name__)
    else:
        error = rules.tensor_error(name, tensor, dims)
    if error is not None:
        prefix = f"feature '{rules.clip(feature)}': " if feature is not None else ""
        raise RequestError(prefix + error, feature=feature)


def check_dense_features(dense_features: Any, batch: int, num_dense: int) -> torch.Tensor:
    """``dense_features`` as a backend takes it: a float32 ``[batch, num_dense]`` tensor, else ``RequestError``."""
    if isinstance(dense_features, torch.Tensor) and dense_features.dim() == 2:
        check_tensor("dense_features", dense_features)
    if not isinstance(dense_features, torch.Tensor) or tuple(dense_features.shape) != (batch, num_dense):
        shape = list(dense_features.shape) if isinstance(dense_features, torch.Tensor) else type(dense_features)
        raise RequestError(rules.dense_shape(batch, num_dense, str(shape)))
    return dense_features.contiguous()
