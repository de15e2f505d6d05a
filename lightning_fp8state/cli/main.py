"""The ``fp8state`` command: ``train``, ``audit`` and ``report``.

Bad input (an unknown key, a wrong type, an out-of-range or non-finite value, a missing file,
a YAML syntax error, a resume that cannot be validated, a checkpoint refused at load, a GPU recipe
without a GPU) exits with code 2 and one line naming the key or path and what is allowed; no
traceback. A full disk (a checkpoint or a run file that cannot be written) exits with code 3 and
one line naming the file and the space it needs; every file saved before is intact. A bare
``fp8state`` prints the usage.
"""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
from pathlib import Path

from ..config import require_int
from ..errors import ConfigError, DiskFullError, StateLoadError
from .resume import RESUMABLE_KEYS

__all__ = ["EXIT_DISK_FULL", "EXIT_INTERRUPTED", "main"]

EXIT_DISK_FULL = 3  # a file could not be written for lack of space; what was saved before is intact
EXIT_INTERRUPTED = 130  # Ctrl-C, SIGTERM or SIGHUP (128 + SIGINT, as shells report it)


MAX_AUDIT_STEPS = 1_000_000  # an audit records every call of every event: far more is a typo


class _Once(argparse.Action):
    """An option that may be given once (``--resume A --resume B`` took B silently)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(
                f"{option_string} given twice ({getattr(namespace, self.dest)!r} and {values!r}): give it once"
            )
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors: also code 2, one line
        self.exit(2, f"fp8state: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fp8state", description="Recompute-safe FP8/FP4 training: train, audit, report.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a recipe (default: the tiny CPU GPT)")
    t.add_argument("recipe", nargs="?", default=None, help="recipe name or YAML path")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=50")
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        default=None,
        action=_Once,
        help="continue the run in RUN_DIR from its last checkpoint; the overrides may change only "
        + ", ".join(RESUMABLE_KEYS),
    )
    t.add_argument(
        "--verbose", action="store_true", help="log the full conversion report (always in RUN_DIR/conversion.json)"
    )
    a = sub.add_parser("audit", help="prove forward and recompute bit-identical (exit 1 if not)")
    a.add_argument("recipe", nargs="?", default=None)
    a.add_argument("overrides", nargs="*")
    a.add_argument("--mode", choices=["safe", "naive", "bf16"], default=None, help="override quant mode / recipe")
    a.add_argument("--steps", type=int, default=10, help="logical events to audit (default 10)")
    a.add_argument("--compare", action="store_true", help="also run naive and bf16 and print the seed's table")
    r = sub.add_parser("report", help="plots and a summary of a run directory")
    r.add_argument("run_dir", help="a run directory (or its telemetry.jsonl)")
    r.add_argument("--out", default=None, help="where the PNGs go (default: <run>/report)")
    return p


def _split(args) -> tuple[str | None, list[str]]:
    """A first positional with '=' is an override, not a recipe."""
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        overrides.insert(0, recipe)
        recipe = None
    return recipe, overrides


def _audit(args) -> int:
    from .audit import HEADER, run_audit
    from .checks import require_accelerator, require_finite
    from .config import load_config

    require_int("--steps", args.steps, 1, MAX_AUDIT_STEPS)
    recipe, overrides = _split(args)
    modes = [args.mode] if args.mode else [None]
    if args.compare:
        modes = ["naive", "safe", "bf16"]
    outcomes = []
    for mode in modes:
        extra = []
        if mode == "bf16":
            extra = ["quant.recipe=bf16"]
        elif mode is not None:
            extra = ["quant.recipe=fp8_delayed", f"quant.mode={mode}"]
        cfg = load_config(recipe, overrides + extra + ["quant.strict=false"])
        require_finite(cfg)
        require_accelerator(cfg, recipe)  # a GPU recipe on a machine without one: refused at once
        outcome = run_audit(cfg, args.steps)
        print(f"== {outcome.mode}: {args.steps} events, recipe {cfg.name}")
        print(outcome.report.format_table())
        if outcome.refused is not None:
            print(f"recompute refused at {outcome.refused}")
        outcomes.append(outcome)
    print()
    print(HEADER)
    for o in outcomes:
        print(o.summary_row())
    primary = outcomes[0] if not args.compare else next(o for o in outcomes if o.mode == "safe")
    if args.compare:
        return 0 if primary.ok else 1
    return 0 if all(o.ok for o in outcomes) else 1


def _train(args) -> int:
    from .train import run_training

    recipe, overrides = _split(args)
    return run_training(recipe, overrides, resume=args.resume, verbose=args.verbose)


def _report(args) -> int:
    from .report import run_report

    return run_report(args.run_dir, args.out)


def _yaml_error(exc) -> str:
    """A YAML syntax error as one line: the file, the line and column, what is wrong."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a YAML file"
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: not valid YAML ({problem}); fix the file's syntax"


def _disk_full(exc: OSError) -> str:
    """A full disk (or a file-size limit) as one line: the file, the space needed and free
    (DiskFullError), and what to do: the command that continues the run where it has a
    checkpoint, else to start it again."""
    from .rundir import resume_command  # noqa: PLC0415

    path = getattr(exc, "path", None) or exc.filename
    if isinstance(exc, DiskFullError):
        text = str(exc)
    else:
        where = f"to write {path}" if path else "on the device"
        text = f"no space left {where} ({exc.strerror}); free some space (or pass another out_dir)"
    if path is None:
        return text
    path = Path(path)
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    ckpts = run / "checkpoints"
    if ckpts.is_dir() and any(ckpts.glob("*.ckpt")):
        return f"{text}, then continue: {resume_command(run)}"
    if not run.exists():
        return f"{text}; no checkpoint had been saved, so the run's directory {run} was removed: start the run again"
    return f"{text}; no checkpoint was saved yet: start the run again"


def _options_first(argv: list[str]) -> list[str]:
    """``train``'s options moved before its positionals, so that overrides may stand on both
    sides of ``--resume RUN_DIR`` (argparse takes no positional after an option's value)."""
    if not argv or argv[0] != "train":
        return argv
    options, rest, i = [], [], 1
    while i < len(argv):
        item = argv[i]
        if item == "--resume" and i + 1 < len(argv):
            options += argv[i : i + 2]
            i += 2
            continue
        (options if item.startswith("--") else rest).append(item)
        i += 1
    return ["train", *options, *rest]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv:  # a bare `fp8state`: say what it does and how to call it
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(_options_first(argv))
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        # past a file-size limit (ulimit -f) a write then fails with EFBIG, said in one line,
        # instead of the signal killing the process with no word
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415  (the CLI's own dependency)
    from yaml import YAMLError  # noqa: PLC0415

    try:
        return {"audit": _audit, "train": _train, "report": _report}[args.command](args)
    except (ConfigError, StateLoadError) as exc:  # StateLoadError: a checkpoint refused at load
        print(f"fp8state: error: {exc}", file=sys.stderr)
    except YAMLError as exc:
        print(f"fp8state: error: {_yaml_error(exc)}", file=sys.stderr)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        print(f"fp8state: error: {_disk_full(exc)}", file=sys.stderr)
        return EXIT_DISK_FULL
    except KeyboardInterrupt:  # Ctrl-C before Lightning's own handling (imports, validation, setup)
        print("fp8state: interrupted (Ctrl-C); nothing was saved", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OmegaConfBaseException as exc:  # a configuration error the checks above did not name
        key = getattr(exc, "full_key", None)
        print(f"fp8state: error: {f'key {key!r}: ' if key else ''}{str(exc).splitlines()[0]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
