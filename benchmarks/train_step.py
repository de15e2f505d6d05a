"""Benchmark: one GPT training step with activation checkpointing, bf16 vs FP8 (ours) vs torchao.

In one run, for the same model shape, data and optimizer (AdamW, fused), each variant trains
``--warmup`` steps, then ``--steps`` timed steps (CUDA events around forward + backward +
optimizer step; medians). Variants:

- ``bf16``: plain ``nn.Linear`` under bf16 autocast (the baseline);
- ``safe`` / ``naive``: our Fp8Linear (FP8 delayed scaling) in the protocol's safe mode and
  in the seed's defective naive mode;
- ``torchao``: torchao's float8 training with tensorwise dynamic scaling (the peer);
- ``current`` / ``rowwise`` / ``rowwise_gw_hp`` (on request): our stateless recipes
  ``fp8_current`` / ``fp8_rowwise`` / ``fp8_rowwise_gw_hp``, each against the torchao recipe it
  mirrors: ``torchao`` (tensorwise), ``torchao_rowwise`` and ``torchao_rowwise_gw_hp`` (on request);
- ``safe_unfused`` (on request): ``safe`` with ``fuse_prologues=false``, the LayerNorm and
  GELU running on their own before the input's quantize (the A/B of the fusion);
- ``safe_policy`` (on request): ``safe`` with ``quant.policy.by_size=auto``: the GEMMs the
  device's measured table predicts to gain too little stay in bf16;
- ``blockwise`` (on request): ``fp8_blockwise`` (1x128 tiles, 128x128 weight blocks);
- ``safe_percall_w`` (on request): ``safe`` with the weight encoded at every run of a call (the
  recompute encodes it again, the backward transposes it), as before the weight's codes were
  made once per event (``quant.weight_codes_once=false``; the A/B of that change).

``--modes`` runs every variant in each of: ``eager``; ``compile`` (every block compiled,
``Block.compile()``: each of our Fp8Linear calls is one opaque op in the block's graph, the
protocol running inside it, no graph break; ``--compile`` is this mode alone); ``graphs``
(the whole step, forward + backward + optimizer, captured once in a CUDA graph by
``lightning_fp8state.GraphedStep`` and replayed: ours with the protocol's bookkeeping
replayed per step, the peers with ``state=None``, the same capture); ``compile+graphs``.
Each variant is then ranked by its best mode against bf16's best (like with like).
Blocks always run through ``lightning_fp8state.checkpoint`` (non-reentrant torch engine).
``host ms`` is the time Python takes to issue a step (steps issued back to back), ``GPU ms``
(``--busy``) the profiler's device total per step: where host > GPU, the host sets the pace.

Prints tokens/s, ms per step (median of steps timed one by one), peak memory and the ratios
to bf16, and the mean ms of the same number of steps run back to back (``b2b``: one
synchronization at the end, as a training loop that does not wait for each step runs);
``--json`` writes them.
With ``--repeat N`` every (variant, mode) is measured N times, the repeats interleaved, and
each timing reports its fastest repeat (the host of a shared machine only ever adds time; every
repeat's value is in the JSON). ``--host-profile VARIANT`` prints a cProfile of 3 steps.
With ``--sync-check`` one extra safe step runs under ``torch.cuda.set_sync_debug_mode("error")``.
With ``--saturation`` the FP8 variants also print, per step and role, the share of elements
that encoding clamped to the format's max (a diagnostic run: its timings include the count).

    python benchmarks/train_step.py [--d-model 2048 --layers 20 --heads 16 --seq 2048 --batch 32]

The default batch, 32 sequences (65,536 tokens a step, ~70 GiB at peak in bf16), sizes the
step to fill a large part of one H200 as the end-to-end issue asks; runs before the fifth
session used ``--batch 8`` (16,384 tokens, ~29 GiB), and each recorded run names its batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from timing import fresh_peak

import lightning_fp8state as f8s
from lightning_fp8state.errors import ConfigError
from lightning_fp8state.models import GPT, GPTConfig, Llama, LlamaConfig, MarkovTokens

VARIANTS = ("bf16", "safe", "naive", "torchao")
EXTRA_VARIANTS = (
    "safe_unfused",  # safe with fuse_prologues=false (LayerNorm / GELU not fused)
    "safe_percall_w",  # safe with the weight encoded at every run of a call (no codes once per event)
    "safe_policy",  # safe with quant.policy.by_size=auto (the device's GEMM table keeps small GEMMs in bf16)
    "current",  # quant.recipe=fp8_current
    "rowwise",  # quant.recipe=fp8_rowwise
    "rowwise_gw_hp",  # quant.recipe=fp8_rowwise_gw_hp
    "blockwise",  # quant.recipe=fp8_blockwise (1x128 tiles, 128x128 weight blocks)
    "torchao_rowwise",  # torchao's "rowwise" recipe
    "torchao_rowwise_gw_hp",  # torchao's "rowwise_with_gw_hp"
    "torchao_blockwise",  # torchao's blockwise prototype (1x128 / 128x128; bias-free Linears only)
)
OUR_RECIPES = {
    "current": "fp8_current",
    "rowwise": "fp8_rowwise",
    "rowwise_gw_hp": "fp8_rowwise_gw_hp",
    "blockwise": "fp8_blockwise",
}
TORCHAO_RECIPES = {"torchao": None, "torchao_rowwise": "rowwise", "torchao_rowwise_gw_hp": "rowwise_with_gw_hp"}


def batches(cfg: GPTConfig, batch: int, n: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = MarkovTokens(cfg.vocab_size, cfg.seq_len, length=batch * n, seed=1)
    out = []
    for b in range(n):
        xs, ys = zip(*(data[b * batch + i] for i in range(batch)), strict=True)
        out.append((torch.stack(xs).to(device), torch.stack(ys).to(device)))
    return out


def build(
    variant: str, cfg: GPTConfig, compile_blocks: bool, exclude: tuple[str, ...] = (), graphs: bool = False, tokens=0
):
    torch.manual_seed(0)
    model = (Llama if isinstance(cfg, LlamaConfig) else GPT)(cfg).cuda()
    state = None
    if variant in ("safe", "naive", "safe_unfused", "safe_percall_w", "safe_policy"):
        # naive mode violates the ledger on purpose (that is the defect): count, do not raise
        mode = "naive" if variant == "naive" else "safe"
        config = f8s.QuantConfig(
            mode=mode,
            ownership="per_layer",
            strict=mode == "safe",
            exclude=exclude,
            fuse_prologues=variant != "safe_unfused",
            weight_codes_once=variant != "safe_percall_w",
            policy={"by_size": "auto", "tokens": tokens} if variant == "safe_policy" else {},
        )
        state = f8s.Fp8State(config)
        state.convert(model)
    elif variant in OUR_RECIPES:  # stateless: nothing to commit, the protocol's owners and stamps
        recipe = OUR_RECIPES[variant]
        config = f8s.QuantConfig(recipe=recipe, ownership="per_layer", exclude=exclude)  # the recipe's own formats
        state = f8s.Fp8State(config)
        state.convert(model)
    elif variant in TORCHAO_RECIPES:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415  (optional peer)

        recipe = TORCHAO_RECIPES[variant]
        config = Float8LinearConfig.from_recipe_name(recipe) if recipe else None
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda mod, fqn: not any(fnmatch(fqn, p) for p in exclude)
        )
    elif variant == "torchao_blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import (  # noqa: PLC0415  (optional peer)
            Float8BlockwiseLinearConfig,
        )
        from torchao.quantization import quantize_  # noqa: PLC0415

        def takes(mod, fqn):  # what its from_float accepts: no bias, both dims multiples of 128
            return (
                isinstance(mod, torch.nn.Linear)
                and mod.bias is None
                and mod.in_features % 128 == 0
                and mod.out_features % 128 == 0
                and not any(fnmatch(fqn, p) for p in exclude)
            )

        quantize_(model, Float8BlockwiseLinearConfig(), filter_fn=takes)
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    # capturable: the step counter stays on the device, so the optimizer step can be captured
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True, capturable=graphs)
    return model, state, opt


def make_step(model, state, opt, data, graphs: bool = False, warmup: int = 3):
    """One training step per call: eager, or (``graphs``) from a whole-step CUDA graph
    (:class:`lightning_fp8state.GraphedStep`: the same capture for every variant, with the
    protocol's bookkeeping replayed for ours; ``state=None`` captures the peers)."""
    counter = {"n": 0}

    def body(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if state is not None:
                state.commit_forward()
            loss.backward()
        return loss.detach()

    if graphs:
        graphed = f8s.GraphedStep(state, body, *data[0], optimizer=opt, warmup=warmup)

        def graph_step():
            n = counter["n"]
            counter["n"] += 1
            return graphed(n, *data[n % len(data)]).clone()

        return graph_step

    def step():
        n = counter["n"]
        counter["n"] += 1
        x, y = data[n % len(data)]
        if state is None:
            loss = body(x, y)
        else:
            with state.step(n, 0):
                loss = body(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


ROLES = ("input", "weight", "grad_output")


def saturation_by_role(state, seen: list) -> dict[str, float]:
    """Share of the elements encoded since the last call, per role, that encoding clamped to the
    format's max: the growth of the bank's saturation counters (kept by the quantize kernels),
    ``seen`` holding their values at the last call (one host read: a diagnostic, not for timed
    steps)."""
    now = state.bank.saturation.tolist()  # the one read: [clipped, elements] per owner
    old = seen[0] if seen else [[0] * len(now[0]), [0] * len(now[0])]
    seen[:] = [now]
    hits = dict.fromkeys(ROLES, 0)
    totals = dict.fromkeys(ROLES, 0)
    for index, owner in enumerate(state.bank.owners):
        if owner.role in hits and index < len(old[0]):
            hits[owner.role] += now[0][index] - old[0][index]
            totals[owner.role] += now[1][index] - old[1][index]
    return {r: hits[r] / totals[r] for r in ROLES if totals[r]}


MODES = ("eager", "compile", "graphs", "compile+graphs")


def measure(variant: str, cfg: GPTConfig, args, data, mode: str = "eager") -> dict:
    left = fresh_peak()  # (earlier variants' models collected first)
    compiled, graphs = mode.startswith("compile"), mode.endswith("graphs")
    exclude = ("*head",) if args.exclude_head else ()
    model, state, opt = build(variant, cfg, compiled, exclude, graphs, tokens=args.batch * args.seq)
    step = make_step(model, state, opt, data, graphs, warmup=max(1, args.warmup - 1))
    collector = None
    if args.gc == "managed":  # Python's collector at step boundaries, for every variant alike
        collector = f8s.ManagedCollector()
        collector.start()
        step = collected(step, collector)
    # what the conversion (and quant.policy) made FP8: a policy may keep every layer in bf16
    kinds = [type(m).__name__ for m in model.modules()]
    converted, plain = kinds.count("Fp8Linear"), kinds.count("Linear")
    try:
        return dict(
            _measure(variant, cfg, args, mode, model, state, opt, step),
            converted=(converted, converted + plain),
            left_gib=left,
        )
    finally:
        if collector is not None:
            collector.stop()


def cpu_probe_ms() -> float:
    """The host's speed right now: ms for a fixed piece of pure Python (the best of 3). A
    host-bound step's time moves with it; a GPU-bound one's does not."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        total = 0
        for i in range(600_000):
            total += i * i
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def collected(step, collector):
    """``step`` followed by the collector's step-boundary collection."""

    def step_and_collect():
        loss = step()
        collector.step_end()
        return loss

    return step_and_collect


def _measure(variant: str, cfg: GPTConfig, args, mode: str, model, state, opt, step) -> dict:
    seen, saturation = None, []
    if args.saturation and state is not None:
        seen = []  # the saturation counters' values at the last read

    def run_step(quant=state):  # (bound now: ``state`` is deleted at the end)
        loss = step()
        if seen is not None:
            saturation.append(saturation_by_role(quant, seen))
        return loss

    for _ in range(args.warmup):
        run_step()
    torch.cuda.synchronize()
    times, losses = [], []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(run_step())
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    # the same steps back to back, one synchronization at the end: what a loop that does not
    # wait for each step sees (the per-step timing above also pays the restart of the queue);
    # the host's time to issue them is read before that synchronization (an upper bound when
    # the launch queue fills up and makes the host wait for the GPU)
    probe_before = cpu_probe_ms()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        run_step()
    host_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    end.record()
    end.synchronize()
    result = {
        "cpu_probe_ms": (probe_before + cpu_probe_ms()) / 2,  # around the back-to-back steps
        "variant": variant,
        "mode": mode,
        "host_ms": host_ms,
        "ms_back_to_back": start.elapsed_time(end) / args.steps,
        "ms": statistics.median(times),
        "tokens_per_s": args.batch * cfg.seq_len / (statistics.median(times) / 1e3),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "final_loss": torch.stack(losses)[-5:].mean().item(),
    }
    if seen is not None:
        result["saturation"] = saturation
        print(f"--- {variant}: share of elements clamped to the format's max, per step (warm-up included)")
        for i, row in enumerate(saturation):
            print(f"  step {i:>3}: " + "  ".join(f"{r} {v:.2e}" for r, v in row.items()))
    if args.busy:  # the GPU's busy time per step: the profiler's device total over 3 steps
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        busy = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
        result["gpu_busy_ms"] = busy / 3 / 1e3
    if variant in args.profile:
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(f"--- profile of 2 {variant} steps")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    if variant in args.host_profile:  # where the host's issue time goes: Python functions by own time
        import cProfile  # noqa: PLC0415  (diagnostic only)
        import pstats  # noqa: PLC0415

        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"--- host profile of 3 {variant} steps ({mode}), by own time")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.host_profile_rows)
    if variant in args.host_waits:  # where the host waits while issuing steps back to back
        host_waits(step, args.steps)
    if args.sync_check and state is not None and variant == "safe":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        result["sync_free_step"] = True
    del model, state, opt
    return result


def host_waits(step, n: int) -> None:
    """Print what the host spends its time on while it issues ``n`` steps back to back (the
    CUDA runtime calls among the torch profiler's CPU events, by own time: a wait for the
    device, an allocation or a launch that blocks shows here) and how long Python's garbage
    collector paused it; then the same ``n`` steps timed with the collector off."""
    import gc  # noqa: PLC0415  (diagnostic only)

    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((time.perf_counter() - started.pop()) * 1e3)

    torch.cuda.synchronize()
    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        host = (time.perf_counter() - t0) * 1e3 / n
        torch.cuda.synchronize()
    finally:
        gc.callbacks.remove(on_gc)
    print(
        f"--- host waits (CPU probe {cpu_probe_ms():.1f} ms): {n} steps back to back, host {host:.1f} ms/step; "
        "garbage collector ran "
        f"{len(pauses)} times, {sum(pauses):.1f} ms in all (max {max(pauses, default=0):.1f} ms)"
    )
    enabled = gc.isenabled()  # (off already under --gc managed)
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        print(f"    with the collector off: host {(time.perf_counter() - t0) * 1e3 / n:.1f} ms/step")
        torch.cuda.synchronize()
    finally:
        if enabled:
            gc.enable()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
    rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print("    CUDA runtime calls over 3 steps (profiler on), by own time:")
    for e in rows[:15]:
        print(
            f"    {e.key:<40} {e.count:>7} calls {e.self_cpu_time_total / 1e3:>9.1f} ms "
            f"({e.self_cpu_time_total / max(e.count, 1):.1f} us each)"
        )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt", help="the model family (as model.arch)")
    p.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=None, help="llama: the SwiGLU hidden size (default: Llama's rule)")
    p.add_argument("--rope-theta", type=float, default=500000.0, help="llama: the rotary base")
    p.add_argument(
        "--fused",
        action="store_true",
        help="llama: fused q/k/v and gate/up projections (every variant), as the recipes",
    )
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + EXTRA_VARIANTS)
    p.add_argument("--compile", action="store_true", help="the same as --modes compile")
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=MODES,
        help="run every variant in each of these modes (eager; compile: every block compiled; graphs: the "
        "whole step in a CUDA graph; compile+graphs) and rank each variant by its best mode",
    )
    p.add_argument(
        "--peer-modes",
        nargs="+",
        default=None,
        choices=MODES,
        help="modes for torchao (default: --modes)",
    )
    p.add_argument("--busy", action="store_true", help="also measure the GPU's busy time per step (profiler)")
    p.add_argument(
        "--exclude-head",
        action="store_true",
        help="keep the output head in bf16 in the FP8 variants (ours and torchao), as the recipes do",
    )
    p.add_argument("--sync-check", action="store_true")
    p.add_argument(
        "--saturation",
        action="store_true",
        help="count, per step and role, the FP8 elements clamped to the format's max (a diagnostic: it adds "
        "work and a host read to every step, so the timings are not the benchmark's)",
    )
    p.add_argument(
        "--profile", nargs="*", default=[], choices=VARIANTS + EXTRA_VARIANTS, help="print a kernel table for these"
    )
    p.add_argument(
        "--host-profile",
        nargs="*",
        default=[],
        choices=VARIANTS + EXTRA_VARIANTS,
        help="print a cProfile of 3 steps of these (each mode): where the host's issue time goes",
    )
    p.add_argument("--host-profile-rows", type=int, default=30)
    p.add_argument(
        "--gc",
        choices=("automatic", "managed"),
        default="automatic",
        help="Python's garbage collector for every variant: automatic (Python's own, whose full collections can "
        "land in the timed steps), or managed (lightning_fp8state.ManagedCollector: collections at step "
        "boundaries, objects alive after the warm-up frozen; what fp8state train does by default)",
    )
    p.add_argument(
        "--host-waits",
        nargs="*",
        default=[],
        choices=VARIANTS + EXTRA_VARIANTS,
        help="for these: the garbage collector's pauses and the CUDA runtime calls (profiler) over steps issued "
        "back to back, where the host waits",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every (variant, mode) this many times, interleaved, and report the fastest of each timing",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shape = {"vocab_size": args.vocab, "seq_len": args.seq, "d_model": args.d_model}
    shape.update(n_layers=args.layers, n_heads=args.heads, checkpoint=True)
    if args.arch == "llama":
        cfg = LlamaConfig(
            **shape,
            n_kv_heads=args.kv_heads,
            ffn_hidden=args.ffn,
            rope_theta=args.rope_theta,
            fused_projections=args.fused,
        )
        with torch.device("meta"):
            n_params = sum(p.numel() for p in Llama(cfg).parameters())
    else:
        cfg = GPTConfig(**shape)
        n_params = 12 * args.layers * args.d_model**2 + 2 * args.vocab * args.d_model
    try:
        import torchao  # noqa: PLC0415

        ao_version = torchao.__version__
    except ImportError:
        ao_version = None
        args.variants = [v for v in args.variants if not v.startswith("torchao")]
    modes = args.modes or (["compile"] if args.compile else ["eager"])
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, torchao {ao_version}; "
        f"{args.arch}{' (fused projections)' if args.fused else ''} d={args.d_model} layers={args.layers} "
        f"seq={args.seq} batch={args.batch} "
        f"(~{n_params / 1e9:.2f}B params), modes={modes}, FP8 head={not args.exclude_head}"
    )
    data = batches(cfg, args.batch, 4, "cuda")
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeat):  # repeats interleaved: a noisy host affects every variant alike
        for v in args.variants:
            for mode in (args.peer_modes or modes) if v.startswith("torchao") else modes:
                try:
                    r = measure(v, cfg, args, data, mode)
                except ConfigError as exc:  # a mode the library refuses for this variant, by key
                    print(f"  refused {v} ({mode}): {exc}", flush=True)
                    continue
                runs.setdefault((v, mode), []).append(r)
                tag = f" [repeat {rep + 1}/{args.repeat}]" if args.repeat > 1 else ""
                print(
                    f"  measured {v} ({mode}){tag}: {r['ms']:.1f} ms/step, b2b {r['ms_back_to_back']:.1f}, host "
                    f"{r['host_ms']:.1f} (CPU probe {r['cpu_probe_ms']:.1f} ms); fp8state linears {r['converted'][0]} of "
                    f"{r['converted'][1]}",
                    flush=True,
                )
    results = [merge_repeats(rs) for rs in runs.values()]
    report(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "torchao": ao_version, "results": results}, fh, indent=1)
    return results


