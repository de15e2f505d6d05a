"""The per-expert panel of the report: a table and a PNG from the per-expert keys of a run's rows
(:mod:`~lightning_fp8state.telemetry.experts`).

For each mixture-of-experts layer and expert: the routed rows it received over the run, its share
of the layer's rows, the steps it sat idle, and its latest scale per projection and role. The
figure shows the shares as a heat map (layer x expert), the idle experts per step, and the latest
scales by expert. ``plt`` is handed in by :func:`~lightning_fp8state.telemetry.write_report`, the
one place matplotlib is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .experts import EXPERT_SCALE, EXPERT_TOKENS, EXPERTS_IDLE

__all__ = ["ExpertRow", "expert_summary", "expert_table", "format_expert_table", "plain_text", "plot_experts"]


def plain_text(name: str) -> str:
    """``name`` as matplotlib draws it literally: layer and owner names come from the JSONL (a
    received run's is data), and a ``$`` pair in one would be parsed as mathtext (``$\\frac$``
    raised when the plot was drawn)."""
    return name.replace("$", r"\$")


@dataclass
class ExpertRow:
    """One expert of one layer over the run."""

    layer: str
    expert: int
    tokens: int  # routed (token, slot) rows over all recorded steps
    share: float  # of the layer's rows (nan when the layer received none)
    idle_steps: int  # steps in which it received no row
    steps: int  # steps recorded
    scales: dict[str, float] = field(default_factory=dict)  # "<projection>.<role>" -> latest scale


def _tokens(rows: list[dict]) -> dict[str, dict[int, list[int]]]:
    """layer -> expert -> per-step token counts (steps that recorded the layer)."""
    out: dict[str, dict[int, list[int]]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(EXPERT_TOKENS) and isinstance(value, (int, float)) and math.isfinite(value):
                layer, _, e = key[len(EXPERT_TOKENS) :].rpartition("/")
                if e.isdigit():  # (what the writer logs; a key from elsewhere may not be)
                    out.setdefault(layer, {}).setdefault(int(e), []).append(int(value))
    return out


def _latest_scales(rows: list[dict]) -> dict[tuple[str, int], dict[str, float]]:
    """(layer, expert) -> "<projection>.<role>" -> the scale of the last row that logged it."""
    out: dict[tuple[str, int], dict[str, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(EXPERT_SCALE) and isinstance(value, (int, float)):
                layer, operand, e = key[len(EXPERT_SCALE) :].split("/")
                out.setdefault((layer, int(e)), {})[operand] = float(value)
    return out


def expert_table(rows: list[dict[str, Any]]) -> list[ExpertRow]:
    """Every expert of every layer that the run's rows count, layer by layer, in expert order."""
    scales = _latest_scales(rows)
    table = []
    for layer, experts in sorted(_tokens(rows).items()):
        total = sum(sum(counts) for counts in experts.values())
        for e, counts in sorted(experts.items()):
            tokens = sum(counts)
            share = tokens / total if total else math.nan
            idle = sum(1 for n in counts if n == 0)
            table.append(ExpertRow(layer, e, tokens, share, idle, len(counts), scales.get((layer, e), {})))
    return table


def format_expert_table(table: list[ExpertRow]) -> str:
    """The table as plain text: one line per expert, a column per projection and role's scale."""
    operands = sorted({op for row in table for op in row.scales})
    head = ["layer", "expert", "tokens", "share", "idle steps", *(f"scale {op}" for op in operands)]
    lines = [head]
    for r in table:
        scales = [f"{r.scales[op]:.4g}" if op in r.scales else "-" for op in operands]
        lines.append([r.layer, str(r.expert), str(r.tokens), f"{r.share:.3f}", f"{r.idle_steps}/{r.steps}", *scales])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def expert_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's per-expert lines (empty for a run without experts)."""
    table = expert_table(rows)
    if not table:
        return {}
    shares = [r.share for r in table if math.isfinite(r.share)]
    last: dict[str, list[int]] = {}
    for layer, experts in _tokens(rows).items():
        last[layer] = [e for e, counts in sorted(experts.items()) if counts[-1] == 0]
    idle = "; ".join(f"{layer}: {','.join(map(str, ids))}" for layer, ids in sorted(last.items()) if ids)
    out: dict[str, Any] = {"MoE layers": len(last), "expert-steps idle": sum(r.idle_steps for r in table)}
    if shares:
        out["expert token share"] = f"{min(shares):.3f} .. {max(shares):.3f}"
    out["idle experts (last step)"] = idle or "none"
    return out


