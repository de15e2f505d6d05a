"""Encoders: how a role's tensor becomes its low-precision data and its amax a record.

One encoder per role format, between ``state/`` (the bank the records land in) and the
protocol (which decides *which* snapshot a call uses and *whether* it records):

- :class:`Fp8Encoder`: FP8 codes (E4M3 / E5M2); a :class:`Prologue` (the LayerNorm, RMSNorm,
  GELU or SwiGLU that produces the tensor) is a stage of it, fused into the encode where a
  kernel takes it;
- :class:`Fp4Encoder`: packed E2M1 with block scales (NVFP4, MXFP4);
- :class:`CenteredFp4Encoder`: the same after subtracting a running per-channel center,
  whose statistics are recorded too.

Every encoder has two entry points: :meth:`encode` (records nothing: recompute, inference)
and :meth:`encode_record` (folds the amax into the owner's pending slot: the true forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .config import QuantConfig, require_that
from .formats import FP4_LAYOUTS, fp8_format
from .ops.library_fused import layer_norm_width_ok
from .ops.reference_rms import rms_norm_unfused, rms_norm_unfused_backward
from .ops.reference_swiglu import swiglu_f32
from .state import ATTENTION_ROLES, QuantSnapshot, StateBank, role_phase

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "CastTranspose",
    "CenteredFp4Encoder",
    "Fp4Encoder",
    "Fp8Encoder",
    "Prologue",
    "encoder_for",
    "norm_kind",
    "norm_operands",
    "prologue_width",
    "register_rms_norm",
    "rms_norm_types",
    "role_format",
    "run_unfused",
    "swiglu",
]

ACTIVATIONS = ("gelu", "swiglu")  # swiglu halves the width: h [..., 2I] = [gate, up] gives [..., I]
NORMS = ("layer_norm", "rms_norm")
_NORM_WEIGHT_DTYPES = {  # a norm weight the fused kernel takes (an RMSNorm's is given to it as float32)
    "layer_norm": (torch.float32,),
    "rms_norm": (torch.float32, torch.bfloat16, torch.float16),
}
# the RMSNorm modules linear_after fuses (register_rms_norm adds one)
_RMS_NORM_TYPES: list[type] = [nn.RMSNorm]


def role_format(config: QuantConfig, role: str) -> str:
    """The format of ``role``: an FP8 format name, or an FP4 layout for attention roles."""
    if role in ATTENTION_ROLES:
        return config.attn_format
    return config.backward_format if role_phase(role) == "backward" else config.forward_format


def register_rms_norm(cls: type) -> type:
    """Declare the module class ``cls`` an RMSNorm that ``linear_after`` may fuse into the next
    Fp8Linear (``nn.RMSNorm`` is one already): its ``weight`` (``[d]`` or None) and ``eps`` are
    read, and its forward must compute ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``
    (Hugging Face's LlamaRMSNorm), which the fused op reproduces up to ``rstd``'s last bits
    (:mod:`lightning_fp8state.ops.reference_rms`). Returns ``cls`` (usable as a decorator)."""
    require_that(isinstance(cls, type) and issubclass(cls, nn.Module), "cls", cls, "an nn.Module subclass")
    if cls not in _RMS_NORM_TYPES:
        _RMS_NORM_TYPES.append(cls)
    return cls


def rms_norm_types() -> tuple[type, ...]:
    """The RMSNorm module classes a fused ``rms_norm`` prologue takes."""
    return tuple(_RMS_NORM_TYPES)


def norm_kind(norm: nn.Module) -> str | None:
    """The prologue kind of a norm module: ``layer_norm`` (``nn.LayerNorm``), ``rms_norm``
    (:func:`rms_norm_types`; exact classes, not subclasses, whose forward may be another), else None."""
    if type(norm) is nn.LayerNorm:
        return "layer_norm"
    return "rms_norm" if type(norm) in _RMS_NORM_TYPES else None


def norm_operands(kind: str | None, norm: nn.Module | None) -> tuple:
    """``(weight, bias, eps)`` of a norm module of prologue ``kind`` (``(None, None, 0.0)``
    without one): an RMSNorm has no bias, and ``nn.RMSNorm(eps=None)`` adds float32's epsilon,
    as torch does for every input dtype it takes."""
    if norm is None:
        return None, None, 0.0
    if kind == "rms_norm":
        eps = norm.eps
        return norm.weight, None, float(torch.finfo(torch.float32).eps if eps is None else eps)
    return norm.weight, norm.bias, float(norm.eps)


def prologue_width(kind: str | None, width: int) -> int:
    """The width of a prologue's output for an input of ``width``: half for ``swiglu``."""
    return width // 2 if kind == "swiglu" else width


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``h = [gate, up]`` (its last dim's halves): torch's ops in
    ``h``'s dtype, with autograd, the unfused SwiGLU (what a Llama MLP computes). The fused op's
    numerics are :mod:`lightning_fp8state.ops.reference_swiglu` (float32, one rounding)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def run_unfused(kind: str, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
    """Prologue ``kind`` on ``x`` as the model runs it without fusion, with autograd: the norm
    module itself, ``F.gelu`` or :func:`swiglu`."""
    if kind in NORMS:
        return norm(x)
    return F.gelu(x) if kind == "gelu" else swiglu(x)


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.float32 else t.to(torch.float32)


class Prologue:
    """One call's prologue, the op that produces an FP8 role's tensor, run as the first stage of
    its encode: ``layer_norm`` or ``rms_norm`` (a module's weight, bias and eps), ``gelu``, or
    ``swiglu`` (``h [..., 2I]`` to ``silu(gate) * up [..., I]``).

    ``stats`` holds the norm's statistics after :meth:`encode` or :meth:`apply` ran (the
    LayerNorm's ``(mean, rstd)``, the RMSNorm's ``(rstd,)``; the caller saves them for
    :meth:`backward`); ``fused`` says which ran last: the fused kernel (our numerics, whose
    backward is ``ops.layer_norm_backward`` / ``ops.rms_norm_backward``) or torch's reductions
    (torch's LayerNorm and its backward; :func:`~.ops.reference_rms.rms_norm_unfused`).
    """

    __slots__ = ("bias", "eps", "fused", "kind", "stats", "weight")

    def __init__(self, kind: str, weight=None, bias=None, eps: float = 0.0) -> None:
        self.kind, self.weight, self.bias, self.eps = kind, weight, bias, eps
        self.stats: tuple[torch.Tensor, ...] | None = None
        self.fused = False

    @classmethod
    def layer_norm(cls, norm: nn.LayerNorm) -> Prologue:
        return cls.for_norm("layer_norm", norm)

    @classmethod
    def rms_norm(cls, norm: nn.Module) -> Prologue:
        return cls.for_norm("rms_norm", norm)

    @classmethod
    def for_norm(cls, kind: str, norm: nn.Module) -> Prologue:
        """The prologue of norm module ``norm`` of ``kind`` (one of ``NORMS``)."""
        return cls(kind, *norm_operands(kind, norm))

    def fusable(self, x: torch.Tensor) -> bool:
        """Whether a fused kernel takes ``x`` (else the stage runs on its own, then the encode)."""
        if self.kind in ACTIVATIONS:
            return True
        w, b = self.weight, self.bias
        affine_ok = (w is None or w.dtype in _NORM_WEIGHT_DTYPES[self.kind]) and (b is None or b.dtype == torch.float32)
        return affine_ok and layer_norm_width_ok(x.dtype, x.shape[-1])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The prologue's output as a tensor (no autograd): for paths without a fused kernel. The
        SwiGLU's is the fused op's float32 product (quantizing it gives the fused op's codes)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._apply(x)
        return self._apply(x)

    def torch_norm_operands(self, x: torch.Tensor):
        """``(x, weight, bias)`` in one dtype for torch's LayerNorm, which takes no mix: a
        bf16 activation beside a float32 affine (FSDP2 units at ``param_dtype`` float32 fed a
        bf16 stream) runs in float32, as autocast runs ``layer_norm``. The fused kernel takes
        the mix as it is."""
        dtype = x.dtype
        for p in (self.weight, self.bias):
            if p is not None:
                dtype = torch.promote_types(dtype, p.dtype)
        return tuple(t if t is None or t.dtype == dtype else t.to(dtype) for t in (x, self.weight, self.bias))

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "gelu":
            return F.gelu(x)
        if self.kind == "swiglu":
            return swiglu_f32(x)
        if self.kind == "rms_norm":
            y, rstd = rms_norm_unfused(x, self.weight, self.eps)
            self.stats, self.fused = (rstd,), False
            return y
        xc, w, b = self.torch_norm_operands(x)
        y, mean, rstd = torch.ops.aten.native_layer_norm(xc, [x.shape[-1]], w, b, self.eps)
        self.stats, self.fused = (mean, rstd), False
        return y

    def encode(self, x: torch.Tensor, scale, dtype, amax_pending=None, slot: int = 0, saturation=None) -> torch.Tensor:
        """FP8 codes of the prologue's output (recording its amax into ``amax_pending[slot]``
        when given, and its clips into ``saturation[:, slot]`` when given too): fused where a
        kernel takes the shape, else applied, then quantized.
        Without autograd (the linear call's Function runs with gradients off already: then no
        context is entered)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._encode(x, scale, dtype, amax_pending, slot, saturation)
        return self._encode(x, scale, dtype, amax_pending, slot, saturation)

    def _encode(self, x: torch.Tensor, scale, dtype, amax_pending, slot: int, sat) -> torch.Tensor:
        if not self.fusable(x):
            y = self.apply(x)
            if amax_pending is None:
                return ops.quantize_fp8(y, scale, dtype)
            return ops.quantize_fp8_record_amax(y, scale, amax_pending, slot, dtype, sat)
        if self.kind == "gelu":
            return ops.gelu_quantize_fp8(x, scale, dtype, amax_pending, slot, sat)
        if self.kind == "swiglu":
            return ops.swiglu_quantize_fp8(x, scale, dtype, amax_pending, slot, sat)
        if self.kind == "rms_norm":
            w = _float32(self.weight)
            q, rstd = ops.rms_norm_quantize_fp8(x, w, self.eps, scale, dtype, amax_pending, slot, sat)
            self.stats, self.fused = (rstd,), True
            return q
        q, mean, rstd = ops.layer_norm_quantize_fp8(
            x, self.weight, self.bias, self.eps, scale, dtype, amax_pending, slot, sat
        )
        self.stats, self.fused = (mean, rstd), True
        return q

    def backward(self, grad_y: torch.Tensor, x: torch.Tensor, stats: tuple, needs: tuple[bool, bool, bool]):
        """Gradients of ``(x, weight, bias)`` from the gradient of the prologue's output
        (``stats``: the norm's saved statistics; empty for an activation), each in its operand's
        dtype. The backward of the norm that ran: ours after the fused kernel (one pass,
        deterministic), torch's after torch's LayerNorm (the unfused RMSNorm's formulas after
        :func:`~.ops.reference_rms.rms_norm_unfused`)."""
        if self.kind == "gelu":
            return torch.ops.aten.gelu_backward(grad_y, x), None, None
        if self.kind == "swiglu":
            return ops.swiglu_backward(grad_y, x), None, None
        if self.kind == "rms_norm":
            return self._rms_norm_backward(grad_y, x, stats, needs)
        mean, rstd = stats
        if self.fused:
            return ops.layer_norm_backward(grad_y, x, mean, rstd, self.weight, needs)
        xc, w, b = self.torch_norm_operands(x)
        grads = torch.ops.aten.native_layer_norm_backward(
            grad_y.to(xc.dtype), xc, [x.shape[-1]], mean, rstd, w, b, list(needs)
        )
        # each gradient in its operand's own dtype
        return tuple(
            g if g is None or g.dtype == t.dtype else g.to(t.dtype)
            for g, t in zip(grads, (x, self.weight, self.bias), strict=True)
        )

    def _rms_norm_backward(self, grad_y: torch.Tensor, x: torch.Tensor, stats: tuple, needs: tuple):
        (rstd,) = stats
        w = self.weight
        mask = (needs[0], needs[1] and w is not None)
        if self.fused:
            dx, dw = ops.rms_norm_backward(grad_y, x, rstd, _float32(w), mask)
        else:
            dx, dw = rms_norm_unfused_backward(grad_y, x, rstd, w, mask)
        return dx, dw if dw is None or dw.dtype == w.dtype else dw.to(w.dtype), None


class Fp8Encoder:
    """FP8 codes of one format; a :class:`Prologue` is its first stage."""

    layout: str | None = None
    centered = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = fp8_format(name).dtype

    def source(self, x: torch.Tensor, prologue: Prologue | None) -> torch.Tensor:
        """The tensor whose amax the owner's scale covers (the prologue's output, if any),
        materialized: for the first event's calibration only."""
        return x if prologue is None else prologue.apply(x)

    def encode(self, x: torch.Tensor, snap: QuantSnapshot, prologue: Prologue | None = None):
        """Encode with ``snap``, recording nothing."""
        if prologue is not None:
            return prologue.encode(x, snap.scale, self.dtype)
        return ops.quantize_fp8(x, snap.scale, self.dtype)

    def encode_record(
        self, x: torch.Tensor, snap: QuantSnapshot, bank: StateBank, index: int, prologue: Prologue | None = None
    ):
        """Encode with ``snap``, fold the amax into owner ``index``'s pending slot and count
        its clipped elements into ``bank.saturation`` (in the kernel: no host work)."""
        if prologue is not None:
            return prologue.encode(x, snap.scale, self.dtype, bank.amax_pending, index, bank.saturation)
        return ops.quantize_fp8_record_amax(x, snap.scale, bank.amax_pending, index, self.dtype, bank.saturation)


class CastTranspose:
    """The backward's stage for grad_output: with its FP8 codes, the codes transposed (the
    weight-gradient GEMM's operand, which cuBLASLt takes only row-major) and, with
    ``column_sum``, the float32 column sums of the tensor (the bias gradient), all from one
    read of it (``ops.quantize_fp8_t_record_amax``). The encode's data is the triple
    ``(codes, codes_t, sums or None)``.

    Only the recording encode exists: a backward role runs once per event, never in a
    recompute or in inference.
    """

    __slots__ = ("column_sum",)
    kind = "cast_transpose"

    def __init__(self, column_sum: bool) -> None:
        self.column_sum = column_sum

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """What the owner's scale covers: the tensor itself."""
        return x

    def encode(self, x: torch.Tensor, scale, dtype, amax_pending=None, slot: int = 0, saturation=None):
        require_that(
            amax_pending is not None,
            "CastTranspose.encode(amax_pending)",
            None,
            "a tensor: the grad_output stage encodes only with a record (a backward role is quantized once "
            "per event, in its backward)",
        )
        if torch.is_grad_enabled():  # (a backward runs with gradients off: no context to enter)
            with torch.no_grad():
                q, q_t, sums = ops.quantize_fp8_t_record_amax(
                    x, scale, amax_pending, slot, dtype, self.column_sum, saturation
                )
        else:
            q, q_t, sums = ops.quantize_fp8_t_record_amax(
                x, scale, amax_pending, slot, dtype, self.column_sum, saturation
            )
        return q, q_t, (sums if self.column_sum else None)


class Fp4Encoder:
    """Packed E2M1 with block scales (``layout``: ``nvfp4`` | ``mxfp4``); returns
    ``(packed uint8, block_scales)``. A prologue runs on its own before the encode."""

    centered = False
    dtype = torch.uint8

    def __init__(self, layout: str) -> None:
        self.name = self.layout = layout

    source = Fp8Encoder.source

    def encode(self, x: torch.Tensor, snap: QuantSnapshot, prologue: Prologue | None = None):
        x = self.source(x, prologue)
        return ops.quantize_fp4(x, snap.scale, self.layout, snap.center)

    def encode_record(
        self, x: torch.Tensor, snap: QuantSnapshot, bank: StateBank, index: int, prologue: Prologue | None = None
    ):
        x = self.source(x, prologue)
        return ops.quantize_fp4_record_amax(x, snap.scale, bank.amax_pending, index, self.layout)


class CenteredFp4Encoder(Fp4Encoder):
    """:class:`Fp4Encoder` on ``x - center`` (the snapshot's frozen running center); the true
    forward also records the per-channel statistics the center advances from."""

    centered = True

    def encode_record(
        self, x: torch.Tensor, snap: QuantSnapshot, bank: StateBank, index: int, prologue: Prologue | None = None
    ):
        x = self.source(x, prologue)
        return ops.quantize_fp4_centered_record(
            x, snap.scale, snap.center, bank.amax_pending, bank.center_max, bank.center_min, index, self.layout
        )


def encoder_for(config: QuantConfig, role: str) -> Fp8Encoder | Fp4Encoder:
    """The encoder of ``role`` under ``config``."""
    name = role_format(config, role)
    if name not in FP4_LAYOUTS:
        return Fp8Encoder(name)
    if role in ATTENTION_ROLES and config.attn_centered:
        return CenteredFp4Encoder(name)
    return Fp4Encoder(name)
