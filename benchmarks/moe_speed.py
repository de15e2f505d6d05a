"""Benchmark: a Mixtral-8x7B-like mixture-of-experts feed-forward layer, forward + backward per step:
bf16 peers, our FP8 experts (grouped and forced to the per-expert loop) and torchao's FP8 MoE
training path, measured in one run.

The layer: hidden 4096, ffn 14336, 8 experts, top-2 (``--small``: hidden 1024, ffn 3584), over
``--tokens`` tokens (8192 and 16384 by default) routed by a fixed random router (every variant
gets the same routing, the same weights and the same input). Each step is the experts' call as
transformers makes it (route, gather, the experts, the weighted combine) and its backward to the
input and both weights. Variants:

- ``bf16 loop``: :class:`~lightning_fp8state.nn.GroupedExperts`, ``F.linear`` per expert.
- ``bf16 grouped_mm``: one ``torch._grouped_mm`` per product (the weight gradient's groups padded
  to 16 rows), what the ``bf16`` recipe runs on an sm90 GPU.
- ``fp8_delayed`` / ``fp8_current``: :class:`~lightning_fp8state.nn.Fp8Experts`, grouped; with the
  default E5M2 gradients only the forward GEMMs are grouped (the device's grouped FP8 kernel takes
  E4M3 only); the ``e4m3-bwd`` variants (``backward_format=e4m3``) group all three products.
- ``fp8_delayed loop``: the same with ``grouped_gemm = False`` (the per-expert ``torch._scaled_mm``
  loop).
- ``torchao fp8 rowwise``: torchao's ``moe_training`` FP8 rowwise scaled grouped GEMM (dynamic
  rowwise scales, E4M3 everywhere) on groups zero-padded to 16 rows, where torchao imports.

``--modes eager compile``: each variant also under ``torch.compile`` of the module (ours compile
around the experts, which run eagerly). Times are CUDA-event milliseconds per step after
``--warmup`` steps: best and median of ``--reps``; peak memory is the timed steps' maximum
allocated; host ms is the fastest of 3 steps' issue time (the routing's copy included: near the
step's time, the host sets the pace). ``--profile VARIANT ...`` prints torch.profiler's kernel
table of 2 steps of each. Ratios are against the best bf16 time of the same token count (any bf16 peer, any
mode). ``--json PATH`` writes every number with the device and versions.

    python benchmarks/moe_speed.py [--tokens 8192 16384] [--small] [--modes eager compile] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback

import torch
from timing import fresh_peak
from torch import nn

import lightning_fp8state as f8s
from lightning_fp8state.nn import GroupedExperts
from lightning_fp8state.nn.grouped_gemm import GROUP_ALIGN, group_ends, grouped_linear, padded_rows

SHAPES = {"mixtral": (4096, 14336), "small": (1024, 3584)}


class GroupedMmExperts(GroupedExperts):
    """The bf16 peer on the grouped kernel: each projection one ``torch._grouped_mm``."""

    def grouped(self, x_sorted, counts):
        gate, up = grouped_linear(x_sorted, self.gate_up_proj, counts).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, self.down_proj, counts)


def _ao_grouped_mm():
    """torchao's differentiable FP8 rowwise grouped GEMM ``(A, B_t, offs) -> bf16``, or raises
    ImportError saying why it is not there."""
    from torchao.prototype import moe_training  # noqa: PLC0415  (the peer is optional)

    try:  # the recipe named where torchao's version has the choice (newer ones default to MXFP8)
        from torchao.prototype.moe_training.conversion_utils import MoEScalingType  # noqa: PLC0415

        kw = {"scaling_type": MoEScalingType.FP8_ROWWISE}
    except ImportError:
        kw = {}
    for name in ("_scaled_grouped_mm", "_quantize_then_scaled_grouped_mm"):
        fn = getattr(moe_training, name, None)
        if fn is not None:
            return functools.partial(fn, out_dtype=torch.bfloat16, **kw)
    # torchao 0.18: the FP8 rowwise path under its own name; the groups arrive padded to 16 rows
    fn = getattr(moe_training, "_to_fp8_rowwise_then_scaled_grouped_mm", None)
    if fn is not None:
        return functools.partial(fn, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False)
    raise ImportError(f"torchao.prototype.moe_training has no _scaled_grouped_mm ({dir(moe_training)})")


class TorchaoExperts(GroupedExperts):
    """torchao's FP8 MoE training GEMMs on the experts: the rows of each expert zero-padded to a
    multiple of 16 (torchao's FP8 rowwise alignment), one scaled grouped GEMM per projection."""

    ao_mm = None

    def grouped(self, x_sorted, counts):
        padded = padded_rows(counts, GROUP_ALIGN)
        offs = torch.tensor(group_ends(padded), dtype=torch.int32).pin_memory().to(x_sorted.device, non_blocking=True)
        pieces = []
        for x_e, n, p in zip(x_sorted.split(list(counts)), counts, padded, strict=True):
            pieces += [x_e, x_e.new_zeros((p - n, x_e.shape[1]))]
        x_pad = torch.cat(pieces)
        gate, up = self.ao_mm(x_pad, self.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
        y_pad = self.ao_mm(self.act_fn(gate) * up, self.down_proj.transpose(-2, -1), offs)
        return torch.cat([y_e[:n] for y_e, n in zip(y_pad.split(list(padded)), counts, strict=True)])


def make_experts(cls, hidden, ffn, experts):
    torch.manual_seed(0)
    module = cls(experts, hidden, ffn, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for name in module.projections:
            getattr(module, name).normal_(0, 0.02)
    return module


def variants(hidden, ffn, experts):
    """``name -> build()`` returning ``(module, state or None)``."""

    def plain(cls):
        return lambda: (make_experts(cls, hidden, ffn, experts), None)

    def ours(recipe, grouped=True, **cfg):
        def build():
            holder = nn.Module()
            holder.experts = make_experts(GroupedExperts, hidden, ffn, experts)
            state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe, **cfg))
            state.convert(holder)
            holder.experts.grouped_gemm = grouped
            return holder.experts, state

        return build

    def torchao():
        TorchaoExperts.ao_mm = staticmethod(_ao_grouped_mm())
        return make_experts(TorchaoExperts, hidden, ffn, experts), None

    return {
        "bf16 loop": plain(GroupedExperts),
        "bf16 grouped_mm": plain(GroupedMmExperts),
        "fp8_delayed": ours("fp8_delayed"),
        "fp8_delayed e4m3-bwd": ours("fp8_delayed", backward_format="e4m3"),
        "fp8_current": ours("fp8_current"),
        "fp8_current e4m3-bwd": ours("fp8_current", backward_format="e4m3"),
        "fp8_delayed loop": ours("fp8_delayed", grouped=False),
        "torchao fp8 rowwise": torchao,
    }


def inputs(tokens, hidden, experts, top_k):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    logits = torch.randn(tokens, experts, device="cuda", generator=g)
    weights, index = logits.softmax(-1).topk(top_k, dim=-1)
    grad = torch.randn(tokens, hidden, device="cuda", generator=g, dtype=torch.bfloat16)
    return x, index, (weights / weights.sum(-1, keepdim=True)).bfloat16(), grad


def measure(build, mode, data, reps, warmup, profile: bool = False):
    module, state = build()
    fn = torch.compile(module) if mode == "compile" else module
    x, index, weights, grad = data
    x = x.clone().requires_grad_(True)
    counter = {"n": 0}

    def step():
        module.zero_grad(set_to_none=True)
        x.grad = None
        if state is None:
            fn(x, index, weights).backward(grad)
        else:
            with state.step(counter["n"]):
                fn(x, index, weights).backward(grad)
        counter["n"] += 1

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    fresh_peak()  # (earlier variants' tensors collected first)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() / 2**30
    # the host's issue time of a step (the routing's one device-to-host copy included): where it
    # is near the step's time, the host sets the pace
    hosts = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    if profile:
        import torch.profiler as tp  # noqa: PLC0415

        with tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    return {"best_ms": min(times), "median_ms": statistics.median(times), "peak_gib": peak, "host_ms": min(hosts)}


def run_all(args, hidden, ffn) -> list[dict]:
    rows = []
    builds = variants(hidden, ffn, args.experts)
    chosen = args.variants or list(builds)
    for tokens in args.tokens:
        data = inputs(tokens, hidden, args.experts, args.top_k)
        flops = 18 * tokens * args.top_k * hidden * ffn  # forward 6 M D F (M routed rows), backward twice that
        for mode in args.modes:
            for name in chosen:
                row = {"tokens": tokens, "mode": mode, "variant": name}
                try:
                    if name in args.profile:
                        print(f"--- profile of 2 steps: {tokens} tokens, {mode}, {name}")
                    row |= measure(builds[name], mode, data, args.reps, args.warmup, name in args.profile)
                    row["tflops"] = flops / row["best_ms"] / 1e9
                except Exception as exc:  # noqa: BLE001  (a peer that cannot run is reported, not fatal)
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    if args.verbose:
                        traceback.print_exc()
                torch.cuda.empty_cache()
                rows.append(row)
                print(_format(row), flush=True)
    _ratios(rows)
    return rows


def _ratios(rows: list[dict]) -> None:
    """Each row's ``vs_best_bf16``: the best bf16 time of its token count over its best time."""
    for tokens in {r["tokens"] for r in rows}:
        bf16 = [
            r["best_ms"] for r in rows if r["tokens"] == tokens and r["variant"].startswith("bf16") and "best_ms" in r
        ]
        for r in rows:
            if r["tokens"] == tokens and "best_ms" in r and bf16:
                r["vs_best_bf16"] = min(bf16) / r["best_ms"]


def _format(row: dict) -> str:
    head = f"{row['tokens']:>6} {row['mode']:>8} {row['variant']:<22}"
    if "error" in row:
        return f"{head} did not run: {row['error']}"
    ratio = f"{row['vs_best_bf16']:>6.2f}x" if "vs_best_bf16" in row else ""
    return (
        f"{head} {row['best_ms']:>9.2f} {row['median_ms']:>9.2f} {row['host_ms']:>8.2f} {row['tflops']:>8.1f}"
        f" {row['peak_gib']:>8.2f} {ratio}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--small", action="store_true", help="hidden 1024, ffn 3584 (a quick check)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=["eager", "compile"], default=["eager"])
    p.add_argument("--variants", nargs="+", help="a subset of the variants, by name")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--verbose", action="store_true", help="print a failing variant's traceback")
    p.add_argument("--profile", nargs="*", default=[], help="variants whose 2 steps torch.profiler tables by kernel")
    args = p.parse_args()
    hidden, ffn = SHAPES["small" if args.small else "mixtral"]
    try:
        import torchao  # noqa: PLC0415

        ao = torchao.__version__
    except ImportError as exc:
        ao = f"missing ({exc})"
    device = f"{torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})"
    print(f"device: {device}, torch {torch.__version__}, torchao {ao}")
    print(f"layer: hidden {hidden}, ffn {ffn}, {args.experts} experts, top-{args.top_k}; forward + backward per step")
    print(
        f"{'tokens':>6} {'mode':>8} {'variant':<22} {'best ms':>9} {'median':>9} {'host ms':>8} {'TFLOP/s':>8}"
        f" {'peak GiB':>8} vs best bf16"
    )
    rows = run_all(args, hidden, ffn)
    print("\nratios against the best bf16 of each token count (higher is faster):")
    for r in rows:
        print(_format(r))
    if args.json:
        meta = {"device": device, "torch": torch.__version__, "torchao": ao, "hidden": hidden, "ffn": ffn}
        with open(args.json, "w") as f:
            json.dump({"meta": meta | vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
