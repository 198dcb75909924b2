"""The request rules: what makes a lookup batch valid, and the one wording of every violation.

Python validation (``SparseFeatures``), the scripted model (TorchScript, run by Python and C++ hosts)
and the server all build their messages with these functions; the C++ loader's ``validate`` repeats
the same sentences, and ``tests/support/bad_requests.py`` holds every entry point to them. The
functions are plain and typed so TorchScript compiles them into the exported model.
"""

from typing import List, Optional

import torch
from torch import Tensor

# Every request error raised inside a scripted model starts with this, so hosts can tell a bad
# request from a broken model (Python: ``Runtime``; C++: ``embserve::RequestError``).
REQUEST_ERROR_PREFIX = "embserve.RequestError: "

NO_DENSE_PART = "this model has no dense part; use lookup, not predict"
WEIGHTS_DETACHED = (
    "this model.pt keeps its tables in the weight files beside it (artifact format 3); load the artifact folder "
    + "with infer.load or embserve::Model::load, or export with --weights-format embedded for a bare TorchScript host"
)

# ------------------------------------------------------------------------------------------ the call contract
# Every entry point (the scripted model's forward/predict, the Python runtimes on TorchScript, pt2 and
# onnxruntime, embserve.v1 and the Open Inference Protocol) takes these tensors, and only these dtypes:
#   values          int64 or int32   [num_ids]
#   lengths         int32 or int64   [num_features * batch], feature-major
#   weights         float32          [num_ids], or absent (every id weighs 1)
#   dense_features  float32          [batch, num_dense_features] (predict only)
# A documented dtype is cast at the boundary to what the backend runs (model.pt2: int64 ids and lengths,
# ones for absent weights); any other dtype is refused with ``dtype_error``'s message, never reinterpreted.
# ``predict`` returns float32 scores [batch] everywhere (a dense part returning [batch, 1] is squeezed).
CONTRACT_TENSORS = ("values", "lengths", "weights", "dense_features")


def accepts_dtype(tensor: str, dtype: torch.dtype) -> bool:
    """Whether ``tensor`` (one of ``CONTRACT_TENSORS``) may have ``dtype``."""
    if tensor == "values" or tensor == "lengths":
        return dtype == torch.int64 or dtype == torch.int32
    return dtype == torch.float32


def dtype_rule(tensor: str) -> str:
    """The rule ``tensor`` breaks when its dtype or rank is wrong (literals: TorchScript compiles this)."""
    if tensor == "values":
        return "values must be a 1-D int64 or int32 tensor of ids"
    if tensor == "lengths":
        return "lengths must be a 1-D int32 (or int64) tensor"
    if tensor == "weights":
        return "weights must be a 1-D float32 tensor with one weight per id"
    return "dense_features must be float32 [batch, num_dense_features]"


