"""The pt2 backend: an artifact's ``model.pt2`` (AOTInductor) behind the same ``Runtime`` API.

``Pt2Module`` stands where the scripted model stands: ``module(values, lengths, weights)`` validates the
request with the shared rules (``SparseFeatures.validate``, the ``request_rules`` wording) and raises
``RequestError`` before the compiled program sees it, then calls the program at the call contract's boundary
(``program``): int64 ids and lengths, all-ones weights when the request has none (bit-identical to an
unweighted lookup). fbgemm's FATAL bounds
check inside the program stays as the last line.

Calling the package from Python holds the GIL for the whole call (``AOTIModelPackageLoader.boxed_run`` does
not release it; bench/pt2.py measures it), so splitting a batch over Python threads gains nothing here:
every call is one program run. A C++ host may split a batch into example ranges on its own threads.

A mapped artifact's package holds no tables (its metadata names the constants it lacks): once the artifact is
verified, each kernel's view of its mapped weight file is handed to the program as a user-managed constant (no
copy: the program reads the mapping), with ones for its ``tables_attached`` check (without them the program
raises, telling a bare caller to load through embserve). AOTInductor (torch 2.13) keeps a tensor handle of every
user-managed constant that it never frees, which would keep the mapping alive forever; so the program gets a view
that does not own the mapping (``_borrowed``), and ``Pt2Module`` holds the mappings as long as it lives.
"""

from __future__ import annotations

import ctypes
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from infer import request_rules as rules
from infer.artifact.fbgemm_libs import load_fbgemm
from infer.artifact.formats.pt2_program import (
    BLOCK_REMAPS_KEY,
    TABLES_ATTACHED,
    WEIGHT_CONSTANTS_KEY,
    read_block_remaps,
    read_weight_constants,
    tables_attached,
)
from infer.artifact.manifest import MANIFEST_FILE, PT2_INPUTS, PT2_TABLES_IN_WEIGHT_FILES, Manifest
from infer.artifact.mapped import map_kernel_weights
from infer.artifact.runtime import Runtime
from infer.config import ModelSpec
from infer.errors import ArtifactError, ArtifactErrorKind, RequestError
from infer.features import SparseFeatures, check_dense_features, check_tensor

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKEND = "pt2"
MODEL = ArtifactErrorKind.MODEL


