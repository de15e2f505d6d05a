"""Multi-process Lightning runs for the tests: ``python -m tests.lightning.scenarios PLAN.json OUT``.

PLAN.json is a list of run specs (see ``DEFAULTS``). The script is started once, as rank 0;
Lightning launches the other ranks by re-running it (``strategy="fp8state_ddp"``), and every
rank then runs the same fits in order, in the same process group. After each fit every rank
writes what it observed to ``OUT/<name>/rank<r>.pt`` (plain tensors and values) for the test
to compare across ranks and runs. The GPU tests use it with ``fp8state_deepspeed``.
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DistributedSampler

import lightning_fp8state as f8s
from lightning_fp8state.models import ResumableLoader
from lightning_fp8state.nn.fsdp import gathered_layers
from tests.lightning.models import CheckpointedBoring, HfLlamaModule, ScaledDataset, TokenRows

DEFAULTS = {
    "name": "run",
    "config": {},  # QuantConfig fields
    "ckpt": "f8s_torch",  # see models.CKPT_MODES
    "accelerator": "cpu",
    "devices": 2,
    "strategy": "fp8state_ddp",
    "strategy_kwargs": {},  # when set, the strategy is built from its class with these
    "precision": "32-true",
    "accumulate": 3,
    "max_epochs": 2,
    "samples": 32,
    "batch_size": 2,
    "frozen": False,  # a frozen layer whose weight differs per rank (perturbed after DDP's broadcast)
    "audit": True,
    "save_at": [],  # [[epoch, batch_idx, file name(, save_grads)], ...]: trainer.save_checkpoint there
    "stop_after_save": False,  # stop the fit right after the last save_at (an interruption)
    "resume_from": None,  # file name of a checkpoint written by an earlier run
    "graphed": False,  # the blocks through GraphedBlocks, its graphs emulated (tests/graph_emulation.py)
    "optimizer": "sgd",  # or "adamw" (fused)
    # "hf_llama": a tiny transformers Llama on token rows (models.HfLlamaModule), its decoder layers
    # checkpointed eagerly, or graphed by Fp8StateCallback(graph_blocks=True) with "graph_blocks"
    "model": "boring",
    "graph_blocks": False,
}


class SaveAt(Callback):
    """Writes a checkpoint at chosen (epoch, batch) ends; optionally stops the fit there."""

    def __init__(self, points, out, stop, fp8cb):
        self.points = [(e, b, name, *rest) for e, b, name, *rest in points]
        self.last = max(((e, b) for e, b, *_ in self.points), default=None)
        self.out, self.stop, self.fp8cb = out, stop, fp8cb

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for epoch, index, name, *rest in self.points:
            if (epoch, index) != (trainer.current_epoch, batch_idx):
                continue
            self.fp8cb.save_accumulated_grads = rest[0] if rest else True
            trainer.save_checkpoint(os.path.join(self.out, name))
            self.fp8cb.save_accumulated_grads = True
        if self.stop and (trainer.current_epoch, batch_idx) == self.last:
            trainer.should_stop = True


class Perturb(Callback):
    def on_fit_start(self, trainer, pl_module):
        if pl_module.frozen is not None:
            pl_module.perturb_frozen(trainer.global_rank)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``; a sharded (FSDP2) DTensor is gathered whole first (a collective)."""
    from lightning_fp8state.nn.fsdp import plain_shard

    t = plain_shard(t)
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def _key(owner) -> str:
    return f"{owner.layer}#{owner.site}.{owner.role}"


def momentum_buffers(trainer) -> list:
    """SGD momentum buffers of a torch optimizer (DeepSpeed's ZeRO optimizer keeps its own: [])."""
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [
        _full(s["momentum_buffer"])
        for s in optimizer.state_dict()["state"].values()
        if s.get("momentum_buffer") is not None
    ]


def adam_moments(trainer) -> list:
    """AdamW's first and second moments, whole (gathered from the shards under FSDP2)."""
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    if not isinstance(optimizer, torch.optim.AdamW):
        return []
    return [_full(s[k]) for s in optimizer.state_dict()["state"].values() for k in ("exp_avg", "exp_avg_sq")]


