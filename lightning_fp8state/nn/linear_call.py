"""One quantized linear call: its forward and backward bodies, run by the eager autograd
Function of :class:`~lightning_fp8state.nn.Fp8Linear` (nn/linear.py), and torch.compile's path,
which runs the same bodies as two opaque ops.

The protocol's bookkeeping (ownership, snapshot choice, the ledger, stamps) is host Python with
side effects, which dynamo cannot trace. Instead of a graph break at every linear, the compiled
graph calls two ops whose kernels run that Python at run time, the eager path's own bodies
(``_linear_forward`` / ``_linear_backward`` below):

- ``fp8state::fp8_linear``: enter the call (true forward or recompute, found at run time as
  eagerly), quantize input and weight, the GEMM. Its outputs are ``y`` and what the backward
  reads: the codes and a norm prologue's statistics (the LayerNorm's mean and rstd, the
  RMSNorm's rstd in the rstd slot). The call's host-side state (its
  record and snapshots) the protocol keeps under the address of the input codes until the
  backward takes it or the event ends (a freed address reused by a later call is that call's);
- ``fp8state::fp8_linear_backward``: takes that state by its codes' address and runs the
  backward. Both are wrapped in one autograd Function that dynamo traces.

The module is named by a key (``_op_key``: its index in a registry, in a CPU tensor, an input
of the graph, so the blocks of a model share one compiled graph). Grad mode is read at trace time and passed in (``training``): inside a compiled forward, autograd runs
with gradients off, so the call could not tell a training forward outside an event from an
evaluation one.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..encoders import NORMS, Prologue, norm_operands, prologue_width, role_format
from ..formats import fp8_format
from ..ops import transpose_fp8
from ..ops.library import LIB, define_from, register_fake_from
from ..protocol import QuantProtocol, release_weight_codes, take_kept
from ..recompute import Phase
from ..sac import outside_selective_checkpoint

__all__ = ["LINEAR_ROLES", "fp8_linear_op", "module_of", "op_key"]

LINEAR_ROLES = ("input", "weight", "grad_output")
# index -> module: torch.compile's op names its module by index (op_key)
_MODULES: list[weakref.ref] = []


def _register_module(module: nn.Module) -> int:
    _MODULES.append(weakref.ref(module))
    return len(_MODULES) - 1


def module_of(index: int) -> nn.Module:
    """The module registered as ``index`` (raises if it was garbage-collected)."""
    module = _MODULES[index]() if 0 <= index < len(_MODULES) else None
    if module is None:
        raise RuntimeError(f"fp8state::fp8_linear names module {index}, which no longer exists")
    return module


class _Call(NamedTuple):
    """What a call's backward needs besides its saved tensors (host-side, per call)."""

    protocol: QuantProtocol
    record: object  # the CallRecord
    snaps: tuple  # (input, weight) snapshots the forward's GEMM consumed
    prologue: Prologue | None
    backend: str
    x_dtype: torch.dtype
    x_shape: torch.Size
    w_dtype: torch.dtype
    bias_dtype: torch.dtype | None


def _linear_forward(x, weight, bias, protocol: QuantProtocol, record, phase: Phase, out_dtype, backend, prologue):
    """The quantized call: ``(y, saved tensors, _Call)``. ``saved`` is what the recipe keeps of
    input and weight (``(xq, wq)``: their codes, for per-tensor recipes), and with a prologue
    also its input and its statistics (as the unfused op would keep them). The GEMMs are the
    recipe's (:mod:`lightning_fp8state.quant_recipes`): the layer's, where the fallback moved it."""
    recipe = protocol.recipe_of(record.layer)
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = protocol.quantize(record, "input", x2, phase, prologue)
    gathered = getattr(weight, "fp8", None)  # an FSDP2 FP8 all-gather's codes (nn/fsdp.py)
    if gathered is not None:
        wq, sw = protocol.adopt(record, "weight", gathered, weight.snapshot, phase)
    else:
        stage = None if phase is Phase.INFERENCE else recipe.weight_stage(weight)
        wq, sw = protocol.quantize(record, "weight", weight, phase, stage)
    if phase is not Phase.INFERENCE:
        protocol.check_consumer(record, "input", sx)
        protocol.check_consumer(record, "weight", sw)
    y = recipe.linear_gemm(
        xq, wq, sx, sw, out_dtype, backend, _gemm_bias(recipe, bias, out_dtype, backend, record, phase)
    )
    x_saved, w_saved = recipe.saved_for_backward(xq, wq, x2, weight)
    saved = (x_saved, w_saved) if prologue is None else (x_saved, w_saved, x2, *(prologue.stats or ()))
    if prologue is not None:
        prologue.stats = None  # handed to the caller's save, not held twice
    bias_dtype = None if bias is None else bias.dtype
    call = _Call(protocol, record, (sx, sw), prologue, backend, x.dtype, x.shape, weight.dtype, bias_dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1]), saved, call


