"""The GEMMs of one mixture-of-experts projection as ONE grouped GEMM on the device: FP8 per-tensor
products through ``torch._scaled_grouped_mm``, the high-precision experts through
``torch._grouped_mm``; :mod:`.experts` runs its per-expert loop wherever these do not apply.

The FP8 grouped GEMM is rowwise scaled: a per-tensor scale per expert becomes a scale vector, the
expert's descale repeated over its rows (the left operand's) or its weight's columns (the right
one's). What the products compute is the per-expert ``torch._scaled_mm`` loop of
:class:`~lightning_fp8state.quant_recipes.delayed.PerTensorFp8`, up to the accumulation order and
the order the two descales multiply in (the loop multiplies them first).

Whether a product runs grouped is a pure function of dtypes, shapes, device and backend
(:func:`fp8_grouped_problem`), never of tensor values: a true forward and its recompute choose
the same path, so the recompute stays bitwise. The device runs ``torch._scaled_grouped_mm`` only
with E4M3 x E4M3 operands, float32 scales, a bfloat16 output and every weight dimension a
multiple of 16: E5M2 gradients (the default ``backward_format``), another output dtype or another
recipe (rowwise, blockwise: their GEMMs are their own) keep the loop.

Three shapes of product (``y = x @ W^T``, ``dX = g @ W``, ``dW = g^T @ x``): the first two group
rows (2-D left operand, 3-D stacked weights, ``offs`` the experts' cumulative row ends); the
weight gradient groups its contraction (2-D x 2-D, one ``[out, in]`` product per expert). There
each group's start must be 16-byte aligned on the device, so every expert's rows are padded
with zero codes to a multiple of 16 (at least 16: an active expert with no local row gets an
exact zero gradient): zeros add nothing to a sum, so the result is the unpadded one.

No host sync: the offsets come from host ints (the routing's one copy made them) through one
pinned, non-blocking copy, and the scale vectors are built on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import ops
from ..formats import PER_TENSOR
from ..quant_recipes.delayed import PerTensorFp8

__all__ = [
    "GROUP_ALIGN",
    "MAX_GROUPS",
    "bf16_grouped_problem",
    "fp8_grouped_problem",
    "aligned_groups",
    "aligned_rows",
    "group_ends",
    "grouped_device",
    "grouped_expert_gemms",
    "grouped_expert_problem",
    "grouped_linear",
    "pad_groups",
    "padded_rows",
    "per_tensor_gemms",
    "unpad_groups",
]

# rows of one group of the weight gradient's operands: 16 FP8 bytes, the device's TMA alignment
GROUP_ALIGN = 16
# torch's grouped kernels take fewer than this many groups
MAX_GROUPS = 1024
# the capability whose grouped kernels run here without a host sync (other chips: torch's
# fallback reads the offsets on the host, or refuses)
_GROUPED_CAPABILITY = (9, 0)
_E4M3 = torch.float8_e4m3fn


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def grouped_device(device: torch.device, op: str = "_scaled_grouped_mm") -> bool:
    """Whether ``torch.<op>`` (``_scaled_grouped_mm`` or ``_grouped_mm``) runs its grouped kernel on
    ``device``: this torch has it and ``device`` is a CUDA device of compute capability 9.0."""
    if device.type != "cuda" or not hasattr(torch, op):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) == _GROUPED_CAPABILITY


def per_tensor_gemms(recipe) -> bool:
    """Whether ``recipe``'s three linear GEMMs are the per-tensor scaled products of
    :class:`~lightning_fp8state.quant_recipes.delayed.PerTensorFp8` (fp8_delayed, fp8_current):
    the products the FP8 grouped GEMM reproduces. A recipe with GEMMs of its own is not."""
    cls = type(recipe)
    return (
        recipe.quantized
        and isinstance(recipe, PerTensorFp8)
        and cls.linear_gemm is PerTensorFp8.linear_gemm
        and cls.grad_input is PerTensorFp8.grad_input
        and cls.grad_weight is PerTensorFp8.grad_weight
        and all(
            op.scales == PER_TENSOR
            for pair in (cls.gemm_layouts.forward, cls.gemm_layouts.grad_input, cls.gemm_layouts.grad_weight)
            for op in pair
        )
    )


def fp8_grouped_problem(
    left_dtype: torch.dtype,
    right_dtype: torch.dtype,
    out_dtype: torch.dtype,
    weight_dims: tuple[int, int],
    groups: int,
    rows: int,
    device: torch.device,
    backend: str,
) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run one projection's products (``None``: it can).

    ``weight_dims``: the weight's ``(out, in)``; ``groups``: the active experts; ``rows``: their
    rows together (the weight gradient pads its groups, so it passes any positive number). A pure
    function of its arguments: no tensor is read."""
    if backend != "auto":
        return f"gemm={backend!r}: the grouped GEMM runs under gemm='auto' only"
    if not grouped_device(device):
        return f"{device}: torch._scaled_grouped_mm runs on a CUDA device of capability {_GROUPED_CAPABILITY} only"
    if left_dtype != _E4M3 or right_dtype != _E4M3:
        return f"operands {left_dtype} x {right_dtype}: the grouped GEMM takes {_E4M3} x {_E4M3} only"
    if out_dtype != torch.bfloat16:
        return f"output {out_dtype}: the grouped GEMM writes torch.bfloat16 only"
    if any(d % 16 for d in weight_dims):
        return f"weight {tuple(weight_dims)}: the grouped GEMM needs both dimensions multiples of 16"
    if not 0 < groups < MAX_GROUPS:
        return f"{groups} experts: the grouped GEMM takes 1 to {MAX_GROUPS - 1} groups"
    if rows <= 0:
        return "no rows"
    return None


