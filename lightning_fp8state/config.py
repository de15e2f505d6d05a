"""QuantConfig: the one plain dataclass that configures the quantizer protocol.

Every choice and bound of the configuration is a constant here (or in ``formats``), checked
once, in ``QuantConfig.__post_init__``; the op checks in ``ops/`` read the same constants, and
``tests/unit/test_config_rules.py`` holds the CUDA kernels' own checks in ``csrc/`` to them.
The ``require_*`` helpers are how every config dataclass (the model's, the CLI's sections)
and every function of the package checks an argument, so that each error is a ``ConfigError``
naming the key, what was found and what is allowed. ``FIELD_GROUPS`` sorts QuantConfig's flat
fields by concern (scaling, attention, selection, execution, sharing, diagnostics), each also a
read-only section of a config (``cfg.scaling``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .errors import ConfigError
from .formats import FP4_LAYOUTS, FP8_FORMATS

__all__ = [
    "AMAX_ALGOS",
    "AMAX_REDUCTIONS",
    "CENTER_MOMENTUM_MAX",
    "FIELD_GROUPS",
    "FP4_LAYOUT_NAMES",
    "FORMAT_AUTO",
    "FP8_NAMES",
    "INITIAL_SCALES",
    "MARGIN_MAX",
    "MODES",
    "OWNERSHIP_SCOPES",
    "SIZE_RULES",
    "WORLD_SIZE_MERGES",
    "FALLBACK_TARGETS",
    "GROUP_OF",
    "ConfigSection",
    "PrecisionPolicy",
    "QuantConfig",
    "require_bool",
    "require_callable",
    "require_choice",
    "require_int",
    "require_name",
    "require_number",
    "require_strings",
    "recipe_formats",
    "require_that",
    "require_type",
    "set_recipe_formats",
]

# safe: the protocol. naive and naive_snapshot reproduce the seed's defects on purpose.
MODES = ("safe", "naive", "naive_snapshot")
AMAX_ALGOS = ("max", "most_recent")
# Which OwnerKey fields tell owners apart. per_model exists only to reproduce the defect.
OWNERSHIP_SCOPES = ("per_model", "per_layer", "per_layer_rank", "per_layer_rank_stream")
FP8_NAMES = tuple(FP8_FORMATS)  # ("e4m3", "e5m2")
# quant.forward_format / backward_format "auto": the formats the recipe names (its class's
# ``formats``, told here by the recipe registry as each recipe registers; a name not registered
# takes the per-tensor recipes' e4m3 / e5m2, and the registry refuses it when a recipe is built)
FORMAT_AUTO = "auto"
_RECIPE_FORMATS: dict[str, tuple[str, str]] = {}
_DEFAULT_FORMATS = ("e4m3", "e5m2")


def set_recipe_formats(recipe: str, forward: str, backward: str) -> None:
    """Make ``forward`` / ``backward`` what ``quant.*_format=auto`` means under ``recipe``."""
    require_choice("forward_format", forward, FP8_NAMES)
    require_choice("backward_format", backward, FP8_NAMES)
    _RECIPE_FORMATS[recipe] = (forward, backward)


def recipe_formats(recipe: str) -> tuple[str, str]:
    """The ``(forward, backward)`` formats ``auto`` resolves to under ``recipe``."""
    return _RECIPE_FORMATS.get(recipe, _DEFAULT_FORMATS)


GEMM_BACKENDS = ("auto", "emulated", "scaled_mm")
# How a role's pending amax is combined across processes before its commit.
# none: each rank keeps its own history. data_parallel: MAX over the data-parallel group.
AMAX_REDUCTIONS = ("none", "data_parallel")
# Weights are replicated across data-parallel ranks: reducing their amax keeps every
# replica's weight quantization identical (even if replicas drift) and costs one collective
# per commit. Inputs and gradients depend on each rank's data; a per-rank scale fits that
# rank's data best, so reducing them is opt-in.
DEFAULT_AMAX_REDUCTION = (("weight", "data_parallel"),)
# A resume on another world size (state/reshard.py): owners whose state is the same on every
# saved rank are copied; those that differ are merged (max: elementwise max of the amax
# histories, the scale of the largest amax) or the resume is refused (refuse).
WORLD_SIZE_MERGES = ("max", "refuse")
# What a fallen-back layer runs as (QuantConfig.fallback_to): bf16, high precision (the bf16
# recipe's plain F.linear); current, per-tensor FP8 scaled from each call's own amax (the
# fp8_current recipe's encoders and GEMM, for that layer only: no delayed state to go stale).
FALLBACK_TARGETS = ("bf16", "current")
FP4_LAYOUT_NAMES = tuple(FP4_LAYOUTS)  # ("nvfp4", "mxfp4")
# scale = fmax / amax / 2**margin, margin in [0, MARGIN_MAX]. The CUDA update_scales takes
# 2**margin as a float32 (ldexpf) and checks margin < MARGIN_MAX + 1 (csrc/fp8_ops.cu);
# the reference op and QuantConfig check the same bound.
MARGIN_MAX = 126
# The running center's step at a commit: c += momentum * (midrange - c), momentum in
# (0, CENTER_MOMENTUM_MAX] (update_centers: ops/library_fp4.py, csrc/fp4_ops.cu).
CENTER_MOMENTUM_MAX = 1.0
# The scale of an owner that has none yet (its first event). calibrate: from that call's own
# amax; one: 1.0 until the first commit.
INITIAL_SCALES = ("calibrate", "one")


def _refuse(key: str, value: object, expected: str, why: str) -> ConfigError:
    """The one message of every check: the key, what was found, what is allowed (and why)."""
    return _refusal(key, _shown(value), expected, why)


def _refusal(key: str, shown: str, expected: str, why: str) -> ConfigError:
    return ConfigError(f"{key}={shown} is not allowed: expected {expected}" + (f" ({why})" if why else ""))


def require_that(ok: bool, key: str, found: object, expected: str, *, why: str = "") -> None:
    """The general check, for a condition the helpers below do not name: ``ConfigError``
    naming ``key`` unless ``ok``, in their one message. ``found`` is shown as ``str`` shows it:
    the ops pass tensor attributes (a dtype, a device, a shape tuple) and quoted names, as their
    CUDA kernels print them (``csrc/``: the same message, bit for bit)."""
    if not ok:
        raise _refusal(key, str(found), expected, why)


def _shown(value: object) -> str:
    """``value``'s repr, or its type's name where the repr is long or spans lines (a module)."""
    text = repr(value)
    return text if len(text) <= 80 and "\n" not in text else f"<{type(value).__name__}>"


def _or_none(expected: str, optional: bool) -> str:
    return f"{expected} or None" if optional else expected


def require_choice(key: str, value: object, allowed: tuple, *, why: str = "") -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is one of ``allowed`` (a bool
    matches only a bool: ``True`` is not the choice ``1``)."""
    if (value is None or isinstance(value, str)) and value in allowed:  # the usual case, checked fast
        return
    if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        raise _refuse(key, value, f"one of {list(allowed)}", why)


