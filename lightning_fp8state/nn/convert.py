"""convert_model: swap a model's Linear-like modules for protocol-driven ones, bind its FP4
attention quantizers, and report every candidate: converted, skipped or not quantizable, each
with its reason.

Candidates are ``nn.Linear`` (and subclasses), transformers' ``Conv1D`` (GPT-2; its weight is
``[in, out]``) and ``nn.MultiheadAttention``'s projections: its in-projection (a bare parameter,
``<mha>.in_proj`` or ``<mha>.q_proj|k_proj|v_proj``) and ``out_proj``, both quantized by making the
module an :class:`~lightning_fp8state.nn.Fp8MultiheadAttention` (nn/transformer.py). A candidate
whose weight is read outside its own ``forward`` would never quantize if swapped (the
projections of a *subclass* of ``nn.MultiheadAttention``, whose forward we cannot replace), so it
is left as it is and reported as not quantizable, never claimed. An ``nn.TransformerEncoderLayer``
holding converted layers becomes an :class:`~lightning_fp8state.nn.Fp8TransformerEncoderLayer`
(no eval fast path reading their weights) and an ``nn.TransformerEncoder`` of them stops
building nested tensors: both reported as rerouted. A subclass of the encoder layer with its
own forward cannot be rerouted: reported (``fast_path``) and warned about at its first eval
call. A Linear whose weight its parent's ``forward`` source reads (``self.<child>.weight``, its
values) is not converted either, and a module doing a Linear's work without being one (3-D
expert weights, ``F.linear`` on its own parameter) is reported. What no static rule can see is
caught after the first event by :meth:`ConversionReport.unowned` (a converted layer that never
ran through the protocol).

peft's LoRA adapters stay in high precision unless an include pattern naming LoRA selects them.
Patterns match a LightningModule's names with or without its attribute prefix; a pattern that
matches nothing, and a conversion that converts nothing, are warned about
(:class:`~lightning_fp8state.errors.ConversionWarning`).
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import functools
import inspect
import textwrap
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from ..errors import AlreadyConvertedError, ConversionWarning
from ..protocol import QuantProtocol
from .attention import Fp4AttentionQuantizer
from .conv1d import Fp8Conv1D, is_hf_conv1d
from .experts import KEEP_ATTRIBUTE, Fp8Experts, GroupedExperts
from .linear import Fp8Linear
from .policy import POLICY_WHY, decide
from .transformer import Fp8MultiheadAttention, Fp8TransformerEncoderLayer, mha_projections

__all__ = ["ConversionReport", "convert_model"]

CONVERTED, SKIPPED, NOT_QUANTIZABLE = "converted", "skipped", "not quantizable"
REROUTED, FAST_PATH = "rerouted", "eval fast path"


@dataclass
class ConversionReport:
    """Every candidate module of one conversion, by status, each with a reason.

    Attributes:
        converted: names of the layers now quantized (in model order).
        how: per converted layer, what it was and what it became.
        skipped: quantizable layers left alone, and why (include/exclude patterns, bound
            elsewhere).
        not_quantizable: layers that look quantizable but would not quantize if swapped,
            and why.
        attention: FP4 attention quantizers bound to the state.
        owner_layers: per converted entry whose calls take other layer names than the entry's
            own (``nn.MultiheadAttention``'s in-projection: ``<mha>.in_proj.q``, ...), those names.
        rerouted: modules holding converted layers whose torch fast path was turned off for them
            (per module), and how.
        fast_path: modules holding converted layers whose eval fast path could not be turned
            off, and why (warned about at their first eval call).
        warnings: what this conversion warned about (:class:`ConversionWarning` messages:
            patterns that matched nothing, a conversion that converted nothing).
        notes: what ``quant.policy`` used to decide (which GEMM table, or that the device has
            no measurement); the layers it kept are in ``skipped``, each with its rule.
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)
    not_quantizable: dict[str, str] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)
    owner_layers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    rerouted: dict[str, str] = field(default_factory=dict)
    fast_path: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def layers(self) -> list[str]:
        """Every layer name the converted entries' calls take (what their owners are keyed by)."""
        out = []
        for name in (*self.converted, *self.attention):
            out += self.owner_layers.get(name, (name,))
        return out

    def entries(self) -> list[tuple[str, str, str]]:
        """``(name, status, reason)`` for every candidate (status: converted | skipped |
        not quantizable)."""
        rows = [(n, CONVERTED, self.how.get(n, "converted")) for n in self.converted]
        rows += [(n, CONVERTED, "FP4 attention quantizer bound to the state") for n in self.attention]
        rows += [(n, SKIPPED, why) for n, why in self.skipped.items()]
        rows += [(n, NOT_QUANTIZABLE, why) for n, why in self.not_quantizable.items()]
        rows += [(n, REROUTED, why) for n, why in self.rerouted.items()]
        rows += [(n, FAST_PATH, why) for n, why in self.fast_path.items()]
        return rows

    def counts(self) -> dict[str, int]:
        kinds = Counter(self.how.get(n, "").split(" ->")[0] for n in self.converted)
        out = {CONVERTED: len(self.converted), SKIPPED: len(self.skipped), NOT_QUANTIZABLE: len(self.not_quantizable)}
        out.update({f"converted {k}": v for k, v in sorted(kinds.items()) if k})
        by_policy = sum(POLICY_WHY in why for why in self.skipped.values())
        if by_policy:
            out["kept by quant.policy"] = by_policy
        if self.attention:
            out["attention quantizers"] = len(self.attention)
        if self.rerouted:
            out[REROUTED] = len(self.rerouted)
        if self.fast_path:
            out[FAST_PATH] = len(self.fast_path)
        return out

    def summary(self) -> str:
        """One line with counts (the log line); the full list is :meth:`__str__` / :meth:`to_dict`."""
        kinds = Counter(self.how.get(n, "").split(" ->")[0] for n in self.converted)
        by_kind = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()) if k)
        line = f"converted {len(self.converted)} layer(s)" + (f" ({by_kind})" if by_kind else "")
        by_policy = sum(POLICY_WHY in why for why in self.skipped.values())
        line += f", skipped {len(self.skipped)}" + (f" ({by_policy} kept by quant.policy)" if by_policy else "")
        line += f", not quantizable {len(self.not_quantizable)}"
        if self.attention:
            line += f", bound {len(self.attention)} FP4 attention quantizer(s)"
        if self.rerouted:
            line += f", rerouted {len(self.rerouted)} module(s) off torch's fast path"
        if self.fast_path:
            line += f", {len(self.fast_path)} module(s) with an eval fast path bypassing FP8"
        return line

    def merge(self, other: ConversionReport) -> ConversionReport:
        """Add ``other``'s entries that this report does not have yet; returns the new part."""
        new = ConversionReport(
            [n for n in other.converted if n not in self.how and n not in self.converted],
            {k: v for k, v in other.skipped.items() if k not in self.skipped},
            [n for n in other.attention if n not in self.attention],
            {k: v for k, v in other.not_quantizable.items() if k not in self.not_quantizable},
        )
        new.how = {n: other.how[n] for n in new.converted if n in other.how}
        new.owner_layers = {n: other.owner_layers[n] for n in new.converted if n in other.owner_layers}
        new.rerouted = {k: v for k, v in other.rerouted.items() if k not in self.rerouted}
        new.fast_path = {k: v for k, v in other.fast_path.items() if k not in self.fast_path}
        self.converted += new.converted
        self.skipped.update(new.skipped)
        self.attention += new.attention
        self.not_quantizable.update(new.not_quantizable)
        self.how.update(new.how)
        self.owner_layers.update(new.owner_layers)
        self.rerouted.update(new.rerouted)
        self.fast_path.update(new.fast_path)
        new.warnings = [w for w in other.warnings if w not in self.warnings]
        self.warnings += new.warnings
        new.notes = [w for w in other.notes if w not in self.notes]
        self.notes += new.notes
        return new

    def to_dict(self) -> dict:
        """Plain data (JSON-ready): the counts and every entry."""
        return {
            "counts": self.counts(),
            "entries": [{"name": n, "status": s, "reason": r} for n, s, r in self.entries()],
            **({"notes": list(self.notes)} if self.notes else {}),
        }

    def unowned(self, protocol: QuantProtocol) -> list[str]:
        """Converted layers (and attention quantizers) that hold no quantizer owner in
        ``protocol`` (its bank's, or a stateless recipe's): they never ran a training forward through the protocol. Meaningful
        after the first event, under a quantized recipe and per-layer ownership."""
        layers = {o.layer for o in getattr(protocol, "protocol", protocol).owners()}
        return [
            n for n in (*self.converted, *self.attention) if not layers.intersection(self.owner_layers.get(n, (n,)))
        ]

    def __str__(self) -> str:
        lines = [self.summary(), *(f"  note: {n}" for n in self.notes)]
        lines += [f"  {status} {name or '<root>'}: {why}" for name, status, why in self.entries()]
        return "\n".join(lines)


