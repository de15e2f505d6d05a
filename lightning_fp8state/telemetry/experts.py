"""Per-expert telemetry of mixture-of-experts layers (:class:`~lightning_fp8state.nn.Fp8Experts`):
the tokens each expert received in a step, the experts that received none, and each expert's
scale and amax per projection and role.

An ``Fp8Experts`` module registers each expert's projection as its own protocol layer
(``<experts>.<projection>.<e>``), so the generic per-owner keys already hold every expert's scale;
what they do not say is which owners form one layer's experts, how the tokens were spread over
them, and which experts sat idle (an idle expert is not entered, so no owner of it reports). The
keys here give that view:

- per step: ``fp8state/expert_tokens/<experts>/<e>`` (the routed (token, slot) rows expert ``e``
  received in the step's true forwards: the ``top_k`` choices of every token, summed over the
  step's microbatches), ``fp8state/expert_calls/<experts>`` (true-forward calls in the step),
  ``fp8state/experts_idle/<experts>`` (experts that received no row) and
  ``fp8state/experts_idle_ids/<experts>`` (which: ``"1,3"``; ``""`` when none);
- on log steps: ``fp8state/expert_scale/<experts>/<projection>.<role>/<e>`` and
  ``fp8state/expert_amax/...`` (the bank's scale and latest amax of the owner; an expert never
  entered has no owner yet, so no key).

The counts come from the module's routing, which reads them on the host anyway (one copy per MoE
call): recording them costs an append per call and no device read; a recompute is not counted
(its routing is the true forward's, checked by the module). Counts are this rank's (the row of
rank 0 is what is written). With no telemetry attached the module's hook is ``None``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..nn import Fp8Experts
from .quantizer import owner_label

__all__ = [
    "EXPERTS_IDLE",
    "EXPERTS_IDLE_IDS",
    "EXPERT_AMAX",
    "EXPERT_CALLS",
    "EXPERT_SCALE",
    "EXPERT_TOKENS",
    "ExpertTelemetry",
]

EXPERT_TOKENS = "fp8state/expert_tokens/"  # + "<experts>/<e>"
EXPERT_CALLS = "fp8state/expert_calls/"  # + "<experts>"
EXPERTS_IDLE = "fp8state/experts_idle/"  # + "<experts>"
EXPERTS_IDLE_IDS = "fp8state/experts_idle_ids/"  # + "<experts>"
EXPERT_SCALE = "fp8state/expert_scale/"  # + "<experts>/<projection>.<role>/<e>"
EXPERT_AMAX = "fp8state/expert_amax/"  # + "<experts>/<projection>.<role>/<e>"


class ExpertTelemetry:
    """Counts tokens per expert of every ``Fp8Experts`` of a model, per optimizer step.

    Attached, it sets each module's ``routing_observer``; :meth:`close` removes it. Use
    :meth:`attach`, which returns ``None`` for a model without experts.
    """

    def __init__(self, modules: list[Fp8Experts]) -> None:
        self.modules = modules
        self._calls: dict[str, list[tuple[int, ...]]] = {m.layer_name: [] for m in modules}
        self._owners: tuple[tuple, list[int], list[str]] | None = None  # ((bank, size), indices, key suffixes)
        for module in modules:
            module.routing_observer = self._observe

    @classmethod
    def attach(cls, model: nn.Module | None) -> ExpertTelemetry | None:
        """Count the experts of ``model`` (``None`` when it has no ``Fp8Experts``)."""
        modules = [m for m in model.modules() if isinstance(m, Fp8Experts)] if model is not None else []
        return cls(modules) if modules else None

    def _observe(self, module: Fp8Experts, counts: tuple[int, ...]) -> None:
        self._calls[module.layer_name].append(counts)  # summed once per step (take_step)

    def take_step(self) -> dict[str, Any]:
        """The step's per-expert keys (host values); starts the next step's count."""
        out: dict[str, Any] = {}
        for module in self.modules:
            name = module.layer_name
            calls, self._calls[name] = self._calls[name], []
            totals = [sum(column) for column in zip(*calls, strict=True)] if calls else [0] * module.num_experts
            idle = [e for e, n in enumerate(totals) if n == 0]
            for e, n in enumerate(totals):
                out[f"{EXPERT_TOKENS}{name}/{e}"] = n
            out[f"{EXPERT_CALLS}{name}"] = len(calls)
            out[f"{EXPERTS_IDLE}{name}"] = len(idle)
            out[f"{EXPERTS_IDLE_IDS}{name}"] = ",".join(map(str, idle))
        return out

    def _owner_keys(self, bank) -> tuple[list[int], list[str]]:
        """The bank indices of the experts' owners and each one's key suffix
        ``<experts>/<projection>.<role>/<e>`` (cached until owners are added or the bank replaced)."""
        if self._owners is None or self._owners[0] != (id(bank), len(bank)):
            where = {
                layer: (module.layer_name, projection, e)
                for module in self.modules
                for projection, layers in module.expert_layers.items()
                for e, layer in enumerate(layers)
            }
            indices, suffixes = [], []
            for i, owner in enumerate(bank.owners):
                if owner.layer in where:
                    experts, projection, e = where[owner.layer]
                    role = owner_label(owner)[len(owner.layer) + 1 :]  # role, plus #site/@rank/@stream
                    indices.append(i)
                    suffixes.append(f"{experts}/{projection}.{role}/{e}")
            self._owners = ((id(bank), len(bank)), indices, suffixes)
        return self._owners[1], self._owners[2]

    def health(self, protocol) -> dict[str, float]:
        """Each expert owner's scale and latest amax (one device-to-host transfer; log steps)."""
        bank = getattr(protocol, "protocol", protocol).bank
        indices, suffixes = self._owner_keys(bank)
        if not indices:
            return {}
        at = torch.tensor(indices, device=bank.scale.device)
        scale, amax = torch.stack([bank.scale[at], bank.amax_history[0][at]]).to(torch.float32).cpu().tolist()
        out: dict[str, float] = {}
        for suffix, s, a in zip(suffixes, scale, amax, strict=True):
            out[f"{EXPERT_SCALE}{suffix}"] = s
            out[f"{EXPERT_AMAX}{suffix}"] = a
        return out

    def close(self) -> None:
        """Detach from the modules: their calls do no telemetry work again."""
        for module in self.modules:
            if module.routing_observer == self._observe:
                module.routing_observer = None
        for calls in self._calls.values():
            calls.clear()
