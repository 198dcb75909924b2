"""The shared bad-request corpus: each case a malformed lookup batch and the fragment its error must carry.

Every entry point runs the whole corpus and asserts the same fragment: the in-process ``Runtime``,
the scripted model called directly (the TorchScript path C++ hosts use), the gRPC server and the C++
``embserve_run``. The fragments are written here by hand from the rules' wording (``request_rules``),
not produced by the code under test.

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

    def __repr__(self) -> str:  # pytest ids
        return self.name


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _lengths(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


BAD_REQUESTS: tuple[BadRequest, ...] = (
    BadRequest(
        "id_past_the_table",
        _ids(1, 2, 3, 20),
        _lengths(1, 1, 1, 1),
        None,
        "feature 'f1': id 20 is out of range [0, 20)",
    ),
    BadRequest(
        "negative_id",
        _ids(1, -3, 3, 4),
        _lengths(1, 1, 1, 1),
        None,
        "feature 'f0': id -3 is out of range [0, 10)",
    ),
    BadRequest(
        "id_legal_elsewhere",  # 15 is a valid row of t1 but not of t0
        _ids(15, 2, 3, 4),
        _lengths(1, 1, 1, 1),
        None,
        "feature 'f0': id 15 is out of range [0, 10)",
    ),
    BadRequest(
        "negative_length",
        _ids(1, 2, 3),
        _lengths(2, -1, 1, 1),
        None,
        "feature 'f0': bag 1 has negative length -1",
    ),
    BadRequest(
        "lengths_short_of_ids",
        _ids(1, 2, 3, 4, 5),
        _lengths(1, 1, 1, 1),
        None,
        "lengths sum to 4 but there are 5 ids",
    ),
    BadRequest(
        "lengths_past_ids",
        _ids(1, 2),
        _lengths(1, 1, 1, 1),
        None,
        "lengths sum to 4 but there are 2 ids",
    ),
    BadRequest(
        "uneven_batch",
        _ids(1, 2, 3),
        _lengths(1, 1, 1),
        None,
        "lengths has 3 entries, not a multiple of the 2 features",
    ),
    BadRequest(
        "weights_short",
        _ids(1, 2, 3, 4),
        _lengths(1, 1, 1, 1),
        torch.ones(3),
        "weights has 3 entries but there are 4 ids",
    ),
)