# A dotted-name component that makes a module one of peft's LoRA adapters.
LORA_COMPONENTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
_LORA_WHY = "a LoRA adapter (peft): kept in high precision; name it in an include pattern to quantize it"


def _is_lora_adapter(name: str) -> bool:
    return not LORA_COMPONENTS.isdisjoint(name.split("."))


@dataclass(frozen=True)
class _Patterns:
    """The include/exclude patterns of one conversion and how a module name meets them.

    ``unprefixed``: the model is a LightningModule, whose attribute (``self.model``) prefixes
    every name; a name then also matches without its first dotted component, so the patterns
    written for the bare model (``exclude=["lm_head"]``) work on the LightningModule too.
    """

    include: tuple[str, ...]
    exclude: tuple[str, ...]
    unprefixed: bool = False

    def matches(self, name: str, patterns: tuple[str, ...]) -> bool:
        forms = (name, name.partition(".")[2]) if self.unprefixed and "." in name else (name,)
        return any(fnmatch.fnmatchcase(form, p) for form in forms for p in patterns)

    def why_skipped(self, name: str) -> str | None:
        """Why ``name`` is left alone by the patterns, or None (selected). A LoRA adapter is
        left alone unless an include pattern naming LoRA (not a bare ``*``) matches it."""
        if _is_lora_adapter(name) and not self.matches(name, tuple(p for p in self.include if "lora" in p.lower())):
            return _LORA_WHY
        if not self.matches(name, self.include):
            return f"matches no include pattern {list(self.include)}"
        if self.matches(name, self.exclude):
            return f"matches an exclude pattern {list(self.exclude)}"
        return None

    def unmatched(self, names: list[str]) -> list[tuple[str, str]]:
        """``(kind, pattern)`` of every exclude pattern, and include pattern unless the include
        is the default ``("*",)``, that matches none of ``names``."""
        groups = [("exclude", self.exclude)]
        if tuple(self.include) != ("*",):
            groups.insert(0, ("include", self.include))
        return [
            (kind, p) for kind, patterns in groups for p in patterns if not any(self.matches(n, (p,)) for n in names)
        ]