def _gemm_bias(recipe, bias, out_dtype, backend: str, record, phase: Phase):
    """The bias in the GEMM epilogue's dtype (the output's, when 16-bit), converted once per
    event: the recompute reuses the true forward's copy (one launch and allocation less a call).
    The conversion is unseen by SAC, which needs the recompute to issue the forward's ops."""
    if bias is None or bias.dtype == out_dtype or out_dtype not in (torch.bfloat16, torch.float16):
        return bias
    if not recipe.bias_in_epilogue(bias.device, backend):  # the GEMM adds it in float32
        return bias
    if phase is Phase.INFERENCE:
        return bias.to(out_dtype)
    held = record.derived.get("bias")
    if held is None or held[0] is not bias or held[1].dtype != out_dtype:
        held = record.derived["bias"] = (bias, outside_selective_checkpoint(bias.to, out_dtype))
    return held[1]


def _linear_backward(grad_out, saved, call: _Call, needs) -> tuple:
    """Gradients of ``(x, weight, bias, norm weight, norm bias)``; ``None`` where not needed."""
    x_saved, w_saved, *prologue_saved = saved
    sx, sw = call.snaps
    protocol, record, prologue = call.protocol, call.record, call.prologue
    release_weight_codes(record)  # no recompute of this call follows its backward in the event
    recipe = protocol.recipe_of(record.layer)  # (a move happens between events: the forward's recipe)
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    if not g2.is_contiguous():
        g2 = g2.contiguous()
    want_bias = call.bias_dtype is not None and needs[2]
    # grad_output's operands of both GEMMs (per-tensor recipes: its codes and their transpose,
    # from one read of it) and the bias gradient
    (gq, g_w, g_sums), sg = protocol.quantize(
        record, "grad_output", g2, Phase.FORWARD, recipe.grad_output_stage(want_bias)
    )
    protocol.check_consumer(record, "input", sx)
    protocol.check_consumer(record, "weight", sw)
    protocol.check_consumer(record, "grad_output", sg)
    grad_x = grad_w = grad_b = grad_nw = grad_nb = None
    # The weight gradient first: its operands (gq^T, and the transpose of xq made inside)
    # are freed before the input gradient (float32 where x is) and the prologue's backward
    # allocate theirs, so the two sets never coexist.
    if needs[1]:
        grad_w = recipe.grad_weight(g_w, x_saved, sg, sx, call.w_dtype, call.backend)
    del g_w
    if want_bias:
        grad_b = g_sums.to(call.bias_dtype)
    if needs[0] or needs[3] or needs[4]:
        grad_x = recipe.grad_input(gq, w_saved, sg, sw, call.x_dtype, call.backend)
        del gq
        if prologue is not None:
            x2, *stats = prologue_saved
            x2 = x2.reshape(-1, x2.shape[-1])
            grad_x, grad_nw, grad_nb = prologue.backward(grad_x, x2, tuple(stats), (needs[0], needs[3], needs[4]))
        grad_x = grad_x.reshape(call.x_shape) if grad_x is not None and needs[0] else None
    return grad_x, grad_w, grad_b, grad_nw if needs[3] else None, grad_nb if needs[4] else None


# ``instance``: an empty tensor made for each call in the graph. A call has effects beyond its
# outputs (an owner observed, an amax recorded, state kept for its backward), so two calls of a
# layer on the same input are two calls; AOTAutograd's common-subexpression elimination would
# merge them (it spares only random ops and ``aten.empty``, whatever the op's tags), and the
# distinct ``instance`` of each keeps them apart.
# Both ops run host Python (the protocol) on every call, which a replay of Inductor's own CUDA
# graphs (mode="reduce-overhead") would skip: the tag keeps them out of those graphs. (Our
# GraphedStep captures them on purpose: it replays the protocol's bookkeeping on the host.)
_HOST_CALL = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def op_key(module) -> torch.Tensor:
    """The key that names ``module`` to the ops: its registry index in a CPU int64 tensor. A
    tensor, not an int: dynamo would make an int attribute a constant of the graph, and every
    block (the same code, another module) would compile a graph of its own."""
    return torch.tensor([_register_module(module)], dtype=torch.int64)


