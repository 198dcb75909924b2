"""Compile an exported model's lookups to ``model.pt2``: ``torch.export`` (non-strict, dynamic ids and batch),
then AOTInductor's ``aoti_compile_and_package``. The program is ``pt2_program.LookupProgram``; the package's
default model name ("model") is what the Python and C++ loaders run.

Compiling takes about a minute on CPU (a C++ build), so it is logged before and timed after.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from infer.artifact.manifest import PT2_FILE, Pt2Entry
from infer.errors import ConfigError

logger = logging.getLogger(__name__)

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


def export_pt2(model: Any, folder: Path) -> Pt2Entry:
    """Write ``folder/model.pt2`` for ``model`` (an ``EmbserveModel``, sharded or not) and describe it."""
    from infer.artifact.fbgemm_libs import load_fbgemm
    from infer.artifact.pt2_program import lookup_program

    load_fbgemm()  # the bounds-check and lookup operators, and their fake kernels
    device = program_device(model)
    program = lookup_program(model).eval()
    started = time.monotonic()
    exported = export_program(program, len(model.spec.features), device)
    logger.info("compiling %s with AOTInductor (about a minute)...", PT2_FILE)
    compile_started = time.monotonic()
    torch._inductor.aoti_compile_and_package(exported, package_path=str(folder / PT2_FILE))
    logger.info(
        "compiled %s in %.1fs (export %.1fs)",
        PT2_FILE,
        time.monotonic() - compile_started,
        compile_started - started,
    )
    return Pt2Entry(file=PT2_FILE, torch_version=torch.__version__, device=device)