def require_int(
    key: str, value: object, low: int, high: int | None = None, *, optional: bool = False, why: str = ""
) -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is an integer in ``[low, high]``
    (or ``None``, where ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f">= {low} and <= {high}"
        raise _refuse(key, value, _or_none(f"an integer {bound}", optional), why)


def require_number(
    key: str,
    value: object,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    optional: bool = False,
    why: str = "",
) -> float | None:
    """``value`` as a float; ``ConfigError`` naming ``key`` unless it is a number in the range
    (``low`` excluded when ``low_open``, ``high`` included), or ``None`` where ``optional``."""
    if optional and value is None:
        return None
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        if high is None:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            bound = f"in ({low:g}, {high:g}]" if low_open else f"in [{low:g}, {high:g}]"
        raise _refuse(key, value, _or_none(f"a finite number {bound}", optional), why)
    return float(value)


def require_bool(key: str, value: object, *, why: str = "") -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise _refuse(key, value, "true or false", why)


def require_type(key: str, value: object, types: type | tuple[type, ...], what: str, *, why: str = "") -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is an instance of ``types``
    (``what`` says so in words: ``"a QuantConfig"``). A bool is not an ``int`` here."""
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed and int in allowed):
        raise _refuse(key, value, what, why)


def require_callable(key: str, value: object, what: str = "a function", *, why: str = "") -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is callable."""
    if not callable(value):
        raise _refuse(key, value, what, why)


def require_strings(
    key: str, value: object, what: str = "a list of strings", *, optional: bool = False, nonempty: bool = False
) -> tuple[str, ...] | None:
    """``value`` (a list, tuple or other iterable of strings) as a tuple; ``ConfigError`` naming ``key``
    otherwise: a bare string is refused (``"blocks.*"`` is not a list of patterns), as is an
    empty list where ``nonempty``. ``None`` passes where ``optional``."""
    if optional and value is None:
        return None
    items = None
    if not isinstance(value, (str, bytes)):
        try:
            items = tuple(value)
        except TypeError:
            items = None
    if items is None or not all(isinstance(s, str) for s in items) or (nonempty and not items):
        raise _refuse(key, value, _or_none(what, optional), "")
    return items


def require_name(key: str, value: object, what: str = "a non-empty string", *, why: str = "") -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``value`` is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise _refuse(key, value, what, why)


def _reduction_pairs(value: object) -> tuple[tuple[str, str], ...]:
    """Normalize ``amax_reduction`` (a mode, a mapping or (role, mode) pairs) to sorted pairs."""
    if isinstance(value, str):
        require_choice("amax_reduction", value, AMAX_REDUCTIONS)
        return (("*", value),)
    try:
        items = list(value.items()) if hasattr(value, "items") else [tuple(p) for p in value]
    except TypeError as exc:
        raise ConfigError(
            f"amax_reduction={value!r} is not allowed: expected a mode {list(AMAX_REDUCTIONS)} "
            "or a mapping role -> mode"
        ) from exc
    pairs = {}
    for item in items:
        if len(item) != 2 or not isinstance(item[0], str) or not item[0]:
            raise ConfigError(f"amax_reduction entry {item!r} is not allowed: expected role -> mode")
        role, mode = item
        require_choice(f"amax_reduction[{role!r}]", mode, AMAX_REDUCTIONS)
        pairs[role] = mode
    return tuple(sorted(pairs.items()))


# The concerns of QuantConfig, each field in exactly one, in the order the fields are declared
# (tests/unit/test_config_groups.py holds the class to it). Each concern is also a read-only
# section of a config (``cfg.scaling``, ``cfg.selection``, ...): code that needs one concern
# takes that section. Users still write the flat keys (``quant.margin=2``); the sections add none.
FIELD_GROUPS: dict[str, tuple[str, ...]] = {
    # what a quantized tensor's scale is and how it is derived from the amax history
    "scaling": ("recipe", "forward_format", "backward_format", "history_len", "amax_algo", "margin", "initial_scale"),
    # the packed-FP4 attention operands (Fp4AttentionQuantizer): layout, centering, which operands
    "attention": ("attn_format", "attn_centered", "attn_center_momentum", "attn_quantize_v"),
    # which modules are converted (patterns, and the policy keeping some in high precision)
    "selection": ("include", "exclude", "policy"),
    # how a quantized linear call runs: the GEMM backend, fused prologues (no change to what is stored)
    "execution": ("gemm", "fuse_prologues", "weight_codes_once"),
    # who shares delayed state: the ownership scope (layers, ranks, streams) and the amax reduction across ranks
    "sharing": ("ownership", "amax_reduction", "world_size_merge"),
    # an opt-in way out for a layer that FP8 fails on: moved to high precision at an event boundary
    "resilience": (
        "fallback",
        "fallback_to",
        "fallback_on_nonfinite",
        "fallback_saturation",
        "fallback_patience",
    ),
    # the protocol's policy towards violations: the rules or the seed's defects, raise or count, ledger detail
    "diagnostics": ("mode", "strict", "ledger_window"),
}


class ConfigSection:
    """A read-only view of one concern of a :class:`QuantConfig` (see ``FIELD_GROUPS``): its
    fields as attributes, and no other field (``cfg.selection.margin`` is an ``AttributeError``)."""

    __slots__ = ("_config", "_name")

    def __init__(self, config: QuantConfig, name: str) -> None:
        require_choice("section", name, tuple(FIELD_GROUPS))
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, key: str):
        if key.startswith("_"):  # (a slot not set yet: copy and pickle look for hooks first)
            raise AttributeError(key)
        if key in FIELD_GROUPS[self._name]:
            return getattr(self._config, key)
        where = f" (it is in QuantConfig.{GROUP_OF[key]})" if key in GROUP_OF else ""
        raise AttributeError(
            f"QuantConfig.{self._name} has no field {key!r}: it holds {list(FIELD_GROUPS[self._name])}{where}"
        )

    def __reduce__(self):
        return ConfigSection, (self._config, self._name)

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"QuantConfig.{self._name} is read-only: build another QuantConfig")

    def keys(self) -> tuple[str, ...]:
        """The section's field names, in declaration order."""
        return FIELD_GROUPS[self._name]

    def as_dict(self) -> dict[str, object]:
        """The section's fields and values."""
        return {k: getattr(self._config, k) for k in self.keys()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConfigSection):
            return NotImplemented
        return self._name == other._name and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash((self._name, tuple(self.as_dict().items())))

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(f'{k}={v!r}' for k, v in self.as_dict().items())})"