def fp8_linear_op(module, x, weight, bias, norm, prologue: str | None) -> torch.Tensor:
    """``module(x)`` (an Fp8Linear, or Fp8Conv1D with its weight view) as the op, traced by dynamo;
    ``norm``: the norm module of a ``layer_norm`` / ``rms_norm`` prologue, else None."""
    nw, nb, eps = norm_operands(prologue, norm)
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    protocol = module.protocol
    config = protocol.config  # the codes' formats: pure functions of the config (no cache to guard on)
    input_dtype, weight_dtype = (fp8_format(role_format(config, role)).dtype for role in ("input", "weight"))
    training = torch.is_grad_enabled()
    # whether the op hands its backward the weight's transposed codes ([in, out]; Recipe.weight_stage)
    weight_t = training and protocol.recipe.weight_stage(weight) is not None
    return _CompiledFp8LinearFn.apply(
        x.contiguous(), weight, bias, nw, nb, module._op_key, prologue or "", eps, out_dtype,
        input_dtype, weight_dtype, training, protocol.recipe.saves_inputs, weight_t,
    )  # fmt: skip


def _autocast_off(device: str, fn, *args):
    """The op's kernels run as the eager Function does: outside autocast (where it is on; see
    nn.linear.autocast_off, the same switch)."""
    torch.set_autocast_enabled(device, False)
    try:
        return fn(*args)
    finally:
        torch.set_autocast_enabled(device, True)


def _codes_key(xq: torch.Tensor) -> int:
    """The address a call's state is kept under: its input codes' (unique among live tensors)."""
    return xq.data_ptr() if xq.numel() else xq.untyped_storage().data_ptr()


def _input_key(x: torch.Tensor) -> torch.Tensor:
    """(A recipe that saves its high-precision input: ``Recipe.saves_inputs``) the op's stand-in
    for the input codes, ``[0, K]`` in x's dtype: it carries K to the backward's shapes, and the
    call's state is kept under its storage."""
    return x.new_empty((0, x.shape[-1]))


def _stats_empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,), dtype=torch.float32)


def _fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    module: Tensor,
    prologue: str,
    eps: float,
    out_dtype: torch.dtype,
    input_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    training: bool,
    instance: Tensor,
    saves_inputs: bool = False,
    weight_t: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward op's kernel (every device); its signature is the op's schema (define_from)."""
    mod = module_of(module.item())  # a CPU tensor: no device sync
    protocol = mod.protocol
    stage = None
    if prologue:
        stage = Prologue(prologue, norm_weight, norm_bias, eps) if prologue in NORMS else Prologue(prologue)
    phase, record = protocol.enter_call(mod.layer_name, LINEAR_ROLES, x.device, grad_enabled=training)
    args = (x, weight, bias, protocol, record, phase, out_dtype, protocol.config.gemm, stage)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        y, saved, call = _autocast_off(device, _linear_forward, *args)
    else:
        y, saved, call = _linear_forward(*args)
    protocol.observe_output(record, phase, y, record.used)
    xq, wq, *rest = saved  # rest: the prologue's input, then the norm's (mean, rstd) or (rstd,)
    stats = rest[1:]
    mean = stats[0] if len(stats) == 2 else _stats_empty(x)
    rstd = stats[-1] if stats else _stats_empty(x)
    if saves_inputs:  # saved: x (reshaped) and the weight themselves, which the Function saves
        xq, wq = _input_key(x), weight.new_empty((0, weight.shape[-1]))
    elif weight_t:  # the fake's layout: the transposed codes, [in, out] contiguous
        wq = wq.t() if wq.t().is_contiguous() and not wq.is_contiguous() else transpose_fp8(wq)
    if training and phase is not Phase.INFERENCE:  # the backward finds it by its codes' address
        if xq.numel() == 0:  # empty codes have no address: give them a storage of their own
            xq = xq.new_empty(1).as_strided(xq.shape, xq.stride())
        protocol.keep_for_backward(_codes_key(xq), call)
    return y, xq, wq, mean, rstd


define_from("fp8_linear", _fp8_linear, tags=_HOST_CALL)
torch.library.impl(LIB, "fp8_linear", "CompositeExplicitAutograd")(_fp8_linear)


@register_fake_from("fp8_linear", _fp8_linear)
def _fp8_linear_fake(a):
    x, weight, eps, prologue = a.x, a.weight, a.eps, a.prologue
    n = weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    k = prologue_width(prologue, x.shape[-1])  # the codes' width: the prologue's output's
    if a.saves_inputs:
        xq, wq = _input_key(x), weight.new_empty((0, k))
    else:
        xq = x2.new_empty((x2.shape[0], k), dtype=a.input_dtype)
        wq = weight.new_empty((k, n) if a.weight_t else (n, k), dtype=a.weight_dtype)
    if prologue == "rms_norm":  # its rstd, from the kernel or from torch's reductions alike
        mean, rstd = _stats_empty(x), x2.new_empty((x2.shape[0], 1), dtype=torch.float32)
    elif prologue == "layer_norm":
        norm = Prologue(prologue, a.norm_weight, a.norm_bias, eps)
        if norm.fusable(x2):  # the fused kernel's statistics
            mean = x2.new_empty((x2.shape[0], 1), dtype=torch.float32)
            rstd = torch.empty_like(mean)
        else:  # torch's LayerNorm ran, on the operands the real call gives it
            xc, w, b = norm.torch_norm_operands(x2)
            _, mean, rstd = torch.ops.aten.native_layer_norm(xc, [x.shape[-1]], w, b, eps)
    else:
        mean, rstd = _stats_empty(x), _stats_empty(x)
    y = x.new_empty((*x.shape[:-1], n), dtype=a.out_dtype)
    return y, xq, wq, mean, rstd


def _fp8_linear_backward(
    grad: Tensor,
    xq: Tensor,
    wq: Tensor,
    x: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor | None,
    needs: list[bool],
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    bias_dtype: torch.dtype | None,
    norm_dtype: torch.dtype | None,
    weight_t: bool = False,
):
    """The backward op's kernel: gradients of ``(x, weight, bias, norm weight, norm bias)``."""
    call = take_kept(_codes_key(xq))
    if weight_t:  # the transposed codes: the [out, in] view the eager call saves
        wq = wq.t()
    saved = (xq, wq)
    if call.protocol.recipe.saves_inputs:  # xq is the key, wq the weight, x the call's input
        saved = (x.reshape(-1, x.shape[-1]), wq)
    if call.prologue is not None:
        kind = call.prologue.kind
        saved = (
            (xq, wq, x, mean, rstd)
            if kind == "layer_norm"
            else (xq, wq, x, rstd)
            if kind == "rms_norm"
            else (xq, wq, x)
        )
    device = grad.device.type
    if torch.is_autocast_enabled(device):
        return _autocast_off(device, _linear_backward, grad, saved, call, needs)
    return _linear_backward(grad, saved, call, needs)


