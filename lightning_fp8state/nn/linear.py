"""Fp8Linear: nn.Linear whose input, weight and grad_output are FP8 owners, quantized as the
protocol's recipe says (:mod:`lightning_fp8state.quant_recipes`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import require_choice, require_type
from ..encoders import ACTIVATIONS, NORMS, Prologue, rms_norm_types, run_unfused
from ..protocol import QuantProtocol
from .linear_call import LINEAR_ROLES, _linear_backward, _linear_forward, fp8_linear_op, op_key

__all__ = ["Fp8Linear", "LINEAR_ROLES"]

_PROLOGUES = (None, *NORMS, *ACTIVATIONS)  # what Fp8Linear.forward's prologue= takes


class _Fp8LinearFn(torch.autograd.Function):
    """The eager path: the protocol's bookkeeping runs in the call itself. The tensors are
    arguments of their own (autograd tracks them); everything else travels as one tuple, ``call``:
    ``(protocol, record, phase, out_dtype, backend, prologue)`` (each argument of a Function costs
    the host a little on every call, forward and backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, norm_weight, norm_bias, call):
        protocol, record, phase, out_dtype, backend, prologue = call
        y, saved, ctx.call = _linear_forward(x, weight, bias, protocol, record, phase, out_dtype, backend, prologue)
        ctx.save_for_backward(*saved)
        return _not_a_view(y)

    @staticmethod
    def backward(ctx, grad_out):
        # Outside autocast, as the forward: a backward() called inside an autocast region runs
        # under it (the engine carries the caller's autocast state), and autocast would turn the
        # GEMMs that are not _scaled_mm (the float32 emulation) into bfloat16 ones
        device = grad_out.device.type
        if torch.is_autocast_enabled(device):
            grads = autocast_off(device, _linear_backward, grad_out, ctx.saved_tensors, ctx.call, ctx.needs_input_grad)
        else:
            grads = _linear_backward(grad_out, ctx.saved_tensors, ctx.call, ctx.needs_input_grad)
        return (*grads, None)


def _not_a_view(y: torch.Tensor) -> torch.Tensor:
    """``y`` (the GEMM's 2-D result reshaped to the input's leading dims: a view of it) as a
    tensor of its own, sharing the storage: a custom Function's view output may not be modified
    in place (``nn.ReLU(inplace=True)``, ``out += residual``), which ``nn.Linear`` allows."""
    return y.detach() if y._is_view() else y


def apply_linear_fn(args: tuple, x: torch.Tensor, gemm: str, prologue) -> torch.Tensor:
    """Run the eager Function on ``args`` = ``(x, weight, bias, norm weight, norm bias, protocol,
    record, phase)``: under autocast, outside it with the output in autocast's dtype (the
    Function's kernels choose their own precision); else in ``x``'s dtype. The one entry of
    Fp8Linear, Fp8Conv1D and the attention projections."""
    x, weight, bias, nw, nb, protocol, record, phase = args
    device = x.device.type
    if torch.is_autocast_enabled(device):
        call = (protocol, record, phase, torch.get_autocast_dtype(device), gemm, prologue)
        return autocast_off(device, _Fp8LinearFn.apply, x, weight, bias, nw, nb, call)
    return _Fp8LinearFn.apply(x, weight, bias, nw, nb, (protocol, record, phase, x.dtype, gemm, prologue))


def autocast_off(device: str, fn, *args):
    """``fn(*args)`` with autocast off on ``device``, where it is on: for the ops inside, what
    ``torch.autocast(device, enabled=False)`` does (the enclosing autocast's dtype and cache
    settings stay as they are, and its cache is not cleared: the enclosing autocast is still
    open), without that context manager's Python (several microseconds, twice a linear call
    in a bf16-mixed step)."""
    torch.set_autocast_enabled(device, False)
    try:
        return fn(*args)
    finally:
        torch.set_autocast_enabled(device, True)


