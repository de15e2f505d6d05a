"""Benchmark: the LayerNorm backward (dx, dgamma, dbeta) of the fused prologue, ours against torch.

At the shapes of the GPT models (tokens x d_model: 124M 32768 x 768, 350M 16384 x 1024,
1.2B 16384 x 2048 and 65536 x 2048), float32 x / grad / weight as under bf16 autocast (the
residual stream is float32), in one run:
- ``ceiling``: ``torch.add(x, dy, out=dx)``, one elementwise kernel with the backward's main
  traffic (two reads, one write): the memory-bandwidth ceiling;
- ``eager``: ``aten.native_layer_norm_backward`` (what the unfused prologue runs: the
  ``layer_norm_grad_input`` kernel, then ``GammaBetaBackward``, which reads x and dy again);
- ``compile``: ``torch.compile`` of that op (Inductor's fused Triton, what bf16 gets);
- ``ours``: ``ops.layer_norm_backward`` (``csrc/ln_ops.cu``: one pass plus a partials sum).
Medians of CUDA-event-timed calls; GB/s counts the ideal bytes (x, dy read; dx written; the
statistics, weight and column gradients); ratios are times (``/ceiling``: the ceiling's time
over ours, 1.0 = at the ceiling). ``--profile`` adds each kernel's time from torch.profiler.

    python benchmarks/ln_backward.py [--dtype float32|bfloat16] [--shapes 32768x768 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms

from lightning_fp8state import ops

SHAPES = ("32768x768", "16384x1024", "16384x2048", "65536x2048")
ALL = [True, True, True]
CALLS_PER_124M_STEP = 24  # 12 layers x 2 LayerNorm prologues


def inputs(m: int, n: int, dtype: torch.dtype):
    """``(dy, x, mean, rstd, weight, bias)`` on the GPU, the statistics from the fused forward."""
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = (torch.randn(m, n, device="cuda", generator=g) * 3 + 1).to(dtype)
    dy = (torch.randn(m, n, device="cuda", generator=g) * 0.1).to(dtype)
    w = 1 + 0.2 * torch.randn(n, device="cuda", generator=g)
    b = 0.1 * torch.randn(n, device="cuda", generator=g)
    _, mean, rstd = ops.layer_norm_quantize_fp8(x, w, b, 1e-5, torch.ones(1, device="cuda"), torch.float8_e4m3fn)
    return dy, x, mean, rstd, w, b


def torch_backward(dy, x, mean, rstd, w, b):
    return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd, w, b, ALL)


def kernel_times(fn, reps: int = 10) -> dict[str, float]:
    """Mean microseconds per call of each CUDA kernel ``fn`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415  (only with --profile)

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        device_us = getattr(ev, "device_time_total", None)
        if device_us is None:
            device_us = ev.cuda_time_total
        if device_us > 0:
            times[ev.key[:60]] = device_us / reps
    return times


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxN (tokens x width)")
    p.add_argument("--profile", action="store_true", help="also print each kernel's time (torch.profiler)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    compiled = torch.compile(torch_backward, dynamic=False)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, x/grad {args.dtype}, weight float32")
    print(
        f"{'shape':>12} {'ceiling':>8} {'eager':>8} {'compile':>8} {'ours':>8} {'ours GB/s':>10} "
        f"{'/ceiling':>8} {'vs eager':>9} {'vs compile':>10}"
    )
    results = []
    for shape in args.shapes:
        m, n = (int(v) for v in shape.lower().split("x"))
        dy, x, mean, rstd, w, b = inputs(m, n, dtype)
        ours_out = ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)
        for got, want in zip(
            ours_out, torch_backward(dy, x, mean, rstd, w, b), strict=True
        ):  # a sanity check, not the test
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
        out = torch.empty_like(x)
        t_ceiling = median_ms(lambda: torch.add(x, dy, out=out))
        t_eager = median_ms(lambda: torch_backward(dy, x, mean, rstd, w, b))
        t_compile = median_ms(lambda: compiled(dy, x, mean, rstd, w, b))
        t_ours = median_ms(lambda: ops.layer_norm_backward(dy, x, mean, rstd, w, ALL))
        ideal = 3 * x.numel() * x.element_size() + 2 * mean.numel() * 4 + 3 * n * 4
        gbs = ideal / t_ours / 1e6
        row = {
            "shape": [m, n],
            "dtype": args.dtype,
            "ms": {"ceiling": t_ceiling, "eager": t_eager, "compile": t_compile, "ours": t_ours},
            "ours_gbs": gbs,
            "ceiling_gbs": 3 * x.numel() * x.element_size() / t_ceiling / 1e6,
        }
        print(
            f"{shape:>12} {t_ceiling:8.3f} {t_eager:8.3f} {t_compile:8.3f} {t_ours:8.3f} {gbs:10.0f} "
            f"{t_ceiling / t_ours:8.2f} {t_eager / t_ours:8.2f}x {t_compile / t_ours:9.2f}x"
        )
        if args.profile:
            row["kernels_us"] = {
                "ours": kernel_times(lambda: ops.layer_norm_backward(dy, x, mean, rstd, w, ALL)),
                "eager": kernel_times(lambda: torch_backward(dy, x, mean, rstd, w, b)),
            }
            for who, kernels in row["kernels_us"].items():
                print(f"{'':>12} {who} kernels: " + ", ".join(f"{k} {v:.1f} us" for k, v in kernels.items()))
        results.append(row)
    first = next((r for r in results if r["shape"] == [32768, 768]), None)
    if first is not None:
        ms = first["ms"]
        print(
            f"per 124M step ({CALLS_PER_124M_STEP} calls at 32768x768): eager {CALLS_PER_124M_STEP * ms['eager']:.2f} ms, "
            f"compile {CALLS_PER_124M_STEP * ms['compile']:.2f} ms, ours {CALLS_PER_124M_STEP * ms['ours']:.2f} ms"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
