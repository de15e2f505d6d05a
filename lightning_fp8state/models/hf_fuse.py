"""A Hugging Face Llama-family model on the fused fast path: in each decoder layer, the RMSNorm
before attention folded into one q/k/v projection's FP8 encode, and the RMSNorm before the MLP
into one gate/up projection's, whose SwiGLU is folded into the down projection's encode: what
our own :class:`~.llama.Llama` does with ``fused_projections``, in the user's own model.

A Hugging Face decoder layer computes ``x + attn(norm1(x))`` then ``h + mlp(norm2(h))``, and each
norm's output feeds only the projections after it. :func:`fuse_decoder_projections` rewrites the
layer in place, keeping transformers' own attention and layer code:

- the two norms become :class:`DeferredRMSNorm`: they keep their ``weight`` (same parameter,
  same state-dict key) and pass their input through; the norm runs inside the next encode;
- ``q_proj``, ``k_proj`` and ``v_proj`` become :class:`ProjectionSlice` views of one new
  ``self_attn.qkv_proj`` Linear (their weights concatenated): the attention still calls
  ``q_proj(h)``, ``k_proj(h)`` and ``v_proj(h)``; the first call runs the fused projection and the
  other two take their slices of its output for the same input tensor (a call on another tensor
  runs the projection again, so the result is right whatever the order);
- the MLP becomes :class:`FusedSwiGLU` (``gate_up_proj``: gate and up concatenated, and the
  layer's ``down_proj``).

Run it before :meth:`~lightning_fp8state.Fp8State.convert` (the new Linears are what convert
quantizes: one owner for q/k/v's input, one for gate/up's, as in our own fused Llama).
Numerically, the fused model computes what our ``Llama(fused_projections=True)`` computes on the
same weights (tested bitwise), which differs from the unfused model in the norms' last bits and
in q, k and v sharing one input scale. :func:`unfuse_decoder_projections` restores transformers'
modules (and state-dict keys) with the current weights, e.g. before ``save_pretrained``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import require_that
from ..errors import ConfigError
from ..nn.linear import Fp8Linear
from ..nn.prologue import linear_after
from .llama import RMSNorm

__all__ = [
    "DeferredRMSNorm",
    "FusedSwiGLU",
    "ProjectionSlice",
    "fuse_decoder_projections",
    "unfuse_decoder_projections",
]

# norm classes whose forward is Llama's ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``
# (Gemma's, ``(1 + weight) * ...``, is not one)
RMS_NORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "RMSNorm")
SILU_CLASSES = ("SiLU", "SiLUActivation")


class DeferredRMSNorm(nn.Module):
    """A decoder layer's RMSNorm whose work moved into the next projection's encode: holds the
    norm's weight (the state-dict key stays) and passes its input through. :meth:`norm` is the
    norm itself, for the projection."""

    def __init__(self, weight: nn.Parameter, eps: float, original: type) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.original = original  # the class it replaced (unfuse builds it again)
        object.__setattr__(self, "_rms", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def norm(self) -> RMSNorm:
        """An :class:`~.llama.RMSNorm` reading this module's weight: not registered anywhere (the
        parameter stays this module's), made again when the parameter object changed (a
        wrapper that replaces parameters, as FSDP2 does)."""
        rms = self._rms
        if rms is None or rms.weight is not self.weight:
            rms = RMSNorm(self.weight.shape[0], self.eps)
            del rms.weight
            rms.weight = self.weight  # the same Parameter, not a copy
            object.__setattr__(self, "_rms", rms)
        return rms

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused into the next projection"


class ProjectionSlice(nn.Module):
    """``q_proj`` / ``k_proj`` / ``v_proj`` of a fused attention: slice ``index`` of the
    attention's ``qkv_proj(norm(x))``, computed once per input tensor for the three."""

    def __init__(self, attention: nn.Module, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "attention", attention)  # a reference, not a submodule
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attention
        held = attn._fp8state_qkv
        if self.index == 0 or held is None or held[0] is not x:
            out = linear_after(attn.qkv_proj, x, norm=attn._fp8state_norm.norm())
            held = (x, out.split(attn._fp8state_widths, dim=-1))
        # held for k and v of the same input; dropped once v is served
        attn._fp8state_qkv = None if self.index == len(held[1]) - 1 else held
        return held[1][self.index]

    def extra_repr(self) -> str:
        return f"slice {self.index} of qkv_proj"


