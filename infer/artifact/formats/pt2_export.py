"""Compile an exported model's lookups to ``model.pt2``: ``torch.export`` (non-strict, dynamic ids and batch),
then AOTInductor's ``aoti_compile_and_package``. The program is ``pt2_program.LookupProgram``; the package's
default model name ("model") is what the Python and C++ loaders run.

A model with a dense part gets a second program in the same package, "dense":
``(dense_features float32[B, num_dense_features], pooled float32[B, output_dim]) -> scores float32[B]``, so
``predict`` runs the lookups, then the dense part, without duplicating the tables. A TorchScript dense part
(``--dense-arch dense.pt``) is converted for torch.export first; a dense part that still cannot be traced is a
``ConfigError`` before anything is compiled (never a package that silently lacks it).

Compiling takes about a minute on CPU (a C++ build), so it is logged before and timed after.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from infer import request_rules as rules
from infer.artifact.kernels import Kernel
from infer.artifact.manifest import PT2_FILE, PT2_TABLES_IN_PACKAGE, PT2_TABLES_IN_WEIGHT_FILES, Pt2Entry
from infer.errors import ConfigError

logger = logging.getLogger(__name__)

# A mapped artifact's tables are not in the package: the loaders hand the program the mapped weight buffers as
# user-managed constants (pt2_program.weights_constant). An embedded artifact's tables are constants of the
# program. AOTInductor's default puts constants in the generated .so, which a loader maps and then copies into
# its own buffer: 2.35x the table bytes resident after load (bench/pt2.py). As a binary blob beside the .so,
# inside the same package, they are read once: 1.05x. AOTIModelPackageLoader (Python and C++) reads both.
INDUCTOR_CONFIGS = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
}
DENSE_PROGRAM = "dense"  # the package's second program, when the model has a dense part
# Exported dims: N ids, B examples (lengths has F*B entries). The bounds keep the derived F*B within int32.
MAX_IDS = 2**31 - 2
MAX_BATCH = 2**20


def program_device(model: torch.nn.Module) -> str:
    """The one device the program runs on: ``cpu`` or a single ``cuda:N``; several devices are refused."""
    devices = sorted({str(buffer.device) for buffer in model.buffers()} or {"cpu"})
    if len(devices) != 1:
        raise ConfigError(
            f"the model's kernels lie on devices {devices}; model.pt2 is one AOTInductor program for one device. "
            "Shard the model over CPU devices (or one GPU) for --pt2, or export without --pt2"
        )
    return devices[0]


def example_inputs(num_features: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A request to trace: batch 2, bags of 3 ids (0), sizes distinct from each other and from 0/1 (which
    export would specialize)."""
    batch, per_bag = 2, 3
    lengths = torch.full((num_features * batch,), per_bag, dtype=torch.int64, device=device)
    values = torch.zeros(num_features * batch * per_bag, dtype=torch.int64, device=device)
    return values, lengths, torch.ones(values.numel(), device=device)


def export_program(program: torch.nn.Module, num_features: int, device: str) -> torch.export.ExportedProgram:
    """``torch.export`` of a ``LookupProgram``: non-strict, N ids and B examples dynamic (lengths ``F*B``).

    Size-oblivious tracing keeps sizes 0 and 1 generic: without it export assumes B >= 2 and guards on it,
    while a batch of 1 (and a request of no ids) must run the same program."""
    import torch.fx.experimental._config as fx_config

    ids = torch.export.Dim("num_ids", min=0, max=MAX_IDS)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    dynamic = ({0: ids}, {0: num_features * batch}, {0: ids})
    try:
        with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            return torch.export.export(
                program, example_inputs(num_features, device), dynamic_shapes=dynamic, strict=False
            )
    except Exception as err:  # noqa: BLE001 - torch.export raises many error types
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"the model's lookups cannot be exported with torch.export: {first_line}") from None


