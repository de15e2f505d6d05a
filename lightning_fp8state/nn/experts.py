"""Mixture-of-experts feed-forwards whose experts live in 3-D parameters (transformers 5's
layout: ``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``), with every expert of every
projection its own owner.

An expert's projection is quantized exactly as an :class:`~lightning_fp8state.nn.Fp8Linear`
call of its own: layer ``<module>.<projection>.<expert>`` (e.g. ``layers.0.mlp.experts.
gate_up_proj.3``), roles input, weight and grad_output, each an owner of the protocol (rule 1:
layer x expert x role x rank x stream), entered through ``QuantProtocol.enter_call`` and quantized
through ``QuantProtocol.quantize``: the snapshot, the commit, the ledger and the read-only
recompute are the protocol's, not restated here. The tokens an expert receives are its input
group: their amax is that expert's alone.

An expert that receives no token in a call is not entered: nothing of it is observed, so nothing
commits in that event and its scale (and amax history) stay as they are, valid for the next event
it is used in. (Under amax reduction across data-parallel ranks, "no token" means on every rank:
the ranks agree on the active experts with one all-reduce, so their owners and weight scales
stay aligned.) Routing is deterministic (a stable sort by expert; ties by position), so a
recompute routes the same tokens to the same experts in the same order; each expert's call record
keeps the true forward's token counts and a recompute that routes differently fails closed.

The GEMMs of one projection are one grouped GEMM: :func:`expert_gemms` is the single place the
device path plugs in. On a GPU that has it, a per-tensor FP8 recipe's forward, input- and
weight-gradient products each run as one ``torch._scaled_grouped_mm`` across the active experts
(:mod:`.grouped_gemm`: per-expert scales as rowwise scale vectors; equal to the loop up to the
accumulation order); elsewhere (the CPU, E5M2 operands, another output dtype, shapes the kernel
refuses, a recipe with GEMMs of its own) it runs, per expert, the recipe's GEMM that an Fp8Linear
call runs (on the CPU: the exact emulation), so the module there is bitwise a loop of per-expert
Fp8Linear calls. The choice reads dtypes, shapes, device and backend only, so a recompute takes
the true forward's path. The high-precision experts (the ``bf16`` recipe) run one
``torch._grouped_mm`` per projection where the device allows. ``grouped_gemm = False`` on a
module keeps the loop everywhere. Knowing which experts are active takes the per-expert counts
on the host: one device-to-host copy per MoE call, and none more.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..config import require_bool, require_int, require_that
from ..errors import StateTransitionError
from ..protocol import QuantProtocol, release_weight_codes
from ..recompute import Phase
from .grouped_gemm import (
    aligned_groups,
    aligned_rows,
    bf16_grouped_problem,
    fp8_grouped_problem,
    grouped_expert_gemms,
    grouped_linear,
    pad_groups,
    per_tensor_gemms,
    unpad_groups,
)
from .linear import autocast_off
from .linear_call import LINEAR_ROLES

__all__ = [
    "EXPERT_PROJECTIONS",
    "SEPARATE_PROJECTIONS",
    "Fp8Experts",
    "GroupedExperts",
    "Routing",
    "combine",
    "expert_gemms",
    "expert_layer",
    "keep_in_high_precision",
    "route",
]

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # the fused layout (transformers'); separate: gate, up, down
SEPARATE_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# conversion leaves a module carrying this attribute alone, reporting its value (a router)
KEEP_ATTRIBUTE = "_fp8state_keep"
# CallRecord.derived's key: the per-expert token counts of the true forward of a call
_ROWS = "expert_rows"


def keep_in_high_precision(module: nn.Module, why: str) -> nn.Module:
    """Mark ``module`` (an ``nn.Linear``: a router) to be left alone by conversion, which reports
    it as skipped with ``why``. Returns the module."""
    setattr(module, KEEP_ATTRIBUTE, why)
    return module


def expert_layer(layer: str, projection: str, expert: int) -> str:
    """The layer name an expert's projection owns its state under."""
    return f"{layer}.{projection}.{expert}"