def _is_lightning_module(model: nn.Module) -> bool:
    # by name: nothing below lightning/ imports Lightning
    return any(cls.__name__ == "LightningModule" for cls in type(model).__mro__)


@functools.lru_cache(maxsize=512)
def _forward_tree(forward) -> tuple[ast.AST, str] | None:
    """The parsed source of a module class's ``forward`` and the name of its first argument
    (``self``), or None where the source cannot be read (built-in, generated, no file)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or not function.args.args:
        return None
    return tree, function.args.args[0].arg


def _source_of_forward(module: nn.Module) -> tuple[ast.AST, str] | None:
    try:
        return _forward_tree(type(module).forward)
    except TypeError:  # an unhashable forward (a callable object): nothing to read
        return None


def _self_attributes(node: ast.AST, self_name: str) -> list[str]:
    """The ``self.<name>`` attributes read anywhere under ``node``."""
    return [
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == self_name
    ]


_LINEAR_OPS = frozenset(
    {"F.linear", "torch.nn.functional.linear", "nn.functional.linear", "functional.linear", "torch.matmul", "torch.mm"}
)


@functools.lru_cache(maxsize=512)
def _linear_operands(tree: ast.AST, self_name: str) -> tuple[tuple[str, str], ...]:
    """``(op, attribute)`` for every ``self.<attribute>`` used in a linear call of ``forward``:
    an operand of ``F.linear`` / ``torch.matmul`` / ``torch.mm``, or of ``@``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in _LINEAR_OPS:
            op = ast.unparse(node.func)
            found += [(op, a) for arg in (*node.args, *node.keywords) for a in _self_attributes(arg, self_name)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            found += [("@", a) for a in _self_attributes(node, self_name)]
    return tuple(found)


# attribute reads of a weight that do not use its values
_METADATA = frozenset({"dtype", "device", "shape", "size", "ndim", "dim", "requires_grad", "numel", "layout"})


@functools.lru_cache(maxsize=512)
def _weight_readers(tree: ast.AST, self_name: str) -> frozenset[str]:
    """The children ``<c>`` whose ``self.<c>.weight`` values ``forward`` reads (its dtype,
    device, shape, an ``isinstance`` or ``is`` test do not count)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr == "weight" and isinstance(node.ctx, ast.Load)):
            continue
        owner = node.value
        if not (isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == self_name):
            continue
        up = parents.get(node)
        if isinstance(up, ast.Attribute) and (up.attr in _METADATA or up.attr.startswith("is_")):
            continue
        if isinstance(up, ast.Call) and node in up.args and ast.unparse(up.func) in ("isinstance", "type", "id"):
            continue
        if isinstance(up, ast.Compare) and all(isinstance(op, (ast.Is, ast.IsNot)) for op in up.ops):
            continue
        out.add(owner.attr)
    return frozenset(out)


def _not_a_linear_module(module: nn.Module) -> str | None:
    """Why a module that is no Linear-like candidate (no ``nn.Linear``, no Conv1D) still does a
    Linear's work that conversion leaves in high precision, or None: 3-D expert weights, or its
    own 2-D parameter applied by ``F.linear`` / ``torch.matmul`` / ``@`` in its forward."""
    if isinstance(module, (nn.modules.conv._ConvNd, ParametrizationList)):
        return None
    own = {
        n: p
        for n, p in module.named_parameters(recurse=False)
        if not isinstance(p, nn.parameter.UninitializedParameter)
    }
    experts = [n for n, p in own.items() if p.dim() == 3 and p.shape[0] > 1]
    if experts:
        return (
            f"3-D expert weights {', '.join(experts)} [E, out, in] applied with batched/grouped matmuls: not "
            f"converted ({_EXPERTS_LAYOUT})"
        )
    flat = {n for n, p in own.items() if p.dim() == 2}
    source = _source_of_forward(module) if flat else None
    for op, attribute in _linear_operands(*source) if source else ():
        if attribute in flat:
            op = "F.linear" if op.endswith("linear") else op
            return (
                f"calls {op} on its own parameter {attribute} in forward: not a Linear module; convert by hand "
                "or exclude"
            )
    return None


_EXPERTS_KINDS = ("GroupedExperts",)
_HF_EXPERTS = "transformers experts "  # a recognised transformers experts module's kind: this + its class
_EXPERTS_LAYOUT = (
    "Fp8Experts takes gate_up_proj [E, 2F, D] and down_proj [E, D, F] with no biases, an act_fn, called as "
    "forward(hidden_states, top_k_index, top_k_weights); convert by hand or exclude"
)
_EXPERTS_SIGNATURE = ("self", "hidden_states", "top_k_index", "top_k_weights")
_ROUTER_WHY = (
    "the MoE router of {experts}: kept in high precision (routing must be exact: the recompute routes the same "
    "tokens to the same experts)"
)


def _is_experts_kind(kind: str) -> bool:
    return kind in _EXPERTS_KINDS or kind.startswith(_HF_EXPERTS)


def experts_kind(module: nn.Module) -> str | None:
    """What ``module`` is as an experts block :class:`Fp8Experts` can take, or None: our
    :class:`GroupedExperts`, or a transformers 5 experts module of its layout (``MixtralExperts``,
    ``Qwen2MoeExperts``, ``Qwen3MoeExperts``: ``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``,
    no bias, gate first, not transposed, an ``act_fn``, the eager call's signature)."""
    if type(module) in (GroupedExperts,):
        return type(module).__name__
    if isinstance(module, GroupedExperts):  # Fp8Experts, or a subclass with its own behaviour
        return None
    own = dict(module.named_parameters(recurse=False))
    if set(own) != {"gate_up_proj", "down_proj"} or not isinstance(getattr(module, "act_fn", None), nn.Module):
        return None
    gate_up, down = own["gate_up_proj"], own["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3 or isinstance(gate_up, nn.parameter.UninitializedParameter):
        return None
    e, f2, d = gate_up.shape
    if tuple(down.shape) != (e, d, f2 // 2) or f2 % 2 or any(name != "act_fn" for name, _ in module.named_children()):
        return None
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return None
    if not getattr(module, "has_gate", True):
        return None
    try:
        params = tuple(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return None
    return f"{_HF_EXPERTS}{type(module).__name__}" if params == _EXPERTS_SIGNATURE else None


def _survey_experts(
    modules: dict[str, nn.Module], patterns: _Patterns, report: ConversionReport, name: str, module: nn.Module
) -> tuple[str, nn.Module, str] | None:
    """``(name, module, kind)`` for an experts block to swap, else None (reported as skipped, or
    as not quantizable when it is the root or its weights are read by its parent's forward)."""
    kind = experts_kind(module)
    if not name:
        report.not_quantizable[""] = f"the root module itself is {kind}: wrap it in a container to convert it"
        return None
    why = patterns.why_skipped(name)
    if why is not None:
        report.skipped[name] = why
        return None
    return name, module, kind


def _report_routers(modules: dict[str, nn.Module], targets: list, report: ConversionReport) -> None:
    """Report the router (the sibling ``gate``) of each experts block to convert as kept in high
    precision: a transformers router (its own ``weight`` under ``F.linear``, reported as not
    quantizable by the generic rule) is what conversion leaves alone on purpose."""
    for name, _, kind in targets:
        if not _is_experts_kind(kind):
            continue
        parent = name.rpartition(".")[0]
        router = f"{parent}.gate" if parent else "gate"
        if router in modules and router not in report.skipped:
            report.not_quantizable.pop(router, None)
            report.skipped[router] = _ROUTER_WHY.format(experts=name)


def _mha_not_convertible(mha: nn.MultiheadAttention) -> str | None:
    """Why ``mha``'s projections cannot be quantized, or None."""
    if isinstance(mha, Fp8MultiheadAttention) or type(mha) is nn.MultiheadAttention:
        return None
    return (
        f"{type(mha).__name__} subclasses nn.MultiheadAttention, whose projections F.multi_head_attention_forward "
        "reads as raw weights (no module forward runs for them); only nn.MultiheadAttention itself is replaced "
        "by Fp8MultiheadAttention, a subclass may have its own forward: convert it by hand (call the projections "
        "as Linears) or exclude it"
    )


def _weight_read_outside_forward(parents: dict[str, nn.Module], name: str) -> str | None:
    """Why ``name`` would never quantize if swapped (its weight is used by a parent's own code),
    or None: a subclass of ``nn.MultiheadAttention`` reading ``out_proj``, or a parent whose
    forward source reads ``self.<child>.weight``'s values. (nn.MultiheadAttention and
    nn.TransformerEncoderLayer read their children's weights on paths conversion reroutes.)"""
    parent_name, _, child = name.rpartition(".")
    parent = parents.get(parent_name)
    if isinstance(parent, nn.MultiheadAttention):
        return _mha_not_convertible(parent) if child == "out_proj" else None
    if parent is None or isinstance(parent, nn.TransformerEncoderLayer):
        return None
    source = _source_of_forward(parent)
    if source is not None and child in _weight_readers(*source):
        return (
            f"its weight is read by {type(parent).__name__}'s forward (self.{child}.weight), which would use it "
            "unquantized: not converted"
        )
    return None


_ENCODER_LAYER_HOW = (
    "nn.TransformerEncoderLayer -> Fp8TransformerEncoderLayer: eval under no_grad calls its modules instead of "
    "torch's fast path (torch._transformer_encoder_layer_fwd reads linear1/linear2/self_attn weights directly, "
    "so the converted layers would run in high precision)"
)
_ENCODER_HOW = (
    "nn.TransformerEncoder: use_nested_tensor set to False on this module (its layers take the FP8 path; in eval "
    "with a padding mask, padded positions hold computed values, as in training, instead of 0)"
)


def _holds_converted(module: nn.Module) -> bool:
    return any(
        isinstance(m, (Fp8Linear, Fp8Conv1D)) or (isinstance(m, Fp8MultiheadAttention) and m.fp8_in_proj)
        for m in module.modules()
    )


def _warn_at_first_eval(name: str, module: nn.Module) -> None:
    """A forward pre-hook warning once, at the first call in eval under no_grad, that ``module``
    may run torch's fast path past its converted layers (then removing itself)."""

    def hook(mod, args):
        if mod.training or torch.is_grad_enabled():
            return
        handle.remove()
        warnings.warn(
            f"lightning_fp8state: {name or '<root>'} ({type(mod).__name__}) runs in eval under no_grad and may take "
            "torch's nn.TransformerEncoderLayer fast path, which reads the weights of its converted layers "
            "directly: those outputs are not quantized. It subclasses nn.TransformerEncoderLayer with its own "
            "forward, so it was not rerouted (state.last_conversion.fast_path); call its modules yourself in "
            "eval, or turn the fast path off with torch.backends.mha.set_fastpath_enabled(False)",
            ConversionWarning,
            stacklevel=2,
        )

    handle = module.register_forward_pre_hook(hook)


def _reroute_fast_paths(modules: dict[str, nn.Module], report: ConversionReport) -> None:
    """Turn torch's eval fast paths off, per module, where they would bypass converted layers."""
    for name, module in modules.items():
        if not isinstance(module, nn.TransformerEncoderLayer) or isinstance(module, Fp8TransformerEncoderLayer):
            continue
        if not _holds_converted(module):
            continue
        if type(module) is nn.TransformerEncoderLayer:
            Fp8TransformerEncoderLayer.convert(module)
            report.rerouted[name] = _ENCODER_LAYER_HOW
        elif name not in report.fast_path:
            report.fast_path[name] = (
                f"{type(module).__name__} subclasses nn.TransformerEncoderLayer with its own forward, which may "
                "reach torch's fast path (reading its converted layers' weights directly in eval under no_grad); "
                "it is left as it is and warned about at its first eval call"
            )
            _warn_at_first_eval(name, module)
    for name, module in modules.items():
        if isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            if _holds_converted(module):
                module.use_nested_tensor = False
                report.rerouted[name] = _ENCODER_HOW


def convert_model(model: nn.Module, protocol: QuantProtocol, *, warn: bool = True) -> ConversionReport:
    """Replace, in place, every ``nn.Linear`` and transformers ``Conv1D`` of ``model`` whose
    qualified name matches an ``include`` pattern of the protocol's config and no ``exclude``
    pattern, unless it would not quantize (then it is reported as not quantizable); quantize
    ``nn.MultiheadAttention``'s in-projection (entry ``<mha>.in_proj``, or ``<mha>.q_proj`` /
    ``k_proj`` / ``v_proj`` with separate weights) and ``out_proj`` by the same patterns; reroute
    ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` holding converted layers off torch's
    eval fast path (module by module).

    On a LightningModule a name matches a pattern with or without its first component (the
    attribute holding the model: ``exclude=["lm_head"]`` excludes ``model.lm_head``). peft's LoRA
    adapters stay in high precision unless an include pattern naming LoRA matches them.

    Parameters are shared, not copied: an optimizer built before conversion keeps working.
    Layers this protocol converted already are left alone (converting twice is a no-op); a layer
    converted by another protocol raises :class:`AlreadyConvertedError`.

    Every :class:`Fp4AttentionQuantizer` of ``model`` that is not bound yet is bound to
    ``protocol`` under its module path (the include/exclude patterns apply to Linears only:
    an attention quantizer is opted into by placing it in the model). One bound to another
    state is left alone and reported as skipped.

    Args:
        warn: issue the report's :attr:`~ConversionReport.warnings` (a pattern that matched no
            module, a conversion that converted nothing) as :class:`ConversionWarning`; ``False``
            leaves that to the caller (``Fp8State.convert`` says each once).

    Returns:
        A :class:`ConversionReport` of every candidate.
    """
    protocol = getattr(protocol, "protocol", protocol)  # an Fp8State: its protocol
    selection = protocol.config.selection  # the include/exclude patterns: all conversion reads
    patterns = _Patterns(tuple(selection.include), tuple(selection.exclude), _is_lightning_module(model))
    report = ConversionReport()
    targets, attentions, before = _survey(model, protocol, patterns, report)
    targets, attentions = _keep_by_policy(model, protocol.config, report, targets, attentions)
    for name, module, kind in targets:
        _swap_linear(model, protocol, report, name, module, kind)
    for name, module, chosen, entries in attentions:
        _convert_attention(protocol, report, name, module, chosen, entries)
    _reroute_fast_paths(dict(model.named_modules()), report)
    report.warnings = _conversion_warnings(model, protocol, patterns, report, before)
    for message in report.warnings if warn else ():
        warnings.warn(message, ConversionWarning, stacklevel=2)
    return report


def _conversion_warnings(
    model: nn.Module, protocol: QuantProtocol, patterns: _Patterns, report: ConversionReport, before: list[str]
) -> list[str]:
    """What a conversion says out loud: each pattern that matched no Linear-like name (with
    the 3 nearest names, ``before`` being the ones converted already), and a conversion that
    converted nothing in a model holding nothing converted (with each candidate's reason)."""
    names = list(dict.fromkeys([*before, *report.converted, *report.skipped, *report.not_quantizable]))
    model_name = type(model).__name__
    prefix = " (with or without the LightningModule's attribute prefix)" if patterns.unprefixed else ""
    out = [
        f"lightning_fp8state: the {kind} pattern {pattern!r} matches no Linear-like module of {model_name}; the "
        f"nearest names: {difflib.get_close_matches(pattern, names, n=3, cutoff=0)}. A pattern matches a "
        f"module's whole dotted name{prefix}, fnmatch style ('*' for any parents): fix it, or the layers it was "
        "meant for are converted (exclude) or left out (include) unseen"
        for kind, pattern in patterns.unmatched(names)
    ]
    if report.converted or report.attention or before or _holds_bound_quantizer(model, protocol):
        return out
    left = [*report.not_quantizable.items(), *report.skipped.items()]
    if not left:
        out.append(
            f"lightning_fp8state: {model_name} has no Linear-like module (nn.Linear, transformers Conv1D, "
            "nn.MultiheadAttention) and no FP4 attention quantizer: nothing was converted, nothing will be quantized"
        )
        return out
    shown = "; ".join(f"{n or '<root>'}: {why}" for n, why in left[:8])
    more = f"; ... and {len(left) - 8} more" if len(left) > 8 else ""
    out.append(
        f"lightning_fp8state: nothing of {model_name} was converted: its {len(left)} Linear-like candidate(s) were "
        f"all left alone ({shown}{more}). Nothing will be quantized; the report (state.last_conversion) has each "
        "reason"
    )
    return out


def _keep_by_policy(model: nn.Module, config, report: ConversionReport, targets: list, attentions: list) -> tuple:
    """``targets`` and ``attentions`` less what ``config.policy`` keeps in high precision (nn/policy.py),
    each kept layer reported as skipped with its rule (an ``nn.MultiheadAttention``: its chosen
    in-projection entries)."""
    candidates = {name: module for name, module, *_ in (*targets, *attentions)}
    decision = decide(model, config.policy, candidates, config.recipe)
    report.notes += [n for n in decision.notes if n not in report.notes]
    for name, _, *rest in attentions:
        report.skipped.update({entry: decision.kept[name] for entry in rest[0]} if name in decision.kept else {})
    report.skipped.update({n: why for n, why in decision.kept.items() if n in {t[0] for t in targets}})
    return [t for t in targets if t[0] not in decision.kept], [a for a in attentions if a[0] not in decision.kept]


def _holds_bound_quantizer(model: nn.Module, protocol: QuantProtocol) -> bool:
    return any(isinstance(m, Fp4AttentionQuantizer) and m.protocol is protocol for m in model.modules())


def _survey(model: nn.Module, protocol: QuantProtocol, patterns: _Patterns, report: ConversionReport) -> tuple:
    """Walk ``model`` once, before anything is swapped: bind its unbound FP4 attention
    quantizers, refuse a layer converted by another protocol, report every candidate left
    alone (skipped or not quantizable), and return what to convert: ``(targets, attentions,
    before)``, the Linear-likes as ``(name, module, kind)``, the ``nn.MultiheadAttention`` modules
    as ``(name, module, in-projection entries to quantize, every entry's layer names)``, and the
    Linear-likes this protocol converted already."""
    modules = dict(model.named_modules())
    targets, attentions, before = [], [], []
    for name, module in modules.items():
        if isinstance(module, Fp4AttentionQuantizer):
            _bind_attention_quantizer(model, protocol, report, name, module)
        elif isinstance(module, nn.MultiheadAttention) and not isinstance(module, Fp8MultiheadAttention):
            attention = _survey_mha(patterns, report, name, module)
            if attention is not None:
                attentions.append(attention)
        elif isinstance(module, (Fp8Linear, Fp8Conv1D, Fp8MultiheadAttention, Fp8Experts)):  # an MHA: its in-projection
            _refuse_another_protocol(model, protocol, name, module)
            if isinstance(module, Fp8MultiheadAttention):
                before += [f"{name}.{e}" if name else e for e in mha_projections(module)]
            else:
                before.append(name)
        elif experts_kind(module) is not None:
            target = _survey_experts(modules, patterns, report, name, module)
            if target is not None:
                targets.append(target)
        else:
            target = _survey_linear(modules, patterns, report, name, module)
            if target is not None:
                targets.append(target)
    _report_routers(modules, targets, report)
    return targets, attentions, before


def _bind_attention_quantizer(
    model: nn.Module, protocol: QuantProtocol, report: ConversionReport, name: str, module: Fp4AttentionQuantizer
) -> None:
    """Bind an unbound FP4 attention quantizer under its module path; report one bound elsewhere."""
    if module.protocol is None:
        module.bind(protocol, name or type(model).__name__)
        report.attention.append(module.layer_name)
    elif module.protocol is not protocol:
        report.skipped[name] = "an FP4 attention quantizer already bound to another state"


def _survey_mha(
    patterns: _Patterns, report: ConversionReport, name: str, module: nn.MultiheadAttention
) -> tuple | None:
    """``(name, module, chosen entries, entries)`` when some projection of ``module`` is to be
    quantized (its in-projection entries chosen by the patterns, or ``out_proj``), else None;
    every entry left alone is reported with its reason."""
    entries = {f"{name}.{e}" if name else e: layers for e, layers in mha_projections(module).items()}
    why_not = _mha_not_convertible(module)
    chosen = []
    for entry in entries:
        why = why_not or patterns.why_skipped(entry)
        (report.not_quantizable if why_not else report.skipped).update({entry: why} if why else {})
        if why is None:
            chosen.append(entry)
    out_chosen = patterns.why_skipped(f"{name}.out_proj" if name else "out_proj") is None
    if why_not is None and (chosen or out_chosen):
        return name, module, chosen, entries
    return None


def _refuse_another_protocol(model: nn.Module, protocol: QuantProtocol, name: str, module: nn.Module) -> None:
    """AlreadyConvertedError unless the converted layer ``module`` belongs to ``protocol``
    (converting twice with one state is a no-op)."""
    if module.protocol is not protocol:
        raise AlreadyConvertedError(
            f"{name or type(model).__name__} was converted by another Fp8State (layer "
            f"{module.layer_name!r}): a model is converted, and its quantizer state owned, by one Fp8State; "
            "use that Fp8State, or convert a fresh copy of the original model"
        )


def _survey_linear(
    modules: dict[str, nn.Module], patterns: _Patterns, report: ConversionReport, name: str, module: nn.Module
) -> tuple[str, nn.Module, str] | None:
    """``(name, module, kind)`` when ``module`` is a Linear-like to swap, else None: not a
    candidate, or one reported as not quantizable or skipped (with its reason). A module doing
    a Linear's work that is no candidate (3-D expert weights, ``F.linear`` on its own parameter)
    is reported as not quantizable. A module marked ``keep_in_high_precision`` (a router) is
    skipped with the reason it carries."""
    kept = getattr(module, KEEP_ATTRIBUTE, None)
    if kept is not None:
        report.skipped[name] = kept
        return None
    if isinstance(module, nn.Linear):
        kind = "nn.Linear" if type(module) is nn.Linear else f"nn.Linear subclass {type(module).__name__}"
        if type(module).forward is not nn.Linear.forward:
            report.not_quantizable[name] = (
                f"{kind} has its own forward, which an Fp8Linear would drop: convert it by hand or exclude it"
            )
            return None
    elif is_hf_conv1d(module):
        kind = "transformers Conv1D"
    else:
        why_not = _not_a_linear_module(module)
        if why_not is not None:
            report.not_quantizable[name] = why_not
        return None
    if not name:
        report.not_quantizable[""] = f"the root module itself is a {kind}: wrap it in a container to convert it"
        return None
    why_not = _weight_read_outside_forward(modules, name)
    if why_not is not None:
        report.not_quantizable[name] = why_not
        return None
    why = patterns.why_skipped(name)
    if why is not None:
        report.skipped[name] = why
        return None
    return name, module, kind


def _swap_linear(
    model: nn.Module, protocol: QuantProtocol, report: ConversionReport, name: str, module: nn.Module, kind: str
) -> None:
    """Put the protocol-driven module in place of the Linear-like ``module`` (sharing its
    parameters) and report how."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if _is_experts_kind(kind):
        new = Fp8Experts.from_experts(module, protocol=protocol, layer_name=name)
        report.how[name] = f"{kind} -> Fp8Experts (each expert's gate_up_proj and down_proj its own FP8 owners)"
        report.owner_layers[name] = new.owner_layers()
    elif kind == "transformers Conv1D":
        new = Fp8Conv1D.from_conv1d(module, protocol=protocol, layer_name=name)
        report.how[name] = f"{kind} -> Fp8Conv1D (weight [in, out] used as its [out, in] view)"
    elif isinstance(parent, nn.MultiheadAttention):
        new = Fp8Linear.from_linear(module, protocol=protocol, layer_name=name)
        report.how[name] = f"{kind} -> Fp8Linear (called by Fp8MultiheadAttention)"
    else:
        new = Fp8Linear.from_linear(module, protocol=protocol, layer_name=name)
        report.how[name] = f"{kind} -> Fp8Linear"
    setattr(parent, child, new)
    report.converted.append(name)


def _convert_attention(
    protocol: QuantProtocol,
    report: ConversionReport,
    name: str,
    module: nn.MultiheadAttention,
    chosen: list[str],
    entries: dict[str, tuple[str, ...]],
) -> None:
    """Make ``module`` an Fp8MultiheadAttention quantizing the ``chosen`` in-projection entries,
    and report each with how it runs and the layer names its calls own."""
    Fp8MultiheadAttention.convert(
        module, protocol=protocol, layer_name=name, in_proj=frozenset(e.rpartition(".")[2] for e in chosen)
    )
    for entry in chosen:
        param = "in_proj_weight [3E, E]" if entry.endswith("in_proj") else f"{entry.rpartition('.')[2]}_weight"
        report.how[entry] = f"nn.MultiheadAttention {param} -> FP8 GEMM(s) in Fp8MultiheadAttention" + (
            " (one packed GEMM for self-attention, q and packed kv for encoder-decoder attention, three "
            "otherwise; each its own owners)"
            if entry.endswith("in_proj")
            else ""
        )
        prefix = entry.rpartition(".")[0]
        report.owner_layers[entry] = tuple(f"{prefix}.{layer}" if prefix else layer for layer in entries[entry])
        report.converted.append(entry)
