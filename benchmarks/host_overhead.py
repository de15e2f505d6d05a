"""Benchmark: what our per-call Python costs the host, with the device work stubbed out.

At the 124M and 350M shapes an eager FP8 step is host-bound: Python issues it slower than the
GPU runs it. This isolates that Python. Every kernel the FP8 path launches (the quantizes, the
fused LayerNorm / GELU prologues, grad_output's cast-transpose, the LayerNorm backward, the FP8
GEMM) is replaced by an allocation of its output, so what is timed is the protocol, Fp8Linear,
autograd, the checkpoint wrapper and dispatch. It runs anywhere, a laptop CPU included, and says
where the host time goes without device time.

The peer is the same GPT with plain ``nn.Linear`` (``--variants plain``), run at a shape small
enough that its real kernels cost little next to the Python around them. Both run in eager
mode and compiled (``torch.compile`` of every block). Prints ms per step, and what ours adds
over the peer per linear call (forward, recompute and backward together).

    python benchmarks/host_overhead.py [--layers 12] [--steps 30] [--repeats 3] [--modes eager compile]
                                       [--backend inductor] [--autocast] [--profile 25] [--by-area]

``--by-area`` profiles 10 steps of every variant in every mode and prints the host time by area
(torch's autograd engine, AOTAutograd's and dynamo's runtime wrappers, inductor's generated code,
the checkpoint, ours by file): where compiling saves the plain model time and costs ours time.

Each variant's time is the best of ``--repeats`` windows of ``--steps`` steps (a busy host
only ever adds time), and the variants take turns window by window, so a slow spell of the
machine does not land on one of them only.

Numbers from this script are host-only and machine-dependent. Only device measurements go
into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import torch

import lightning_fp8state as f8s
import lightning_fp8state.quant_recipes.blockwise as blockwise_recipe
import lightning_fp8state.quant_recipes.delayed as delayed_recipe
from lightning_fp8state import ops
from lightning_fp8state.models import GPT, GPTConfig


def stub_kernels() -> None:
    """Replace every kernel entry point of the FP8 linear path by an allocation of its outputs."""

    def codes(x, dtype):
        return torch.empty(x.shape, dtype=dtype, device=x.device)

    def stats(x):
        return torch.empty(x.shape[0], 1, device=x.device)

    ops.quantize_fp8 = lambda x, scale, dtype: codes(x, dtype)
    ops.quantize_fp8_record_amax = lambda x, scale, pending, slot, dtype, sat=None: codes(x, dtype)
    ops.gelu_quantize_fp8 = lambda x, scale, dtype, pending=None, slot=0, sat=None: codes(x, dtype)
    ops.layer_norm_quantize_fp8 = lambda x, w, b, eps, scale, dtype, pending=None, slot=0, sat=None: (
        codes(x, dtype),
        stats(x),
        stats(x),
    )
    ops.quantize_fp8_t_record_amax = lambda x, scale, pending, slot, dtype, column_sum, sat=None: (
        codes(x, dtype),
        torch.empty(x.shape[1], x.shape[0], dtype=dtype, device=x.device),
        torch.empty(x.shape[1], device=x.device),
    )
    ops.layer_norm_backward = lambda g, x, mean, rstd, w, needs: (
        torch.empty_like(x),
        torch.empty(x.shape[1], device=x.device) if needs[1] else None,
        torch.empty(x.shape[1], device=x.device) if needs[2] else None,
    )
    delayed_recipe.scaled_matmul = lambda a, b, da, db, out_dtype, backend="auto", bias=None, out=None: (
        torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device) if out is None else out
    )
    _stub_blockwise(codes)


def _stub_blockwise(codes) -> None:
    """fp8_blockwise's encodes and GEMM (what its recipe module calls) as allocations."""

    def tiles(x, rows, cols):
        return [torch.empty(-(-x.shape[0] // rows), -(-x.shape[1] // cols), device=x.device) for _ in range(3)]

    def transposed(x, dtype):
        return torch.empty(x.shape[1], x.shape[0], dtype=dtype, device=x.device)

    blockwise_recipe.quantize_fp8_tile = lambda x, dtype, margin=0, pow2=False: (codes(x, dtype), *tiles(x, 1, 128))
    blockwise_recipe.quantize_fp8_tile_t = lambda x, dtype, margin=0, pow2=False: (
        transposed(x, dtype),
        *tiles(x.t(), 1, 128),
    )
    blockwise_recipe.quantize_fp8_tile_pair = lambda x, dtype, margin=0, pow2=False: (
        codes(x, dtype),
        *tiles(x, 1, 128),
        transposed(x, dtype),
        tiles(x.t(), 1, 128)[0],
    )
    blockwise_recipe.quantize_fp8_block = lambda x, dtype, margin=0, pow2=False: (
        codes(x, dtype),
        *tiles(x, 128, 128),
        transposed(x, dtype),
        tiles(x.t(), 128, 128)[0],
    )
    blockwise_recipe.blockwise_matmul = lambda a, b, da, db, out_dtype, backend="auto", bias=None: torch.empty(
        a.shape[0], b.shape[1], dtype=out_dtype, device=a.device
    )


RECIPES = {"safe": "fp8_delayed", "blockwise": "fp8_blockwise"}  # the variants of ours: their quant.recipe


def build(variant: str, cfg: GPTConfig, mode: str, backend: str):
    torch.manual_seed(0)
    model = GPT(cfg)
    state = None
    if variant in RECIPES:
        state = f8s.Fp8State(f8s.QuantConfig(recipe=RECIPES[variant], mode="safe", strict=True, exclude=("head",)))
        state.convert(model)
    if mode == "compile":  # (dynamo's caches are reset once per mode, in main: both variants stay compiled)
        for block in model.blocks:
            block.compile(backend=backend)
    return model, state


def make_step(model, state, x, autocast: bool = False):
    def step(n: int) -> None:
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with amp, state.step(n) if state is not None else contextlib.nullcontext():
            loss = model.loss(x, x)
            if state is not None:
                state.commit_forward()
            loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="timed windows per variant; the best is reported")
    p.add_argument("--modes", nargs="+", default=["eager", "compile"], choices=["eager", "compile"])
    p.add_argument("--variants", nargs="+", default=["plain", "safe"], choices=["plain", *RECIPES])
    p.add_argument("--backend", default="inductor", help="torch.compile's backend in the compile mode")
    p.add_argument("--autocast", action="store_true", help="run the steps under CPU bf16 autocast (bf16-mixed)")
    p.add_argument("--profile", type=int, default=0, help="print this many rows of a cProfile of ours, by own time")
    p.add_argument("--by-area", action="store_true", help="a cProfile of every variant and mode, by area (ms a step)")
    args = p.parse_args(argv)
    stub_kernels()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=64, seq_len=args.tokens, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    x = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    linears = 4 * args.layers  # qkv, proj, fc, out per block (the head stays plain)
    rows, areas = [], {}
    print(
        f"torch {torch.__version__}; GPT layers={args.layers} d={args.d_model} tokens={args.tokens}, kernels stubbed{', bf16 autocast' if args.autocast else ''}"
    )
    for mode in args.modes:
        steps, times = {}, {}
        torch._dynamo.reset()
        for variant in args.variants:
            model, state = build(variant, cfg, mode, args.backend)
            steps[variant] = (make_step(model, state, x, args.autocast), state)
            for n in range(args.warmup):
                steps[variant][0](n)
        start = args.warmup
        for _ in range(args.repeats):  # the variants take turns, window by window
            for variant, (step, _state) in steps.items():
                t0 = time.perf_counter()
                for n in range(start, start + args.steps):
                    step(n)
                ms = (time.perf_counter() - t0) / args.steps * 1e3
                times[variant] = min(ms, times.get(variant, ms))
            start += args.steps
        for variant, (step, _state) in steps.items():
            rows.append({"mode": mode, "variant": variant, "ms_per_step": times[variant]})
            print(f"  {mode:>8} {variant:>6}: {times[variant]:8.2f} ms/step (best of {args.repeats})")
            if args.profile and variant != "plain":
                profiler = cProfile.Profile()
                profiler.enable()
                for n in range(start, start + 10):
                    step(n)
                profiler.disable()
                print(f"--- cProfile of 10 {mode} steps of {variant}, by own time")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
            if args.by_area:
                areas[(mode, variant)] = _by_area(step, start + 10, 10)
        for variant in [v for v in times if v != "plain" and "plain" in times]:
            per_call = (times[variant] - times["plain"]) * 1e3 / linears
            print(f"  {mode:>8}: {variant} adds {per_call:.1f} µs per linear (forward + recompute + backward)")
            rows.append({"mode": mode, "variant": variant, "us_per_linear_added": per_call})
    if areas:
        _print_areas(areas)
    return rows


_AREAS = (  # (substring of the profiled function's file, area), the first match wins
    ("torchinductor", "inductor's generated code"),
    ("_dynamo", "dynamo and AOTAutograd wrappers"),
    ("_functorch", "dynamo and AOTAutograd wrappers"),
    ("_inductor", "inductor's runtime"),
    ("utils/checkpoint.py", "torch's checkpoint"),
    ("lightning_fp8state/nn/", "ours: nn (modules, the linear call)"),
    ("lightning_fp8state/", "ours: protocol, state, recompute"),
    ("torch/nn/modules", "nn.Module calls"),
)


def _area(func: tuple) -> str:
    filename, _, name = func
    if filename == "~":  # a builtin: the autograd engine's own time is its own area
        return "autograd engine (C++)" if "run_backward" in name else "builtins (ops, tensor methods)"
    return next((area for key, area in _AREAS if key in filename), "other Python")


def _by_area(step, start: int, n: int) -> dict[str, float]:
    """ms a step by area, over ``n`` profiled steps (the profiler inflates every number)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for k in range(start, start + n):
        step(k)
    profiler.disable()
    out: dict[str, float] = {}
    for func, (_, _, own, _, _) in pstats.Stats(profiler).stats.items():
        area = _area(func)
        out[area] = out.get(area, 0.0) + own * 1e3 / n
    return out


def _print_areas(areas: dict) -> None:
    cols = list(areas)
    names = sorted({a for v in areas.values() for a in v}, key=lambda a: -max(v.get(a, 0.0) for v in areas.values()))
    print("--- host time by area, ms a step (cProfile of 10 steps, own time; the profiler inflates it)")
    print(f"{'area':>40} " + " ".join(f"{m + ' ' + v:>16}" for m, v in cols))
    for a in [*names, "total"]:
        vals = [sum(areas[c].values()) if a == "total" else areas[c].get(a, 0.0) for c in cols]
        print(f"{a:>40} " + " ".join(f"{x:16.2f}" for x in vals))


if __name__ == "__main__":
    main()
