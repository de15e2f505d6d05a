"""Train a tiny GPT with FP8 delayed scaling and activation checkpointing, on the CPU.

The whole public contract of lightning_fp8state in one loop:

1. ``Fp8State(QuantConfig(...))`` owns every quantizer's delayed state;
2. ``state.convert(model)`` swaps the Linear layers for FP8 ones;
3. each training step is one logical event: ``with state.step(step, microbatch)``;
4. the model's blocks run through ``lightning_fp8state.checkpoint`` (see
   ``lightning_fp8state/models/gpt.py``), so the recompute during backward replays the
   true forward's snapshots instead of advancing the state;
5. a ``RecomputeAuditor`` proves forward and recompute bit-identical.

Run ``python examples/train_tiny_gpt.py`` (about half a minute on two cores), or with
``--mode naive`` to watch the audit catch the seed's defect (exit code 1, as for any failed audit); ``--fp4-attention nvfp4``
(``--centered``) sends q and k through the packed-FP4 operand quantizer. The CLI (``fp8state train``)
runs the same model through Lightning.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig, MarkovTokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--mode", choices=["safe", "naive", "naive_snapshot"], default="safe")
    parser.add_argument("--fp4-attention", choices=["none", "nvfp4", "mxfp4"], default="none")
    parser.add_argument("--centered", action="store_true", help="centered FP4 attention operands")
    parser.add_argument("--recipe", choices=["fp8_delayed", "bf16"], default="fp8_delayed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    fp4 = args.fp4_attention != "none"
    config = f8s.QuantConfig(
        recipe=args.recipe,
        mode=args.mode,
        strict=False,
        exclude=("head",),
        attn_format=args.fp4_attention if fp4 else "nvfp4",
        attn_centered=args.centered,
    )
    state = f8s.Fp8State(config)
    # head_dim must be a whole number of FP4 blocks: 16 (NVFP4) or 32 (MXFP4)
    heads = 2 if args.fp4_attention == "mxfp4" else 4
    gpt = GPTConfig(
        vocab_size=64, seq_len=64, d_model=64, n_layers=4, n_heads=heads, checkpoint=True, fp4_attention=fp4
    )
    model = state.convert(GPT(gpt))
    print(state.last_conversion)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = MarkovTokens(vocab_size=64, seq_len=64, length=16 * args.steps, seed=args.seed)
    loader = iter(torch.utils.data.DataLoader(data, batch_size=16))

    start, first_loss = time.perf_counter(), None
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(args.steps):
            x, y = next(loader)
            with state.step(step, microbatch=0):  # one logical event
                loss = model.loss(x, y)
                state.commit_forward()  # forward roles advance now; recompute reads snapshots
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            first_loss = loss.item() if first_loss is None else first_loss
            if step % 25 == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - start:.1f}s)")
    report = auditor.report()
    print(report.format_table())
    owner = f8s.OwnerKey("blocks.0.qkv", "input")
    if owner in state.bank.index:
        print(f"commits of {owner}: {state.ledger.commits(owner)} over {args.steps} steps")
    floor = math.log(data.branching)  # entropy of the chain: the best achievable loss
    print(f"loss {first_loss:.3f} -> {loss.item():.3f} (the data's entropy floor is {floor:.3f})")
    # exit 1 whenever forward and recompute differ: with --mode naive that is the defect caught
    raise SystemExit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