def observe(trainer, model, cb) -> dict:
    state = cb.state
    events = state.ledger.events()
    per_event = {
        e: {_key(o): (r.commits, r.observations, r.recompute_records) for o, r in state.ledger.event(e).items()}
        for e in events
    }
    report = cb.audit_report() if cb.audit else None
    reducer = state.protocol.amax_reducer
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "events": events,
        "per_event": per_event,
        "owners": [o.as_list() for o in state.bank.owners],
        "owner_ranks": sorted({o.rank for o in state.bank.owners}),
        "total_commits": {_key(o): state.ledger.commits(o) for o in state.bank.owners},
        "scales": {_key(o): state.bank.scale[i].item() for i, o in enumerate(state.bank.owners)},
        "bank": state.state_dict()["bank"],
        "clock_last": state.clock.last,
        "violations": len(state.ledger.violations),
        "collectives": None if reducer is None else reducer.collectives,
        "audit_ok": None if report is None else report.ok,
        "audit_recomputed": None if report is None else report.recomputed,
        "audit_mismatches": None if report is None else len(report.mismatches),
        "audit_table": None if report is None else report.format_table(),
        "params": {k: _full(v) for k, v in model.state_dict().items()},
        "momentum": momentum_buffers(trainer),
        # AdamW's moments (this rank's shards), and whether its step ran on the local shards
        "adam_moments": adam_moments(trainer),
        "local_step": bool(getattr(trainer.optimizers[0], "_fp8state_local_step", False))
        if trainer.optimizers
        else None,
        "device": str(state.bank.device),  # where the quantizers ran (Lightning may move the model back)
        "strategy": type(trainer.strategy).__name__,
        "fp8_gathered": gathered_layers(model),  # layers whose weight FSDP2 gathers in FP8
        # layers that hold no weight codes from forward to recompute (nn.fsdp.mark_sharded)
        "sharded_layers": sorted(state.protocol.sharded_layers),
        "default_engine": f8s.recompute.default_engine(),
        # DeepSpeed's micro-step counter (its accumulation boundaries); None without DeepSpeed
        "engine_micro_steps": getattr(getattr(trainer.strategy, "deepspeed_engine", None), "micro_steps", None),
    }


def _strategy(spec):
    if not spec["strategy_kwargs"]:
        return spec["strategy"]
    classes = {
        "fp8state_ddp": f8s.lightning.Fp8StateDDPStrategy,
        "fp8state_deepspeed": f8s.lightning.Fp8StateDeepSpeedStrategy,
        "fp8state_fsdp": f8s.lightning.Fp8StateFSDPStrategy,
    }
    return classes[spec["strategy"]](**spec["strategy_kwargs"])


def run(spec: dict, out: str) -> None:
    spec = {**DEFAULTS, **spec}
    pl.seed_everything(0, workers=True, verbose=False)
    from tests.graph_emulation import EmulatedGraphBackend

    if spec["model"] == "hf_llama":
        model = HfLlamaModule(checkpointed=not spec["graph_blocks"])
        data = TokenRows(spec["samples"], seq=16, vocab=128)
    else:
        model = CheckpointedBoring(ckpt=spec["ckpt"], frozen=spec["frozen"], optimizer=spec["optimizer"])
        data = ScaledDataset(spec["samples"])
    if spec["graphed"]:
        from lightning_fp8state.graphs import GraphedBlocks

        model.blocks_runner = GraphedBlocks(model.blocks, warmup=2, backend=EmulatedGraphBackend())

    def train_dataloader():
        # Our own sampler without shuffling (Lightning's shuffles training data): rank 0 gets
        # the even samples, rank 1 the 8x louder odd ones.
        trainer = model.trainer
        sampler = DistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        return ResumableLoader(data, batch_size=spec["batch_size"], sampler=sampler)

    model.train_dataloader = train_dataloader
    # CUDA graphs on a GPU (the callback's default backend), emulated on the CPU
    backend = EmulatedGraphBackend() if spec["accelerator"] == "cpu" else None
    graphs = {"graph_blocks": True, "graph_warmup": 2, "graph_backend": backend}
    cb = f8s.lightning.Fp8StateCallback(
        config=f8s.QuantConfig(**spec["config"]), audit=spec["audit"], **(graphs if spec["graph_blocks"] else {})
    )
    callbacks = [cb, Perturb(), SaveAt(spec["save_at"], out, spec["stop_after_save"], cb)]
    trainer = pl.Trainer(
        accelerator=spec["accelerator"],
        devices=spec["devices"],
        strategy=_strategy(spec),
        precision=spec["precision"],
        max_epochs=spec["max_epochs"],
        accumulate_grad_batches=spec["accumulate"],
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        deterministic=True,
        use_distributed_sampler=False,
    )
    ckpt = None if spec["resume_from"] is None else os.path.join(out, spec["resume_from"])
    trainer.fit(model, ckpt_path=ckpt)
    result = observe(trainer, model, cb)
    bad = [k for k, v in result["params"].items() if not torch.isfinite(v).all()]
    if bad:  # two diverged runs compare equal as NaN: nothing the plan's tests assert would hold
        raise AssertionError(f"scenario {spec['name']!r}: non-finite weights after the fit: {bad}")
    runner = model.blocks_runner or cb.graph_runner
    result["replays"] = None if runner is None else runner.replays
    result["losses"] = [t.float() for t in getattr(model, "losses", [])]
    folder = os.path.join(out, spec["name"])
    os.makedirs(folder, exist_ok=True)
    torch.save(result, os.path.join(folder, f"rank{trainer.global_rank}.pt"))
    trainer.strategy.barrier("scenario done")


def main(argv: list[str]) -> None:
    plan_path, out = argv
    with open(plan_path) as f:
        plan = json.load(f)
    for spec in plan:
        run(spec, out)


if __name__ == "__main__":
    main(sys.argv[1:])
