r"""A linear layer on sparse CSR features whose backward transposes them in linear time.

Bag-of-words node features (Cora, CiteSeer) are about 1% nonzeros, and a layer's first
projection :math:`y = x W^\top + b` takes them as a sparse CSR matrix ``x [N, F]``. The weight's
gradient is

.. math::
    \frac{\partial L}{\partial W} = \Big(x^\top \frac{\partial L}{\partial y}\Big)^\top,

a product with the transpose of x. torch's ``F.linear`` gets :math:`x^\top` by sorting x's
entries by column at every backward (``to_sparse_csr`` of the CSC view). Here a counting sort
builds it in one pass over the entries (the ``cpu`` backend's
:func:`~graphattn.functional.cpu.csr_transpose`), and the product with :math:`x^\top` is the
same CSR-times-dense product as the forward's: a GAT training step on Cora or CiteSeer takes
0.71-0.85 of the time it takes through ``F.linear``, a GraphTransformer step 0.87-0.94
(``benchmarks/sparse_features.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from graphattn.functional._transforms import apply_function, plain_ops_only
from graphattn.functional.cpu import csr_transpose


class _CSRLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` for a CSR ``x`` given by its parts; gradients for weight and
    bias only (x is data)."""

    @staticmethod
    def forward(crow: Tensor, col: Tensor, values: Tensor, num_cols: int, weight: Tensor,
                bias: Tensor | None) -> Tensor:
        x = torch.sparse_csr_tensor(crow, col, values, (crow.numel() - 1, num_cols),
                                    check_invariants=False)
        out = x @ weight.t()  # (N, D)
        return out if bias is None else out + bias

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        crow, col, values, num_cols, _, bias = inputs
        ctx.save_for_backward(crow, col, values)
        ctx.num_cols, ctx.has_bias = num_cols, bias is not None

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        crow, col, values = ctx.saved_tensors
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[4]:
            colptr, position, row = csr_transpose(crow, col, ctx.num_cols)
            values_t = torch.empty_like(values).index_put_((position,), values)  # x^T's
            x_t = torch.sparse_csr_tensor(colptr, row, values_t, (ctx.num_cols, crow.numel() - 1),
                                          check_invariants=False)
            # in x's dtype, as the forward's product, also when backward is called inside
            # torch.autocast (which would cast it to half precision, which has no CSR product)
            with torch.autocast("cpu", enabled=False):
                grad_weight = (x_t @ grad.to(values.dtype)).t().contiguous()  # (D, F)
        if ctx.has_bias and ctx.needs_input_grad[5]:
            grad_bias = grad.sum(0)  # (D,)
        return None, None, None, None, grad_weight, grad_bias


@torch.compiler.disable  # dynamo takes no sparse tensor: eager, behind a graph break
def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    r"""``F.linear(x, weight, bias)``, :math:`x W^\top + b`, with a faster backward for a
    sparse CSR ``x`` on CPU.

    For a CSR x on CPU that does not require grad (features are data), outside
    ``torch.func``'s transforms, the weight's gradient
    :math:`(x^\top \, \partial L / \partial y)^\top` takes x's transpose from a counting sort
    of its entries, in one pass, where ``F.linear`` sorts them (see the module docstring).
    A CSR or CSC x in fp16 or bf16 on CPU, for which torch has no product, is multiplied in
    fp32 and the result rounded to its dtype; so is a sparse x on CPU under
    ``torch.autocast``, whose result comes in autocast's dtype, as a dense x's would (a CSC x
    as CSR there, so that a backward called inside autocast also finds a product).
    Everything else, and every other layout, goes to ``F.linear``. Both compute the same
    values: the sums of each product run over the same entries, in the same order.
    ``torch.compile`` does not trace sparse tensors: in a compiled model this function runs
    eagerly, between graphs (``fullgraph=True`` fails on sparse features either way).

    Args:
        x (Tensor): features ``[N, F]``, dense or sparse.
        weight (Tensor): ``[D, F]``.
        bias (Tensor, optional): ``[D]``. (default: ``None``)

    Shapes:
        - **input:** x ``(N, F)``, weight ``(D, F)``, bias ``(D)``
        - **output:** ``(N, D)``
    """
    cpu = x.device.type == "cpu"
    if (x.layout != torch.strided and cpu and torch.is_autocast_enabled("cpu")
            and x.dtype != torch.float64):
        # autocast would multiply in its dtype, where torch has no CSR or CSC product on CPU:
        # the product in x's dtype (or fp32), the result in autocast's, as F.linear's
        if x.layout == torch.sparse_csc and x.dim() == 2 and not x.requires_grad:
            # as CSR, whose weight gradient is computed with autocast off (F.linear's, called
            # inside autocast, would be cast to half precision, which has no CSC product)
            x = x.to_sparse_csr()
        with torch.autocast("cpu", enabled=False):
            wide = torch.promote_types(x.dtype, torch.float32)
            out = sparse_linear(x if x.dtype == wide else x.to(wide), weight.to(wide),
                                None if bias is None else bias.to(wide))
        return out.to(torch.get_autocast_dtype("cpu"))
    if (x.layout in (torch.sparse_csr, torch.sparse_csc) and cpu and x.dim() == 2
            and x.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype
            and not x.requires_grad):
        # torch's CSR and CSC products have no half-precision kernel on CPU: in fp32
        csr = x.layout == torch.sparse_csr
        build = torch.sparse_csr_tensor if csr else torch.sparse_csc_tensor
        wide = build(*((x.crow_indices(), x.col_indices()) if csr
                       else (x.ccol_indices(), x.row_indices())), x.values().float(), x.shape,
                     check_invariants=False)
        return sparse_linear(wide, weight.float(),
                             None if bias is None else bias.float()).to(x.dtype)
    if (x.layout != torch.sparse_csr or not cpu or x.dim() != 2
            or x.requires_grad or x.dtype != weight.dtype or plain_ops_only(weight, bias)):
        return F.linear(x, weight, bias)
    return apply_function(_CSRLinear, x.crow_indices(), x.col_indices(), x.values(), x.size(1),
                          weight, bias)
