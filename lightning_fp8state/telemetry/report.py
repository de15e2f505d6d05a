"""The report of a run: PNG plots from its telemetry JSONL and a summary table.

``python -m lightning_fp8state.telemetry report RUN_DIR`` (and ``fp8state report RUN_DIR``
once the CLI lands) call :func:`write_report`. matplotlib runs on the Agg backend (no
display needed) and is imported only here.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .expert_panel import ExpertRow, expert_summary, expert_table, format_expert_table, plain_text, plot_experts
from .sinks import JSONL_NAME, read_telemetry

__all__ = [
    "TelemetryReport",
    "find_jsonl",
    "format_summary",
    "owner_role",
    "print_summary",
    "summarize",
    "write_report",
]

PLOTS = ("loss", "grad_norm", "scales", "throughput")


@dataclass
class TelemetryReport:
    """What :func:`write_report` produced."""

    jsonl: Path
    rows: int
    plots: dict[str, Path] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # lines of the JSONL that are not rows (torn, garbage), each naming its line number
    warnings: list[str] = field(default_factory=list)
    superseded: int = 0  # rows of steps a resume re-ran (the later attempt counts)
    # the per-expert panel's table (mixture-of-experts runs; empty otherwise): one row per expert
    experts: list[ExpertRow] = field(default_factory=list)


def find_jsonl(run_dir: str | os.PathLike) -> Path:
    """The telemetry file of a run: ``RUN_DIR`` itself if it is a file, ``RUN_DIR/telemetry.jsonl``,
    or the newest ``telemetry*.jsonl`` below ``RUN_DIR`` (e.g. ``lightning_logs/version_0/``)."""
    path = Path(run_dir)
    if path.is_file():
        return path
    if (path / JSONL_NAME).is_file():
        return path / JSONL_NAME
    found = sorted(path.rglob("telemetry*.jsonl"), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not found:
        raise FileNotFoundError(
            f"no telemetry JSONL in {path}: expected {path / JSONL_NAME} or a telemetry*.jsonl below it "
            "(written by TelemetryCallback / TrainingTelemetry)"
        )
    return found[-1]


def _finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary as plain values (what the table prints)."""
    if not rows:
        return {}
    last = rows[-1]
    s: dict[str, Any] = {
        "steps attempted": last.get("train/steps_attempted", len(rows)),
        "steps applied": last.get("train/steps_applied"),
        "steps skipped": last.get("train/steps_skipped"),
    }
    if s["steps attempted"]:
        s["skip rate"] = (s["steps skipped"] or 0) / s["steps attempted"]
    s["non-finite gradient steps"] = last.get("train/steps_nonfinite")
    s["clip events"] = last.get("train/clip_events")
    if "train/steps_skipped_loss_scale" in last:
        s["skipped by loss scaler"] = last["train/steps_skipped_loss_scale"]
    losses = _finite(r.get("train/loss") for r in rows)
    if losses:
        s["loss first"], s["loss last"], s["loss min"] = losses[0], losses[-1], min(losses)
    final = last.get("train/loss")
    if isinstance(final, (int, float)) and not math.isfinite(final):  # the run ended non-finite: say so,
        s["loss last"] = final  # not the last finite loss of an earlier step
        if losses:
            s["loss last finite"] = losses[-1]
    norms = _finite(r.get("train/grad_norm") for r in rows)
    if norms:
        s["grad norm median"], s["grad norm max"] = statistics.median(norms), max(norms)
    sources = Counter(r["train/dominant_grad_source"] for r in rows if "train/dominant_grad_source" in r)
    if sources:
        s["dominant gradient source"] = ", ".join(f"{name} ({n} steps)" for name, n in sources.most_common(3))
    windows = [r for r in rows if _finite([r.get("train/window_seconds")])]
    seconds = sum(r["train/window_seconds"] for r in windows)

    def rate(key: str) -> float:  # the window-weighted mean of a per-second key (its missing windows: 0)
        return sum((_finite([r.get(key)]) or [0.0])[0] * r["train/window_seconds"] for r in windows) / seconds

    def per_second(key: str) -> float:
        return sum((_finite([r.get(key)]) or [0.0])[0] for r in windows) / seconds

    if seconds > 0 and any("train/tokens_per_s" in r for r in windows):
        s["tokens/s"], s["effective tokens/s"] = rate("train/tokens_per_s"), rate("train/effective_tokens_per_s")
    elif seconds > 0:
        s["steps/s"], s["effective steps/s"] = (
            per_second("train/window_steps"),
            per_second("train/steps_applied_window"),
        )
    peaks = _finite(r.get("train/mem_peak_gib") for r in rows)
    if peaks:  # a resumed run's process starts its peak afresh: the run's is the largest
        s["peak memory GiB (CUDA, allocated)"] = max(peaks)
    health = [r for r in rows if "fp8state/owners" in r]
    if health:
        h = health[-1]
        s["quantizer owners"] = h["fp8state/owners"]
        if "fp8state/scale_min" in h and "fp8state/scale_max" in h:
            s["scale range (last)"] = f"{h['fp8state/scale_min']:.4g} .. {h['fp8state/scale_max']:.4g}"
        sat = _finite(r.get("fp8state/saturated_frac_max") for r in health)
        if sat:
            s["saturated fraction max"] = max(sat)
        lo = _finite(r.get("fp8state/commits_per_event_min") for r in health)
        hi = _finite(r.get("fp8state/commits_per_event_max") for r in health)
        if lo and hi:
            s["commits per event"] = f"{min(lo):g} .. {max(hi):g}"
        s["ledger violations"] = h.get("fp8state/ledger_violations")
        s["non-finite amax events"] = h.get("fp8state/nonfinite_amax_events")
        if "fp8state/recompute_mismatches" in h:
            s["recompute mismatches"] = h["fp8state/recompute_mismatches"]
        for target, moved in _fallback_moves(health).items():
            s[f"fallen back to {target}"] = moved
    s.update(expert_summary(rows))
    return {k: v for k, v in s.items() if v is not None}


