"""convert_model: swap a model's Linear-like modules for protocol-driven ones, bind its FP4
attention quantizers, and report every candidate: converted, skipped or not quantizable, each
with its reason.

Candidates are ``nn.Linear`` (and subclasses) and transformers' ``Conv1D`` (GPT-2; its weight is
``[in, out]``). A candidate whose weight is read outside its own ``forward`` would never
quantize if swapped (``nn.MultiheadAttention.out_proj``: ``F.multi_head_attention_forward`` reads
``out_proj.weight`` directly), so it is left as it is and reported as not quantizable, never
claimed. What no static rule can see is caught after the first event by
:meth:`ConversionReport.unowned` (a converted layer that never ran through the protocol).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ..protocol import QuantProtocol
from .attention import Fp4AttentionQuantizer
from .conv1d import Fp8Conv1D, is_hf_conv1d
from .linear import Fp8Linear

__all__ = ["ConversionReport", "convert_model"]

CONVERTED, SKIPPED, NOT_QUANTIZABLE = "converted", "skipped", "not quantizable"


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
    """

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)
    not_quantizable: dict[str, str] = field(default_factory=dict)
    how: dict[str, str] = field(default_factory=dict)

    def entries(self) -> list[tuple[str, str, str]]:
        """``(name, status, reason)`` for every candidate (status: converted | skipped |
        not quantizable)."""
        rows = [(n, CONVERTED, self.how.get(n, "converted")) for n in self.converted]
        rows += [(n, CONVERTED, "FP4 attention quantizer bound to the state") for n in self.attention]
        rows += [(n, SKIPPED, why) for n, why in self.skipped.items()]
        rows += [(n, NOT_QUANTIZABLE, why) for n, why in self.not_quantizable.items()]
        return rows

    def counts(self) -> dict[str, int]:
        kinds = Counter(self.how.get(n, "").split(" ->")[0] for n in self.converted)
        out = {CONVERTED: len(self.converted), SKIPPED: len(self.skipped), NOT_QUANTIZABLE: len(self.not_quantizable)}
        out.update({f"converted {k}": v for k, v in sorted(kinds.items()) if k})
        if self.attention:
            out["attention quantizers"] = len(self.attention)
        return out

    def summary(self) -> str:
        """One line with counts (the log line); the full list is :meth:`__str__` / :meth:`to_dict`."""
        kinds = Counter(self.how.get(n, "").split(" ->")[0] for n in self.converted)
        by_kind = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()) if k)
        line = f"converted {len(self.converted)} layer(s)" + (f" ({by_kind})" if by_kind else "")
        line += f", skipped {len(self.skipped)}, not quantizable {len(self.not_quantizable)}"
        if self.attention:
            line += f", bound {len(self.attention)} FP4 attention quantizer(s)"
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
        self.converted += new.converted
        self.skipped.update(new.skipped)
        self.attention += new.attention
        self.not_quantizable.update(new.not_quantizable)
        self.how.update(new.how)
        return new

    def to_dict(self) -> dict:
        """Plain data (JSON-ready): the counts and every entry."""
        return {
            "counts": self.counts(),
            "entries": [{"name": n, "status": s, "reason": r} for n, s, r in self.entries()],
        }

    def unowned(self, protocol: QuantProtocol) -> list[str]:
        """Converted layers (and attention quantizers) that hold no quantizer owner in
        ``protocol``'s bank: they never ran a training forward through the protocol. Meaningful
        after the first event, under a quantized recipe and per-layer ownership."""
        layers = {o.layer for o in protocol.bank.owners}
        return [n for n in (*self.converted, *self.attention) if n not in layers]

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  {status} {name or '<root>'}: {why}" for name, status, why in self.entries()]
        return "\n".join(lines)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _weight_read_outside_forward(parents: dict[str, nn.Module], name: str) -> str | None:
    """Why ``name`` would never quantize if swapped (its weight is used by a parent's own code),
    or None."""
    parent_name, _, child = name.rpartition(".")
    parent = parents.get(parent_name)
    if isinstance(parent, nn.MultiheadAttention) and child == "out_proj":
        return (
            "nn.MultiheadAttention reads out_proj.weight/bias directly in F.multi_head_attention_forward; "
            "out_proj's forward never runs, so a swapped layer would never quantize (replace the attention "
            "module with one that calls its projections, e.g. F.scaled_dot_product_attention between Linears)"
        )
    return None


def convert_model(model: nn.Module, protocol: QuantProtocol) -> ConversionReport:
    """Replace, in place, every ``nn.Linear`` and transformers ``Conv1D`` of ``model`` whose
    qualified name matches an ``include`` pattern of the protocol's config and no ``exclude``
    pattern, unless it would not quantize (then it is reported as not quantizable).

    Parameters are shared, not copied: an optimizer built before conversion keeps working.
    Already-converted layers are left alone (converting twice is a no-op).

    Every :class:`Fp4AttentionQuantizer` of ``model`` that is not bound yet is bound to
    ``protocol`` under its module path (the include/exclude patterns apply to Linears only:
    an attention quantizer is opted into by placing it in the model). One bound to another
    state is left alone and reported as skipped.

    Returns:
        A :class:`ConversionReport` of every candidate.
    """
    protocol = getattr(protocol, "protocol", protocol)  # an Fp8State: its protocol
    config = protocol.config
    report = ConversionReport()
    modules = dict(model.named_modules())
    targets = []
    for name, module in modules.items():
        if isinstance(module, Fp4AttentionQuantizer):
            if module.protocol is None:
                module.bind(protocol, name or type(model).__name__)
                report.attention.append(module.layer_name)
            elif module.protocol is not protocol:
                report.skipped[name] = "an FP4 attention quantizer already bound to another state"
            continue
        if isinstance(module, (Fp8Linear, Fp8Conv1D)):
            continue
        if isinstance(module, nn.Linear):
            kind = "nn.Linear" if type(module) is nn.Linear else f"nn.Linear subclass {type(module).__name__}"
            if type(module).forward is not nn.Linear.forward:
                report.not_quantizable[name] = (
                    f"{kind} has its own forward, which an Fp8Linear would drop: convert it by hand or exclude it"
                )
                continue
        elif is_hf_conv1d(module):
            kind = "transformers Conv1D"
        else:
            continue
        if not name:
            report.not_quantizable[""] = f"the root module itself is a {kind}: wrap it in a container to convert it"
            continue
        why_not = _weight_read_outside_forward(modules, name)
        if why_not is not None:
            report.not_quantizable[name] = why_not
        elif not _matches(name, config.include):
            report.skipped[name] = f"matches no include pattern {list(config.include)}"
        elif _matches(name, config.exclude):
            report.skipped[name] = f"matches an exclude pattern {list(config.exclude)}"
        else:
            targets.append((name, module, kind))
    for name, module, kind in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if kind == "transformers Conv1D":
            new = Fp8Conv1D.from_conv1d(module, protocol=protocol, layer_name=name)
            report.how[name] = f"{kind} -> Fp8Conv1D (weight [in, out] used as its [out, in] view)"
        else:
            new = Fp8Linear.from_linear(module, protocol=protocol, layer_name=name)
            report.how[name] = f"{kind} -> Fp8Linear"
        setattr(parent, child, new)
        report.converted.append(name)
    return report
