"""A mixture-of-experts feed-forward for the Llama family (``LlamaConfig.moe_experts > 0``): a
router in high precision, top-k routing with softmax, the experts in 3-D parameters
(:class:`~lightning_fp8state.nn.GroupedExperts`, which conversion makes FP8 with every expert its
own owner), an optional shared expert and a load-balancing auxiliary loss.

The module names follow transformers' Mixtral (``mlp.gate``, ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``; Qwen2-MoE's ``mlp.shared_expert``). Routing is a pure function of the
block's input: the router runs in float32 outside autocast, ``topk`` and the experts' stable sort
break ties by position, so a recompute, whose input is bitwise the true forward's, routes the
same tokens to the same experts in the same order.

The auxiliary loss (Switch Transformer's, as transformers computes it: ``E * sum_e f_e * P_e``,
``f_e`` the fraction of routed slots that chose expert ``e``, ``P_e`` its mean router probability)
is not added to the model's loss: a checkpointed block maps one tensor to one tensor, and under a
reentrant checkpoint its true forward builds no graph. Its gradient, ``coef * d aux``, is added in
backward by an identity on the block's output instead (Megatron's approach), which works under
every checkpoint engine; the value of the last forward is kept for logging (``last_aux_loss``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import GroupedExperts, keep_in_high_precision

__all__ = ["MoEFeedForward", "load_balancing_loss"]


def load_balancing_loss(probs: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (float32): ``probs [T, E]`` the router's softmax, ``top_k_index
    [T, k]`` the chosen experts; ``f_e`` counts every slot (1 per token per choice, over ``T``),
    transformers' ``load_balancing_loss_func`` for one layer without a mask. ``k`` at uniform
    routing."""
    t, e = probs.shape
    counts = torch.bincount(top_k_index.reshape(-1), minlength=e).to(probs.dtype)
    return (counts / t * probs.mean(0)).sum() * e


class _AuxLossGradient(torch.autograd.Function):
    """The identity on ``y``; in backward, ``coef`` as the auxiliary loss's gradient."""

    @staticmethod
    def forward(ctx, y, aux, coef):
        ctx.coef = coef
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


@torch.compiler.disable
def _with_aux_gradient(y: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """``y``, with ``coef * d aux`` added in backward. Outside a compiled graph (a graph break):
    traced by AOTAutograd, the Function's gradient for ``aux``, which no output depends on, is
    dropped."""
    return _AuxLossGradient.apply(y, aux, coef)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class MoEFeedForward(nn.Module):
    """``experts(norm(x))`` routed top-k (plus ``shared_expert(norm(x))`` when given); called as
    the dense feed-forward is: ``mlp(x, norm)``."""

    def __init__(
        self, d_model: int, ffn_hidden: int, num_experts: int, top_k: int, aux_loss_coef: float, shared_expert=None
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.aux_loss_coef = num_experts, top_k, aux_loss_coef
        self.gate = keep_in_high_precision(
            nn.Linear(d_model, num_experts, bias=False),
            "the MoE router: kept in high precision (float32), so that a recompute routes the same tokens to the "
            "same experts",
        )
        self.experts = GroupedExperts(num_experts, d_model, ffn_hidden)
        self.shared_expert = shared_expert  # a dense SwiGLU feed-forward seen by every token, or None
        self.last_aux_loss: torch.Tensor | None = None  # the auxiliary loss of the last forward (detached)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [T, E], top_k_weights [T, k], top_k_index [T, k])`` of ``h [T, D]``: the
        router in float32 outside autocast, softmax over all experts, the top k renormalized."""
        with torch.autocast(h.device.type, enabled=False):
            logits = F.linear(h.float(), self.gate.weight.float())
        probs = torch.softmax(logits, dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        return probs, weights / weights.sum(dim=-1, keepdim=True), index

    def forward(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        h = norm(x)
        h2 = h.reshape(-1, h.shape[-1])
        probs, weights, index = self.route(h2)
        y = self.experts(h2, index, weights)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = load_balancing_loss(probs, index)
            self.last_aux_loss = aux.detach()
            y = _with_aux_gradient(y, aux, self.aux_loss_coef)
        y = y.view_as(h)
        if self.shared_expert is not None:
            y = y + self.shared_expert(h, _identity)
        return y
