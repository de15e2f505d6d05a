"""Fp8Conv1D: Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2's Linear layers, weight
stored ``[in, out]``) driven by the protocol, without importing transformers.

``Conv1D(x) = x @ W + b`` with ``W [in, out]`` is ``F.linear(x, W.t(), b)``, so the quantized
computation is exactly the :class:`~lightning_fp8state.nn.Fp8Linear` one on the weight view
``W.t()`` (same Function, same roles, same snapshots); the weight's amax and codes are those of
``W`` (a transpose moves elements, it does not change them). The quantize of the transposed
view reads it through a strided copy on the GPU (one extra pass over the weight per call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..protocol import QuantProtocol
from .linear import apply_linear_fn
from .linear_call import LINEAR_ROLES, fp8_linear_op, op_key

__all__ = ["Fp8Conv1D", "is_hf_conv1d"]


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (checked by its class and its ``[nx, nf]``
    weight, so a look-alike with another layout is not taken for it)."""
    cls = type(module)
    if cls.__name__ != "Conv1D" or not cls.__module__.startswith("transformers"):
        return False
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2 and tuple(weight.shape) == (nx, nf)


class Fp8Conv1D(nn.Module):
    """A drop-in for transformers' ``Conv1D``: same parameters (``weight [nx, nf]``, ``bias [nf]``,
    shared with the module it replaces, so optimizers and state dict keys keep working), input,
    weight and grad_output quantized as an :class:`~lightning_fp8state.nn.Fp8Linear` does."""

    def __init__(self, nf: int, nx: int, *, protocol: QuantProtocol, layer_name: str) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device="meta"))
        self.bias = nn.Parameter(torch.empty(nf, device="meta"))
        self.protocol = protocol
        self.layer_name = layer_name
        if protocol.fallback is not None:  # QuantConfig.fallback may move it: _forward runs its route
            protocol.fallback.movable.add(layer_name)
        self._op_key = op_key(self)  # names it to torch.compile's op (nn/linear_call.py)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, *, protocol: QuantProtocol, layer_name: str) -> Fp8Conv1D:
        new = cls(conv.nf, conv.nx, protocol=protocol, layer_name=layer_name)
        new.weight = conv.weight
        new.bias = conv.bias
        new.train(conv.training)
        return new

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, layer={self.layer_name!r}, recipe={self.protocol.config.recipe}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # under torch.compile: Fp8Linear's op on the weight view (nn/linear_call.py), no graph break
        if torch.compiler.is_compiling():
            protocol = self.protocol
            moved = protocol.fallen_back and self.layer_name in protocol.fallen_back  # a graph of its own
            if protocol.recipe.quantized and protocol.recipe.compiled_op and not moved:
                return fp8_linear_op(self, x, self.weight.t(), self.bias, None, None)
            return self._forward_outside_graph(x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        protocol = self.protocol
        config = protocol.config
        # a layer the fallback moved (QuantConfig.fallback) runs its target's recipe, as Fp8Linear does
        recipe = protocol.recipe_of(self.layer_name) if protocol.layer_recipes else protocol.recipe
        quantized = recipe.quantized
        roles = LINEAR_ROLES if quantized else ()
        phase, record = protocol.enter_call(self.layer_name, roles, x.device)
        weight = self.weight.t()  # [out, in]: the Linear layout, a view (gradients flow back to W)
        if not quantized:
            out = F.linear(x, weight, self.bias)
            protocol.observe_output(record, phase, out, {})
            return out
        if not x.is_contiguous():
            x = x.contiguous()
        args = (x, weight, self.bias, None, None, protocol, record, phase)
        out = apply_linear_fn(args, x, config.gemm, None)
        protocol.observe_output(record, phase, out, record.used)
        return out

    _forward_outside_graph = torch.compiler.disable(_forward)
