"""The dense part of TorchRec's DLRM family as one scriptable module ``(dense [B, n], pooled [B, F*D]) -> logits``.

TorchRec's ``DLRM.forward`` runs dense arch -> sparse arch -> interaction -> over arch; the sparse arch's
output ``[B, F, D]`` is the pooled embeddings in feature order, reshaped. Served, the pooled embeddings
come from embserve's lookup in the same order, so the dense part is the other three stages.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn


class LowRankCrossNetInteraction(nn.Module):
    """TorchRec's ``InteractionDCNArch`` over a ``LowRankCrossNet``, written so TorchScript compiles it
    (TorchRec's version indexes a ``ParameterList`` with a loop variable, which TorchScript rejects)."""

    def __init__(self, num_sparse_features: int, w_kernels: Tensor, v_kernels: Tensor, bias: Tensor) -> None:
        super().__init__()
        self.num_sparse_features = num_sparse_features
        self.num_layers = int(w_kernels.shape[0])
        # stacked per layer: W [L, N, r], V [L, r, N], bias [L, N]
        self.w_kernels = nn.Parameter(w_kernels.detach().clone(), requires_grad=False)
        self.v_kernels = nn.Parameter(v_kernels.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, dense_features: Tensor, sparse_features: Tensor) -> Tensor:
        if self.num_sparse_features <= 0:
            return dense_features
        batch = dense_features.size(0)
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1).reshape(batch, -1)
        x_0 = combined
        x_l = x_0
        for layer in range(self.num_layers):
            x_l_v = torch.nn.functional.linear(x_l, self.v_kernels[layer])
            x_l_w = torch.nn.functional.linear(x_l_v, self.w_kernels[layer])
            x_l = x_0 * (x_l_w + self.bias[layer]) + x_l
        return x_l


class DLRMDenseArch(nn.Module):
    """Dense arch + feature interaction + over arch of a TorchRec DLRM, fed with pooled embeddings."""

    def __init__(self, dense_arch: nn.Module, inter_arch: nn.Module, over_arch: nn.Module, num_sparse: int, dim: int):
        super().__init__()
        self.dense_arch = dense_arch
        self.inter_arch = inter_arch
        self.over_arch = over_arch
        self.num_sparse = num_sparse
        self.dim = dim

    def forward(self, dense_features: Tensor, pooled: Tensor) -> Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = pooled.reshape(-1, self.num_sparse, self.dim)
        concatenated = self.inter_arch(embedded_dense, embedded_sparse)
        return self.over_arch(concatenated)


def dlrm_dense_arch(dlrm: nn.Module) -> tuple[DLRMDenseArch, int, tuple[str, ...]]:
    """The scriptable dense part of ``dlrm`` (a ``torchrec.models.dlrm.DLRM``, ``DLRM_DCN`` or
    ``DLRM_Projection``), its number of dense input features, and the sparse feature order it expects."""
    from torchrec.models.dlrm import InteractionDCNArch
    from torchrec.modules.crossnet import LowRankCrossNet

    sparse_arch: Any = dlrm.sparse_arch
    dense_arch: nn.Module = copy.deepcopy(dlrm.get_submodule("dense_arch")).cpu().eval()
    over_arch: nn.Module = copy.deepcopy(dlrm.get_submodule("over_arch")).cpu().eval()
    inter: Any = dlrm.inter_arch
    if isinstance(inter, InteractionDCNArch) and isinstance(inter.crossnet, LowRankCrossNet):
        crossnet = inter.crossnet
        inter = LowRankCrossNetInteraction(
            int(inter.F),
            torch.stack([w.detach().cpu() for w in crossnet.W_kernels]),
            torch.stack([v.detach().cpu() for v in crossnet.V_kernels]),
            torch.stack([b.detach().cpu() for b in crossnet.bias]),
        )
    else:
        inter = copy.deepcopy(inter).cpu().eval()
    first_linear = next(m for m in dense_arch.modules() if isinstance(m, nn.Linear))
    for param in (*dense_arch.parameters(), *over_arch.parameters(), *inter.parameters()):
        param.requires_grad_(False)
    module = DLRMDenseArch(dense_arch, inter, over_arch, int(sparse_arch.F), int(sparse_arch.D)).eval()
    return module, int(first_linear.in_features), tuple(sparse_arch.sparse_feature_names)
