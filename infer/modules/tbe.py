"""The fbgemm TBE as embserve uses it: building one inference TBE, its bag offsets, and id-range checks.

fbgemm is imported on first use only, so importing this module stays light.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from infer.artifact.fbgemm_libs import load_fbgemm
from infer.config import DataType
from infer.request_rules import id_range_error


def _tbe_classes():  # type: ignore[no-untyped-def]
    load_fbgemm()
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen,
    )

    return IntNBitTableBatchedEmbeddingBagsCodegen, SparseType, EmbeddingLocation, PoolingMode, BoundsCheckMode


def bag_offsets(lengths: Tensor, values: Tensor) -> Tensor:
    """The kernel's offsets for ``lengths``: ``[0, cumsum(lengths)]`` in the ids' dtype and device."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=values.dtype, device=values.device)
    offsets[1:] = torch.cumsum(lengths, 0).to(values.dtype)
    return offsets


def first_id_error(values: Tensor, bounds: List[int], rows: List[int], names: List[str]) -> Optional[str]:
    """Range-check feature by feature (feature i's ids are ``values[bounds[i]:bounds[i + 1]]``): the first
    violation's message, or None."""
    for i in range(len(rows)):
        error = id_range_error(values[bounds[i] : bounds[i + 1]], rows[i], names[i])
        if error is not None:
            return error
    return None


def make_tbe(
    tables: List[Tuple[str, int, int, DataType]],
    feature_table_map: List[int],
    device: torch.device,
    row_alignment: Optional[int] = None,
    allocate: bool = True,
) -> nn.Module:
    """One inference TBE over ``tables`` (name, rows, dim, data type): SUM pooling, fp32 output,
    FATAL bounds checks (WARNING/IGNORE would rewrite the caller's ids in place). Weights allocated, unless
    ``allocate=False``: then every size and offset is set as allocating sets it, but the weight buffer stays
    empty (a streaming export writes the rows to files and scripts this structure only). Its callers that build
    for a GPU refuse first a type fbgemm's CUDA kernel gets wrong there (``infer.modules.cuda_probe``)."""
    TBE, SparseType, EmbeddingLocation, PoolingMode, BoundsCheckMode = _tbe_classes()
    location = EmbeddingLocation.HOST if device.type == "cpu" else EmbeddingLocation.DEVICE
    tbe = TBE(
        embedding_specs=[(name, rows, dim, SparseType(dtype.value), location) for name, rows, dim, dtype in tables],
        feature_table_map=feature_table_map,
        pooling_mode=PoolingMode.SUM,
        device=device,
        bounds_check_mode=BoundsCheckMode.FATAL,
        output_dtype=SparseType.FP32,
        row_alignment=row_alignment,
    )
    if allocate:
        tbe.initialize_weights()
    else:
        tbe.weight_initialized = True
        tbe.initialize_logical_weights_placements_and_offsets()
    return tbe


def plain_kernel(tbe: nn.Module) -> bool:
    """A built fbgemm TBE with no pruning (index remapping) and no cache: its forward is the lookup op alone."""
    try:
        return (
            tbe.index_remappings_array.numel() == 0  # type: ignore[operator]
            and tbe.index_remapping_hash_table.numel() == 0  # type: ignore[operator]
            and tbe.index_remapping_hash_table_cpu is None
            and tbe.lxu_cache_weights.numel() == 0  # type: ignore[operator]
        )
    except AttributeError:  # a structure-only stand-in (the routing checks build one with no kernel)
        return False


# A range of fewer ids than this stays on the calling thread: a fork costs more than it saves.
MIN_IDS_PER_CHUNK = 4096