class Fp8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` driven by a :class:`QuantProtocol`.

    Input and weight are E4M3 (forward roles), grad_output E5M2 (backward role), each an
    owner of its own delayed state. Under the ``bf16`` recipe it runs plain ``F.linear``
    and holds no quantizer state, but still reports its calls to the audit.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        protocol: QuantProtocol,
        layer_name: str,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.protocol = getattr(protocol, "protocol", protocol)  # an Fp8State's protocol
        self.layer_name = layer_name
        if self.protocol.fallback is not None:  # QuantConfig.fallback may move it: _forward runs its route
            self.protocol.fallback.movable.add(layer_name)
        self._op_key = op_key(self)  # names it to torch.compile's op (nn/linear_call.py)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, protocol: QuantProtocol, layer_name: str) -> Fp8Linear:
        """Wrap an existing ``nn.Linear``, sharing its parameters (optimizers keep working)."""
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            protocol=protocol,
            layer_name=layer_name,
            device="meta",
        )
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer={self.layer_name!r}, recipe={self.protocol.config.recipe}"

    def forward(self, x: torch.Tensor, *, prologue: str | None = None, norm: nn.Module | None = None) -> torch.Tensor:
        """``self(x)``; with ``prologue="layer_norm"`` or ``"rms_norm"`` (and ``norm``, an
        ``nn.LayerNorm`` or an RMSNorm), ``prologue="gelu"`` or ``prologue="swiglu"`` (``x`` is then
        ``[gate, up]``, twice ``in_features`` wide), ``self(norm(x))``, ``self(gelu(x))`` or
        ``self(silu(gate) * up)`` with that op fused into the input's quantize
        (:func:`~lightning_fp8state.nn.linear_after` is the caller's entry point)."""
        # Under torch.compile the whole call is one opaque op that runs the protocol at run time
        # (nn/linear_call.py): the graph around it does not break. Eagerly the call goes straight in.
        if torch.compiler.is_compiling():
            return self._forward_compiled(x, prologue, norm)
        return self._forward(x, prologue, norm)

    def _forward(self, x: torch.Tensor, prologue: str | None, norm: nn.Module | None) -> torch.Tensor:
        protocol = self.protocol
        config = protocol.config
        # a layer the fallback moved (QuantConfig.fallback) runs its target's recipe: bf16 or fp8_current
        recipe = protocol.recipe_of(self.layer_name) if protocol.layer_recipes else protocol.recipe
        quantized = recipe.quantized
        fused = None if prologue is None and norm is None else self._prologue(prologue, norm)
        if fused is not None and not (quantized and config.fuse_prologues and recipe.fuses_prologues):
            x = run_unfused(fused.kind, x, norm)  # the same op, unfused
            fused = None
        phase, record = protocol.enter_call(self.layer_name, LINEAR_ROLES if quantized else (), x.device)
        if not quantized:
            out = F.linear(x, self.weight, self.bias)
            protocol.observe_output(record, phase, out, {})
            return out
        if not x.is_contiguous():
            x = x.contiguous()
        # (the prologue holds norm's parameters, read once)
        nw, nb = (fused.weight, fused.bias) if fused is not None and fused.kind in NORMS else (None, None)
        args = (x, self.weight, self.bias, nw, nb, protocol, record, phase)
        out = apply_linear_fn(args, x, config.gemm, fused)
        protocol.observe_output(record, phase, out, record.used)
        return out

    # what the compiled path does not express as its op (no quantization, a recipe whose call is not
    # the op, FSDP2 FP8 all-gathers):
    # a graph break, the call run eagerly
    _forward_outside_graph = torch.compiler.disable(_forward)

    def _forward_compiled(self, x: torch.Tensor, prologue: str | None, norm: nn.Module | None) -> torch.Tensor:
        protocol = self.protocol
        config = protocol.config
        kind = self._prologue_kind(prologue, norm)
        # (reads no per-module value but the key tensor: the blocks of a model share one graph)
        if not (protocol.recipe.quantized and protocol.recipe.compiled_op) or protocol.gathered_layers:
            return self._forward_outside_graph(x, prologue, norm)
        if protocol.fallen_back and self.layer_name in protocol.fallen_back:  # moved: a graph of its own
            return self._forward_outside_graph(x, prologue, norm)
        if kind is not None and not (config.fuse_prologues and protocol.recipe.fuses_prologues):
            x = run_unfused(kind, x, norm)  # the same op, unfused (as _forward does)
            kind = None
        return fp8_linear_op(self, x, self.weight, self.bias, norm if kind in NORMS else None, kind)

    @classmethod
    def _prologue(cls, prologue: str | None, norm: nn.Module | None) -> Prologue | None:
        kind = cls._prologue_kind(prologue, norm)
        if kind is None:
            return None
        return Prologue.for_norm(kind, norm) if kind in NORMS else Prologue(kind)

    @staticmethod
    def _prologue_kind(prologue: str | None, norm: nn.Module | None) -> str | None:
        """``prologue`` checked against ``norm``."""
        if prologue is None:
            if norm is not None:  # (checked only then: this is every plain call's path)
                require_type(
                    "norm", norm, type(None), 'None: Fp8Linear takes norm with prologue="layer_norm" or "rms_norm" only'
                )
            return None
        if prologue == "layer_norm":
            require_type("norm", norm, nn.LayerNorm, "an nn.LayerNorm", why='Fp8Linear with prologue="layer_norm"')
            return prologue
        if prologue == "rms_norm":
            require_type(
                "norm",
                norm,
                rms_norm_types(),
                "an nn.RMSNorm (or a register_rms_norm class)",
                why='prologue="rms_norm"',
            )
            return prologue
        require_choice("prologue", prologue, _PROLOGUES)
        return prologue
