"""Where telemetry goes: a JSONL file that is always written, W&B, and one fan-out.

Every sink takes whole rows (one ``dict`` per optimizer step, plain values) on log steps.
W&B is imported only when a :class:`WandbSink` starts, and runs offline unless asked.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..errors import ConfigError

__all__ = [
    "JSONL_NAME",
    "FanOut",
    "JsonlSink",
    "Sink",
    "WandbSink",
    "decode_value",
    "encode_value",
    "read_jsonl",
]

JSONL_NAME = "telemetry.jsonl"


class Sink(Protocol):
    def write(self, rows: Sequence[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def encode_value(value: Any) -> Any:
    """Strict-JSON value: non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def decode_value(value: Any) -> Any:
    """Inverse of :func:`encode_value`."""
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return value


class JsonlSink:
    """Appends one JSON object per optimizer step to ``path`` and flushes after each write.

    Append mode: a resumed run continues the same file. The file is opened on the first
    write, so constructing the sink creates nothing.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file = None

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  (kept open for the run)
        for row in rows:
            self._file.write(json.dumps({k: encode_value(v) for k, v in row.items()}, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a telemetry JSONL file, with non-finite values decoded back to floats."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append({k: decode_value(v) for k, v in json.loads(line).items()})
    return rows


class WandbSink:
    """Logs rows to a W&B run; offline by default (no account, no network: ``wandb sync`` later).

    Args:
        run_dir: where W&B writes its run (``<run_dir>/wandb/offline-run-*``).
        project: the W&B project.
        mode: ``"offline"`` (default), ``"online"`` or ``"disabled"``; ``WANDB_MODE`` in the
            environment is not consulted: pass what you want.
        step_key: the row key used as W&B's x-axis (defined as the step metric).
        **init_kwargs: passed to ``wandb.init`` (name, config, tags, ...).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        project: str = "lightning_fp8state",
        mode: str = "offline",
        step_key: str = "step",
        **init_kwargs: Any,
    ) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ConfigError(f"mode={mode!r} is not allowed: expected 'offline', 'online' or 'disabled'")
        self.run_dir = Path(run_dir)
        self.project, self.mode, self.step_key = project, mode, step_key
        self.init_kwargs = init_kwargs
        self.run = None

    def _start(self):
        import wandb  # noqa: PLC0415  (lazy: W&B is heavy and optional at import time)

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, dir=str(self.run_dir), mode=self.mode, **self.init_kwargs)
        self.run.define_metric(self.step_key)
        self.run.define_metric("*", step_metric=self.step_key)
        return self.run

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        run = self.run or self._start()
        for row in rows:
            run.log(dict(row))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class FanOut:
    """One sink that writes to many. A failing sink warns (once per sink) and the others
    still get the rows: a logger that breaks mid-run must not silence the JSONL."""

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)
        self._warned: set[int] = set()

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        for sink in self.sinks:
            try:
                sink.write(rows)
            except Exception as exc:  # one broken sink must not silence the others
                if id(sink) not in self._warned:
                    self._warned.add(id(sink))
                    warnings.warn(
                        f"telemetry sink {type(sink).__name__} failed and is skipped for these rows: {exc!r}",
                        RuntimeWarning,
                        stacklevel=2,
                    )

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
