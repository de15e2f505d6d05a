"""Benchmark: activation memory and step time of selective activation checkpointing (SAC) against
full checkpointing and none, FP8 (ours) with bf16 (the peer: the same model, recipe="bf16") in
the same run.

The package's GPT (fused LayerNorm/GELU prologues, bf16 autocast), every block checkpointed by
``lightning_fp8state.checkpoint`` with:

    none            no checkpointing
    full            plain checkpointing (everything recomputed)
    sac_nothing     SAC saving nothing (selective_checkpoint_context(()))
    sac_matmuls     SAC saving aten.mm/_scaled_mm outputs (the default helper)
    sac_mm_codes    ... and our FP8 codes (save_quantized=True: 1 byte an element, weights' too)
    sac_codes       only our FP8 codes

Per variant: ms per training step (forward + backward, one logical event), the memory the
forward leaves allocated for backward (activations, MiB) and the step's peak (MiB). Every
checkpointed variant's gradients are checked bitwise against "none" first.

    python benchmarks/sac_memory.py [--d-model 2048] [--layers 8] [--batch 4] [--seq 2048]
    python benchmarks/sac_memory.py --device cpu --d-model 64 --layers 2 --seq 64 --vocab 256 --reps 2  # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig

VARIANTS = ("none", "full", "sac_nothing", "sac_matmuls", "sac_mm_codes", "sac_codes")


def context(variant: str):
    return {
        "sac_nothing": lambda: f8s.selective_checkpoint_context(()),
        "sac_matmuls": lambda: f8s.selective_checkpoint_context(),
        "sac_mm_codes": lambda: f8s.selective_checkpoint_context(save_quantized=True),
        "sac_codes": lambda: f8s.selective_checkpoint_context((), save_quantized=True),
    }.get(variant, lambda: None)()


def build(args, recipe: str, variant: str):
    state = f8s.Fp8State(f8s.QuantConfig(recipe=recipe))
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        checkpoint=False,
    )
    model = GPT(cfg)
    state.convert(model)
    model = model.to(args.device)
    if variant != "none":
        ctx = context(variant)
        for block in model.blocks:
            inner = block.forward
            if ctx is None:
                block.forward = lambda x, inner=inner: f8s.checkpoint(inner, x)
            else:
                block.forward = lambda x, inner=inner, ctx=ctx: f8s.checkpoint(inner, x, context_fn=ctx)
    return state, model


def measure(args, recipe: str, variant: str, tokens, targets):
    state, model = build(args, recipe, variant)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    step = {"n": 0}

    def run(probe=None):
        model.zero_grad(set_to_none=True)
        with state.step(step["n"]):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model.loss(tokens, targets)
            if probe is not None:
                probe()
            state.commit_forward()
            loss.backward()
        step["n"] += 1

    run()  # first event: registration, calibration
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    for _ in range(args.warmup):
        run()
    times = []
    for _ in range(args.reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    held = peak = float("nan")
    if cuda:
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        after = {}
        run(lambda: after.setdefault("bytes", torch.cuda.memory_allocated()))
        held = (after["bytes"] - base) / 2**20
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), held, peak, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    targets = torch.roll(tokens, -1, dims=1)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"device: {name}, torch {torch.__version__}; GPT d={args.d_model} L={args.layers} tokens={tokens.numel()}")
    print(f"{'recipe':<11} {'variant':<13} {'ms/step':>9} {'act MiB':>9} {'peak MiB':>9} {'vs none':>8} {'bitwise':>8}")
    for recipe in ("bf16", "fp8_delayed"):
        ref = None
        for variant in ["none", *[v for v in args.variants if v != "none"]]:
            if recipe == "bf16" and variant in ("sac_mm_codes", "sac_codes"):
                continue  # no codes to save
            ms, held, peak, grads = measure(args, recipe, variant, tokens, targets)
            if variant == "none":
                ref = (ms, grads)
            same = all(torch.equal(a, b) for a, b in zip(ref[1], grads, strict=True))
            print(
                f"{recipe:<11} {variant:<13} {ms:>9.2f} {held:>9.1f} {peak:>9.1f} {ms / ref[0]:>8.2f} "
                f"{'yes' if same else 'NO':>8}"
            )


if __name__ == "__main__":
    main()
