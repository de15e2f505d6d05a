"""Train a tiny GPT with FP8 delayed scaling and activation checkpointing, on the CPU.

The whole public contract of lightning_fp8state in one file:

1. ``Fp8State(QuantConfig(...))`` owns every quantizer's delayed state;
2. ``state.convert(model)`` swaps the Linear layers for FP8 ones;
3. each training step is one logical event: ``with state.step(step, microbatch)``;
4. checkpointed blocks go through ``lightning_fp8state.checkpoint`` so that the recompute
   during backward replays the true forward's snapshots instead of advancing the state;
5. a ``RecomputeAuditor`` proves forward and recompute bit-identical.

Run ``python examples/train_tiny_gpt.py`` (about a minute on two cores), or with
``--mode naive`` to watch the audit catch the seed's defect. ``--fp4-attention nvfp4``
(or ``mxfp4``, optionally ``--centered``) also quantizes the attention operands q and k as
packed FP4, one owner per layer and role, through ``Fp4AttentionQuantizer``.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s


# -- data: token sequences from a random sparse Markov chain (learnable structure) -------
def markov_batches(vocab: int, seq: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 3), generator=g)  # 3 likely next tokens
    while True:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(seq):
            pick = torch.randint(0, 3, (batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        yield tokens[:, :-1], tokens[:, 1:]


# -- model: a small pre-norm GPT -------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int, fp4_attention: bool = False) -> None:
        super().__init__()
        self.heads = heads
        # Bound (and named after its module path) by state.convert(model).
        self.attn_quant = f8s.Fp4AttentionQuantizer() if fp4_attention else None
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attn_quant is not None:  # q, k packed FP4; only the packed codes are saved
            att = self.attn_quant.attention(q, k, v, is_causal=True)
        else:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 64, seq: int = 64, d: int = 64, layers: int = 4, heads: int = 4, fp4_attention: bool = False
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, fp4_attention) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = f8s.checkpoint(block, x)  # activation checkpointing, recompute-safe
        return self.head(self.ln(x))


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
    # head_dim must be a whole number of FP4 blocks: 16 (NVFP4) or 32 (MXFP4).
    model = state.convert(TinyGPT(heads=2 if args.fp4_attention == "mxfp4" else 4, fp4_attention=fp4))
    print(state.last_conversion)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = markov_batches(vocab=64, seq=64, batch=16, seed=args.seed)

    start, first_loss = time.perf_counter(), None
    with f8s.RecomputeAuditor(state) as auditor:
        for step in range(args.steps):
            x, y = next(data)
            with state.step(step, microbatch=0):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
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
    floor = math.log(3)  # entropy of the chain: 3 equally likely successors
    print(f"loss {first_loss:.3f} -> {loss.item():.3f} (the data's entropy floor is {floor:.3f})")
    raise SystemExit(0 if report.ok or args.mode != "safe" else 1)


if __name__ == "__main__":
    main()
