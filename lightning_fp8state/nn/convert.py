"""convert_model: swap matching nn.Linear modules for protocol-driven Fp8Linear ones."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

from ..protocol import QuantProtocol
from .linear import Fp8Linear

__all__ = ["ConversionReport", "convert_model"]


@dataclass
class ConversionReport:
    """Which layers were converted and which were skipped, with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} layer(s): {', '.join(self.converted) or '-'}"]
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def convert_model(model: nn.Module, protocol: QuantProtocol) -> ConversionReport:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose qualified name matches an
    ``include`` pattern of the protocol's config and no ``exclude`` pattern.

    Parameters are shared, not copied: an optimizer built before conversion keeps working.
    Already-converted layers are left alone (converting twice is a no-op).
    """
    config = protocol.config
    report = ConversionReport()
    targets = []
    for name, module in model.named_modules():
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