class Routing(NamedTuple):
    """Where each routed (token, slot) row goes: ``order`` sorts the rows, slot-major
    (``slot * T + token``), stably by expert; ``tokens`` is each sorted row's token; ``counts``
    the rows per expert (host ints); ``slots`` the top-k shape ``(T, k)``."""

    order: torch.Tensor
    tokens: torch.Tensor
    counts: tuple[int, ...]
    slots: tuple[int, int]


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Group ``top_k_index [T, k]`` (expert ids) by expert, deterministically.

    Rows are ordered slot-major within an expert (all first choices by token, then second
    choices), the order transformers' eager experts loop takes them in, so per-expert GEMMs see
    the same rows in the same order. The sort is stable: equal experts keep their positions.

    Raises:
        ConfigError: an expert id outside ``[0, num_experts)``.
        StateTransitionError: called during a CUDA graph capture.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise StateTransitionError(
            "a mixture-of-experts layer ran inside a CUDA graph capture: which experts are active is read on the "
            "host per call, which a graph cannot replay. Run MoE models without CUDA graphs (trainer.cuda_graphs=false)"
        )
    t, k = top_k_index.shape
    flat = top_k_index.t().reshape(-1)
    order = torch.argsort(flat, stable=True)
    # the one host copy (bincount itself refuses a negative id)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    require_that(
        len(counts) == num_experts, "top_k_index", f"expert ids up to {len(counts) - 1}", f"ids in [0, {num_experts})"
    )
    return Routing(order, order % t if t else order, tuple(counts), (t, k))


def combine(
    y_sorted: torch.Tensor, routing: Routing, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype
) -> torch.Tensor:
    """``out[t] = sum over t's experts, in ascending expert order, of weight * y`` in ``dtype``.

    Each contribution is weighted (in the weights' and outputs' promoted dtype), rounded to
    ``dtype`` and added to a zero start in ascending expert order: transformers' eager experts
    loop bit for bit, and deterministic on every device (no scatter-add)."""
    t, k = routing.slots
    w_sorted = top_k_weights.t().reshape(-1)[routing.order]
    contrib = (y_sorted * w_sorted[:, None]).to(dtype)
    inverse = torch.argsort(routing.order)
    contrib = contrib[inverse].view(k, t, -1)  # [slot, token, D]
    rank = torch.argsort(top_k_index, dim=1, stable=True)  # each token's slots by expert id
    tokens = torch.arange(t, device=contrib.device)
    out = contrib.new_zeros((t, contrib.shape[-1]))
    for j in range(k):
        out = out + contrib[rank[:, j], tokens]
    return out


def expert_gemms(
    kind: str, recipe, left: list, right: list, left_snaps: list, right_snaps: list, out_dtype, backend, grouped=True
):
    """The grouped GEMM of one projection: one product per active expert, in expert order.

    ``kind``: ``"forward"`` (``y = x @ W^T``: left the inputs' codes, right the weights'),
    ``"grad_input"`` (``dX = g @ W``: grad_output's codes, the saved weights) or ``"grad_weight"``
    (``dW = g^T @ x``: grad_output's weight-gradient operands, the saved inputs); the snapshots
    pair with each side; at least one expert. Returns, for the forward and the input gradient,
    the products' rows one expert after another (one tensor); for the weight gradient, the
    products in expert order (a list, or one ``[G, out, in]`` tensor).

    ``grouped`` (and the device, the recipe and the shapes: :mod:`.grouped_gemm`) lets one FP8
    grouped GEMM over all experts at once run; else the recipe's GEMM runs per expert, exactly
    what an Fp8Linear call runs.
    """
    if grouped:
        out = grouped_expert_gemms(kind, recipe, left, right, left_snaps, right_snaps, out_dtype, backend)
        if out is not None:
            return out
    pairs = zip(left, right, left_snaps, right_snaps, strict=True)
    if kind == "forward":
        gemm = recipe.linear_gemm
        return torch.cat([gemm(a, b, sa, sb, out_dtype, backend, None) for a, b, sa, sb in pairs])
    gemm = recipe.grad_input if kind == "grad_input" else recipe.grad_weight
    products = [gemm(a, b, sa, sb, out_dtype, backend) for a, b, sa, sb in pairs]
    return products if kind == "grad_weight" else torch.cat(products)


class _Entry(NamedTuple):
    """One active expert of one projection call: its index, rows, phase and call record."""

    expert: int
    rows: int
    phase: Phase
    record: object


