"""What a CLI run trains: the GPT as a LightningModule (its AdamW and learning-rate schedule) and
the token data as a LightningDataModule, both built from the run's configuration.

The strategy contract (:func:`~lightning_fp8state.cli.schema.strategy_facts`) says whether the
AdamW is fused, whether ``trainer.cuda_graphs`` graphs the whole step or each block, and whether
the optimizer state is restored after the checkpoint hooks.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from ..models import ResumableLoader, make_dataset
from .models import build_model
from .schema import strategy_facts

__all__ = ["fused_optimizer", "lr_factor", "module_and_data"]


def lr_factor(cfg: DictConfig, step: int) -> float:
    """The learning rate of optimizer step ``step + 1`` as a fraction of ``trainer.lr``: linear
    warm-up, then cosine to 10% over ``trainer.schedule_steps`` (0: ``trainer.max_steps``)."""
    t = cfg.trainer
    warm = max(1, t.warmup_steps)
    total = t.schedule_steps or t.max_steps
    if step < warm:
        return (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))


def fused_optimizer(cfg: DictConfig) -> bool:
    """Whether the run's AdamW is fused: the guard then skips on the device (the strategy says,
    ``Fp8StateStrategyContract.fused_optimizer``). Where the optimizer owns the parameters the
    telemetry clips (``telemetry_clips`` in ``cli/train.py``); under DeepSpeed ZeRO-1/2 the
    optimizer steps DeepSpeed's flat fp32 partitions, and the strategy's device guard
    (``lightning.deepspeed_guard``) checks and clips there."""
    return strategy_facts(cfg.strategy).fused_optimizer(cfg.strategy)


def _set_fused(optimizers, fused: bool) -> None:
    """Every param group of ``optimizers`` (optimizers or their state dicts) fused or not."""
    for opt in optimizers:
        groups = opt.get("param_groups", ()) if isinstance(opt, dict) else opt.param_groups
        for group in groups:
            group["fused"] = fused
            if fused:
                group["foreach"] = None  # fused and foreach are exclusive


def module_and_data(cfg: DictConfig):
    """The run's LightningModule and LightningDataModule."""
    return _gpt_module(cfg), _token_data(cfg)


def _cuda_graphs(module, cfg: DictConfig):
    """``trainer.cuda_graphs=true``: per-block graphs where the strategy's contract says
    ``"blocks"`` (its gradient hooks stay eager between the blocks), installed in the model;
    else the whole step as one graph, returned (manual optimization: the step runs the optimizer
    itself)."""
    if strategy_facts(cfg.strategy).cuda_graphs == "blocks":
        from ..graphs import GraphedBlocks

        module.model.blocks_runner = GraphedBlocks(
            module.model.blocks, warmup=cfg.trainer.cuda_graphs_warmup, checkpoint=cfg.model.checkpoint
        )
        return None
    from ..lightning import GraphedTrainingStep

    return GraphedTrainingStep(module, module.model.loss, warmup=cfg.trainer.cuda_graphs_warmup)


def _gpt_module(cfg: DictConfig):
    """The GPT of ``model.*`` as a LightningModule (compiled or graphed as ``trainer.*`` says)."""
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(cfg)
            if cfg.trainer.compile:  # compiled on first use, after the callback converted the linears
                for block in self.model.blocks:
                    block.compile()
            self.graphed = None
            self.last_loss = None  # the last step's loss, on the device: read once, when the run ends
            if cfg.trainer.cuda_graphs:
                self.graphed = _cuda_graphs(self, cfg)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.graphed(self, batch) if self.graphed is not None else self.model.loss(x, y)
            self.last_loss = loss.detach()
            # for callback_metrics only: the telemetry writes the loss to the loggers and the
            # bar on log steps; a device value in the bar would be read back every batch (a sync)
            self.log("train/loss", loss, on_step=True, prog_bar=False, logger=False)
            return loss

        def configure_optimizers(self):
            t = cfg.trainer
            # fused: one kernel per step, and the telemetry's non-finite guard skips on the device
            # (no host sync); sharded (FSDP2) and DeepSpeed-managed parameters keep the default
            opt = torch.optim.AdamW(self.parameters(), lr=t.lr, weight_decay=t.weight_decay, fused=fused_optimizer(cfg))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_start(self):
            # Under FSDP2 the optimizer state comes back through DCP in the strategy's
            # load_checkpoint, past on_load_checkpoint below: put the configured setting back
            if strategy_facts(cfg.strategy).restores_optimizer_late:
                _set_fused(self.trainer.optimizers, fused_optimizer(cfg))

        def on_load_checkpoint(self, checkpoint):
            # load_state_dict takes the saved param groups' settings: a run saved by an earlier
            # version (AdamW not fused) would continue unfused, its guard syncing every step.
            # The optimizer of this run is what the configuration says (the state is the same).
            fused = fused_optimizer(cfg)
            for opt_state in checkpoint.get("optimizer_states", ()):
                _set_fused([opt_state], fused)

    return GPTModule()


def _token_data(cfg: DictConfig):
    """The tokens of ``data.*`` as a LightningDataModule whose loader resumes mid-epoch."""
    import lightning.pytorch as pl

    class TokenData(pl.LightningDataModule):
        def train_dataloader(self):
            d = cfg.data
            ds = make_dataset(
                d.source,
                vocab_size=cfg.model.vocab_size,
                seq_len=cfg.model.seq_len,
                length=d.num_samples,
                seed=d.seed,
                path=d.path,
            )
            # resumable: a resumed run continues on the next batch of the epoch, not its start
            # pinned on a GPU: Lightning's non-blocking copy to the device is then asynchronous
            pin = cfg.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available()
            return ResumableLoader(
                ds, batch_size=d.batch_size, shuffle=False, drop_last=True, num_workers=d.num_workers, pin_memory=pin
            )

    return TokenData()
