"""Benchmark: one FSDP2 training step of a GPT on two GPUs, bf16 vs torchao float8 vs ours.

In one run (the same processes, one variant after another), for the same model shape, data,
optimizer (AdamW, foreach) and FSDP2 layout (``fully_shard`` on every block and on the GPT,
``MixedPrecisionPolicy(param_dtype=--param-dtype, reduce_dtype=float32)``, reshard after
forward), blocks checkpointed through ``lightning_fp8state.checkpoint`` (torch non-reentrant),
bf16 autocast, each variant trains ``--warmup`` steps, then ``--steps`` timed steps:

- ``bf16``: plain ``nn.Linear`` (the baseline);
- ``torchao``: torchao float8 training (tensorwise dynamic scaling), weights gathered in
  ``--param-dtype``; ``torchao_fp8ag``: the same with ``enable_fsdp_float8_all_gather`` and
  ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step (its amax all-reduce);
  both printed as "not measured" when torchao is not installed (or on the CPU);
- ``ours_hpag``: our Fp8Linear (delayed scaling), weights gathered in ``--param-dtype`` and
  quantized by each layer; ``ours``: the same with FP8 all-gather at the frozen delayed scale
  (``lightning_fp8state.nn.fsdp.enable_fp8_all_gather``), the weight amaxes MAX-reduced in the
  one all-reduce at ``commit_forward``. Its blocks keep ``param_dtype`` float32 (``--ours-block-dtype``)
  and take the root's bf16 activations as they come (``--ours-block-inputs``):
  their weights travel as FP8 whatever ``param_dtype`` says, and the LayerNorm weights and biases
  (a few KB a block) in float32 keep the LayerNorm fused into the input's quantize (the fused
  kernel takes a float32 affine); the GPT unit uses ``--param-dtype`` as every variant's does.

The output head stays in high precision for every variant (``--no-exclude-head`` converts it).

Prints, per variant: tokens/s (global tokens per step over the median step time, CUDA events on
rank 0), all-gather bytes per step, all-reduces per step, peak memory (the max over ranks of
``torch.cuda.max_memory_allocated``), and the ratios to bf16. **All-gather bytes are counted at
the collective**: ``torch.distributed.all_gather_single`` / ``all_gather_into_tensor`` are wrapped
and the bytes of the tensor this rank contributes are summed over the timed steps (per rank and
step; every rank receives ``world_size`` times that). They cover every FSDP2 gather: the forward
and the backward re-gather of each block, and the GPT unit's own parameters (embedding, final
norm, head), which stay in ``--param-dtype`` in every variant. All-reduces are the
``torch.distributed.all_reduce`` calls per step (ours: the one amax reduction at
``commit_forward``); torchao's amax reduction runs through DTensor's functional collectives and
is not in that count. ``--json PATH`` writes the rows. ``--modes eager compile`` runs every
variant in each mode (compile: each block's forward under ``torch.compile``, FSDP2's hooks eager
around it) and takes bf16's best mode as the baseline. ``--memory-summary N`` records each
variant's CUDA memory history and prints the N largest groups of allocations live at its peak
(``memory_peak.py``; ``--memory-stacks none`` where torch's recorder cannot take Python stacks).
Before each variant the previous one's modules are garbage-collected (FSDP2 holds reference
cycles), so each peak is the variant's own. A variant that raises (an out-of-memory,
a torchao API change) is printed as "not measured" with the error, and the run goes on.

Run on two GPUs (either launches two processes, one per GPU, NCCL):

    torchrun --standalone --nproc-per-node=2 benchmarks/fsdp_step.py [--batch 16 --steps 10]
    python benchmarks/fsdp_step.py            # spawns the two processes itself

The default shape is the 1.2B one (``--d-model 2048 --layers 20 --heads 16 --seq 2048``,
vocabulary 50304); ``--batch`` is per rank (default 16 sequences: 65,536 tokens a step on two
ranks). ``--smoke`` runs a tiny GPT for 2 steps on two CPU processes (gloo, the emulated FP8
GEMM) to check the script end to end (``tests/cli/test_benchmark_scripts.py``); its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import time
import traceback
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import lightning_fp8state as f8s
from lightning_fp8state.models import GPT, GPTConfig
from lightning_fp8state.nn.fsdp import enable_fp8_all_gather

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_peak  # noqa: E402
from train_step import batches  # noqa: E402  (the benchmarks' shared data)

VARIANTS = ("bf16", "torchao", "torchao_fp8ag", "ours_hpag", "ours")
PEER = ("torchao", "torchao_fp8ag")


def _torchao():
    """torchao's float8 entry points, or None when it is not installed."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: PLC0415
    except ImportError:
        return None
    try:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415
    except ImportError:
        from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415
    return Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp


class CollectiveCounter:
    """Wraps the all-gather and all-reduce entry points FSDP2 and the quantizers call; counts
    the bytes this rank contributes to all-gathers and the number of all-reduces while on."""

    def __init__(self) -> None:
        self.on = False
        self.gather_bytes = 0
        self.all_reduces = 0
        # all_gather_single is newer than some torch releases (2.11 has only all_gather_into_tensor)
        names = ("all_gather_single", "all_gather_into_tensor", "all_reduce")
        self._orig = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

        def gather(name):
            def wrapped(output, input, *a, **k):
                if self.on:
                    self.gather_bytes += input.numel() * input.element_size()
                return self._orig[name](output, input, *a, **k)

            return wrapped

        def all_reduce(tensor, *a, **k):
            if self.on:
                self.all_reduces += 1
            return self._orig["all_reduce"](tensor, *a, **k)

        for name in self._orig:
            setattr(dist, name, all_reduce if name == "all_reduce" else gather(name))

    def close(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


def _inputs_to_float32(module, args):
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def build(variant: str, cfg: GPTConfig, args, device: torch.device, rank: int, compiled: bool = False):
    """The sharded model, its Fp8State (ours) and optimizer; None when the variant cannot run.
    ``compiled``: each block's forward under ``torch.compile`` (FSDP2's hooks stay eager, around it)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    exclude = ("*head",) if args.exclude_head else ()
    state, after_step = None, None
    if variant in PEER:
        ao = _torchao()
        if ao is None or device.type != "cuda":
            return None
        config_cls, convert, precompute = ao
        config = config_cls(enable_fsdp_float8_all_gather=variant == "torchao_fp8ag")
        convert(model, config=config, module_filter_fn=lambda mod, fqn: not any(fnmatch(fqn, p) for p in exclude))
        if variant == "torchao_fp8ag":
            after_step = lambda: precompute(model)  # noqa: E731  (its amax all-reduce for the next gather)
    elif variant in ("ours", "ours_hpag"):
        state = f8s.Fp8State(f8s.QuantConfig(exclude=exclude), rank=rank)
        state.convert(model)
        if variant == "ours":
            enable_fp8_all_gather(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.param_dtype]
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    block_policy = policy
    if variant == "ours" and args.ours_block_dtype == "fp32":
        # FSDP2 would cast a float32 unit's inputs to float32: the residual stream, and each
        # checkpointed block's saved input, at 4 bytes an element (measured at 1.2B, batch 16:
        # +2.4 GiB of peak, the 20 saved inputs at 256 MiB instead of 128). The blocks take the
        # root's bfloat16 stream as it comes (cast_forward_inputs=False: the FP8 linears and the
        # fused LayerNorm take bf16 inputs beside float32 affines); --ours-block-inputs fp32
        # keeps the float32 stream, cast by a hook of ours (torch 2.11's FSDP2 casts a unit's
        # inputs in its forward but not in a checkpoint's recompute, whose metadata check then
        # fails: seen on the H200; a module pre-hook runs in both).
        block_policy = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        if args.ours_block_inputs == "fp32":
            for block in model.blocks:
                block.register_forward_pre_hook(_inputs_to_float32)
    for block in model.blocks:
        if compiled:
            block.forward = torch.compile(block.forward)
        fully_shard(block, mesh=mesh, mp_policy=block_policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if state is not None:
        state.enable_amax_reduction(group=mesh.get_group(), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    return model, state, opt, after_step


def measure(
    variant: str, cfg: GPTConfig, args, data, device: torch.device, counter: CollectiveCounter, mode: str = "eager"
) -> dict:
    rank = dist.get_rank()
    cuda = device.type == "cuda"
    if cuda:
        # the previous variant's FSDP2 modules hold reference cycles: without a collection its
        # model and optimizer state would still count in this variant's peak
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device) if cuda else 0
    memory = args.memory_summary and cuda
    recorder = memory_peak.recording(stacks=args.memory_stacks) if memory else contextlib.nullcontext()
    with recorder:
        result = _measure(variant, cfg, args, data, device, counter, mode)
        if memory and result["measured"]:
            snapshot = torch.cuda.memory._snapshot()
            if rank == 0:
                print(f"--- {variant} ({mode}): live at the peak (steps timed while recording)", flush=True)
                print(memory_peak.summarize(snapshot, top=args.memory_summary), flush=True)
            del snapshot
    result["start_gib"] = start / 2**30  # allocated before the variant was built (the data): in every peak
    return result


def _measure(variant, cfg, args, data, device, counter, mode) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    if mode == "compile":
        torch._dynamo.reset()  # each variant compiles its own blocks from scratch
    built = build(variant, cfg, args, device, rank, compiled=mode == "compile")
    if built is None:
        why = "torchao not installed" if _torchao() is None else "needs CUDA"
        return {"variant": variant, "mode": mode, "measured": False, "why": why}
    model, state, opt, after_step = built
    n = {"i": 0}

    def step():
        i = n["i"]
        n["i"] += 1
        x, y = data[i % len(data)]
        with state.step(i) if state is not None else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            if state is not None:
                state.commit_forward()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        return loss.detach()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()
    counter.gather_bytes, counter.all_reduces, counter.on = 0, 0, True
    times, losses = [], []
    for _ in range(args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step())
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            losses.append(step())
            times.append((time.perf_counter() - t0) * 1e3)
    counter.on = False
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    ms = statistics.median(times)
    tokens = args.batch * cfg.seq_len * world
    result = {
        "variant": variant,
        "mode": mode,
        "measured": True,
        "ms": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "all_gather_bytes_per_step": counter.gather_bytes / args.steps,
        "all_reduces_per_step": counter.all_reduces / args.steps,
        "peak_gib": float(peak.item()) / 2**30,
        "final_loss": float(losses[-1].item()),
    }
    return result


def report(results: list[dict], args, world: int) -> None:
    # the baseline: bf16 in its best mode of this run
    bf16 = [r for r in results if r["variant"] == "bf16" and r["measured"]]
    base = max(bf16, key=lambda r: r["tokens_per_s"]) if bf16 else None
    print(
        f"FSDP2 step, {world} ranks, d={args.d_model} layers={args.layers} seq={args.seq} batch/rank={args.batch} "
        f"param_dtype={args.param_dtype}; all-gather bytes counted at the collective (sent per rank and step)"
    )
    head = f"{'variant':<24}{'tok/s':>12}{'ms':>9}{'AG MB/step':>12}{'AR/step':>9}{'peak GiB':>10}"
    print(head + f"{'tok/s x':>9}{'AG x':>7}{'mem x':>7}")
    for r in results:
        name = r["variant"] if r.get("mode", "eager") == "eager" else f"{r['variant']} ({r['mode']})"
        if not r["measured"]:
            print(f"{name:<24}  not measured ({r['why']})")
            continue
        line = (
            f"{name:<24}{r['tokens_per_s']:>12.0f}{r['ms']:>9.1f}{r['all_gather_bytes_per_step'] / 1e6:>12.1f}"
            f"{r['all_reduces_per_step']:>9.1f}{r['peak_gib']:>10.2f}"
        )
        if base is not None:
            mem = f"{r['peak_gib'] / base['peak_gib']:>7.2f}" if base["peak_gib"] else f"{'-':>7}"  # CPU: none
            # one rank: FSDP2 gathers nothing
            ag_base = base["all_gather_bytes_per_step"]
            ag = f"{r['all_gather_bytes_per_step'] / ag_base:>7.2f}" if ag_base else f"{'-':>7}"
            line += f"{r['tokens_per_s'] / base['tokens_per_s']:>9.2f}{ag}{mem}"
        print(line)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"), help="FSDP2's param_dtype")
    p.add_argument(
        "--ours-block-dtype",
        default="fp32",
        choices=("fp32", "same"),
        help="param_dtype of the blocks for 'ours' (its weights are FP8 either way); same: --param-dtype",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["eager"],
        choices=("eager", "compile"),
        help="run every variant in each mode (compile: each block's forward under torch.compile); "
        "the ratios are to bf16's best mode",
    )
    p.add_argument(
        "--memory-summary",
        type=int,
        default=0,
        metavar="N",
        help="record the CUDA memory history of each variant and print the N largest groups of "
        "allocations live at its peak (slows the timed steps)",
    )
    p.add_argument(
        "--memory-stacks",
        default="python",
        choices=("python", "all", "none"),
        help="the stacks the history records (none: sizes only)",
    )
    p.add_argument(
        "--ours-block-inputs",
        default="keep",
        choices=("keep", "fp32"),
        help="with --ours-block-dtype fp32: the blocks' inputs as the root gives them (bf16) or cast to float32",
    )
    p.add_argument("--no-exclude-head", dest="exclude_head", action="store_false")
    p.add_argument("--nprocs", type=int, default=2, help="processes to spawn when not under torchrun")
    p.add_argument("--smoke", action="store_true", help="a tiny GPT, 2 steps, two CPU processes (gloo)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.d_model, args.layers, args.heads, args.seq, args.vocab = 32, 2, 4, 16, 64
        args.batch, args.warmup, args.steps, args.param_dtype = 2, 1, 2, "fp32"
    return args


def worker(rank: int, world: int, args: argparse.Namespace, teardown: bool = True) -> list[dict]:
    cuda = not args.smoke
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
    )
    data = [(x.to(device), y.to(device)) for x, y in batches(cfg, args.batch, 4, "cpu")]
    counter = CollectiveCounter()
    results = []
    try:
        for mode in args.modes:
            for variant in args.variants:
                try:
                    results.append(measure(variant, cfg, args, data, device, counter, mode))
                except Exception as exc:  # noqa: BLE001  (report it, measure the others)
                    counter.on = False
                    if rank == 0:
                        traceback.print_exc()
                    why = f"{type(exc).__name__}: {exc}"[:200]
                    results.append({"variant": variant, "mode": mode, "measured": False, "why": why})
                    if cuda:
                        torch.cuda.empty_cache()
                if rank == 0:
                    r = results[-1]
                    state = f"{r['ms']:.1f} ms/step" if r["measured"] else f"not measured ({r['why']})"
                    print(f"  {variant} ({mode}): {state}", flush=True)
    finally:
        counter.close()
    if rank == 0:
        report(results, args, world)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"args": vars(args), "world_size": world, "results": results}, fh, indent=1)
    dist.barrier()  # no rank tears the group down while another still reports
    if teardown:
        dist.destroy_process_group()
    return results


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """A spawned rank: everything is reported once ``worker`` returns, so the process ends there
    without tearing gloo down. Gloo's worker threads can abort the process at teardown ("terminate
    called without an active exception", seen once in CI after a complete run), which made a
    finished benchmark exit with SIGABRT."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(rank, world, args, teardown=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> None:
    args = parse(argv)
    if "RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    if not args.smoke and torch.cuda.device_count() < args.nprocs:
        raise SystemExit(
            f"fsdp_step.py needs {args.nprocs} CUDA GPUs (found {torch.cuda.device_count()}); "
            "--smoke runs two CPU processes"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(args.nprocs, port, args), nprocs=args.nprocs, start_method="spawn")


if __name__ == "__main__":
    main()