class KernelRunner:
    """Runs a module's TBE (``self.tbe``) over its kernel input, split into contiguous example ranges that
    run in parallel on CPU: ``threads`` ranges at most, none smaller than ``min_ids_per_chunk`` ids.

    One fbgemm TBE call uses one core; the same TBE called from several threads on disjoint example
    ranges reads the same weights, so the batch spreads over the cores with no copy of the tables. Each
    range produces exactly the rows the single call would (every bag is pooled by one call either way),
    so the output is bit-identical whatever the split. ``threads`` is set by the loader (the host's
    thread budget); 1 keeps the single call.
    """

    tbe: nn.Module
    threads: int
    kernel_features: int
    range_features: int
    kernel_device: str
    min_ids_per_chunk: int
    direct_kernel: bool

    def init_kernel_runner(self, kernel_features: int, device: str, range_features: int = -1) -> None:
        """Called by the module's ``__init__`` once ``self.tbe`` is set (not part of the scripted model).
        ``range_features``: the features of what ``run_kernel`` is given (default the kernel's), when ``pool``
        makes the kernel's input from each range."""
        self.threads = 1
        self.kernel_features = kernel_features
        self.range_features = range_features if range_features > 0 else kernel_features
        self.kernel_device = device
        self.min_ids_per_chunk = MIN_IDS_PER_CHUNK
        self.direct_kernel = plain_kernel(self.tbe)

    def kernel(self, values: Tensor, offsets: Tensor, weights: Optional[Tensor]) -> Tensor:
        """The TBE's pooled rows of one kernel input.

        On a kernel without pruning or a cache (every kernel embserve builds), fbgemm's lookup op is called on the
        TBE's own buffers as its forward calls it, less the forward's steps that do nothing there (moves to the
        device, the pruning and cache checks, the cache's bookkeeping) and its bounds check, which every entry has
        done already (``lookup`` validates, ``lookup_unchecked`` is for validated requests). On CPU the TorchScript
        interpreter, which costs more than the kernel at batch 1, walks a dozen nodes instead of fbgemm's forward
        (bench/server.py's batch-1 cases); on a GPU the bounds check was a kernel of its own (9 % of the device's
        time in bench/lookup_cuda.py's profile). The output is the forward's, bit for bit (the same op on the same
        arguments). Other kernels go through the forward.
        """
        if not self.direct_kernel:
            return self.tbe(values, offsets, weights)
        tbe = self.tbe
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=tbe.weights_host if tbe.host_size > 0 else tbe.weights_dev,  # type: ignore[operator]
            uvm_weights=tbe.weights_uvm,
            weights_placements=tbe.weights_placements,
            weights_offsets=tbe.weights_offsets,
            weights_tys=tbe.weights_tys,
            D_offsets=tbe.D_offsets,
            total_D=tbe.total_D,
            max_int2_D=tbe.max_int2_D,
            max_int4_D=tbe.max_int4_D,
            max_int8_D=tbe.max_int8_D,
            max_float16_D=tbe.max_float16_D,
            max_float32_D=tbe.max_float32_D,
            indices=values,
            offsets=offsets,
            pooling_mode=int(tbe.pooling_mode),  # type: ignore[arg-type]
            indice_weights=weights,
            output_dtype=tbe.output_dtype,
            lxu_cache_weights=tbe.lxu_cache_weights,
            lxu_cache_locations=torch.empty(0, dtype=torch.int32, device=values.device),
            row_alignment=tbe.row_alignment,
            max_float8_D=tbe.max_float8_D,
            fp8_exponent_bits=tbe.fp8_exponent_bits,
            fp8_exponent_bias=tbe.fp8_exponent_bias,
        )

    def pool(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor]) -> Tensor:
        """One range's pooled output: the kernel over it (a module whose kernel input differs makes it here)."""
        return self.kernel(values, bag_offsets(lengths, values), weights)

    def chunks_for(self, batch: int, num_ids: int) -> int:
        if self.threads <= 1 or self.kernel_device != "cpu":
            return 1
        return max(1, min(self.threads, batch, num_ids // self.min_ids_per_chunk))

    def run_kernel(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor]) -> Tensor:
        """The TBE's pooled output for a kernel input (ids, bag lengths, weights in the kernel's feature order)."""
        num_features = self.range_features
        batch = lengths.numel() // num_features if num_features > 0 else 0
        chunks = self.chunks_for(batch, values.numel())
        if chunks <= 1:
            local_weights: Optional[Tensor] = None
            if weights is not None:
                local_weights = weights.to(self.kernel_device)
            # contiguous: a module's pool may answer a view (precision blocks add in place)
            return self.pool(values.to(self.kernel_device), lengths.to(self.kernel_device), local_weights).contiguous()
        offsets = bag_offsets(lengths, values)
        futures: List[torch.jit.Future[Tensor]] = []
        for k in range(chunks - 1):
            first = k * batch // chunks
            last = (k + 1) * batch // chunks
            futures.append(torch.jit.fork(self.run_chunk, values, lengths, weights, offsets, batch, first, last))
        # the calling thread runs the last range itself instead of idling
        tail = self.run_chunk(values, lengths, weights, offsets, batch, (chunks - 1) * batch // chunks, batch)
        pooled: List[Tensor] = [torch.jit.wait(future) for future in futures]
        pooled.append(tail)
        return torch.cat(pooled, 0)

    def run_chunk(
        self,
        values: Tensor,
        lengths: Tensor,
        weights: Optional[Tensor],
        offsets: Tensor,
        batch: int,
        first: int,
        last: int,
    ) -> Tensor:
        """Examples ``first .. last`` of every feature, gathered into their own kernel input and pooled."""
        features = self.range_features
        bag_starts = torch.arange(features, dtype=torch.int64) * batch
        starts: List[int] = offsets[bag_starts + first].to(torch.int64).tolist()
        ends: List[int] = offsets[bag_starts + last].to(torch.int64).tolist()
        chunk_values = torch.cat([values[starts[f] : ends[f]] for f in range(features)])
        chunk_lengths = torch.cat([lengths[f * batch + first : f * batch + last] for f in range(features)])
        chunk_weights: Optional[Tensor] = None
        if weights is not None:
            chunk_weights = torch.cat([weights[starts[f] : ends[f]] for f in range(features)])
        return self.pool(chunk_values, chunk_lengths, chunk_weights)