def _mark_skipped(ax, rows: list[dict]) -> None:
    skipped = [r["step"] for r in rows if r.get("train/skipped") == 1.0]
    for i, step in enumerate(skipped):
        ax.axvline(step, color="tab:red", alpha=0.35, linewidth=1, label="skipped step" if i == 0 else None)


# Legends go outside the axes, right of the data, so they never cover it.
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "borderaxespad": 0.0, "fontsize": 8}


def _save(plt, fig, ax, path: Path, *, ylabel: str, title: str, xlabel: str = "optimizer step", legend=None) -> bool:
    """Label the axes, add the legend (``legend``: its keyword arguments, default outside the
    axes on the right; ``False``: none) and write the figure to ``path``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend is not False:
        ax.legend(**(legend or OUTSIDE))
    if path.is_symlink():  # a link planted in a received run's report/: replaced, never written through
        path.unlink()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True


def _plot_loss(plt, rows, path: Path) -> bool:
    xs, ys = _series(rows, "train/loss")
    if not xs:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, ys, color="tab:blue", linewidth=1.2, label="loss")
    _mark_skipped(ax, rows)
    return _save(plt, fig, ax, path, ylabel="loss", title="Loss (red: skipped steps)")


def _plot_grad_norm(plt, rows, path: Path) -> bool:
    xs, ys = _series(rows, "train/grad_norm")
    if not xs:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    ok = [(x, y) for x, y in zip(xs, ys, strict=True) if math.isfinite(y) and y > 0]
    if ok:
        ax.plot(*zip(*ok, strict=True), color="tab:green", linewidth=1.2, label="grad norm (before clipping)")
        ax.set_yscale("log")
    clipped = [
        (r["step"], r["train/grad_norm"]) for r in rows if r.get("train/clipped") == 1.0 and "train/grad_norm" in r
    ]
    if clipped:
        ax.scatter(*zip(*clipped, strict=True), s=12, color="tab:orange", label="clipped", zorder=3)
    _mark_skipped(ax, rows)
    return _save(plt, fig, ax, path, ylabel="total gradient norm", title="Gradient norm (red: skipped steps)")


def owner_role(label: str) -> str:
    """The role of a per-owner key's label ``layer.role[#site][@rRANK][@sSTREAM]``."""
    return label.split("#")[0].split("@")[0].rsplit(".", 1)[-1]


def _by_role(rows: list[dict], prefix: str) -> dict[str, list[str]]:
    keys = sorted({k for r in rows for k in r if k.startswith(prefix)})
    roles: dict[str, list[str]] = {}
    for key in keys:
        roles.setdefault(owner_role(key.removeprefix(prefix)), []).append(key)
    return roles