_GRADIENTS = "(" + ", ".join(["Tensor?"] * 5) + ")"  # optional: only those asked for
define_from("fp8_linear_backward", _fp8_linear_backward, returns=_GRADIENTS, tags=_HOST_CALL)
torch.library.impl(LIB, "fp8_linear_backward", "CompositeExplicitAutograd")(_fp8_linear_backward)


@register_fake_from("fp8_linear_backward", _fp8_linear_backward)
def _fp8_linear_backward_fake(a):
    grad, needs, norm_dtype = a.grad, a.needs, a.norm_dtype
    k, n = a.xq.shape[-1], grad.shape[-1]
    column = (k,)
    width = k if a.x is None else a.x.shape[-1]  # the input's: a SwiGLU's is twice the codes'
    return (
        grad.new_empty((*grad.shape[:-1], width), dtype=a.x_dtype) if needs[0] else None,
        grad.new_empty((n, k), dtype=a.w_dtype) if needs[1] else None,
        grad.new_empty((n,), dtype=a.bias_dtype) if needs[2] and a.bias_dtype is not None else None,
        grad.new_empty(column, dtype=norm_dtype) if needs[3] else None,
        grad.new_empty(column, dtype=norm_dtype) if needs[4] else None,
    )


class _CompiledFp8LinearFn(torch.autograd.Function):
    """The two ops as one differentiable call, traced by dynamo (its forward and backward are
    graphs of their own): no autograd kernel on the op, so the compiled forward calls it
    without torch's Python autograd wrapper in between."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, norm_weight, norm_bias, key, prologue, eps, out_dtype, in_dt, w_dt, training,
        saves_inputs, weight_t,
    ):  # fmt: skip
        instance = torch.empty(0, device=x.device)  # distinct per call: see the op's definition
        y, xq, wq, mean, rstd = torch.ops.fp8state.fp8_linear(
            x, weight, bias, norm_weight, norm_bias, key, prologue, eps, out_dtype, in_dt, w_dt, training, instance,
            saves_inputs, weight_t,
        )  # fmt: skip
        ctx.weight_t = weight_t
        if saves_inputs:  # what the eager Function saves: the input and the weight (no prologue: run before)
            ctx.save_for_backward(xq, weight, x, None, None)
        else:  # the codes; with a prologue its input (and a norm's statistics)
            ln, norm = prologue == "layer_norm", prologue in NORMS
            ctx.save_for_backward(xq, wq, x if prologue else None, mean if ln else None, rstd if norm else None)
        norm = norm_weight if norm_weight is not None else norm_bias
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype, None if norm is None else norm.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        xq, wq, x, mean, rstd = ctx.saved_tensors
        x_dtype, w_dtype, bias_dtype, norm_dtype = ctx.dtypes
        needs = list(ctx.needs_input_grad[:5])
        grads = torch.ops.fp8state.fp8_linear_backward(
            grad_y, xq, wq, x, mean, rstd, needs, x_dtype, w_dtype, bias_dtype, norm_dtype, ctx.weight_t
        )
        return (*grads, None, None, None, None, None, None, None, None, None)
