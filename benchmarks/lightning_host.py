"""Benchmark: where the host's time goes in a Lightning step of ``fp8state train`` (the user's path).

Runs a recipe in this process with one extra callback (added to every ``Trainer`` this script
builds) that watches three windows of steady-state batches, after ``--warmup`` batches:

1. syncs: ``torch.cuda.set_sync_debug_mode("warn")`` and every synchronizing call's Python
   stack, grouped by call site, per batch (a loop that syncs cannot run ahead of the GPU);
2. timing: ``--steps`` batches; the host's issue time (until the last batch's hooks return)
   and the wall time once the GPU is done (``torch.cuda.synchronize``): host-bound when the
   two are about equal;
3. profile: a cProfile of a few batches (its times are inflated; compare the shares);
4. busy (on a GPU): the profiler's device total over ``--busy-steps`` batches, the GPU's
   busy time per step, to print beside the host's issue time: where the host's is larger,
   the host sets the pace.

In the timing window it also counts Python's garbage collections and their time, per
generation (a full collection walks every tracked object of the process: a pause of its
own). ``--gc-freeze`` calls ``gc.freeze()`` when the warm-up ends: what exists then (the
model, Lightning, the quantizer's owners) is left out of later collections.

Run once per variant (FP8 safe, and the same command with ``quant.recipe=bf16``):

    python benchmarks/lightning_host.py --out DIR --variant fp8 [--recipe gpt_124m_h200] [key=value ...]
    python benchmarks/lightning_host.py --out DIR --variant bf16
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_fp8state.cli.train import run_training


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostTrace(Callback):
    def __init__(
        self, warmup: int, steps: int, profile_steps: int, sync_steps: int, gc_freeze: bool = False, busy_steps: int = 3
    ) -> None:
        self.sync_start = warmup
        self.time_start = self.sync_start + sync_steps
        self.prof_start = self.time_start + steps
        self.busy_start = self.prof_start + profile_steps
        self.end = self.busy_start + busy_steps
        self.busy_steps = busy_steps
        self._busy = None
        self.steps, self.sync_steps, self.profile_steps = steps, sync_steps, profile_steps
        self.syncs: Counter = Counter()
        self.result: dict = {}
        self._saved_showwarning = None
        self._profile = None
        self._t0 = 0.0
        self.gc_freeze = gc_freeze
        self._gc: dict[int, list] = {}
        self._gc_start = 0.0
        self.dump: Path | None = None  # where the cProfile's raw stats go (set by main)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            entry = self._gc.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - self._gc_start

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return self._saved_showwarning(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-2]
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack if "/torch/" not in f.filename][-4:]
        self.syncs[" <- ".join(reversed(frames))] += 1
        return None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        i = trainer.global_step
        if i == self.sync_start:
            if self.gc_freeze:
                gc.freeze()
            self._saved_showwarning = warnings.showwarning
            warnings.showwarning = self._record
            warnings.simplefilter("always")
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("warn")
        elif i == self.time_start:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = self._saved_showwarning
            _synchronize()
            gc.callbacks.append(self._on_gc)
            self._t0 = time.perf_counter()
        elif i == self.prof_start:
            self._profile = cProfile.Profile()
            self._profile.enable()
        elif i == self.busy_start and torch.cuda.is_available() and self.busy_steps > 0:
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

            _synchronize()
            self._busy = profile(activities=[ProfilerActivity.CUDA])
            self._busy.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        i = trainer.global_step  # already advanced past this batch's optimizer step
        if i == self.prof_start:
            issue = time.perf_counter() - self._t0
            _synchronize()
            wall = time.perf_counter() - self._t0
            gc.callbacks.remove(self._on_gc)
            self.result.update(
                gc_freeze=self.gc_freeze,
                gc_per_generation={g: {"collections": n, "ms": 1e3 * t} for g, (n, t) in sorted(self._gc.items())},
                gc_ms_per_step=1e3 * sum(t for _, t in self._gc.values()) / self.steps,
                host_issue_ms_per_step=1e3 * issue / self.steps,
                wall_ms_per_step=1e3 * wall / self.steps,
                syncs_per_step={k: v / self.sync_steps for k, v in self.syncs.most_common()},
            )
        elif i == self.busy_start and self._profile is not None:
            self._profile.disable()
            out = io.StringIO()
            pstats.Stats(self._profile, stream=out).sort_stats("tottime").print_stats(30)
            self.result["profile_tottime"] = out.getvalue()
            out = io.StringIO()
            pstats.Stats(self._profile, stream=out).sort_stats("cumulative").print_stats(40)
            self.result["profile_cumulative"] = out.getvalue()
            if self.dump is not None:  # the raw profile, to read further with pstats
                self._profile.dump_stats(str(self.dump))
            self._profile = None
        if i == self.end and self._busy is not None:
            _synchronize()
            self._busy.stop()
            events = self._busy.key_averages()
            busy = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
            self.result["gpu_busy_ms_per_step"] = busy / self.busy_steps / 1e3
            # what the GPU spends its time on (compare the variants' tables)
            self.result["gpu_kernels"] = events.table(sort_by="self_device_time_total", row_limit=40)
            self._busy = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="gpt_124m_h200")
    p.add_argument("--variant", choices=["fp8", "bf16"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sync-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() when the warm-up ends")
    p.add_argument("--busy-steps", type=int, default=3, help="batches whose GPU busy time is profiled (GPU only)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = HostTrace(args.warmup, args.steps, args.profile_steps, args.sync_steps, args.gc_freeze, args.busy_steps)
    tag = f"{args.variant}{'_gc_freeze' if args.gc_freeze else ''}"
    trace.dump = out / f"lightning_host_{tag}.pstats"
    original_init = pl.Trainer.__init__

    def init_with_trace(self, *a, callbacks=None, **kw):  # the recipe's callbacks, plus ours
        original_init(self, *a, callbacks=[*(callbacks or []), trace], **kw)

    pl.Trainer.__init__ = init_with_trace
    overrides = [
        "telemetry.wandb=disabled",
        "telemetry.log_every_n_steps=10",
        f"trainer.max_steps={trace.end + 1}",
        "trainer.checkpoint_every_n_steps=100000",
        f"out_dir={out}",
        f"name={args.variant}{'_gc_freeze' if args.gc_freeze else ''}",
        *(["quant.recipe=bf16"] if args.variant == "bf16" else []),
        *args.overrides,
    ]
    code = run_training(args.recipe, overrides)
    result = {"recipe": args.recipe, "variant": args.variant, "overrides": args.overrides, "exit": code, **trace.result}
    (out / f"lightning_host_{tag}.json").write_text(json.dumps(result, indent=1))
    print(f"{tag}: exit {code}")
    print(f"  garbage collections: {result.get('gc_per_generation')}")
    for key in ("host_issue_ms_per_step", "wall_ms_per_step", "gpu_busy_ms_per_step", "gc_ms_per_step"):
        print(f"  {key}: {result.get(key, float('nan')):.1f}")
    print("  syncs per step, by call site:")
    for site, n in result.get("syncs_per_step", {}).items():
        print(f"    {n:5.2f}  {site}")
    print(result.get("profile_tottime", "")[:6000])
    print(result.get("gpu_kernels", "")[:8000])


if __name__ == "__main__":
    main()