class Pt2Module:
    """A module-like wrapper of one loaded AOTInductor package (the program named "model")."""

    def __init__(self, lookup: Any, spec: ModelSpec, dense: Any = None, mappings: Sequence[torch.Tensor] = ()) -> None:
        """``lookup``: the package's lookup program, ``dense``: its dense program or None (lookups only); each
        a loaded ``AOTIModelPackageLoader`` (or anything with its ``boxed_run(list of tensors)``). ``mappings``:
        the weight files the lookup program reads (kept mapped while the module lives)."""
        self.lookup = lookup
        self.dense = dense
        self.spec = spec
        self.has_dense = dense is not None
        self.mappings = tuple(mappings)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings ``[batch, output_dim]`` fp32 (validated first)."""
        features = SparseFeatures.from_tensors(self.spec.feature_names, values, lengths, weights).validate(self.spec)
        return self.program(features.values, features.lengths, features.weights)

    def program(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The lookup program without the request's value checks (ids, lengths: fbgemm's bounds check inside the
        program is the only one), at the call contract's boundary: the program was compiled for int64 ids and
        lengths and float32 weights and reads any other dtype's bytes as those (AOTInductor checks input dtypes
        only under AOTI_RUNTIME_CHECK_INPUTS=1), so documented dtypes are cast here, absent weights become ones
        (bit-identical to an unweighted lookup), and any other dtype is a ``RequestError``."""
        for name, tensor in (("values", values), ("lengths", lengths), ("weights", weights)):
            if tensor is not None:
                check_tensor(name, tensor)
        ids = values.to(torch.int64).contiguous()
        bag_lengths = lengths.to(torch.int64).contiguous()
        id_weights = weights.contiguous() if weights is not None else torch.ones(ids.numel(), device=ids.device)
        result: torch.Tensor = self.lookup.boxed_run([ids, bag_lengths, id_weights])[0]
        return result

    __call__ = forward

    def predict(
        self,
        dense_features: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Scores of the dense part float32 ``[batch]`` (validated first): the lookup program, then the dense one."""
        return self.lookup_and_predict(dense_features, values, lengths, weights)[1]

    def lookup_and_predict(
        self,
        dense_features: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled embeddings ``[batch, output_dim]`` and scores ``[batch]`` of one lookup."""
        if not self.has_dense:
            raise RequestError(rules.NO_DENSE_PART)
        pooled = self.forward(values, lengths, weights)
        batch = pooled.shape[0]
        dense = check_dense_features(dense_features, batch, self.spec.num_dense_features)
        scores: torch.Tensor = self.dense.boxed_run([dense, pooled])[0]
        return pooled, rules.scores_of(scores, batch)


def load_program(package: Path, name: str) -> Any:
    """One program of an AOTInductor package: the ``AOTIModelPackageLoader`` the C++ loader uses too, called
    with a flat list of tensors (``boxed_run``). ``torch._inductor.package.load_package`` would first probe the
    host's vector ISA by building test programs with the C++ compiler (seconds, and a compiler on every
    serving host) and wrap every call in pytree flattening (~9 us at batch 1); the loader needs neither."""
    return torch._C._aoti.AOTIModelPackageLoader(str(package), name, False, 1, -1)


def _borrowed(view: torch.Tensor) -> torch.Tensor:
    """A tensor over ``view``'s bytes that does not own them (its storage holds a ctypes array, not the mapping):
    the handle AOTInductor never frees then keeps a few bytes alive, not the mapping."""
    if view.numel() == 0:
        return view
    array = (ctypes.c_uint8 * view.numel()).from_address(view.data_ptr())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(array, dtype=torch.uint8)


def read_metadata(lookup: Any, key: str, read: Callable[[str], T], package: Path) -> T:
    """The program's metadata entry ``key`` (empty when absent) parsed by ``read``; a malformed one is an
    ``ArtifactError`` (kind MODEL) naming the package and the fix."""
    try:
        return read(lookup.get_metadata().get(key, ""))
    except ValueError as err:
        raise ArtifactError(
            f"{package}: {err}; re-export the artifact with --pt2", path=str(package), kind=MODEL
        ) from None


def check_block_remaps(lookup: Any, manifest: Manifest, package: Path) -> None:
    """The id remaps compiled into the lookup program (its metadata, ``pt2_program.BLOCK_REMAPS_KEY``: table ->
    sha256) are the manifest's ``block_remaps``, table for table; else ``ArtifactError`` (kind MODEL) naming the
    first table that differs and the fix. (A flipped byte inside model.pt2 is its checksum's to catch.)"""
    compiled = read_metadata(lookup, BLOCK_REMAPS_KEY, read_block_remaps, package)
    listed = {entry.table: entry.sha256 for entry in manifest.block_remaps}
    for table in sorted(set(listed) | set(compiled)):
        if listed.get(table) != compiled.get(table):
            held = "no remap" if table not in compiled else f"remap sha256 {compiled[table][:16]}..."
            says = "no remap" if table not in listed else f"sha256 {listed[table][:16]}..."
            raise ArtifactError(
                f"{package} was compiled with {held} for table {table!r}, and {MANIFEST_FILE}'s block_remaps "
                f"says {says}: model.pt2 and the manifest come from different exports. Re-export the artifact "
                "with --pt2",
                path=str(package),
                kind=MODEL,
            )


def attach_weight_constants(lookup: Any, folder: Path, manifest: Manifest, package: Path) -> list[torch.Tensor]:
    """Hand the lookup program every kernel's mapped weight buffer as a user-managed constant, as the program's
    metadata asks (``pt2_program.WEIGHT_CONSTANTS_KEY``); returns the mappings, which must outlive the program.
    A package that carries its tables (no such metadata) gets nothing. ``ArtifactError`` (kind MODEL, naming the
    file and the fix) when the package and the manifest disagree."""
    wanted = read_metadata(lookup, WEIGHT_CONSTANTS_KEY, read_weight_constants, package)
    assert manifest.pt2 is not None
    in_weight_files = manifest.pt2.tables == PT2_TABLES_IN_WEIGHT_FILES
    if bool(wanted) != in_weight_files:
        raise ArtifactError(
            f"{package} {'takes its tables from the weight files' if wanted else 'carries its tables itself'}, but "
            f"{MANIFEST_FILE}'s pt2.tables says {manifest.pt2.tables!r}: model.pt2 and the manifest come from "
            "different exports. Re-export the artifact with --pt2",
            path=str(package),
            kind=MODEL,
        )
    if not wanted:
        return []
    kernels = manifest.kernels
    mapped_bytes = [k.shared.total_bytes if k.weights is not None and k.shared is not None else None for k in kernels]
    known = set(lookup.get_constant_fqns())
    if [size for _, size in wanted] != mapped_bytes or not known.issuperset(name for name, _ in wanted):
        raise ArtifactError(
            f"{package} was compiled for mapped weight buffers of {[size for _, size in wanted]} bytes, and "
            f"{MANIFEST_FILE} maps {mapped_bytes}: model.pt2 and the manifest come from different exports. Re-export "
            "the artifact with --pt2",
            path=str(package),
            kind=MODEL,
        )
    views, mappings = map_kernel_weights(folder, kernels, manifest.file_bytes)
    constants = {name: _borrowed(view) for (name, _), view in zip(wanted, views) if view is not None}
    if TABLES_ATTACHED in known:  # the program's check that its weights were handed over (a 128-byte tensor)
        constants[TABLES_ATTACHED] = tables_attached()
    try:  # the active buffer, a partial update (the package's small constants stay), user-managed: no copy
        lookup.load_constants(constants, False, False, True)
    except RuntimeError as err:
        raise ArtifactError(
            f"{package} does not take the mapped weights: {str(err).strip().splitlines()[0][:300]}; re-export the "
            "artifact with --pt2",
            path=str(package),
            kind=MODEL,
        ) from None
    return list(mappings.values())


def load_pt2(folder: Path, manifest: Manifest, verified: Callable[[], None] = lambda: None) -> Runtime:
    """The ``Runtime`` of an artifact (manifest read) on model.pt2; ``verified`` returns once its checksums are
    checked (raising when one fails): the programs load meanwhile, the mapped weights are handed over after."""
    entry = manifest.pt2
    if entry is None:
        raise ArtifactError(
            f"{folder} has no model.pt2; re-export it with infer.export(..., pt2=True) or `embserve export --pt2`",
            path=str(folder),
            kind=MODEL,
        )
    package = folder / entry.file
    if entry.torch_version != torch.__version__:
        raise ArtifactError(
            f"{package} was compiled by torch {entry.torch_version} and this process runs torch {torch.__version__}; "
            "AOTInductor code runs only under the torch that compiled it. Re-export with --pt2 under this torch, "
            "or load the torchscript backend",
            path=str(package),
            kind=MODEL,
        )
    if tuple(entry.inputs) != PT2_INPUTS:
        raise ArtifactError(
            f"{package} takes inputs {list(entry.inputs)}; this embserve passes {list(PT2_INPUTS)}. Re-export it",
            path=str(package),
            kind=MODEL,
        )
    if entry.device != "cpu" and not (torch.cuda.is_available() and torch.device(entry.device).index is not None):
        raise ArtifactError(
            f"{package} was compiled for {entry.device} and this host has no such device; "
            "load the torchscript backend with a device map",
            path=str(package),
            kind=MODEL,
        )
    load_fbgemm()  # the program calls fbgemm's operators through the proxy executor
    try:
        lookup = load_program(package, "model")
        dense = load_program(package, entry.dense_program) if entry.dense_program is not None else None
    except Exception as err:  # noqa: BLE001 - the loader raises RuntimeError and others for a bad package
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ArtifactError(
            f"{package} cannot be loaded by AOTInductor: {first_line}", path=str(package), kind=MODEL
        ) from None
    check_block_remaps(lookup, manifest, package)
    verified()  # nothing reads a weight file before its checksums pass
    mappings = attach_weight_constants(lookup, folder, manifest, package)
    if manifest.has_dense and dense is None:
        logger.warning("%s holds the lookups only (no dense program): this runtime serves no predictions", package)
    logger.debug("AOTInductor loaded %s (%d mapped weight files)", package, len(mappings))
    return Runtime(folder, manifest, Pt2Module(lookup, manifest.spec, dense, mappings), backend=BACKEND)