def merge_repeats(rs: list[dict]) -> dict:
    """One row from the repeats of a (variant, mode): the fastest of each timing (host noise only
    ever adds time), every repeat's value kept beside it."""
    out = dict(rs[0])
    for key in ("ms", "ms_back_to_back", "host_ms", "gpu_busy_ms"):
        if key in out:
            out[key] = min(r[key] for r in rs)
            if len(rs) > 1:
                out[f"{key}_repeats"] = [r[key] for r in rs]
    out["tokens_per_s"] = max(r["tokens_per_s"] for r in rs)
    out["peak_gib"] = max(r["peak_gib"] for r in rs)
    out["left_gib"] = max(r.get("left_gib", 0.0) for r in rs)
    return out


def report(results: list[dict]) -> None:
    """Print every (variant, mode) row with its ratio to bf16's best mode, then each
    variant's best mode against bf16's best (like with like: every variant in its best mode)."""

    def best(variant, key):
        rows = [r for r in results if r["variant"] == variant]
        return min(rows, key=lambda r: r[key]) if rows else None

    base, base_b2b = best("bf16", "ms"), best("bf16", "ms_back_to_back")
    print(
        f"{'variant':>12} {'mode':>15} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss':>7} "
        f"{'speed/bf16':>11} {'b2b ms':>8} {'b2b/bf16':>9} {'host ms':>8} {'GPU ms':>7}"
    )
    for r in results:
        r["speed_vs_bf16"] = base["ms"] / r["ms"] if base else None  # against bf16's best mode
        r["speed_vs_bf16_back_to_back"] = base_b2b["ms_back_to_back"] / r["ms_back_to_back"] if base_b2b else None
        shown = f"{r['speed_vs_bf16']:>10.2f}x" if base else f"{'-':>11}"
        shown_b2b = f"{r['speed_vs_bf16_back_to_back']:>8.2f}x" if base_b2b else f"{'-':>9}"
        busy = f"{r['gpu_busy_ms']:>7.1f}" if "gpu_busy_ms" in r else f"{'-':>7}"
        print(
            f"{r['variant']:>12} {r['mode']:>15} {r['ms']:>9.1f} {r['tokens_per_s']:>10.0f} {r['peak_gib']:>9.1f} "
            f"{r['final_loss']:>7.3f} {shown} {r['ms_back_to_back']:>8.1f} {shown_b2b} {r['host_ms']:>8.1f} {busy}"
        )
    left = max(r.get("left_gib", 0.0) for r in results)
    if left > 0.05:  # each peak counts what was allocated when its variant began
        print(f"note: up to {left:.2f} GiB was still allocated as a variant began (left by earlier ones), in its peak")
    if base:
        print(f"best mode of each variant against bf16's best ({base['mode']}, {base['ms']:.1f} ms):")
        for variant in dict.fromkeys(r["variant"] for r in results):
            b, b2 = best(variant, "ms"), best(variant, "ms_back_to_back")
            print(
                f"  {variant:>12}: per step {b['mode']} {base['ms'] / b['ms']:.2f}x, back to back {b2['mode']} "
                f"{base_b2b['ms_back_to_back'] / b2['ms_back_to_back']:.2f}x"
            )
    safe, naive = best("safe", "ms"), best("naive", "ms")
    if safe and naive:
        print(f"safe / naive step time (best modes): {safe['ms'] / naive['ms']:.3f}")


if __name__ == "__main__":
    main()
