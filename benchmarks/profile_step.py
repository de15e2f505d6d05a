"""Where the time of one FP8 step goes: torch.profiler over the Linear stack (ours, eager).

Prints the host time per step (Python + launches, measured without synchronizing), the
device time per step, and the CUDA kernels sorted by total device time, so the step can be
split into GEMMs, quantize kernels, transposes and everything else.

    python benchmarks/profile_step.py [--d 4096] [--tokens 8192] [--steps 10]
                                      [--recipe fp8_rowwise] [--autocast]

``--recipe`` picks the quant recipe (with its own formats: E4M3 gradients for the rowwise
ones); ``--autocast`` keeps float32 master weights and runs under bf16 autocast, as the
Lightning recipes train (the backward's weight gradients are then float32 outputs).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import lightning_fp8state as f8s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", default="safe")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--recipe", default="fp8_delayed")
    p.add_argument("--autocast", action="store_true", help="float32 weights under bf16 autocast")
    args = p.parse_args()
    torch.manual_seed(0)
    d = args.d
    model = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(args.layers)]).cuda()
    if not args.autocast:
        model = model.bfloat16()
    state = f8s.Fp8State(f8s.QuantConfig(mode=args.mode, recipe=args.recipe))  # the recipe's own formats
    state.convert(model)
    x = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16)
    n = {"i": 0}

    def step():
        with state.step(n["i"]), torch.autocast("cuda", torch.bfloat16, enabled=args.autocast):
            model(x).backward(g)
        n["i"] += 1

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    # host time: launch everything without waiting (the queue is deep enough for a few steps)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - t0) / args.steps * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / args.steps
    print(
        f"d={d} tokens={args.tokens} layers={args.layers} mode={args.mode} recipe={args.recipe} "
        f"autocast={args.autocast}: host {host:.2f} ms/step "
        f"(issue only), wall {wall:.2f} ms/step, device busy {device_us / 1e3:.2f} ms/step"
    )
    print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


if __name__ == "__main__":
    main()