def bf16_grouped_problem(
    dtypes: tuple[torch.dtype, torch.dtype], weight_dims: tuple[int, int], device: torch.device
) -> str | None:
    """Why ``torch._grouped_mm`` cannot run the high-precision experts' products on ``device``
    (``None``: it can); ``dtypes``: the input's and the weight's compute dtypes (autocast's where
    it is on)."""
    if not grouped_device(device, "_grouped_mm"):
        return f"{device}: torch._grouped_mm runs its grouped kernel on a CUDA device of capability 9.0 only"
    if any(d != torch.bfloat16 for d in dtypes):
        return f"{list(dtypes)}: the grouped kernel takes torch.bfloat16 only"
    if any(d % 16 for d in weight_dims):
        return f"weight {tuple(weight_dims)}: the grouped GEMM needs both dimensions multiples of 16"
    return None


# -- offsets and scale vectors (host ints in, device tensors out, no sync) -----------------------


def padded_rows(rows: Sequence[int], align: int = GROUP_ALIGN) -> tuple[int, ...]:
    """Each count rounded up to a multiple of ``align``, at least ``align`` (the weight gradient's
    groups: 16-byte aligned starts, and no empty group whose output the kernel might not write)."""
    return tuple(max(align, n) for n in aligned_rows(rows, align))


def aligned_groups(device: torch.device) -> bool:
    """Whether the quantized experts pad each expert's rows to :data:`GROUP_ALIGN` on ``device``
    (:func:`pad_groups`): on any CUDA device (the kernels' 16-byte paths) and wherever the grouped
    kernels run; not on the CPU, where the module is bitwise the per-expert loop."""
    return device.type == "cuda" or grouped_device(device)


