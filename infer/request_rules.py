"""The request rules: what makes a lookup batch valid, and the one wording of every violation.

Python validation (``SparseFeatures``), the scripted model (TorchScript, run by Python and C++ hosts)
and the server all build their messages with these functions; the C++ loader's ``validate`` repeats
the same sentences, and ``tests/support/bad_requests.py`` holds every entry point to them. The
functions are plain and typed so TorchScript compiles them into the exported model.
"""

from torch import Tensor

# Every request error raised inside a scripted model starts with this, so hosts can tell a bad
# request from a broken model (Python: ``Runtime``; C++: ``embserve::RequestError``).
REQUEST_ERROR_PREFIX = "embserve.RequestError: "

IDS_DTYPE = "values must be a 1-D int64 or int32 tensor of ids"
LENGTHS_DTYPE = "lengths must be a 1-D int32 (or int64) tensor"
WEIGHTS_DTYPE = "weights must be a 1-D float32 tensor with one weight per id"
DENSE_DTYPE = "dense_features must be float32"
NO_DENSE_PART = "this model has no dense part; use lookup, not predict"


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


def uneven_batch(entries: int, num_features: int) -> str:
    return (
        f"lengths has {entries} entries, not a multiple of the {num_features} features; "
        + "features have inconsistent batch sizes"
    )


def negative_length(feature: str, bag: int, length: int) -> str:
    return f"feature '{feature}': bag {bag} has negative length {length}"


def length_past_ids(feature: str, bag: int, length: int, num_ids: int) -> str:
    # checked before any sum, so huge lengths cannot wrap a sum into a plausible total
    return f"feature '{feature}': bag {bag} has length {length} but the batch has only {num_ids} ids"


def lengths_sum(total: int, num_ids: int) -> str:
    return f"lengths sum to {total} but there are {num_ids} ids; lengths must add up to the number of ids"


def id_out_of_range(feature: str, bad_id: int, rows: int) -> str:
    return f"feature '{feature}': id {bad_id} is out of range [0, {rows})"


def weights_count(num_weights: int, num_ids: int) -> str:
    return f"weights has {num_weights} entries but there are {num_ids} ids; " + "give one weight per id"


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
