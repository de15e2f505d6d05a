"""``fp8state report RUN_DIR``: the telemetry plots (PNG) and the summary table of a run."""

from __future__ import annotations

from ..errors import ConfigError
from ..telemetry.report import write_report

__all__ = ["run_report"]


def run_report(run_dir: str, out_dir: str | None = None) -> int:
    try:
        write_report(run_dir, out_dir)
    except FileNotFoundError as exc:
        raise ConfigError(f"run_dir={run_dir!r}: {exc}") from exc
    return 0
