"""The recipe plug-in: one class answers, for one ``QuantConfig.recipe``, every question the
modules and the protocol used to answer with a per-tensor assumption.

A :class:`Recipe` says, per role, whether its scale is delayed state in the bank
(:meth:`Recipe.stateful`) and which encoder turns its tensor into low-precision data
(:meth:`Recipe.encoder`); it is the linear call's GEMM (:meth:`Recipe.linear_gemm`,
:meth:`Recipe.grad_input`, :meth:`Recipe.grad_weight`) and names what a call saves for its
backward; it says how FSDP2 all-gathers a weight (:meth:`Recipe.all_gather_problem`; a per-call
weight scale comes from the full weight's amax, :meth:`Recipe.gather_scales`; scales of a
shard's own blocks travel with its codes, :attr:`Recipe.shard_scales`) and which
telemetry fields a stateless owner reports (:meth:`Recipe.telemetry`). ``nn/``, the protocol
and the telemetry ask it; none of them tests for a recipe name.

A recipe registers itself with :func:`.registry.register` (its name then becomes a valid
``quant.recipe``); :func:`.registry.recipe_for` builds the one a config names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import QuantConfig
from ..encoders import encoder_for
from ..formats import PER_TENSOR, ScaleLayout, fp8_format
from ..state import ATTENTION_ROLES
from .gemm import _mm_device

__all__ = [
    "LINEAR_GEMM_ROLES",
    "GemmLayouts",
    "Operand",
    "PerCallFp8Encoder",
    "PerCallScales",
    "Recipe",
]

LINEAR_GEMM_ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class Operand:
    """One operand of a linear call's GEMM: whose data it is (``role``) and how its scales
    cover that role's tensor as the role stores it (``scales``; ``None``: the GEMM reads the
    role in high precision)."""

    role: str
    scales: ScaleLayout | None


@dataclass(frozen=True)
class GemmLayouts:
    """The operands of a linear call's three GEMMs, as data: ``forward`` ``y = x @ W^T``,
    ``grad_input`` ``dX = g @ W``, ``grad_weight`` ``dW = g^T @ x``; each a pair
    ``(left, right)`` of :class:`Operand`. A per-row recipe scales ``W`` per row in the forward
    and per column in the input gradient: the same role, two layouts, two encodes."""

    forward: tuple[Operand, Operand]
    grad_input: tuple[Operand, Operand]
    grad_weight: tuple[Operand, Operand]

    @classmethod
    def uniform(cls, layout: ScaleLayout) -> GemmLayouts:
        """Every operand of every GEMM at ``layout`` (per-tensor recipes)."""
        x, w, g = (Operand(role, layout) for role in LINEAR_GEMM_ROLES)
        return cls((x, w), (g, w), (g, x))

    def operands(self, role: str) -> tuple[Operand, ...]:
        """Every GEMM operand that reads ``role``."""
        return tuple(op for pair in (self.forward, self.grad_input, self.grad_weight) for op in pair if op.role == role)


class Recipe:
    """One quantization recipe (see the module doc). Subclasses set the class attributes and
    override what differs; the defaults are FP8 per-tensor delayed scaling's answers."""

    name: ClassVar[str]
    # The QuantConfig.mode values it allows: the naive modes reproduce delayed-scaling defects.
    modes: ClassVar[tuple[str, ...]] = ("safe",)
    # False: nothing is quantized (the bf16 control).
    quantized: ClassVar[bool] = True
    # (forward, backward): the FP8 formats QuantConfig's forward_format / backward_format "auto"
    # resolve to under this recipe (the registry tells config.py as the recipe registers)
    formats: ClassVar[tuple[str, str]] = ("e4m3", "e5m2")
    # Whether a LayerNorm/GELU that produces a Linear's input is fused into the input's encode
    # (False: the module runs it on its own, then the call quantizes its output).
    fuses_prologues: ClassVar[bool] = True
    # Whether torch.compile runs a linear call as the opaque fp8state::fp8_linear op (its saved
    # tensors are the input and weight codes); False: a graph break, the call run eagerly.
    compiled_op: ClassVar[bool] = True
    # Whether a call saves its high-precision input and weight (saved_for_backward returns them)
    # rather than codes: the compiled op then saves the op's own inputs (its outputs may not
    # alias them) and returns only a key for the backward.
    saves_inputs: ClassVar[bool] = False
    # Whether the recipe can make a training call's weight codes once per event: the true
    # forward's encode (with the stage weight_stage names) is kept for its recompute, which
    # reuses it (Quantizer.quantize, protocol/encode.py). An instance's attribute is what a run does: this and
    # QuantConfig.weight_codes_once; False: every run of the call encodes the weight.
    weight_codes_once: ClassVar[bool] = False
    # What one line of the README's feature table says the recipe guarantees.
    summary: ClassVar[str] = ""
    # The scale layout of each linear role's snapshot (what its encode in the forward, or of
    # grad_output in the backward, pairs with the codes): the audit decodes with it, the FSDP2
    # gather and the telemetry read it. No code outside quant_recipes/ assumes a layout.
    scale_layouts: ClassVar[Mapping[str, ScaleLayout]] = dict.fromkeys(LINEAR_GEMM_ROLES, PER_TENSOR)
    # The operands of the linear call's three GEMMs (the forward's are the snapshots' layouts).
    gemm_layouts: ClassVar[GemmLayouts] = GemmLayouts.uniform(PER_TENSOR)
    # Whether an FP8 all-gather encodes each weight shard at scales of its own (blocks inside
    # the shard's rows, from the shard's values: its encoder's encode_dynamic), which travel with
    # its codes (all_gather_inputs / all_gathered); False: at one scale per weight (the frozen
    # delayed one, or the full weight's per-call one, gather_scales), sent as metadata.
    shard_scales: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.saves_inputs and cls.fuses_prologues:
            # the compiled op's backward takes the saved input in the slot a fused prologue's
            # input uses (nn/linear_call.py): a recipe cannot have both
            raise TypeError(f"{cls.__name__}: saves_inputs=True needs fuses_prologues=False")
        for op in cls.gemm_layouts.forward:
            if op.scales != cls.scale_layouts[op.role]:  # the forward consumes the snapshot
                raise TypeError(
                    f"{cls.__name__}: the forward GEMM reads {op.role!r} at {op.scales and op.scales.name!r}, "
                    f"not its snapshot's layout {cls.scale_layouts[op.role].name!r}"
                )

    def __init__(self, config: QuantConfig) -> None:
        self.config = config
        self._encoders: dict[str, object] = {}
        self.weight_codes_once = type(self).weight_codes_once and config.weight_codes_once

    # -- per role ---------------------------------------------------------------------
    def stateful(self, role: str) -> bool:
        """Whether ``role``'s scale is delayed state (an owner in the bank, committed once per
        event); False: each call derives it from its own tensor (nothing to commit)."""
        return True

    def encoder(self, role: str):
        """The encoder of ``role`` (cached). FP4 attention operands keep their delayed encoders
        under every recipe."""
        enc = self._encoders.get(role)
        if enc is None:
            enc = self._encoders[role] = self._make_encoder(role)
        return enc

    def _make_encoder(self, role: str):
        return encoder_for(self.config, role)

    def weight_stage(self, weight: torch.Tensor):
        """The stage a training call's weight encode runs (its data feeds the forward GEMM and,
        saved, the input gradient's; the recompute reuses it): ``None``, the plain encode."""
        return None

    def grad_output_stage(self, column_sum: bool):
        """The stage the grad_output encode runs (its data feeds both backward GEMMs and, with
        ``column_sum``, gives the bias gradient): ``None`` where the role needs none."""
        return None

    # -- the linear call's GEMMs -------------------------------------------------------
    def bias_in_epilogue(self, device: torch.device, backend: str) -> bool:
        """Whether the forward GEMM adds the bias in a 16-bit epilogue on ``device`` (then the
        call converts it once per event); else the GEMM adds it in float32."""
        return backend != "emulated" and _mm_device(device)

    def linear_gemm(self, xq, wq, sx, sw, out_dtype: torch.dtype, backend: str, bias):
        """``y = x @ w^T (+ bias)`` from the input's and weight's encoded data and snapshots."""
        raise NotImplementedError

    def saved_for_backward(self, xq, wq, x2: torch.Tensor, weight: torch.Tensor) -> tuple:
        """``(for the weight gradient, for the input gradient)``: what a call saves of its input
        and weight (default: their codes)."""
        return xq, wq

    def grad_weight(self, g_w, x_saved, sg, sx, out_dtype: torch.dtype, backend: str):
        """``dW = g^T @ x`` from grad_output's weight-gradient operand and the saved input."""
        raise NotImplementedError

    def grad_input(self, g_x, w_saved, sg, sw, out_dtype: torch.dtype, backend: str):
        """``dX = g @ W`` from grad_output's input-gradient operand and the saved weight."""
        raise NotImplementedError

    def graph_problem(self) -> str | None:
        """Why a whole-step CUDA graph (``GraphedStep``, ``trainer.cuda_graphs=true``) must not
        replay this recipe (``None``: it may)."""
        return None

    # -- distributed and telemetry ------------------------------------------------------
    def all_gather_problem(self) -> str | None:
        """Why FSDP2 cannot all-gather this recipe's weights as FP8 (``None``: it can: at the
        event's frozen weight scale where the weight is ``stateful``, else at the full weight's
        per-call scale, :meth:`gather_scales`; or at scales of each shard's own blocks,
        :attr:`shard_scales`; nn/fsdp.py). Read from the layouts: an FP8 all-gather brings the
        weight's codes at its snapshot's layout only, so every GEMM must read the weight at that
        layout, and the gathered scale is one per weight unless the shards carry their own."""
        if not self.quantized:
            return None
        stored = self.scale_layout("weight")
        others = sorted(
            {op.scales.name if op.scales else "high precision" for op in self.gemm_layouts.operands("weight")}
            - {stored.name}
        )
        if others:
            return (
                f"recipe={self.name!r}: the GEMMs read the weight at {others} besides its {stored.name!r} scales, "
                "which an FP8 all-gather does not bring (they need the high-precision weight); the weights gather "
                "in high precision (fp8_all_gather=False)"
            )
        if not stored.per_tensor and not self.shard_scales:
            return (
                f"recipe={self.name!r}: the weight's {stored.name!r} scales are not gathered with its codes yet; "
                "the weights gather in high precision (fp8_all_gather=False)"
            )
        return None

    def gather_scales(self, shards: list[torch.Tensor], group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a per-tensor weight scale (:meth:`all_gather_problem` allows no other) that is
        not delayed state (``stateful("weight")`` False) under an FP8 all-gather:
        ``(scale, descale, amax)``, float32 ``[len(shards)]``, entry ``i`` the one
        the unsharded call would derive from the full weight whose shard on this rank is
        ``shards[i]``. Each rank passes its shards of the same weights in the same order; the
        full amaxes take one collective over ``group`` (the shard group; ``None``: the shards
        are whole weights, no collective). Each shard is then encoded at its scale by the
        weight's encoder (``encoder("weight").encode``): elementwise, so the gathered codes are
        bitwise the unsharded call's."""
        raise NotImplementedError(f"recipe {self.name!r} derives no per-call weight scale for an FP8 all-gather")

    def shard_gather_problem(self, full_shape: tuple, shard_rows: list[int]) -> str | None:
        """Why one weight (``full_shape``, its rows split over the shard group as ``shard_rows``,
        rank by rank) gathers in high precision although :meth:`all_gather_problem` allows FP8
        (``None``: FP8). Per-tensor scales cover any split (an uneven one is refused by
        nn/fsdp.py); block scales need shards made of whole blocks."""
        return None

    def all_gather_inputs(self, codes: torch.Tensor, snap) -> tuple[torch.Tensor, ...]:
        """What one rank sends of its shard's ``codes`` and their ``snap``: tensors split along
        dim 0 as the weight's rows, each concatenated across ranks by the all-gather. Default:
        the codes as bytes (one scale per weight: the snapshot travels as metadata, the same on
        every rank)."""
        return (codes.view(torch.uint8),)

    def all_gathered(self, outputs: tuple[torch.Tensor, ...], snap, dtype: torch.dtype):
        """``(codes, snapshot)`` of the full weight from the gathered :meth:`all_gather_inputs`
        (``outputs``) and this rank's shard's ``snap``. The snapshot's tensors must not be views
        of ``outputs``: the all-gather frees that memory after each use."""
        return outputs[0].view(dtype), snap

    def telemetry(self, snap) -> dict[str, torch.Tensor]:
        """A stateless owner's fields on a log step, from its latest true-forward snapshot
        (each a float32 scalar on the device); stateful owners report the bank's scale and amax."""
        return {}

    def scale_layout(self, role: str) -> ScaleLayout:
        """How ``role``'s snapshot scales cover its data (the FP4 attention operands: per
        tensor, their block scales travel with their packed codes)."""
        return self.scale_layouts.get(role, PER_TENSOR)

    @staticmethod
    def attention_role(role: str) -> bool:
        return role in ATTENTION_ROLES


class PerCallFp8Encoder:
    """What every per-call FP8 encoder shares: its format and margin, no layout or center, no
    state; a subclass gives ``encode_dynamic(x, stage)`` (the data and ``(scale, descale, amax)``)."""

    layout = None
    centered = False
    stateful = False

    def __init__(self, name: str, margin: int) -> None:
        self.name = name
        self.dtype = fp8_format(name).dtype
        self.margin = margin


class PerCallScales:
    """Mixin of the recipes whose scales come from each call's own tensor (stateless, nothing in
    the bank): every linear role gets ``per_call_encoder`` in its format; the FP4 attention
    operands keep their delayed encoders. Put it before the recipe base it completes."""

    per_call_encoder: ClassVar[type]

    def stateful(self, role: str) -> bool:
        return self.attention_role(role)

    def _make_encoder(self, role: str):
        if self.attention_role(role):
            return super()._make_encoder(role)
        config = self.config
        name = config.backward_format if role == "grad_output" else config.forward_format
        return self.per_call_encoder(name, config.margin)