class _Call(NamedTuple):
    """What a projection's backward needs besides its saved tensors."""

    protocol: QuantProtocol
    entries: tuple
    snaps: tuple  # per entry: (input, weight) snapshots
    backend: str
    grouped: bool  # whether the device's grouped GEMM may run (expert_gemms)
    x_dtype: torch.dtype
    w_dtype: torch.dtype
    w_shape: torch.Size
    # per entry: None (the weight's codes saved), else the backward re-encodes them from the saved
    # weight, transposed (True) or not, as the recipe's weight stage would have laid them out
    reencoded: tuple


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _weight_codes(w_e: torch.Tensor, sw, transposed: bool) -> torch.Tensor:
    """An expert's weight codes re-encoded at its call's frozen snapshot: bitwise the forward's
    (the same tensor, scale and rounding), made in the backward, where the GEMMs read them, so
    that no expert's codes are held from its forward to its backward. Records nothing.
    ``transposed``: as the ``[out, in]`` view of the transposed codes (what the cast-transpose
    stage saves, the input gradient's GEMM takes it without a copy), else row-major."""
    codes = ops.quantize_fp8(w_e, sw.scale, sw.dtype)
    return ops.transpose_fp8(codes).t() if transposed else codes


def _projection_forward(x, weight, protocol: QuantProtocol, entries: tuple, out_dtype, backend, grouped: bool):
    """Quantize each active expert's input rows and weight (its own owners), then the grouped
    GEMM: ``(y [rows, out], saved tensors, _Call)``."""
    recipe = protocol.recipe
    # a per-tensor recipe's weight codes are re-encoded in the backward from the weight itself
    # (a parameter, held anyway): the forward writes no transposed codes and saves none; the
    # experts' weights are most of an MoE layer's bytes, their codes more than its activations'
    reencode = per_tensor_gemms(recipe)
    xqs, wqs, sxs, sws, saved, reencoded = [], [], [], [], [], []
    for entry, x_e in zip(entries, x.split([e.rows for e in entries]), strict=True):
        record, phase = entry.record, entry.phase
        w_e = weight[entry.expert]
        xq, sx = protocol.quantize(record, "input", x_e, phase)
        stage = None if phase is Phase.INFERENCE else recipe.weight_stage(w_e)
        wq, sw = protocol.quantize(record, "weight", w_e, phase, None if reencode else stage)
        if phase is not Phase.INFERENCE:
            protocol.check_consumer(record, "input", sx)
            protocol.check_consumer(record, "weight", sw)
        xqs.append(xq)
        wqs.append(wq)
        sxs.append(sx)
        sws.append(sw)
        again = reencode and type(wq) is torch.Tensor and wq.dtype in _FP8 and sw.dtype == wq.dtype
        reencoded.append((stage is not None) if again else None)
        saved += (xq, w_e) if again else recipe.saved_for_backward(xq, wq, x_e, w_e)
    if entries:
        y = expert_gemms("forward", recipe, xqs, wqs, sxs, sws, out_dtype, backend, grouped)
    else:
        y = x.new_empty((0, weight.shape[1]), dtype=out_dtype)
    snaps = tuple(zip(sxs, sws, strict=True))
    call = _Call(protocol, entries, snaps, backend, grouped, x.dtype, weight.dtype, weight.shape, tuple(reencoded))
    return y, saved, call


