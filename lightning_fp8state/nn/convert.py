"""convert_model: swap matching nn.Linear modules for protocol-driven Fp8Linear ones and bind
the model's FP4 attention quantizers."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from ..protocol import QuantProtocol
from .attention import Fp4AttentionQuantizer
from .linear import Fp8Linear

__all__ = ["ConversionReport", "convert_model"]


@dataclass
class ConversionReport:
    """Which layers were converted (or, for attention quantizers, bound) and which were
    skipped, with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} layer(s): {', '.join(self.converted) or '-'}"]
        if self.attention:
            lines.append(f"bound {len(self.attention)} FP4 attention quantizer(s): {', '.join(self.attention)}")
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def convert_model(model: nn.Module, protocol: QuantProtocol) -> ConversionReport:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose qualified name matches an
    ``include`` pattern of the protocol's config and no ``exclude`` pattern.

    Parameters are shared, not copied: an optimizer built before conversion keeps working.
    Already-converted layers are left alone (converting twice is a no-op).

    Every :class:`Fp4AttentionQuantizer` of ``model`` that is not bound yet is bound to
    ``protocol`` under its module path (the include/exclude patterns apply to Linears only:
    an attention quantizer is opted into by placing it in the model). One bound to another
    state is left alone and reported as skipped.
    """
    protocol = getattr(protocol, "protocol", protocol)  # an Fp8State: its protocol
    config = protocol.config
    report = ConversionReport()
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, Fp4AttentionQuantizer):
            if module.protocol is None:
                module.bind(protocol, name or type(model).__name__)
                report.attention.append(module.layer_name)
            elif module.protocol is not protocol:
                report.skipped[name] = "an FP4 attention quantizer already bound to another state"
            continue
        if isinstance(module, Fp8Linear) or not isinstance(module, nn.Linear) or not name:
            continue
        if not _matches(name, config.include):
            report.skipped[name] = f"matches no include pattern {list(config.include)}"
        elif _matches(name, config.exclude):
            report.skipped[name] = f"matches an exclude pattern {list(config.exclude)}"
        else:
            targets.append((name, module))
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8Linear.from_linear(module, protocol=protocol, layer_name=name))
        report.converted.append(name)
    if isinstance(model, nn.Linear) and not isinstance(model, Fp8Linear):
        report.skipped[""] = "the root module itself is a Linear: wrap it in a container to convert it"
    return report