GROUP_OF: dict[str, str] = {key: group for group, keys in FIELD_GROUPS.items() for key in keys}


# quant.policy.by_size: off (no size rule), auto (the device's measured GEMM table if the shipped
# one has it, else a rule of thumb), or the path of a GEMM table file (nn/policy.py reads it).
SIZE_RULES = ("off", "auto")
TABLE_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class PrecisionPolicy:
    """``quant.policy``: which of the selected layers stay in high precision, by their position
    in the model's stack of blocks and by their GEMM shapes (``nn/policy.py`` applies it; each
    layer it keeps is reported with the rule that kept it). The default keeps nothing."""

    # The first and last N blocks of the model's repeated block list keep their layers in high
    # precision (Megatron's first/last layers in bf16: the ends of the stack are the most sensitive).
    keep_first: int = 0
    keep_last: int = 0
    # The last ceil(f * n_blocks) blocks, in [0, 1] (united with keep_first/keep_last).
    keep_last_fraction: float = 0.0
    # The block list's module path ("model.layers"); empty: found (the longest nn.ModuleList of
    # one block type, not inside another).
    blocks: str = ""
    # Keep the layers whose FP8 GEMMs are predicted to gain less than min_gain over high
    # precision: off | auto | a GEMM table file (see SIZE_RULES). An unquoted YAML `off` (read as
    # false) means off.
    by_size: str = "off"
    # The least predicted speed-up (bf16 time / FP8 time, forward and both backward GEMMs) for
    # which a layer is converted by the table rule.
    min_gain: float = 1.05
    # The GEMMs' M (tokens per micro-batch per rank: batch x sequence length) at which the table
    # rule predicts; 0: not given (the CLI sets it from data.batch_size x model.seq_len).
    tokens: int = 0

    def __post_init__(self) -> None:
        for key in ("keep_first", "keep_last", "tokens"):
            require_int(f"policy.{key}", getattr(self, key), 0)
        fraction = require_number("policy.keep_last_fraction", self.keep_last_fraction, 0, 1)
        object.__setattr__(self, "keep_last_fraction", fraction)
        require_type("policy.blocks", self.blocks, str, "a module path (empty: found)")
        by_size = "off" if self.by_size in (False, "False", "false") else self.by_size
        expected = f"one of {list(SIZE_RULES)} or the path of a GEMM table file (.yaml, .yml or .json)"
        require_name("policy.by_size", by_size, expected)
        require_that(
            by_size in SIZE_RULES or by_size.endswith(TABLE_SUFFIXES), "policy.by_size", repr(by_size), expected
        )
        object.__setattr__(self, "by_size", by_size)
        gain = require_number("policy.min_gain", self.min_gain, 0, low_open=True)
        object.__setattr__(self, "min_gain", gain)

    @classmethod
    def of(cls, value: object) -> PrecisionPolicy:
        """``value`` as a PrecisionPolicy: one already, a mapping of its keys (an unknown key is a
        ``ConfigError`` naming it) or None (the default: nothing kept)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if not hasattr(value, "items"):
            raise _refuse("policy", value, f"a mapping of {[f.name for f in fields(cls)]}", "")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ConfigError(f"policy: unknown keys {unknown}: expected {sorted(known)}")
        return cls(**dict(value))

    def keeps_by_position(self) -> bool:
        """Whether a position rule is set (then the model must have a block list)."""
        return bool(self.keep_first or self.keep_last or self.keep_last_fraction)

    def is_off(self) -> bool:
        """Whether the policy keeps nothing (no position rule, no size rule)."""
        return not self.keeps_by_position() and self.by_size == "off"


@dataclass(frozen=True)
class QuantConfig:
    """How layers are quantized and how their delayed state is owned and advanced.

    The fields are flat (the keys users write: ``QuantConfig(margin=2)``, ``quant.margin=2``,
    the YAML and the stored checkpoints) and declared by concern (``FIELD_GROUPS``); each
    concern is also a read-only section, for code that needs only that one:

    - ``scaling``: recipe, forward_format, backward_format, history_len, amax_algo, margin,
      initial_scale — what a scale is and how it follows the amax history;
    - ``attention``: attn_format, attn_centered, attn_center_momentum, attn_quantize_v — the
      packed-FP4 attention operands;
    - ``selection``: include, exclude, policy — which modules are converted;
    - ``execution``: gemm, fuse_prologues, weight_codes_once — how a quantized call runs;
    - ``sharing``: ownership, amax_reduction, world_size_merge — who shares delayed state,
      across layers, ranks and streams, and how it maps onto another number of ranks;
    - ``resilience``: fallback, fallback_to, fallback_on_nonfinite, fallback_saturation,
      fallback_patience — an opt-in move of a layer FP8 fails on to high precision or to
      per-call current scaling;
    - ``diagnostics``: mode, strict, ledger_window — the protocol's policy on violations.

    Every field is validated on construction; a bad value raises ``ConfigError`` naming
    the field and what it allows.
    """

    # -- scaling -------------------------------------------------------------------------
    # fp8_delayed: FP8 delayed scaling. bf16: no quantization at all (the control).
    # fp8_current: per-tensor scales from each call's own amax (stateless). fp8_rowwise: one
    # scale per row of the input and grad_output, per output channel of the weight (stateless);
    # fp8_rowwise_gw_hp: the same, its weight-gradient GEMM in high precision. The recipes are
    # lightning_fp8state.quant_recipes; its recipe_names() lists them, its check_recipe checks the name.
    recipe: str = "fp8_delayed"
    # FP8 formats of the forward roles (input, weight) and the backward role (grad_output).
    # auto: the recipe's own, resolved on construction (the field then holds the name): e4m3 /
    # e5m2 for the per-tensor recipes, e4m3 / e4m3 for rowwise and blockwise, whose cuBLASLt
    # GEMMs take E4M3 only. (dataclasses.replace keeps resolved names: pass auto again.)
    forward_format: str = FORMAT_AUTO
    backward_format: str = FORMAT_AUTO
    # Length of each owner's amax history (the window the scale is derived from).
    history_len: int = 16
    # max: the history's maximum; most_recent: the newest entry.
    amax_algo: str = "max"
    # scale = fmax / amax / 2**margin; a larger margin leaves headroom.
    margin: int = 0
    # The scale of an owner's first event, before any amax is in its history (safe mode).
    # calibrate: the first true-forward call (or backward quantize) computes it from its own
    # tensor, fmax / amax / 2**margin, one extra read of that tensor in the first event only;
    # it is frozen in that event's snapshot like any scale, so recompute reads it back. one:
    # scale 1 until the first commit (TransformerEngine's start): small tensors, gradients
    # above all, then flush to zero in the first step (E5M2's smallest subnormal is 2**-16).
    # The naive modes keep the seed's start (one) whatever this says.
    initial_scale: str = "calibrate"
    # -- attention -----------------------------------------------------------------------
    # Packed-FP4 attention operands (Fp4AttentionQuantizer): block layout of q, k (and v).
    # nvfp4: 16-element blocks, E4M3 block scales; mxfp4: 32-element blocks, E8M0 block scales.
    attn_format: str = "nvfp4"
    # Centered variant: quantize x - c, c a running per-channel center (owned, delayed state
    # advanced only at commit, snapshotted like the scale); for operands with large offsets.
    attn_centered: bool = False
    # At each commit: c += attn_center_momentum * (midrange of the event's x - c); in (0, 1].
    attn_center_momentum: float = 0.5
    # Also quantize v (role attn_v); q and k (attn_q, attn_k) always are.
    attn_quantize_v: bool = False
    # -- selection -----------------------------------------------------------------------
    # fnmatch patterns over module names: convert nn.Linear modules matching any include
    # pattern and no exclude pattern.
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    # Which selected layers stay in high precision, by block position and GEMM size: a
    # PrecisionPolicy or a mapping of its keys (quant.policy.keep_last=2); default: none.
    policy: PrecisionPolicy = PrecisionPolicy()
    # -- execution -----------------------------------------------------------------------
    # GEMM backend: auto uses torch._scaled_mm where the GPU has it, else the emulation.
    gemm: str = "auto"
    # Fuse the op that produces a Linear's input (a LayerNorm or a GELU, where the model asks
    # for it through ``linear_after``) into the input's quantize: one pass writes the FP8
    # codes and records their amax. false: the prologue runs on its own, then the quantize.
    fuse_prologues: bool = True
    # Make a weight's FP8 codes once per event where the recipe can (fp8_delayed): the true
    # forward encodes the weight with its transpose, the recompute reuses those codes, the
    # backward reads the transpose (bitwise the same result; a checkpointed call holds 2 bytes a
    # parameter from its forward to its backward). false: every run of a call encodes the weight.
    weight_codes_once: bool = True
    # -- sharing -------------------------------------------------------------------------
    # Which entrants get independent state; see OWNERSHIP_SCOPES. Applies to FP8 linears and
    # FP4 attention operands alike: per_layer* is the fix, per_model the defect (one state for
    # the whole model, kept only to demonstrate it).
    ownership: str = "per_layer_rank"
    # Per role, how pending amaxes are combined across the data-parallel group before each
    # commit (see AMAX_REDUCTIONS): a mapping role -> mode ("*" = every other role) or one
    # mode for all roles. Roles not named are "none". Stored as sorted (role, mode) pairs.
    amax_reduction: tuple[tuple[str, str], ...] = DEFAULT_AMAX_REDUCTION
    # A resume on another number of ranks (see WORLD_SIZE_MERGES): what happens to owners whose
    # saved state differs per rank. max: every new rank takes their elementwise max of the amax
    # histories (and the scale of the largest amax); refuse: the resume is refused, naming them.
    # Owners equal on every rank (amax reduced each event) are copied bitwise either way.
    world_size_merge: str = "max"
    # -- resilience ----------------------------------------------------------------------
    # Opt-in (protocol/fallback.py): a layer that FP8 fails on runs in high precision from the
    # next event on, on every rank at once; which layers and when is carried in the state.
    fallback: bool = False
    # What a fallen-back layer runs as (see FALLBACK_TARGETS): bf16, the plain high-precision
    # F.linear of the bf16 recipe; current, FP8 at each call's own per-tensor scale (the
    # fp8_current recipe's route, for that layer only). A move keeps its target in the state.
    fallback_to: str = "bf16"
    # Move a layer whose output goes non-finite in an event while its quantized operands' amaxes
    # are finite (the fault starts in that layer's FP8 call, not upstream of it).
    fallback_on_nonfinite: bool = True
    # Move a layer one of whose operands has more than this fraction of its elements encoded at
    # +-fmax (saturated) ...
    fallback_saturation: float = 0.01
    # ... in this many consecutive events.
    fallback_patience: int = 3
    # -- diagnostics ---------------------------------------------------------------------
    # safe: the protocol. naive: reproduces the seed's defects on purpose (advance before
    # consume, record in recompute) so the audit can prove it catches them. naive_snapshot:
    # the seed's first attempted fix, also on purpose: advance after every call, but keep one
    # snapshot per owner, taken before the advance, and replay it in recompute (right when
    # each owner is entered once per event, wrong when the owner is shared: per_model).
    mode: str = "safe"
    # Raise StateTransitionError on a protocol violation (else count it in the ledger).
    strict: bool = True
    # How many events of per-event ledger detail to keep (totals are always kept).
    ledger_window: int = 64
    # -----------------------------------------------------------------------------------
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        # scaling
        # a name: which exist, and the modes each allows, the recipe registry checks (check_recipe)
        require_name("recipe", self.recipe)
        for key, default in zip(("forward_format", "backward_format"), recipe_formats(self.recipe), strict=True):
            require_choice(key, getattr(self, key), (*FP8_NAMES, FORMAT_AUTO))
            if getattr(self, key) == FORMAT_AUTO:
                object.__setattr__(self, key, default)
        require_int("history_len", self.history_len, 1)
        require_choice("amax_algo", self.amax_algo, AMAX_ALGOS)
        require_int("margin", self.margin, 0, MARGIN_MAX)
        require_choice("initial_scale", self.initial_scale, INITIAL_SCALES)
        # attention
        require_choice("attn_format", self.attn_format, FP4_LAYOUT_NAMES)
        require_bool("attn_centered", self.attn_centered)
        m = require_number("attn_center_momentum", self.attn_center_momentum, 0, CENTER_MOMENTUM_MAX, low_open=True)
        object.__setattr__(self, "attn_center_momentum", m)
        require_bool("attn_quantize_v", self.attn_quantize_v)
        # selection
        for key in ("include", "exclude"):
            value = getattr(self, key)
            value = (value,) if isinstance(value, str) else value  # one pattern
            object.__setattr__(self, key, require_strings(key, value, "a list of patterns"))
        object.__setattr__(self, "policy", PrecisionPolicy.of(self.policy))
        # execution
        require_choice("gemm", self.gemm, GEMM_BACKENDS)
        require_bool("fuse_prologues", self.fuse_prologues)
        require_bool("weight_codes_once", self.weight_codes_once)
        # sharing
        require_choice("ownership", self.ownership, OWNERSHIP_SCOPES)
        object.__setattr__(self, "amax_reduction", _reduction_pairs(self.amax_reduction))
        require_choice("world_size_merge", self.world_size_merge, WORLD_SIZE_MERGES)
        # resilience
        require_bool("fallback", self.fallback)
        require_choice("fallback_to", self.fallback_to, FALLBACK_TARGETS)
        require_bool("fallback_on_nonfinite", self.fallback_on_nonfinite)
        sat = require_number("fallback_saturation", self.fallback_saturation, 0, 1, low_open=True)
        object.__setattr__(self, "fallback_saturation", sat)
        require_int("fallback_patience", self.fallback_patience, 1)
        # diagnostics
        require_choice("mode", self.mode, MODES)
        require_bool("strict", self.strict)
        require_int("ledger_window", self.ledger_window, 1)
        if self.extra:
            raise ConfigError(f"unknown QuantConfig keys {sorted(self.extra)}: expected {self.keys()}")

    @classmethod
    def keys(cls) -> list[str]:
        """The configurable field names."""
        return [f.name for f in fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, values: dict) -> QuantConfig:
        """Build from a plain mapping; unknown keys raise ``ConfigError`` naming them."""
        known = set(cls.keys())
        unknown = {k: v for k, v in values.items() if k not in known}
        return cls(**{k: v for k, v in values.items() if k in known}, extra=unknown)

    # -- the sections: read-only views of one concern each (FIELD_GROUPS) -----------------
    @property
    def scaling(self) -> ConfigSection:
        """recipe, formats, history_len, amax_algo, margin, initial_scale."""
        return ConfigSection(self, "scaling")

    @property
    def attention(self) -> ConfigSection:
        """attn_format, attn_centered, attn_center_momentum, attn_quantize_v."""
        return ConfigSection(self, "attention")

    @property
    def selection(self) -> ConfigSection:
        """include, exclude, policy."""
        return ConfigSection(self, "selection")

    @property
    def execution(self) -> ConfigSection:
        """gemm, fuse_prologues, weight_codes_once."""
        return ConfigSection(self, "execution")

    @property
    def sharing(self) -> ConfigSection:
        """ownership, amax_reduction (:meth:`reduction_of` reads it per role), world_size_merge."""
        return ConfigSection(self, "sharing")

    @property
    def resilience(self) -> ConfigSection:
        """fallback, fallback_to, fallback_on_nonfinite, fallback_saturation, fallback_patience."""
        return ConfigSection(self, "resilience")

    @property
    def diagnostics(self) -> ConfigSection:
        """mode, strict, ledger_window."""
        return ConfigSection(self, "diagnostics")

    def reduction_of(self, role: str) -> str:
        """How ``role``'s amax is reduced across data-parallel ranks: ``none`` or ``data_parallel``."""
        table = dict(self.amax_reduction)
        return table.get(role, table.get("*", "none"))