def _plot_role_panel(ax, rows: list[dict], prefix: str, colors) -> None:
    """One band per role (min..max over its owners) with the median as a line; the owners
    holding the extreme last values are named at their points."""
    extremes = []
    for i, (role, keys) in enumerate(sorted(_by_role(rows, prefix).items())):
        xs, lo, mid, hi = [], [], [], []
        for r in rows:
            vals = [r[k] for k in keys if isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) and r[k] > 0]
            if vals:
                xs.append(r["step"])
                lo.append(min(vals))
                mid.append(statistics.median(vals))
                hi.append(max(vals))
        if not xs:
            continue
        color = colors(i % 10)
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
        ax.plot(
            xs, mid, color=color, linewidth=1.4, label=f"{plain_text(role)} ({len(keys)} owners: median, band min..max)"
        )
        for key in keys:
            value = _last_value(rows, key)
            if value is not None:
                extremes.append((value, key.removeprefix(prefix), xs[-1]))
    if extremes:
        for value, label, x in (min(extremes), max(extremes)):
            ax.annotate(
                plain_text(label), (x, value), xytext=(-6, 5), textcoords="offset points", fontsize=7, ha="right"
            )
            ax.plot([x], [value], marker="o", markersize=3, color="black")
    ax.set_yscale("log")