def _projection_backward(grad_out, saved, call: _Call, needs) -> tuple:
    """Gradients of ``(x, weight)``: grad_output quantized per expert (its own owner), then the
    weight- and input-gradient GEMMs; an idle expert's weight gradient is zero.

    Where the GEMMs are a per-tensor recipe's per-expert loop (E5M2 gradients, the default, or no
    grouped kernel) the experts stream: each expert's gradient codes, its weight's codes
    (re-encoded) and its two products, written into their slices of the results, before the next
    expert's; only one expert's codes are alive at a time. Else (the grouped GEMMs, a recipe with
    GEMMs of its own) every expert's codes are made first."""
    g = grad_out if grad_out.is_contiguous() else grad_out.contiguous()
    device = grad_out.device
    if not call.entries:
        grad_x = g.new_empty((0, call.w_shape[2]), dtype=call.x_dtype) if needs[0] else None
        return grad_x, torch.zeros(call.w_shape, dtype=call.w_dtype, device=device) if needs[1] else None
    grads = g.split([e.rows for e in call.entries])
    x_saved, w_saved = saved[0::2], saved[1::2]
    first = _grad_codes(call, 0, grads[0])
    if _streams(call, first[0].dtype, sum(e.rows for e in call.entries), device):
        return _streamed_backward(call, grads, first, x_saved, w_saved, needs, device)
    gqs, gws, sgs = zip(first, *(_grad_codes(call, i, g_e) for i, g_e in enumerate(grads[1:], 1)), strict=True)
    sxs, sws = [s[0] for s in call.snaps], [s[1] for s in call.snaps]
    grad_x = grad_w = None
    if needs[1]:
        grad_w = _weight_gradient(call, list(gws), x_saved, list(sgs), sxs, device)
    del gws
    if needs[0]:
        w_codes = [
            w if t is None else _weight_codes(w, sw, t) for w, sw, t in zip(w_saved, sws, call.reencoded, strict=True)
        ]
        grad_x = expert_gemms(
            "grad_input",
            call.protocol.recipe,
            list(gqs),
            w_codes,
            list(sgs),
            sws,
            call.x_dtype,
            call.backend,
            call.grouped,
        )
    return grad_x, grad_w


def _grad_codes(call: _Call, i: int, g_e: torch.Tensor) -> tuple:
    """Entry ``i``'s grad_output quantized by its owner: ``(codes, weight-gradient operand,
    snapshot)``, every operand's snapshot checked as its consumer's."""
    protocol, record = call.protocol, call.entries[i].record
    sx, sw = call.snaps[i]
    release_weight_codes(record)  # no recompute of this call follows its backward in the event
    stage = protocol.recipe.grad_output_stage(False)
    (gq, g_w, _), sg = protocol.quantize(record, "grad_output", g_e, Phase.FORWARD, stage)
    protocol.check_consumer(record, "input", sx)
    protocol.check_consumer(record, "weight", sw)
    protocol.check_consumer(record, "grad_output", sg)
    return gq, g_w, sg


def _streams(call: _Call, grad_dtype: torch.dtype, rows: int, device: torch.device) -> bool:
    """Whether the backward runs the per-tensor GEMMs expert by expert: the recipe's GEMMs are
    the per-tensor products and the grouped kernel does not take these operands (a pure function
    of dtypes, shapes, device and backend, as :func:`expert_gemms`'s choice)."""
    if not per_tensor_gemms(call.protocol.recipe):
        return False
    if not call.grouped:
        return True
    x_dtype, w_dtype = call.snaps[0][0].dtype, call.snaps[0][1].dtype  # the operands' formats
    dims = (call.w_shape[1], call.w_shape[2])
    groups = len(call.entries)
    return any(
        fp8_grouped_problem(grad_dtype, right, out, dims, groups, rows, device, call.backend) is not None
        for right, out in ((w_dtype, call.x_dtype), (x_dtype, call.w_dtype))  # dX = g W, dW = g^T x
    )


def _streamed_backward(call: _Call, grads, first, x_saved, w_saved, needs, device) -> tuple:
    """The per-tensor loop, one expert at a time (see :func:`_projection_backward`): each product
    written by its GEMM into its slice (``scaled_matmul(out=)``), no zero fill where every expert
    is active, no copy of the products."""
    recipe = call.protocol.recipe
    every = len(call.entries) == call.w_shape[0]
    grad_w = grad_x = None
    if needs[1]:
        grad_w = (torch.empty if every else torch.zeros)(call.w_shape, dtype=call.w_dtype, device=device)
    if needs[0]:
        grad_x = torch.empty((sum(e.rows for e in call.entries), call.w_shape[2]), dtype=call.x_dtype, device=device)
    start = 0
    for i, (entry, g_e) in enumerate(zip(call.entries, grads, strict=True)):
        gq, g_w, sg = first if i == 0 else _grad_codes(call, i, g_e)
        sx, sw = call.snaps[i]
        n = entry.rows
        if grad_w is not None:
            if n:
                recipe.grad_weight(g_w, x_saved[i], sg, sx, call.w_dtype, call.backend, out=grad_w[entry.expert])
            else:  # active on another rank only: no local row
                grad_w[entry.expert].zero_()
        if grad_x is not None and n:
            t = call.reencoded[i]
            w = w_saved[i] if t is None else _weight_codes(w_saved[i], sw, t)
            recipe.grad_input(gq, w, sg, sw, call.x_dtype, call.backend, out=grad_x[start : start + n])
        start += n
    return grad_x, grad_w


