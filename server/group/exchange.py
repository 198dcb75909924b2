"""Moving only owned ids and pooled columns between the hosts of a group (torch.distributed all-to-all).

Wire format of a sub-request (``routing.SubRequest``) to one host, one uint8 buffer: ids as int32 (int64 when a
table has more than 2**31 - 1 rows), then lengths as int32, then weights as float32 (each aligned for its
view); the receiver knows the batch, whether weights come and its features from the step's header and the
routing, so the buffer's size gives the number of ids. Back come the columns the host computes
(``HostNeeds.columns``), float32 ``[batch, columns]``.

Both exchanges are one ``all_to_all_single`` with uneven splits (gloo on the CPU, NCCL on CUDA: both have it on
torch 2.13; gloo's list ``all_to_all`` copies through the same path). Counters keep the bytes this rank sent
and received, for ``bench/multihost.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from server.group.routing import GroupRouting, SubRequest

_LENGTH_BYTES = 4
_WEIGHT_BYTES = 4
_OUTPUT_BYTES = 4


class Exchange:
    """One rank's side of the ids and outputs all-to-alls; ``device``: where collectives run."""

    def __init__(self, routing: GroupRouting, rank: int, device: str = "cpu", group: Any = None) -> None:
        self.routing = routing
        self.group = group  # None: the default group; else a ProcessGroup or a gloo backend (``members``)
        self.rank = rank
        self.device = device
        self.id_dtype = torch.int32 if routing.ids_int32 else torch.int64
        self.id_bytes = 4 if routing.ids_int32 else 8
        self.columns = [torch.tensor(n.columns, dtype=torch.int64, device=device) for n in routing.hosts]
        self.bytes_sent = 0
        self.bytes_received = 0

    # ----------------------------------------------------------------- wire format
    def pack(self, sub: SubRequest) -> torch.Tensor:
        pieces = [sub.values.to(self.id_dtype), sub.lengths.to(torch.int32)]
        if sub.weights is not None:
            pieces.append(sub.weights.to(torch.float32))
        return torch.cat([p.contiguous().view(torch.uint8) for p in pieces]).to(self.device)

    def unpack(self, data: torch.Tensor, batch: int, weighted: bool, slot: int | None = None) -> SubRequest:
        """The sub-request of plan host ``slot`` (default this rank) from its buffer."""
        if data.storage_offset() % 8:
            data = data.clone()  # dtype views need aligned offsets
        slot = self.rank if slot is None else slot
        length_bytes = len(self.routing.needs(slot).features) * batch * _LENGTH_BYTES
        num_ids = (data.numel() - length_bytes) // (self.id_bytes + (_WEIGHT_BYTES if weighted else 0))
        ids_end = num_ids * self.id_bytes
        values = data[:ids_end].view(self.id_dtype)
        lengths = data[ids_end : ids_end + length_bytes].view(torch.int32)
        weights = data[ids_end + length_bytes :].view(torch.float32) if weighted else None
        return SubRequest(values, lengths, weights)

    def output_bytes(self, host: int, batch: int) -> int:
        return batch * len(self.routing.needs(host).columns) * _OUTPUT_BYTES

    # ----------------------------------------------------------------- collectives
    def all_to_all(self, send: list[torch.Tensor], receive_sizes: list[int]) -> list[torch.Tensor]:
        """Send ``send[h]`` (uint8) to every rank h and receive ``receive_sizes[h]`` bytes from each."""
        send_sizes = [int(t.numel()) for t in send]
        # every rank calls it, even with nothing to move: collectives pair up by order alone
        inputs = torch.cat([t.to(self.device) for t in send])
        output = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=self.device)
        if self.group is None:
            dist.all_to_all_single(output, inputs, receive_sizes, send_sizes)
        else:  # a re-formed group is a gloo backend of its own, outside torch.distributed's registry
            self.group.alltoall_base(output, inputs, receive_sizes, send_sizes).wait()
        self.bytes_sent += sum(s for h, s in enumerate(send_sizes) if h != self.rank)
        self.bytes_received += sum(s for h, s in enumerate(receive_sizes) if h != self.rank)
        return list(output.split(receive_sizes))

    def add_columns(self, out: torch.Tensor, host: int, data: torch.Tensor) -> None:
        """Add host ``host``'s columns (``data``, as it sent them) into the full output ``out``."""
        batch = out.shape[0]
        if data.numel() == 0:
            return
        piece = data.view(torch.float32).view(batch, -1).to(out.device)
        out.index_add_(1, self.columns[host].to(out.device), piece)

    def own_columns(self, partial: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """The columns of plan host ``slot`` (default this rank) of its partial output, as bytes to send."""
        columns = self.columns[self.rank if slot is None else slot]
        return partial.index_select(1, columns.to(partial.device)).reshape(-1).view(torch.uint8)
