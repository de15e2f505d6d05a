"""StepRecorder: keeps each optimizer step's metrics on the device until a log step.

A step's device values (0-d tensors) are packed into one small float64 vector when the
step is recorded (device ops only); :meth:`StepRecorder.drain` moves every vector of the
window to the host in one transfer and returns one plain ``dict[str, float]`` per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["StepRecorder"]


@dataclass
class _Pending:
    keys: tuple[str, ...]
    values: torch.Tensor | None  # [len(keys)] float64 on the device
    host: dict[str, Any] = field(default_factory=dict)


class StepRecorder:
    """The window of steps since the last log step."""

    def __init__(self) -> None:
        self._steps: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._steps)

    def append(self, device: dict[str, torch.Tensor], host: dict[str, Any]) -> None:
        """Record one step: ``device`` holds 0-d tensors (kept on the device), ``host`` plain values."""
        keys = tuple(device)
        values = None
        if keys:
            values = torch.stack([device[k].detach().reshape(()).to(torch.float64) for k in keys])
        self._steps.append(_Pending(keys, values, dict(host)))

    def drain(self) -> list[dict[str, Any]]:
        """All recorded steps as host dicts (one device-to-host transfer), oldest first."""
        steps, self._steps = self._steps, []
        vectors = [s.values for s in steps if s.values is not None]
        flat: list[float] = []
        if vectors:
            device = vectors[0].device
            if all(v.device == device for v in vectors):
                flat = torch.cat(vectors).cpu().tolist()
            else:
                flat = torch.cat([v.cpu() for v in vectors]).tolist()
        rows, at = [], 0
        for s in steps:
            row = dict(s.host)
            for k in s.keys:
                row[k] = flat[at]
                at += 1
            rows.append(row)
        return rows
