"""What is live at the peak of a CUDA memory trace, grouped by where it was allocated.

``torch.cuda.memory._record_memory_history`` records every allocation and free with its Python
stack; ``torch.cuda.memory._snapshot()`` returns that trace. The HTML viewer
(``torch.cuda._memory_viz``) needs a browser; a device call returns text. This module replays a
snapshot's trace to the moment the allocated bytes peaked and prints the blocks live then,
grouped by the innermost Python frames that allocated them (``nn.Module`` and context-manager
plumbing left out), and by size:

    from memory_peak import recording, summarize
    with recording():                       # _record_memory_history(stacks="python")
        run()
        snap = torch.cuda.memory._snapshot()
    print(summarize(snap, top=20))

Only allocations made while recording are seen: start it before the model is built. A block
counts as live until its ``free_completed`` event; a block freed while another stream still used
it (``record_stream``) is released there later than in the allocator's own ``allocated_bytes``,
so this peak can exceed ``torch.cuda.max_memory_allocated`` by such blocks.

torch 2.11 + CUDA: with Python stacks recorded, any ``torch.autograd.Function`` called inside a
non-reentrant ``torch.utils.checkpoint`` region fails with ``SystemError: <built-in method apply
of FunctionMeta object> returned NULL without setting an exception`` (seen on the H200 with a
three-line Function of torch's own ops, not only with ours; reentrant checkpointing and no
checkpointing run). ``stacks="none"`` records sizes and order without gathering a traceback,
and runs; the blocks' sizes then say what they hold.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

# frames that say nothing about who asked for the memory
_NOISE = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "torch/_tensor.py", "/contextlib.py")


@contextlib.contextmanager
def recording(max_entries: int = 2_000_000, stacks: str = "python"):
    """``stacks``: "python", "all" (with C++ frames) or "none" (sizes and order only: no
    traceback is gathered at an allocation)."""
    context = None if stacks == "none" else "all"
    torch.cuda.memory._record_memory_history(
        max_entries=max_entries, context=context, stacks="python" if stacks == "none" else stacks
    )
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _where(frames: list[dict], depth: int) -> str:
    kept = []
    for f in frames:
        name = f.get("filename", "")
        if not name.endswith(".py") or any(n in name for n in _NOISE):
            continue
        # site-packages/ and the device harness's copy of the repository (benchmarks/device_run.sh)
        short = name.split("site-packages/")[-1].split("/tmp/t/")[-1]
        kept.append(f"{short}:{f.get('line')}({f.get('name')})")
        if len(kept) == depth:
            break
    if kept:
        return " <- ".join(kept)
    # the autograd engine's thread has no Python stack; with stacks="all" its nodes name themselves
    nodes = [f.get("name", "")[:80] for f in frames if "Backward" in f.get("name", "")][:2]
    return "(no Python frame) " + (" <- ".join(nodes) if nodes else "C++ / autograd engine")


def live_at_peak(snapshot: dict, device: int = 0) -> tuple[int, list[dict]]:
    """(peak bytes allocated while recording, the alloc events live at that moment)."""
    trace = snapshot["device_traces"][device]
    live: dict[int, dict] = {}
    total = peak = 0
    peak_index = -1
    for i, ev in enumerate(trace):
        action = ev["action"]
        if action == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, peak_index = total, i
        elif action == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    live = {}
    for ev in trace[: peak_index + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    return peak, list(live.values())


def summarize(snapshot: dict, top: int = 20, depth: int = 4, device: int = 0) -> str:
    peak, blocks = live_at_peak(snapshot, device)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for ev in blocks:
        g = groups[_where(ev.get("frames", []), depth)]
        g[0] += ev["size"]
        g[1] += 1
    lines = [f"peak of the recorded allocations: {peak / 2**30:.2f} GiB in {len(blocks)} blocks; largest groups:"]
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / 2**30:7.3f} GiB {count:6d} x  {where}")
    by_size: dict[int, int] = defaultdict(int)
    for ev in blocks:
        by_size[ev["size"]] += 1
    lines.append("by block size (the shapes say what a block holds when no stack does):")
    for size, count in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1])[:top]:
        lines.append(f"  {size * count / 2**30:7.3f} GiB {count:6d} x {size / 2**20:10.3f} MiB")
    return "\n".join(lines)
