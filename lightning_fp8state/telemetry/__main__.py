"""``python -m lightning_fp8state.telemetry report RUN_DIR [--out DIR]``: the run's plots and summary."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from .report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_fp8state.telemetry")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="PNG plots and a summary table of a run's telemetry")
    report.add_argument("run_dir", help="the run directory (or its telemetry.jsonl)")
    report.add_argument("--out", default=None, help="where the PNGs go (default: <run>/report)")
    args = parser.parse_args(argv)
    try:
        write_report(args.run_dir, args.out)
    except (FileNotFoundError, ConfigError) as exc:  # ConfigError: not telemetry, a link, an unwritable --out
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
