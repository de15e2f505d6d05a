"""Benchmark: a user's own Hugging Face Llama trained through Lightning with ``Fp8StateCallback``
(per-layer CUDA graphs, ``graph_blocks=True``), against the same model in bf16 and our own Llama
(``lightning_fp8state.models.Llama``) at the same shape, in one run.

Every variant is a plain ``lightning.Trainer`` on one device (strategy ``auto``), bf16-mixed, fused
AdamW, each decoder layer checkpointed, the output head in bf16, the loss the same float32
cross-entropy; only the model and how it is quantized change:

    hf_bf16           transformers' LlamaForCausalLM, its own gradient checkpointing, no callback
    hf_fp8            + Fp8StateCallback (FP8 delayed scaling), its layers eager
    hf_fp8_graphs     + Fp8StateCallback(graph_blocks=True): each decoder layer from a CUDA graph
    hf_fused_fp8      hf_fp8 after lightning_fp8state.fuse_decoder_projections (RMSNorm / SwiGLU fused)
    hf_fused_fp8_graphs  hf_fp8_graphs after fuse_decoder_projections: a user's model on our fast path
    ours_fp8          our Llama (separate projections, as the Hugging Face layer has), callback
    ours_fp8_fused    our Llama with fused projections (RMSNorm / SwiGLU folded into the encodes)
    ours_bf16         our Llama without the callback

Throughput is tokens/s over the steps after ``--warmup`` (timed with one synchronize at each
end, the host's issue included, as a user runs it). Prints each variant and the ratios against
``hf_bf16`` and ``ours_fp8_fused``; ``--json`` keeps them.

    python benchmarks/hf_speed.py [--d-model 2048 --layers 16 --heads 32 --kv-heads 8 --ffn 8192
        --vocab 128256 --seq 2048 --batch 8] [--steps 20 --warmup 5] [--variants ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time

import lightning.pytorch as pl
import torch
import transformers
from timing import fresh_peak

import lightning_fp8state as f8s
from lightning_fp8state.lightning import Fp8StateCallback
from lightning_fp8state.models import Llama, llama_config_from_hf
from lightning_fp8state.models.blocks import next_token_loss

VARIANTS = (
    "hf_bf16",
    "hf_fp8",
    "hf_fp8_graphs",
    "hf_fused_fp8",
    "hf_fused_fp8_graphs",
    "ours_fp8",
    "ours_fp8_fused",
    "ours_bf16",
)


def _hf_config(args):
    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def _hf_model(args) -> torch.nn.Module:
    return transformers.LlamaForCausalLM(_hf_config(args))


def _our_model(args, fused: bool) -> torch.nn.Module:
    """Our Llama of the same shape: the transformers config read as a checkpoint's would be."""
    cfg = llama_config_from_hf(_hf_config(args).to_dict())
    return Llama(dataclasses.replace(cfg, seq_len=args.seq, checkpoint=True, fused_projections=fused))


def _module(variant: str, args):
    hf = variant.startswith("hf_")
    net = _hf_model(args) if hf else _our_model(args, fused=variant.endswith("_fused"))
    if hf and "fused" in variant:
        f8s.fuse_decoder_projections(net)  # before the callback converts the model
    if hf and not variant.endswith("_graphs"):  # with graphs, the graphs' runner checkpoints the layers
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(input_ids=x, use_cache=False).logits if hf else self.net(x)
            return next_token_loss(logits, y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    return Module()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Clock:
    """Times the steps after ``warmup`` with one synchronize at each end."""

    def __init__(self, warmup: int) -> None:
        clock = self

        class Timer(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == warmup:
                    _sync()
                    clock.start = time.perf_counter()

            def on_train_end(self, trainer, pl_module):
                _sync()
                clock.end = time.perf_counter()

        self.callback = Timer()
        self.start = self.end = 0.0


def measure(variant: str, args) -> dict:
    torch.manual_seed(0)
    left = fresh_peak()  # earlier variants' models collected first (a Lightning fit leaves cycles)
    module = _module(variant, args)
    g = torch.Generator().manual_seed(1)
    n = args.steps + args.warmup
    tokens = torch.randint(0, args.vocab, (n * args.batch, args.seq + 1), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, pin_memory=args.accelerator == "gpu")
    clock = _Clock(args.warmup)
    callbacks = [clock.callback]
    if "fp8" in variant:
        config = f8s.QuantConfig(exclude=("*head",), strict=False, weight_codes_once=args.weight_codes_once == "true")
        callbacks.append(Fp8StateCallback(config=config, graph_blocks=variant.endswith("_graphs")))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision="bf16-mixed" if args.accelerator == "gpu" else "32-true",
        max_steps=n,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    seconds = clock.end - clock.start
    row = {
        "variant": variant,
        "ms_per_step": 1e3 * seconds / args.steps,
        "tokens_per_s": args.steps * args.batch * args.seq / seconds,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.accelerator == "gpu" else float("nan"),
        "left_gib": left,  # allocated before this variant began: counted in its peak (should be ~0)
        "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
    }
    print(
        f"  {variant}: {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, {row['peak_gib']:.1f} GiB"
        f" (of which {left:.2f} GiB left by earlier variants)"
    )
    del trainer, module
    return row


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu", help="cpu: a smoke run of the script")
    p.add_argument(
        "--weight-codes-once",
        choices=("true", "false"),
        default="true",
        help="QuantConfig.weight_codes_once of the FP8 variants (false: no weight codes held forward to backward)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(
        f"device: {torch.cuda.get_device_name() if args.accelerator == 'gpu' else 'cpu'}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"host {platform.processor() or platform.machine()}; Llama d={args.d_model} layers={args.layers} "
        f"heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} seq={args.seq} batch={args.batch}"
    )
    rows = [measure(v, args) for v in args.variants]
    by = {r["variant"]: r for r in rows}
    print(f"{'variant':>16} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'/hf_bf16':>9} {'/ours_fused':>12}")
    for r in rows:
        vs_bf16 = by["hf_bf16"]["ms_per_step"] / r["ms_per_step"] if "hf_bf16" in by else float("nan")
        vs_ours = r["tokens_per_s"] / by["ours_fp8_fused"]["tokens_per_s"] if "ours_fp8_fused" in by else float("nan")
        print(
            f"{r['variant']:>16} {r['ms_per_step']:>9.1f} {r['tokens_per_s']:>10,.0f} {r['peak_gib']:>9.1f} "
            f"{vs_bf16:>8.2f}x {vs_ours:>11.2f}x"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
