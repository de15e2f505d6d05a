"""Benchmark: the host time of one AdamW step over an FSDP2-sharded GPT, through DTensor's dispatch
(torch's own path, the peer) against the same step on the local shards
(:func:`lightning_fp8state.nn.fsdp.step_on_local_shards`), in one process, world size 1; and
the same for the telemetry's gradient clip (torch's ``clip_grads_with_norm_`` over the DTensor
gradients against the local ones the telemetry hands it).

Both variants run with FP8 all-gather (the weights' local tensors wrapped) and without
(``--recipe bf16``). The step is issued ``--steps`` times back to back; the host's time per step
is read before the final synchronization (on a GPU, the kernels themselves are the same in both
variants: the difference is the host's). Prints both and the ratio.

    python benchmarks/fsdp_optimizer_step.py [--device cuda] [--layers 24] [--d-model 1024] [--recipe fp8_delayed]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig
from lightning_fp8state.nn.fsdp import enable_fp8_all_gather, step_on_local_shards
from lightning_fp8state.telemetry.tracker import _clip_targets


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args, local: bool) -> tuple[float, float, int]:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=16, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    model = GPT(cfg).to(device)
    state = f8s.Fp8State(f8s.QuantConfig(recipe=args.recipe))
    state.convert(model)
    mesh = init_device_mesh(device.type, (1,))
    if args.recipe != "bf16":
        enable_fp8_all_gather(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if local:
        step_on_local_shards(opt)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    for _ in range(3):  # states made, kernels warm
        opt.step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        opt.step()
    issue = (time.perf_counter() - t0) / args.steps
    _sync(device)
    grads = [p.grad for p in params]
    norm = torch.tensor(1e6, device=device)  # a coefficient below 1: every gradient scaled
    t0 = time.perf_counter()
    for _ in range(args.steps):  # the telemetry picks its targets every step
        torch.nn.utils.clip_grads_with_norm_(_clip_targets(params, grads) if local else params, 1.0, norm)
    clip = (time.perf_counter() - t0) / args.steps
    _sync(device)
    return issue, clip, len(params)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=64, help="small by default: the host's cost does not depend on it")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--recipe", default="fp8_delayed", choices=["fp8_delayed", "fp8_current", "bf16"])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        peer, peer_clip, n = measure(args, local=False)
        ours, ours_clip, _ = measure(args, local=True)
    finally:
        dist.destroy_process_group()
    print(f"{n} FSDP2 parameters, {args.layers} blocks, recipe {args.recipe}, {args.device}; host ms a step:")
    print(f"  AdamW (fused) through DTensor's dispatch: {peer * 1e3:.2f}")
    print(f"  AdamW (fused) on the local shards:        {ours * 1e3:.2f} ({peer / ours:.2f}x)")
    print(f"  clip through DTensor's dispatch:          {peer_clip * 1e3:.2f}")
    print(f"  clip on the local shards (telemetry's):   {ours_clip * 1e3:.2f} ({peer_clip / ours_clip:.2f}x)")


if __name__ == "__main__":
    main()