IDS_DTYPE = dtype_rule("values")
LENGTHS_DTYPE = dtype_rule("lengths")
WEIGHTS_DTYPE = dtype_rule("weights")
DENSE_DTYPE = dtype_rule("dense_features")


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``, ``int64``, ... (TorchScript prints a dtype as a number, Python as ``torch.float32``)."""
    names: List[str] = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]
    dtypes: List[torch.dtype] = [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    ]
    for i in range(len(dtypes)):
        if dtype == dtypes[i]:
            return names[i]
    return "dtype " + str(dtype)


def dtype_error(tensor: str, got: str) -> str:
    """The one wording of a refused input: the tensor, the rule it breaks and what it was (``got``: its dtype
    and shape, or a protocol's datatype)."""
    return dtype_rule(tensor) + ", got " + got


def tensor_error(tensor: str, value: Tensor, dims: int) -> Optional[str]:
    """``dtype_error`` for ``value`` as input ``tensor`` when its dtype or rank breaks the contract, else None."""
    if value.dim() == dims and accepts_dtype(tensor, value.dtype):
        return None
    return dtype_error(tensor, dtype_name(value.dtype) + " " + str(list(value.shape)))


def scores_error(got: str, batch: int) -> str:
    """A dense part whose output is not scores: ``predict`` returns float32 ``[batch]`` on every backend."""
    return (
        f"the dense part returned {got} for a batch of {batch}; predict returns float32 scores [batch], so the "
        + "dense part must return floating-point [B] or [B, 1] (squeeze or slice its output to one score per example)"
    )


def scores_of(out: Tensor, batch: int) -> Tensor:
    """The dense part's output as ``predict`` returns it: float32 ``[batch]`` (``[batch, 1]`` squeezed, another
    floating dtype cast); any other shape or dtype raises ``ValueError(scores_error(...))``: a broken model, not
    a bad request. Export probes every dense part with it, and every backend applies it."""
    if out.dim() == 2 and out.size(1) == 1:
        out = out.squeeze(1)
    if out.dim() != 1 or out.size(0) != batch or not out.is_floating_point():
        raise ValueError(scores_error(dtype_name(out.dtype) + " " + str(list(out.shape)), batch))
    return out.to(torch.float32)


# Echoed client input (a name, a value) is cut to this many characters, and a whole message to MAX_MESSAGE_CHARS:
# a status message travels in gRPC metadata, whose size is bounded.
MAX_ECHO_CHARS = 64
MAX_MESSAGE_CHARS = 1024


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"…({len(text)} chars)"


def clip_names(names: list[str], count: int = 5) -> str:
    """A bounded list of client-given names: the first ``count``, each clipped, then how many more."""
    shown = [clip(name) for name in names[:count]]
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return "[" + ", ".join(["'" + name + "'" for name in shown]) + "]" + more


def feature_list(names: List[str]) -> str:
    """``['a', 'b', 'c', 'd', 'e'] and 3 more``: the model's features in a message (the first five; a loop, not a
    comprehension: TorchScript compiles this, and the C++ loader writes the same)."""
    shown: List[str] = []
    for i in range(min(len(names), 5)):
        shown.append("'" + names[i] + "'")
    more = ""
    if len(names) > 5:
        more = " and " + str(len(names) - 5) + " more"
    return "[" + ", ".join(shown) + "]" + more


def uneven_batch(entries: int, feature_names: List[str]) -> str:
    """The packed form's ``lengths`` cannot be split into one batch per feature."""
    count = len(feature_names)
    return (
        f"lengths has {entries} entries, not a multiple of the {count} features {feature_list(feature_names)}: "
        + f"it holds one bag length per example and feature (batch size x {count} entries, feature-major), "
        + "so the features have inconsistent batch sizes"
    )


def bags_differ(feature: str, bags: int, first_feature: str, first_bags: int) -> str:
    """A per-feature form (a mapping, OIP tensors, embserve.v1 typed) whose features carry different batch sizes."""
    return (
        f"feature '{feature}' has {bags} bags but feature '{first_feature}' has {first_bags}: the features have "
        + "inconsistent batch sizes; every feature needs one bag per example (an empty bag for no ids)"
    )


def negative_length(feature: str, bag: int, length: int) -> str:
    return f"feature '{feature}': bag {bag} has negative length {length}"


def length_past_ids(feature: str, bag: int, length: int, num_ids: int) -> str:
    # checked before any sum, so huge lengths cannot wrap a sum into a plausible total
    return f"feature '{feature}': bag {bag} has length {length} but the batch has only {num_ids} ids"


def lengths_sum(total: int, num_ids: int) -> str:
    return f"lengths sum to {total} but there are {num_ids} ids; lengths must add up to the number of ids"


def feature_lengths_sum(feature: str, total: int, num_ids: int) -> str:
    """``lengths_sum`` of one feature of a per-feature form (its own lengths and ids)."""
    return f"feature '{feature}': " + lengths_sum(total, num_ids)


def id_out_of_range(feature: str, bad_id: int, rows: int) -> str:
    return f"feature '{feature}': id {bad_id} is out of range [0, {rows})"


def weights_count(num_weights: int, num_ids: int) -> str:
    return f"weights has {num_weights} entries but there are {num_ids} ids; " + "give one weight per id"


def feature_weights_count(feature: str, num_weights: int, num_ids: int) -> str:
    """``weights_count`` of one feature of a per-feature form (its own weights and ids)."""
    return f"feature '{feature}': " + weights_count(num_weights, num_ids)


TOO_LARGE = "exceeds the server's max batch size"  # how a client tells this refusal from the others


def too_large(batch_size: int, max_batch_size: int) -> str:
    """A request larger than a server's batches (every protocol; ``embserve serve --max-batch-size``)."""
    return (
        f"batch of {batch_size} examples {TOO_LARGE} {max_batch_size} (embserve serve --max-batch-size "
        f"{max_batch_size}); split the request into calls of at most {max_batch_size} examples (EmbserveClient "
        "does: it reads the limit from the model's metadata), or serve with a larger --max-batch-size"
    )


def dense_shape(batch: int, num_dense: int, got: str) -> str:
    return f"dense_features must have shape [{batch}, {num_dense}], got {got}"


def id_range_error(ids: Tensor, rows: int, feature: str) -> str | None:
    """The message for the first kind of bad id of ``feature`` (outside ``[0, rows)``), or None."""
    if ids.numel() == 0:
        return None
    low, high = ids.aminmax()
    if int(low) < 0:
        return id_out_of_range(feature, int(low), rows)
    if int(high) >= rows:
        return id_out_of_range(feature, int(high), rows)
    return None