def _idle_series(rows: list[dict], layer: str) -> tuple[list[float], list[float]]:
    key = f"{EXPERTS_IDLE}{layer}"
    pairs = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_experts(plt, rows: list[dict], path: Path, save) -> bool:
    """Draw the panel to ``path`` (``save``: the report's ``_save``); False without expert data."""
    table = expert_table(rows)
    if not table:
        return False
    layers = sorted({r.layer for r in table})
    n_experts = max(r.expert for r in table) + 1
    fig, axes = plt.subplots(3, 1, figsize=(10, 12), squeeze=False)
    fig.subplots_adjust(hspace=0.45)
    heat, idle_ax, scale_ax = axes[0][0], axes[1][0], axes[2][0]
    grid = [[math.nan] * n_experts for _ in layers]
    for r in table:
        grid[layers.index(r.layer)][r.expert] = r.share
    image = heat.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0)
    fig.colorbar(image, ax=heat, label="share of the layer's routed rows")
    heat.set_yticks(range(len(layers)), labels=[plain_text(layer) for layer in layers], fontsize=7)
    heat.set_xticks(range(n_experts))
    heat.set_xlabel("expert")
    heat.set_title(f"Tokens per expert over the run ({len(layers)} MoE layers; uniform = {1 / n_experts:.3g})")
    if len(layers) * n_experts <= 128:
        for r in table:
            heat.text(r.expert, layers.index(r.layer), f"{r.share:.2f}", ha="center", va="center", fontsize=7)
    for layer in layers[:10]:
        xs, ys = _idle_series(rows, layer)
        idle_ax.plot(xs, ys, marker=".", linewidth=1, label=plain_text(layer))
    idle_ax.set_xlabel("optimizer step")
    idle_ax.set_ylabel("idle experts")
    idle_ax.set_ylim(-0.2, n_experts + 0.2)
    idle_ax.set_title("Experts that received no token in the step" + (" (first 10 layers)" if len(layers) > 10 else ""))
    idle_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    operands = sorted({op for r in table for op in r.scales})
    colors = plt.get_cmap("tab10")
    for i, op in enumerate(operands):
        by_expert = [
            [r.scales[op] for r in table if r.expert == e and r.scales.get(op, 0) > 0] for e in range(n_experts)
        ]
        xs = [e for e in range(n_experts) if by_expert[e]]
        if not xs:
            continue
        lo, hi = [min(by_expert[e]) for e in xs], [max(by_expert[e]) for e in xs]
        scale_ax.fill_between(xs, lo, hi, color=colors(i % 10), alpha=0.2, linewidth=0)
        scale_ax.plot(
            xs,
            [math.sqrt(a * b) for a, b in zip(lo, hi, strict=True)],
            marker="o",
            color=colors(i % 10),
            linewidth=1,
            label=f"{plain_text(op)} (band: min..max over layers)",
        )
    if operands:
        scale_ax.set_yscale("log")
        scale_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    scale_ax.set_xticks(range(n_experts))
    return save(
        plt,
        fig,
        scale_ax,
        path,
        ylabel="latest scale (fmax / amax)",
        xlabel="expert",
        title="Scale by expert, per projection and role (last log step)",
        legend=False,
    )