def _weight_gradient(call: _Call, gws, x_saved, sgs, sxs, device) -> torch.Tensor:
    """``[E, out, in]``: each active expert's product, an idle expert's zero. The grouped GEMM's
    ``[E, out, in]`` is the gradient itself when every expert is active."""
    products = expert_gemms(
        "grad_weight", call.protocol.recipe, gws, x_saved, sgs, sxs, call.w_dtype, call.backend, call.grouped
    )
    if len(call.entries) == call.w_shape[0] and isinstance(products, torch.Tensor) and products.dtype == call.w_dtype:
        return products  # every expert active, in expert order
    grad_w = torch.zeros(call.w_shape, dtype=call.w_dtype, device=device)
    for entry, product in zip(call.entries, products, strict=True):
        grad_w[entry.expert] = product
    return grad_w


class _ExpertsProjectionFn(torch.autograd.Function):
    """One projection of the active experts; ``call``: ``(protocol, entries, out_dtype, backend,
    grouped)``."""

    @staticmethod
    def forward(ctx, x, weight, call):
        y, saved, ctx.call = _projection_forward(x, weight, *call)
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        device = grad_out.device.type
        args = (grad_out, ctx.saved_tensors, ctx.call, ctx.needs_input_grad)
        if torch.is_autocast_enabled(device):  # as Fp8Linear's backward: the GEMMs choose their precision
            grads = autocast_off(device, _projection_backward, *args)
        else:
            grads = _projection_backward(*args)
        return (*grads, None)


