"""Benchmark: 8 bias-free Linear layers, forward + backward, bf16 vs torchao float8 vs ours.

For d in (4096, 8192) and 8192 tokens, in one run: bf16 (torch.compile), torchao's float8
training with tensorwise dynamic scaling (torch.compile; the peer), and our FP8 delayed
scaling (eager: the protocol's bookkeeping runs in Python around the fused kernels and
``torch._scaled_mm``). Prints ms per step and ratios to bf16.

    python benchmarks/linear_stack.py [--dims 4096 8192] [--tokens 8192]
"""

from __future__ import annotations

import argparse

import torch
from timing import median_ms
from torch import nn

import lightning_fp8state as f8s


def stack(d: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(8)]).cuda().bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    try:
        import torchao  # noqa: PLC0415  (the peer is optional)
        from torchao.float8 import convert_to_float8_training  # noqa: PLC0415
    except ImportError:
        torchao = None
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"torchao {getattr(torchao, '__version__', 'missing')}"
    )
    print(
        f"{'d':>6} {'bf16 ms':>9} {'torchao ms':>11} {'ours ms':>9} {'torchao/bf16':>13} {'ours/bf16':>10} {'ours/torchao':>13}"
    )
    for d in args.dims:
        x = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16)

        bf16 = torch.compile(stack(d))
        t_bf16 = median_ms(lambda m=bf16: m(x).backward(g))

        t_ao = float("nan")
        if torchao is not None:
            ao = stack(d)
            convert_to_float8_training(ao)
            ao = torch.compile(ao)
            t_ao = median_ms(lambda m=ao: m(x).backward(g))

        state = f8s.Fp8State(f8s.QuantConfig())
        ours = state.convert(stack(d))
        step_no = {"n": 0}

        def ours_step(m=ours, s=state):
            with s.step(step_no["n"]):
                m(x).backward(g)
            step_no["n"] += 1

        t_ours = median_ms(ours_step)
        print(
            f"{d:>6} {t_bf16:>9.2f} {t_ao:>11.2f} {t_ours:>9.2f} {t_bf16 / t_ao:>13.2f}x {t_bf16 / t_ours:>9.2f}x "
            f"{t_ao / t_ours:>12.2f}x"
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