def aligned_rows(rows: Sequence[int], align: int = GROUP_ALIGN) -> tuple[int, ...]:
    """Each count rounded up to a multiple of ``align`` (zero stays zero): the experts' groups as
    :func:`pad_groups` lays them out."""
    return tuple(-(-n // align) * align for n in rows)


def _regroup(x: torch.Tensor, take: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> torch.Tensor:
    """Consecutive groups of ``src[e]`` rows of ``x`` as groups of ``dst[e]`` rows: the first
    ``take[e]`` rows of each kept, the rest of a ``dst`` group zero. One copy kernel (a cat)."""
    width = x.shape[1]
    extra = max((d - n for d, n in zip(dst, take, strict=True)), default=0)
    zeros = x.new_zeros((extra, width)) if extra else None
    pieces = []
    for x_e, n, d in zip(x.split(list(src)), take, dst, strict=True):
        if n:
            pieces.append(x_e[:n])
        if d > n:
            pieces.append(zeros[: d - n])
    return torch.cat(pieces) if pieces else x.new_empty((0, width))


class _Regroup(torch.autograd.Function):
    """:func:`_regroup` from ``src`` to ``dst`` groups; the gradient goes back the other way."""

    @staticmethod
    def forward(ctx, x, counts, src, dst):
        ctx.groups = (counts, src, dst)
        return _regroup(x, counts, src, dst)

    @staticmethod
    def backward(ctx, grad):
        counts, src, dst = ctx.groups
        return _regroup(grad.contiguous(), counts, dst, src), None, None, None


def pad_groups(x: torch.Tensor, counts: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    """``x [sum counts, D]`` (expert ``e``'s ``counts[e]`` rows in expert order) with each expert's
    group zero-padded to ``rows[e]`` rows (:func:`aligned_rows`); differentiable.

    On the device every expert's operands then have a multiple of 16 rows: the cast-transpose
    stores its transposed codes 16 bytes at a time, the weight gradient's contraction needs no
    padding copy, the FP8 operands' byte transposes take their tiled path. Zero rows change no
    amax, no code of another row and no sum, and their outputs are dropped (:func:`unpad_groups`),
    their gradients zero."""
    counts, rows = tuple(counts), tuple(rows)
    return x if counts == rows else _Regroup.apply(x, counts, counts, rows)


def unpad_groups(y: torch.Tensor, counts: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
    """The inverse of :func:`pad_groups`: each group's first ``counts[e]`` of its ``rows[e]`` rows."""
    counts, rows = tuple(counts), tuple(rows)
    return y if counts == rows else _Regroup.apply(y, counts, rows, counts)


def group_ends(rows: Sequence[int]) -> tuple[int, ...]:
    """The cumulative ends of consecutive groups of ``rows`` (``offs`` of the grouped GEMMs)."""
    ends, total = [], 0
    for n in rows:
        total += n
        ends.append(total)
    return tuple(ends)


def _device_offsets(ends: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ends`` as an int32 tensor on ``device``: on a GPU through pinned memory and a
    non-blocking copy (no host sync; the stream orders it before its readers)."""
    host = torch.tensor(ends, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _descales(snaps) -> torch.Tensor:
    """The per-tensor descales of ``snaps`` as one float32 vector ``[G]`` (one kernel)."""
    return torch.stack([s.descale.reshape(()) for s in snaps]).float()


def _row_scales(descales: torch.Tensor, offs: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]``: each row's group's descale (``offs``: the groups' ends), on the device."""
    rows = torch.arange(total, dtype=torch.int32, device=offs.device)
    return descales.index_select(0, torch.searchsorted(offs, rows, right=True))


def _repeated(descales: torch.Tensor, n: int) -> torch.Tensor:
    """``[G, n]`` contiguous: each group's descale over its ``n`` columns."""
    return descales.unsqueeze(1).expand(descales.shape[0], n).contiguous()


# -- FP8 operands ---------------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # FP8 tensors are concatenated as bytes: the same codes, through the plainest copy kernels
    return t.view(torch.uint8)


def _stacked_row_groups(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """``mats[e] [rows_e, k]`` one under the other: ``[sum rows, k]``, row-major."""
    if len(mats) == 1 and mats[0].is_contiguous():
        return mats[0]
    return torch.cat([_bytes(m) for m in mats]).view(mats[0].dtype)


def _col_major_stack(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """``mats[e] [k, n]`` (the right operands of ``a @ b``) as ``[G, k, n]``, column-major in its
    last two dimensions (what the grouped GEMM takes): a stack of the ``[n, k]`` transposes, which
    are views where a recipe kept them (a weight's codes, the cast-transpose's transposed codes),
    else made by the byte-transpose kernel."""
    transposed = []
    for m in mats:
        t = m.t()
        if not t.is_contiguous():
            t = ops.transpose_fp8(m) if m.is_contiguous() else t.contiguous()
        transposed.append(_bytes(t))
    return torch.stack(transposed).view(mats[0].dtype).transpose(1, 2)


def _grouped_rows(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], da, db) -> torch.Tensor:
    """``cat(a[e] @ b[e] * da[e] * db[e])`` over the experts as one grouped GEMM (2-D x 3-D):
    ``a[e] [rows_e, k]``, ``b[e] [k, n]``; bfloat16 ``[sum rows, n]``."""
    rows = [m.shape[0] for m in a]
    total = sum(rows)
    mat_a = _stacked_row_groups(a)
    mat_b = _col_major_stack(b)
    offs = _device_offsets(group_ends(rows), mat_a.device)
    scale_a = _row_scales(da, offs, total)
    scale_b = _repeated(db, mat_b.shape[2])
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def _grouped_contraction(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], da, db) -> torch.Tensor:
    """``stack(a[e] @ b[e] * da[e] * db[e])`` as one grouped GEMM over the contraction (2-D x 2-D):
    ``a[e] [n, rows_e]``, ``b[e] [rows_e, k]``, every group zero-padded to :func:`padded_rows`;
    bfloat16 ``[G, n, k]``."""
    rows = [m.shape[1] for m in a]
    padded = padded_rows(rows)
    n, k = a[0].shape[0], b[0].shape[1]
    device = a[0].device
    zeros = torch.zeros(GROUP_ALIGN * max(n, k), dtype=torch.uint8, device=device)
    left, right = [], []
    for a_e, b_e, r, p in zip(a, b, rows, padded, strict=True):
        left.append(_bytes(a_e))
        right.append(_bytes(b_e))
        if p > r:
            left.append(zeros[: n * (p - r)].view(n, p - r))
            right.append(zeros[: (p - r) * k].view(p - r, k))
    mat_a = torch.cat(left, dim=1).view(a[0].dtype)  # [n, sum padded], row-major
    mat_b = ops.transpose_fp8(torch.cat(right).view(b[0].dtype)).t()  # [sum padded, k], column-major
    offs = _device_offsets(group_ends(padded), device)
    scale_a = _repeated(da, n).reshape(-1)
    scale_b = _repeated(db, k).reshape(-1)
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def _operands(kind: str, left: list, right: list) -> tuple[list, list]:
    """The products' ``(a, b)`` (``a[e] @ b[e]``) from the operands PerTensorFp8's GEMMs take:
    the forward's weight is its codes (or the cast-transpose's ``(codes, transposed, None)``)."""
    if kind == "forward":
        return left, [(w[0] if type(w) is tuple else w).t() for w in right]
    return left, right


def grouped_expert_problem(kind: str, recipe, left: list, right: list, out_dtype, backend: str) -> str | None:
    """Why one projection's ``kind`` products (see :func:`~.experts.expert_gemms`) do not run as
    one FP8 grouped GEMM (``None``: they do). Reads dtypes and shapes only."""
    if not per_tensor_gemms(recipe):
        return f"recipe={recipe.name!r}: its GEMMs are not the per-tensor scaled products"
    if not left:
        return "no active expert"
    a, b = _operands(kind, left[:1], right[:1])
    a0, b0 = a[0], b[0]
    if kind == "grad_weight":
        weight_dims, rows = (a0.shape[0], b0.shape[1]), 1
    else:
        weight_dims, rows = (b0.shape[1], b0.shape[0]), sum(m.shape[0] for m in left)
        if kind == "grad_input":
            weight_dims = weight_dims[::-1]
    return fp8_grouped_problem(a0.dtype, b0.dtype, out_dtype, weight_dims, len(left), rows, a0.device, backend)


def grouped_expert_gemms(kind: str, recipe, left, right, left_snaps, right_snaps, out_dtype, backend):
    """One projection's ``kind`` products as one FP8 grouped GEMM, or ``None`` where
    :func:`grouped_expert_problem` says it cannot run (the caller's loop runs). Returns, for the
    forward and the input gradient, the products' rows one expert after another ``[sum rows, out]``;
    for the weight gradient, ``[G, out, in]``."""
    if grouped_expert_problem(kind, recipe, left, right, out_dtype, backend) is not None:
        return None
    a, b = _operands(kind, left, right)
    da, db = _descales(left_snaps), _descales(right_snaps)
    if kind == "grad_weight":
        return _grouped_contraction(a, b, da, db)
    return _grouped_rows(a, b, da, db)


# -- bfloat16 ----------------------------------------------------------------------------------------


class _GroupedLinear(torch.autograd.Function):
    """``y = cat(x_e @ weight[e]^T)`` over all experts (``rows[e]`` rows each, zero for an idle
    one) with ``torch._grouped_mm``: the forward and the input gradient group rows; the weight
    gradient groups the contraction, its operands zero-padded per expert (:func:`padded_rows`),
    an idle expert's gradient zero."""

    @staticmethod
    def forward(ctx, x, weight, rows):
        offs = _device_offsets(group_ends(rows), x.device)
        ctx.save_for_backward(x, weight, offs)
        ctx.rows = rows
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offs = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight, offs=offs)
        if ctx.needs_input_grad[1]:
            grad_w = _bf16_weight_gradient(grad, x, ctx.rows)
        return grad_x, grad_w, None


def _bf16_weight_gradient(grad: torch.Tensor, x: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """``stack(grad_e^T @ x_e)`` ``[E, out, in]``, the groups zero-padded as the FP8 weight
    gradient's (an idle expert's: 16 zero rows, an exact zero gradient)."""
    padded = padded_rows(rows)
    offs = _device_offsets(group_ends(padded), x.device)
    return torch._grouped_mm(_regroup(grad, rows, rows, padded).t(), _regroup(x, rows, rows, padded), offs=offs)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """The high-precision experts' projection in one ``torch._grouped_mm``: ``x [sum rows, in]``
    (expert ``e``'s ``rows[e]`` rows in expert order), ``weight [E, out, in]``; differentiable.
    Under autocast, computed in autocast's dtype as ``F.linear`` would be (the caller checked it
    is bfloat16 with :func:`bf16_grouped_problem`)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return _GroupedLinear.apply(x.to(dtype), weight.to(dtype), tuple(rows))
    return _GroupedLinear.apply(x, weight, tuple(rows))