class GroupedExperts(nn.Module):
    """``E`` gated experts in 3-D parameters, in high precision: ``down(act(gate(x)) * up(x))``
    per expert, ``gate_up_proj [E, 2F, D]`` (gate rows first), ``down_proj [E, D, F]``, no biases;
    with ``fused_gate_up=False`` ``gate_proj`` and ``up_proj [E, F, D]`` instead (each its own
    projection, its own owners once converted).

    ``forward(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k])`` is transformers 5's
    experts call (``MixtralExperts``, ``Qwen2MoeExperts``, ...) and gives its result bit for bit;
    :meth:`grouped` is the FFN on rows already grouped by expert. Conversion makes it an
    :class:`Fp8Experts` sharing its parameters."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        ffn_hidden: int,
        *,
        act_fn: nn.Module | None = None,
        fused_gate_up: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        require_int("num_experts", num_experts, 1)
        require_int("hidden", hidden, 1)
        require_int("ffn_hidden", ffn_hidden, 1)
        require_bool("fused_gate_up", fused_gate_up)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, ffn_hidden
        self.projections = EXPERT_PROJECTIONS if fused_gate_up else SEPARATE_PROJECTIONS
        kw = {"device": device, "dtype": dtype}
        if fused_gate_up:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_hidden, hidden, **kw))
        else:
            self.gate_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden, **kw))
            self.up_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden, **kw))
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()

    def extra_repr(self) -> str:
        fused = "" if self.projections is EXPERT_PROJECTIONS else ", fused_gate_up=False"
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, ffn_hidden={self.intermediate_dim}{fused}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        routing = route(top_k_index, self.num_experts)
        x_sorted = hidden_states[routing.tokens]
        y_sorted = self.grouped(x_sorted, routing.counts)
        return combine(y_sorted, routing, top_k_index, top_k_weights, hidden_states.dtype)

    def grouped(self, x_sorted: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """The experts on rows grouped by expert (``counts[e]`` rows of expert ``e``, in order)."""
        parts = []
        for e, x_e in zip(range(self.num_experts), x_sorted.split(list(counts)), strict=True):
            if not counts[e]:
                continue
            if self.projections is EXPERT_PROJECTIONS:
                gate, up = F.linear(x_e, self.gate_up_proj[e]).chunk(2, dim=-1)
            else:
                gate, up = F.linear(x_e, self.gate_proj[e]), F.linear(x_e, self.up_proj[e])
            parts.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(parts) if parts else x_sorted.new_empty((0, self.hidden_dim))


class Fp8Experts(GroupedExperts):
    """:class:`GroupedExperts` driven by a :class:`QuantProtocol`: each active expert's projection
    is one quantized call (see the module doc), the GEMMs of a projection one grouped GEMM. Under
    the ``bf16`` recipe it runs the high-precision experts, reporting each expert's call to the
    audit. Under torch.compile the experts run eagerly (a graph break).

    ``grouped_gemm``: whether a projection's GEMMs may run as one grouped GEMM on the device
    (:mod:`.grouped_gemm`); False keeps the per-expert loop. True by default since the grouped
    path's GPU test (``tests/gpu/test_experts_grouped_cuda.py``) passed on the H200."""

    grouped_gemm: bool = True

    # Telemetry's hook (lightning_fp8state.telemetry.experts): while set, a function called with
    # (this module, the per-expert token counts) once per true-forward call; the counts are the
    # host ints routing made anyway (no device read). None: no work per call.
    routing_observer = None

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, *, protocol, layer_name: str, **kw) -> None:
        super().__init__(num_experts, hidden, ffn_hidden, **kw)
        self.protocol = getattr(protocol, "protocol", protocol)  # an Fp8State's protocol
        self.layer_name = layer_name
        self.expert_layers = {
            p: tuple(expert_layer(layer_name, p, e) for e in range(num_experts)) for p in self.projections
        }

    @classmethod
    def from_experts(cls, experts: nn.Module, *, protocol, layer_name: str) -> Fp8Experts:
        """Wrap ``experts`` (a :class:`GroupedExperts` or transformers' experts module of that
        layout), sharing its parameters and activation."""
        fused = not isinstance(getattr(experts, "gate_proj", None), nn.Parameter)
        e, d, f = experts.down_proj.shape
        new = cls(
            e, d, f, protocol=protocol, layer_name=layer_name, act_fn=experts.act_fn, fused_gate_up=fused, device="meta"
        )
        for name in new.projections:
            setattr(new, name, getattr(experts, name))
        new.train(experts.training)
        return new

    def owner_layers(self) -> tuple[str, ...]:
        """Every layer name its calls can own state under (all experts, both projections)."""
        return tuple(name for p in self.projections for name in self.expert_layers[p])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layer={self.layer_name!r}, recipe={self.protocol.config.recipe}"

    @torch.compiler.disable
    def grouped(self, x_sorted: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        active = self._active(counts, x_sorted.device)
        on_device = self.grouped_gemm and x_sorted.is_cuda
        # on the device, a quantized call pads each expert's rows to a multiple of 16 (zero rows:
        # grouped_gemm.pad_groups says why and why nothing changes); elsewhere the rows are the
        # counts, the module bitwise the per-expert loop
        pad = self.grouped_gemm and self.protocol.recipe.quantized and aligned_groups(x_sorted.device)
        rows = aligned_rows(counts) if pad else counts
        x_sorted = pad_groups(x_sorted, counts, rows)
        if self.projections is EXPERT_PROJECTIONS:
            h = self._projection("gate_up_proj", self.gate_up_proj, x_sorted, counts, rows, active)
            gate, up = h.chunk(2, dim=-1)
        else:
            gate = self._projection("gate_proj", self.gate_proj, x_sorted, counts, rows, active)
            up = self._projection("up_proj", self.up_proj, x_sorted, counts, rows, active)
        if on_device:
            a = self.act_fn(gate) * up  # one kernel each over all experts (no per-expert copies)
        else:
            # the activation per expert, as the per-expert calls do (a vectorized op may round a
            # tensor's tail elements otherwise than its body: one tensor would differ in the last bit)
            sizes = [n for n in rows if n]
            act = [self.act_fn(g) * u for g, u in zip(gate.split(sizes), up.split(sizes), strict=True)]
            a = torch.cat(act) if act else x_sorted.new_empty((0, self.intermediate_dim))
        y = self._projection("down_proj", self.down_proj, a, counts, rows, active)
        return unpad_groups(y, counts, rows)

    def _active(self, counts: tuple[int, ...], device: torch.device) -> tuple[bool, ...]:
        """Which experts this call enters: those that received rows here, and, where pending
        amaxes are reduced across data-parallel ranks, those that received rows on any rank (one
        MAX all-reduce of the mask): every rank then registers the same owners in the same order
        and commits the same experts, so the reduced weight scales stay identical across replicas;
        an expert active elsewhere runs here on zero rows (its input amax 0)."""
        local = tuple(n > 0 for n in counts)
        reducer = self.protocol.amax_reducer
        if reducer is None or not self.protocol.recipe.quantized:
            return local
        mask = torch.tensor(local, dtype=torch.int32, device=reducer.device or device)
        dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=reducer.group)
        return tuple(bool(v) for v in mask.tolist())

    def _enter(self, projection: str, counts: tuple, rows: tuple, active: tuple[bool, ...], roles: tuple, device):
        """Enter the call of every active expert of ``projection`` (an idle one is not entered:
        it observes, records and commits nothing); ``rows``: each expert's rows in the call's
        operands (its count, or padded: :meth:`grouped`). A recompute must see the true forward's
        counts.

        Raises:
            StateTransitionError: a recompute that routes tokens otherwise than its true forward.
        """
        entries = []
        for e, n in enumerate(rows):
            if not active[e]:
                continue
            layer = self.expert_layers[projection][e]
            phase, record = self.protocol.enter_call(layer, roles, device)
            if phase is Phase.FORWARD:
                record.derived[_ROWS] = counts
            elif phase is Phase.RECOMPUTE and record.derived.get(_ROWS) != counts:
                raise StateTransitionError(
                    f"{layer}: the recompute routed {list(counts)} tokens to the experts, its true forward "
                    f"{list(record.derived.get(_ROWS) or ())}: routing must be deterministic (a router in high "
                    "precision on bitwise-equal inputs, ties broken by position)"
                )
            entries.append(_Entry(e, n, phase, record))
        observer = self.routing_observer
        if observer is not None and projection == self.projections[0] and entries and entries[0].phase is Phase.FORWARD:
            observer(self, counts)  # once per call (its first projection), never for a recompute
        return tuple(entries)

    def _projection(self, projection: str, weight: torch.Tensor, x: torch.Tensor, counts, rows, active):
        protocol = self.protocol
        quantized = protocol.recipe.quantized
        entries = self._enter(projection, counts, rows, active, LINEAR_ROLES if quantized else (), x.device)
        if not x.is_contiguous():
            x = x.contiguous()
        if not quantized:
            y = self._high_precision(weight, x, entries, rows)
        else:
            device = x.device.type
            grouped = bool(self.grouped_gemm)
            if torch.is_autocast_enabled(device):
                call = (protocol, entries, torch.get_autocast_dtype(device), protocol.config.gemm, grouped)
                y = autocast_off(device, _ExpertsProjectionFn.apply, x, weight, call)
            else:
                y = _ExpertsProjectionFn.apply(x, weight, (protocol, entries, x.dtype, protocol.config.gemm, grouped))
        if protocol.auditors:
            for en, y_e in zip(entries, y.split([en.rows for en in entries]), strict=True):
                protocol.observe_output(en.record, en.phase, y_e, en.record.used)
        return y

    def _high_precision(self, weight: torch.Tensor, x: torch.Tensor, entries: tuple, counts) -> torch.Tensor:
        """The ``bf16`` recipe's projection: one ``torch._grouped_mm`` over all experts where the
        device and dtype allow (:func:`~.grouped_gemm.bf16_grouped_problem`), else ``F.linear`` per
        active expert."""
        device = x.device.type
        if torch.is_autocast_enabled(device):
            dtypes = (torch.get_autocast_dtype(device),) * 2
        else:
            dtypes = (x.dtype, weight.dtype)
        if entries and self.grouped_gemm and bf16_grouped_problem(dtypes, weight.shape[1:], x.device) is None:
            return grouped_linear(x, weight, counts)
        parts = [
            F.linear(x_e, weight[en.expert])
            for en, x_e in zip(entries, x.split([en.rows for en in entries]), strict=True)
        ]
        return torch.cat(parts) if parts else x.new_empty((0, weight.shape[1]))