def _last_value(rows: list[dict], key: str) -> float | None:
    for r in reversed(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            return float(v)
    return None


def _plot_scales(plt, rows, path: Path) -> bool:
    """Delayed scales (top) and amaxes (bottom) grouped by role; per-owner keys when the run
    logged them, else the min/max over all owners."""
    if not any(k.startswith("fp8state/scale/") for r in rows for k in r):
        keys = [k for k in ("fp8state/scale_min", "fp8state/scale_max") if any(k in r for r in rows)]
        if not keys:
            return False
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for key in keys:
            xs, ys = _series(rows, key)
            ax.plot(xs, ys, marker=".", linewidth=1, label=key.removeprefix("fp8state/"))
        ax.set_yscale("log")
        return _save(plt, fig, ax, path, ylabel="scale (fmax / amax)", title="Delayed scales (min and max over owners)")
    colors = plt.get_cmap("tab10")
    n_owners = len({k for r in rows for k in r if k.startswith("fp8state/scale/")})
    has_amax = any(k.startswith("fp8state/amax/") for r in rows for k in r)
    fig, axes = plt.subplots(2 if has_amax else 1, 1, figsize=(10, 7 if has_amax else 4.5), sharex=True, squeeze=False)
    _plot_role_panel(axes[0][0], rows, "fp8state/scale/", colors)
    axes[0][0].set_ylabel("scale (fmax / amax)")
    axes[0][0].set_title(f"Delayed scales of {n_owners} owners, by role (the extreme owners named)")
    axes[0][0].legend(**OUTSIDE)
    ax = axes[0][0]
    if has_amax:
        _plot_role_panel(axes[1][0], rows, "fp8state/amax/", colors)
        axes[1][0].set_title("Amax (largest recent |x|), by role")
        axes[1][0].legend(**OUTSIDE)
        ax = axes[1][0]
        return _save(plt, fig, ax, path, ylabel="amax", title=ax.get_title(), legend=False)
    return _save(plt, fig, ax, path, ylabel="scale (fmax / amax)", title=ax.get_title(), legend=False)


def _plot_throughput(plt, rows, path: Path) -> bool:
    raw_key, eff_key, unit = "train/tokens_per_s", "train/effective_tokens_per_s", "tokens/s"
    if not any(raw_key in r for r in rows):
        raw_key, eff_key, unit = "train/steps_per_s", "train/effective_steps_per_s", "steps/s"
    xs, raw = _series(rows, raw_key)
    if not xs:
        return False
    eff_xs, eff = _series(rows, eff_key)  # (a JSONL from elsewhere may lack it in some rows, or all)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(xs, raw, marker="o", color="tab:gray", label=f"raw {unit}")
    if eff_xs:
        ax.plot(eff_xs, eff, marker="o", color="tab:blue", label=f"effective {unit} (applied steps only)")
    if eff_xs == xs:
        ax.fill_between(xs, eff, raw, color="tab:red", alpha=0.15, label="lost to skipped steps")
    ax.set_ylim(bottom=0)
    return _save(
        plt,
        fig,
        ax,
        path,
        ylabel=unit,
        title="Throughput: raw vs effective",
        xlabel="optimizer step (end of window)",
    )


def _fallback_moves(health: list[dict]) -> dict[str, str]:
    """Per target (``high precision``, ``current scaling``), ``layer (step N), ...``: the layers
    QuantConfig.fallback moved there, each with the step at whose end it moved
    (``fp8state/fallback/<layer>`` rows, ``fp8state/fallback_current/<layer>`` for those moved to
    current scaling; the first row that names it). Targets that no layer went to are left out."""
    found: dict[str, dict[str, float]] = {"fp8state/fallback/": {}, "fp8state/fallback_current/": {}}
    for row in health:
        for key, value in row.items():
            for prefix, moves in found.items():
                if key.startswith(prefix) and isinstance(value, (int, float)) and math.isfinite(value):
                    moves.setdefault(key[len(prefix) :], value)
    current = found.pop("fp8state/fallback_current/")
    high = {layer: step for layer, step in found.popitem()[1].items() if layer not in current}
    out = {}
    for target, moves in (("high precision", high), ("current scaling", current)):
        if moves:
            out[target] = ", ".join(f"{n} (step {int(s)})" for n, s in sorted(moves.items(), key=lambda m: m[1]))
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a plain two-column table."""
    width = max((len(k) for k in summary), default=0)
    lines = []
    for key, value in summary.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {text}")
    return "\n".join(lines)


def print_summary(summary: dict[str, Any], title: str) -> None:
    """Print the summary with rich when it is installed, else as plain text."""
    try:
        from rich.console import Console  # noqa: PLC0415  (optional)
        from rich.table import Table  # noqa: PLC0415
        from rich.text import Text  # noqa: PLC0415
    except ImportError:
        print(title)
        print(format_summary(summary))
        return
    # every cell as plain Text: module names, paths and a received run's values are data, never
    # rich markup ("[/]" in one raised MarkupError, "[red]" vanished into a style)
    table = Table(title=Text(title))
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(Text(str(key)), Text(f"{value:.4g}" if isinstance(value, float) else str(value)))
    Console().print(table)


def _require_report_dir(out: Path, *, given: bool) -> None:
    """A folder the plots can be written into, created if missing; ConfigError naming it (and
    ``--out``) when it is a link (a received run's ``report`` may point anywhere), a file, or
    cannot be created or written (a read-only run directory)."""
    what = "--out" if given else "the report folder"
    if out.is_symlink():
        raise ConfigError(
            f"{what} {out} is a symbolic link (to {os.readlink(out)!r}): plots are never written through one; "
            "remove it, or pass --out DIR"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{what} {out} is a file, not a folder: pass --out DIR (a folder, created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"{what} {out} cannot be written ({exc.strerror}): pass --out DIR, a folder you can write"
        ) from None


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, *, show: bool = True):
    """Draw the run's plots (PNG) and print its summary.

    Args:
        run_dir: the run directory (or the JSONL file itself); see :func:`find_jsonl`.
        out_dir: where the PNGs go (default: ``<dir of the JSONL>/report``).
        show: print the summary table.

    Returns:
        A :class:`TelemetryReport` with the plot paths and the summary. Plots whose data
        the run does not have (no quantizer state, no losses) are left out and named in
        ``notes``.
    """
    import matplotlib  # noqa: PLC0415  (lazy: only the report draws)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    jsonl = find_jsonl(run_dir)
    log = read_telemetry(jsonl)  # torn / garbage lines skipped; rows a resume re-ran superseded
    rows = log.rows
    if not rows:  # before anything is created: a file that is not telemetry gets no report/ beside it
        skipped = f"; {len(log.bad_lines)} line(s) that are not rows, first {log.bad_lines[0]}" if log.bad_lines else ""
        raise ConfigError(
            f"{jsonl}: not a telemetry file: no row with a numeric 'step'{skipped}. Expected the "
            "telemetry.jsonl that fp8state train (TelemetryCallback, TrainingTelemetry) writes"
        )
    out = Path(out_dir) if out_dir is not None else jsonl.parent / "report"
    _require_report_dir(out, given=out_dir is not None)
    report = TelemetryReport(jsonl=jsonl, rows=len(rows), warnings=log.warnings(), superseded=log.superseded)
    if log.superseded:
        report.notes.append(
            f"{log.superseded} row(s) of steps re-run after a resume were superseded (each step counts once)"
        )
    drawers = {"loss": _plot_loss, "grad_norm": _plot_grad_norm, "scales": _plot_scales, "throughput": _plot_throughput}
    for name in PLOTS:
        path = out / f"{name}.png"
        if drawers[name](plt, rows, path):
            report.plots[name] = path
        else:
            report.notes.append(f"{name}.png not drawn: the run has no {name} data")
    report.experts = expert_table(rows)
    if report.experts and plot_experts(plt, rows, out / "experts.png", _save):  # MoE runs only
        report.plots["experts"] = out / "experts.png"
    report.summary = summarize(rows)
    if show:
        for warning in report.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print_summary(report.summary, f"telemetry: {jsonl} ({len(rows)} steps)")
        for name, path in report.plots.items():
            print(f"{name:>10}: {path}")
        if report.experts:
            print(f"experts (per MoE layer, over {len(rows)} steps):")
            print(format_expert_table(report.experts))
        for note in report.notes:
            print(note)
    return report
