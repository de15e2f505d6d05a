"""The recipe plug-in: one class answers, for one ``QuantConfig.recipe``, every question the
modules and the protocol used to answer with a per-tensor assumption.

A :class:`Recipe` says, per role, whether its scale is delayed state in the bank
(:meth:`Recipe.stateful`) and which encoder turns its tensor into low-precision data
(:meth:`Recipe.encoder`); it is the linear call's GEMM (:meth:`Recipe.linear_gemm`,
:meth:`Recipe.grad_input`, :meth:`Recipe.grad_weight`) and names what a call saves for its
backward; it says how FSDP2 all-gathers a weight (:meth:`Recipe.all_gather_problem`; a per-call
weight scale comes from the full weight's amax, :meth:`Recipe.gather_scales`) and which
telemetry fields a stateless owner reports (:meth:`Recipe.telemetry`). ``nn/``, the protocol
and the telemetry ask it; none of them tests for a recipe name.

A recipe registers itself with :func:`register` (its name then becomes a valid
``quant.recipe``); :func:`recipe_for` builds the one a config names.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..config import QuantConfig, register_recipe_name, require_choice
from ..encoders import encoder_for
from ..formats import fp8_format
from ..state import ATTENTION_ROLES
from .gemm import _mm_device

__all__ = ["RECIPE_CLASSES", "PerCallFp8Encoder", "PerCallScales", "Recipe", "recipe_for", "register"]

RECIPE_CLASSES: dict[str, type[Recipe]] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: make ``cls`` the recipe of ``quant.recipe=cls.name``."""
    register_recipe_name(cls.name, cls.modes)
    RECIPE_CLASSES[cls.name] = cls
    return cls


def recipe_for(config: QuantConfig) -> Recipe:
    """The recipe ``config.recipe`` names, bound to ``config``."""
    require_choice("recipe", config.recipe, tuple(RECIPE_CLASSES))
    return RECIPE_CLASSES[config.recipe](config)


class Recipe:
    """One quantization recipe (see the module doc). Subclasses set the class attributes and
    override what differs; the defaults are FP8 per-tensor delayed scaling's answers."""

    name: ClassVar[str]
    # The QuantConfig.mode values it allows: the naive modes reproduce delayed-scaling defects.
    modes: ClassVar[tuple[str, ...]] = ("safe",)
    # False: nothing is quantized (the bf16 control).
    quantized: ClassVar[bool] = True
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
    # reuses it (QuantProtocol._quantize). An instance's attribute is what a run does: this and
    # QuantConfig.weight_codes_once; False: every run of the call encodes the weight.
    weight_codes_once: ClassVar[bool] = False
    # What one line of the README's feature table says the recipe guarantees.
    summary: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.saves_inputs and cls.fuses_prologues:
            # the compiled op's backward takes the saved input in the slot a fused prologue's
            # input uses (nn/linear_call.py): a recipe cannot have both
            raise TypeError(f"{cls.__name__}: saves_inputs=True needs fuses_prologues=False")

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
        per-call scale, :meth:`gather_scales`; nn/fsdp.py)."""
        return None

    def gather_scales(self, shards: list[torch.Tensor], group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a weight scale that is not delayed state (``stateful("weight")`` False) under an
        FP8 all-gather: ``(scale, descale, amax)``, float32 ``[len(shards)]``, entry ``i`` the one
        the unsharded call would derive from the full weight whose shard on this rank is
        ``shards[i]``. Each rank passes its shards of the same weights in the same order; the
        full amaxes take one collective over ``group`` (the shard group; ``None``: the shards
        are whole weights, no collective). Each shard is then encoded at its scale by the
        weight's encoder (``encoder("weight").encode``): elementwise, so the gathered codes are
        bitwise the unsharded call's."""
        raise NotImplementedError(f"recipe {self.name!r} derives no per-call weight scale for an FP8 all-gather")

    def telemetry(self, snap) -> dict[str, torch.Tensor]:
        """A stateless owner's fields on a log step, from its latest true-forward snapshot
        (each a float32 scalar on the device); stateful owners report the bank's scale and amax."""
        return {}

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
