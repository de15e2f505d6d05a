"""Benchmark: what counting clipped elements in the quantize kernels costs, against not
counting and against the Python probe it replaced (a scaled compare and a sum per tensor).

For each recording FP8 kernel (plain quantize, cast-transpose, LayerNorm, RMSNorm, SwiGLU) on
bf16 data of 2^22 and 2^26 elements: the kernel time without a counter, with one (``saturation``,
a per-thread count, a warp reduce, one atomicAdd per CTA), and the torch count the telemetry's
probe ran beside the kernel (``((x.float() * scale).abs() > fmax).sum()``). Kernel times are
measured over 20 launches captured in a CUDA graph (no host time). Prints a table with the
ratios; ``--json PATH`` writes the numbers.

    python benchmarks/saturation_count.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import median_ms as bench

from lightning_fp8state import ops

E4M3 = torch.float8_e4m3fn
LAUNCHES = 20


def graphed_ms(fn) -> float:
    """ms per launch of ``fn``, from LAUNCHES launches captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES):
            fn()
    return bench(graph.replay, reps=50) / LAUNCHES


def kernels(n: int):
    """name -> (call(saturation), the tensor the kernel encodes, for the probe's count)."""
    d = 4096
    x = torch.randn(n // d, d, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.ones(d, device="cuda")
    scale = torch.tensor(448.0 / 6.0, device="cuda")
    pending = torch.zeros(4, device="cuda")
    return (
        {
            "quantize": lambda s: ops.quantize_fp8_record_amax(x, scale, pending, 1, E4M3, s),
            "cast_transpose": lambda s: ops.quantize_fp8_t_record_amax(x, scale, pending, 1, E4M3, False, s),
            "layer_norm": lambda s: ops.layer_norm_quantize_fp8(x, w, None, 1e-5, scale, E4M3, pending, 1, s),
            "rms_norm": lambda s: ops.rms_norm_quantize_fp8(x, w, 1e-6, scale, E4M3, pending, 1, s),
            "swiglu": lambda s: ops.swiglu_quantize_fp8(x, scale, E4M3, pending, 1, s),
        },
        x,
        scale,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    assert ops.cuda.ensure_loaded(), ops.cuda.extension_info()
    dev = torch.cuda.get_device_name()
    results = {"device": dev, "torch": torch.__version__, "rows": []}
    sat = torch.zeros(2, 4, dtype=torch.int64, device="cuda")
    print(f"device: {dev}, torch {torch.__version__}; bf16 input, rows of 4096, E4M3; us per launch (graphed)")
    print(f"{'kernel':<15} {'n':>5} {'plain':>9} {'counted':>9} {'probe':>9} {'counted/plain':>14} {'probe/plain':>12}")
    for log2 in (22, 26):
        calls, x, scale = kernels(1 << log2)
        t_probe = graphed_ms(lambda x=x, scale=scale: ((x.float() * scale).abs() > 448.0).sum())
        for name, call in calls.items():
            t_plain = graphed_ms(lambda call=call: call(None))
            t_counted = graphed_ms(lambda call=call: call(sat))
            row = {"kernel": name, "log2": log2, "ms_plain": t_plain, "ms_counted": t_counted, "ms_probe": t_probe}
            results["rows"].append(row)
            print(
                f"{name:<15} 2^{log2:<3} {t_plain * 1e3:9.1f} {t_counted * 1e3:9.1f} {t_probe * 1e3:9.1f} "
                f"{t_counted / t_plain:14.3f} {t_probe / t_plain:12.2f}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