class FusedSwiGLU(nn.Module):
    """``down(silu(gate(norm(x))) * up(norm(x)))`` with the norm folded into ``gate_up_proj``'s
    encode and the SwiGLU into ``down_proj``'s."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Module, norm: DeferredRMSNorm) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        object.__setattr__(self, "deferred_norm", norm)  # the layer's module: a reference here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear_after(self.gate_up_proj, x, norm=self.deferred_norm.norm())
        return linear_after(self.down_proj, h, activation="swiglu")


def _plain_linear(module: nn.Module, name: str) -> nn.Linear:
    if type(module) is nn.Linear:
        return module
    if isinstance(module, Fp8Linear):
        raise ConfigError(
            f"fuse_decoder_projections: {name} is already converted to FP8: fuse the projections first, then "
            "call Fp8State.convert"
        )
    raise ConfigError(f"fuse_decoder_projections: {name} is a {type(module).__name__}, expected a plain nn.Linear")


def _check_layer(layer: nn.Module, where: str) -> None:
    """The structure the rewrite relies on, or ConfigError naming what differs."""
    for attr in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"):
        if not hasattr(layer, attr):
            raise ConfigError(f"fuse_decoder_projections: {where} has no {attr}: not a Llama-family decoder layer")
    for attr in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, attr)
        if type(norm).__name__ not in RMS_NORM_CLASSES or not hasattr(norm, "weight"):
            raise ConfigError(
                f"fuse_decoder_projections: {where}.{attr} is a {type(norm).__name__}; expected one of "
                f"{RMS_NORM_CLASSES} (Llama's RMSNorm formula)"
            )
    act = getattr(layer.mlp, "act_fn", None)
    if type(act).__name__ not in SILU_CLASSES:
        raise ConfigError(
            f"fuse_decoder_projections: {where}.mlp.act_fn is {type(act).__name__}; expected SiLU (a SwiGLU MLP)"
        )
    for name in ("q_proj", "k_proj", "v_proj"):
        _plain_linear(getattr(layer.self_attn, name, None), f"{where}.self_attn.{name}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        linear = _plain_linear(getattr(layer.mlp, name, None), f"{where}.mlp.{name}")
        require_that(
            linear.bias is None, f"{where}.mlp.{name}.bias", "a tensor", "None (the SwiGLU fusion has no bias)"
        )


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _concat(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of ``linears``' outputs (their weights copied)."""
    first = linears[0]
    bias = first.bias is not None
    require_that(all((m.bias is not None) == bias for m in linears), "bias", "mixed", "all or none of q/k/v")
    out = sum(m.out_features for m in linears)
    fused = nn.Linear(first.in_features, out, bias=bias, device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if bias:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    fused.weight.requires_grad_(first.weight.requires_grad)
    return fused


def _defer(layer: nn.Module, attr: str) -> DeferredRMSNorm:
    norm = getattr(layer, attr)
    deferred = DeferredRMSNorm(norm.weight, _eps(norm), type(norm))
    setattr(layer, attr, deferred)
    return deferred


def fuse_decoder_projections(model: nn.Module, layers_path: str | None = None) -> nn.Module:
    """Rewrite every decoder layer of a Hugging Face Llama-family model (Llama, Mistral, Qwen2,
    Qwen3) for the fused FP8 prologues, in place (see the module's docstring). Call it before
    ``Fp8State.convert``. Returns ``model``.

    Args:
        model: the model (``LlamaForCausalLM``), or anything holding it (a LightningModule).
        layers_path: the decoder layers' attribute path, where ``*.model.layers`` does not find them.

    Raises:
        ConfigError: a layer is not of the Llama structure (its norms, SwiGLU MLP, plain
            bias-free MLP projections), is already converted, or the model was fused already.
    """
    from ..graphs.hf_layers import find_decoder_layers  # noqa: PLC0415 (graphs imports models)

    layers = find_decoder_layers(model, layers_path)
    for i, layer in enumerate(layers):
        if isinstance(layer.input_layernorm, DeferredRMSNorm):
            raise ConfigError(f"fuse_decoder_projections: layer {i} is fused already")
        _check_layer(layer, f"layer {i}")
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        attn.qkv_proj = _concat([q, k, v])
        attn._fp8state_widths = (q.out_features, k.out_features, v.out_features)
        attn._fp8state_qkv = None
        object.__setattr__(attn, "_fp8state_norm", _defer(layer, "input_layernorm"))
        attn.q_proj, attn.k_proj, attn.v_proj = (ProjectionSlice(attn, i) for i in range(3))
        layer.mlp = FusedSwiGLU(
            _concat([mlp.gate_proj, mlp.up_proj]), mlp.down_proj, _defer(layer, "post_attention_layernorm")
        )
        object.__setattr__(layer.mlp, "_fp8state_original", mlp)  # for unfuse (its old Linears dropped below)
        del mlp.gate_proj, mlp.up_proj
        mlp.down_proj = None
    return model


def _split(fused: nn.Linear, widths: tuple[int, ...]) -> list[nn.Linear]:
    out = []
    weights = fused.weight.detach().split(widths)
    biases = fused.bias.detach().split(widths) if fused.bias is not None else [None] * len(widths)
    for w, b in zip(weights, biases, strict=True):
        linear = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            if b is not None:
                linear.bias.copy_(b)
        out.append(linear)
    return out


def _restore_norm(layer: nn.Module, attr: str) -> None:
    deferred = getattr(layer, attr)
    norm = deferred.original(deferred.weight.shape[0], eps=deferred.eps)
    norm.weight = deferred.weight
    setattr(layer, attr, norm)


def unfuse_decoder_projections(model: nn.Module, layers_path: str | None = None) -> nn.Module:
    """Undo :func:`fuse_decoder_projections` with the current weights: transformers' own norms,
    q/k/v and gate/up Linears again (e.g. before ``save_pretrained``). Refused once converted to
    FP8 (the state's owners are the fused projections)."""
    from ..graphs.hf_layers import find_decoder_layers  # noqa: PLC0415

    for i, layer in enumerate(find_decoder_layers(model, layers_path)):
        if not isinstance(layer.input_layernorm, DeferredRMSNorm):
            raise ConfigError(f"unfuse_decoder_projections: layer {i} is not fused")
        attn, fused = layer.self_attn, layer.mlp
        _plain_linear(attn.qkv_proj, f"layer {i}.self_attn.qkv_proj")
        _plain_linear(fused.gate_up_proj, f"layer {i}.mlp.gate_up_proj")
        attn.q_proj, attn.k_proj, attn.v_proj = _split(attn.qkv_proj, attn._fp8state_widths)
        del attn.qkv_proj, attn._fp8state_widths, attn._fp8state_qkv, attn._fp8state_norm
        mlp = fused._fp8state_original
        del mlp.down_proj  # registered again after gate and up: transformers' order of keys
        mlp.gate_proj, mlp.up_proj = _split(fused.gate_up_proj, (fused.gate_up_proj.out_features // 2,) * 2)
        mlp.down_proj = fused.down_proj
        layer.mlp = mlp
        _restore_norm(layer, "input_layernorm")
        _restore_norm(layer, "post_attention_layernorm")
    return model