def export_pt2(model: Any, folder: Path, kernels: Sequence[Kernel] | None = None) -> Pt2Entry:
    """Write ``folder/model.pt2`` for ``model`` (an ``EmbserveModel``, sharded or not) and describe it.

    ``kernels``: the artifact's kernels (in kernel order). Each one with a weight file (a mapped artifact's CPU
    kernel) is compiled without its tables: the lookup program's metadata (``WEIGHT_CONSTANTS_KEY``) names, per
    kernel, the constant that takes the kernel's mapped buffer at load, and the buffer's size."""
    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.artifact.formats.pt2_program import (
        BLOCK_REMAPS_KEY,
        WEIGHT_CONSTANTS_KEY,
        block_remaps_entry,
        lookup_program,
        weight_constants_entry,
    )

    load_fbgemm()  # the bounds-check and lookup operators, and their fake kernels
    device = program_device(model)
    started = time.monotonic()
    # the dense part first: one that cannot be exported is refused before the lookups are traced
    dense = export_dense(model, device) if getattr(model, "has_dense", False) else None
    program = lookup_program(model, kernels).eval()
    mapped = [k for k in kernels or () if k.weights is not None]
    if mapped and len(mapped) != len(kernels or ()):  # pragma: no cover - a one-device program: all or none mapped
        raise ConfigError("model.pt2 takes every kernel's weights from the weight files or none")
    # the package says itself which constants it lacks: a loader cannot run it without handing them over
    metadata = {WEIGHT_CONSTANTS_KEY: weight_constants_entry(mapped)} if mapped else {}
    if getattr(model.embeddings, "has_blocks", False):  # the remaps compiled in, for the loaders to check
        metadata[BLOCK_REMAPS_KEY] = block_remaps_entry(model.embeddings)
    exported = export_program(program, len(model.spec.features), device)
    logger.info("compiling %s with AOTInductor (about a minute)...", PT2_FILE)
    compile_started = time.monotonic()
    path = folder / PT2_FILE
    if dense is None:
        configs = {**INDUCTOR_CONFIGS, "aot_inductor.metadata": metadata}
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
    else:
        _compile_programs({"model": exported, DENSE_PROGRAM: dense}, path, {"model": metadata})
    logger.info(
        "compiled %s in %.1fs (export %.1fs)",
        PT2_FILE,
        time.monotonic() - compile_started,
        compile_started - started,
    )
    return Pt2Entry(
        file=PT2_FILE,
        torch_version=torch.__version__,
        device=device,
        dense_program=DENSE_PROGRAM if dense is not None else None,
        tables=PT2_TABLES_IN_WEIGHT_FILES if mapped else PT2_TABLES_IN_PACKAGE,
    )


class DenseProgram(torch.nn.Module):
    """The model's dense part alone: ``(dense_features, pooled) -> scores`` float32 ``[B]`` (``rules.scores_of``:
    a ``[B, 1]`` output squeezed, as every backend's ``predict``)."""

    def __init__(self, dense_arch: torch.nn.Module) -> None:
        super().__init__()
        self.dense_arch = dense_arch

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return rules.scores_of(self.dense_arch(dense_features, pooled), pooled.shape[0])


def traceable_dense_arch(dense_arch: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor]) -> torch.nn.Module:
    """``dense_arch`` as torch.export can trace it: a TorchScript module (``--dense-arch dense.pt``, or a
    ``torch.export`` file traced to TorchScript on load) is converted back to a graph module by torch's
    TorchScript converter (``torch._export.converter.TS2EPConverter``); any other module as it is."""
    dense_arch = copy.deepcopy(dense_arch).eval()  # served in eval mode; the model's own part stays as it is
    if not isinstance(dense_arch, torch.jit.ScriptModule):
        return dense_arch
    from torch._export.converter import TS2EPConverter

    with torch.no_grad():
        converted = TS2EPConverter(dense_arch, example).convert()
    logger.info("dense part: TorchScript converted for torch.export")
    module: torch.nn.Module = converted.module()
    return module


def export_dense(model: Any, device: str) -> torch.export.ExportedProgram:
    """``torch.export`` of the model's dense part with a dynamic batch; ``ConfigError`` when it cannot be traced
    (before anything is compiled): model.pt2 holds the dense part whenever the model has one, or is not written."""
    import torch.fx.experimental._config as fx_config

    spec = model.spec
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    example = (
        torch.zeros(2, spec.num_dense_features, device=device),
        torch.zeros(2, spec.output_dim, device=device),
    )
    try:
        dense_arch = traceable_dense_arch(model.dense_arch, example)
        with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            return torch.export.export(
                DenseProgram(dense_arch), example, dynamic_shapes=({0: batch}, {0: batch}), strict=False
            )
    except Exception as err:  # noqa: BLE001 - the converter and torch.export raise many error types
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"the dense part ({type(model.dense_arch).__name__}) cannot be exported with torch.export for "
            f"{PT2_FILE}: {first_line[:300]}. Make it traceable by torch.export (or give it as a torch.export "
            "program), or export without --pt2 (model.pt and model.onnx serve predict)"
        ) from None


def _compile_programs(
    programs: dict[str, torch.export.ExportedProgram], path: Path, metadata: dict[str, dict[str, str]]
) -> None:
    """Several programs in one AOTInductor package, each under its name (``load_package(path, name)``), each with
    its ``metadata`` (by name, default none)."""
    from torch._inductor.package import package_aoti

    files = {}
    for name, program in programs.items():
        args, kwargs = program.example_inputs
        options = {"aot_inductor.package": True, **INDUCTOR_CONFIGS, "aot_inductor.metadata": metadata.get(name, {})}
        files[name] = torch._inductor.aot_compile(program.module(), args, kwargs, options=options)
    package_aoti(str(path), files)  # type: ignore[arg-type]
