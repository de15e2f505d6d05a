"""``fp8state train``: a Lightning run of a recipe with the project's callbacks and strategy.

The run directory (``out_dir/name``, numbered if taken) holds the resolved ``config.yaml``,
``provenance.json`` (what produced the run), ``telemetry.jsonl``, W&B's offline files under
``wandb/`` and Lightning checkpoints under ``checkpoints/``. ``--resume RUN_DIR`` continues
from ``checkpoints/last.ckpt`` with that directory's configuration.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..models import GPT, ResumableLoader, make_dataset
from ..ops import cuda as cuda_ext
from .audit import model_config
from .config import load_config, quant_config, validate

__all__ = ["provenance", "run_training"]


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown (installed package)"
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance() -> dict:
    """What produced a run: package, git commit, Python, torch, CUDA and the built extension."""
    from .. import __version__

    return {
        "package": "lightning_fp8state",
        "version": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cuda_extension": cuda_ext.extension_info(),
        "command": sys.argv,
    }


def _new_run_dir(cfg: DictConfig) -> Path:
    base = Path(cfg.out_dir) / cfg.name
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _module_and_data(cfg: DictConfig):
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(model_config(cfg))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model.loss(x, y)
            self.log("train/loss", loss, prog_bar=True, on_step=True)
            return loss

        def configure_optimizers(self):
            t = cfg.trainer
            opt = torch.optim.AdamW(self.parameters(), lr=t.lr, weight_decay=t.weight_decay)
            warm = max(1, t.warmup_steps)
            total = t.schedule_steps or t.max_steps

            def lr_at(step: int) -> float:  # linear warm-up, then cosine to 10%
                if step < warm:
                    return (step + 1) / warm
                frac = min(1.0, (step - warm) / max(1, total - warm))
                return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))

            sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

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
            return ResumableLoader(
                ds, batch_size=d.batch_size, shuffle=False, drop_last=True, num_workers=d.num_workers
            )

    return GPTModule(), TokenData()


def _strategy(cfg: DictConfig):
    s = cfg.strategy
    if s.name == "auto":
        return "auto"
    from ..lightning import strategies

    if s.name == "fp8state_ddp":
        return strategies.Fp8StateDDPStrategy()
    return strategies.Fp8StateDeepSpeedStrategy(
        stage=s.zero_stage,
        partition_activations=s.partition_activations,
        cpu_checkpointing=s.cpu_checkpointing,
        contiguous_memory_optimization=s.contiguous_memory_optimization,
    )


def last_checkpoint(run_dir: Path) -> Path:
    """The run's ``checkpoints/last.ckpt``: a file, or under DeepSpeed a directory of
    per-rank shards (a link to either counts too); ConfigError if there is none."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        raise ConfigError(f"--resume {str(run_dir)!r}: no checkpoints/last.ckpt to continue from")
    return last


def run_training(recipe: str | None, overrides: list[str], *, resume: str | None = None, verbose: bool = False) -> int:
    """Validate the configuration, then train; nothing is written if validation fails."""
    ckpt_path = None
    if resume is not None:
        run_dir = Path(resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"--resume {resume!r}: no config.yaml there (not a run directory)")
        last = last_checkpoint(run_dir)
        cfg = OmegaConf.merge(load_config(None), OmegaConf.load(saved))
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
        validate(cfg)
        ckpt_path = str(last)
    else:
        cfg = load_config(recipe, overrides)
        run_dir = _new_run_dir(cfg)

    os.environ.setdefault("WANDB_SILENT", "true")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..lightning import Fp8StateCallback, TelemetryCallback, wandb_logger

    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    loggers = []
    if cfg.telemetry.wandb != "disabled":
        loggers.append(
            wandb_logger(
                run_dir, project=cfg.telemetry.project, online=cfg.telemetry.wandb == "online", name=run_dir.name
            )
        )
    module, data = _module_and_data(cfg)
    t = cfg.trainer
    trainer = pl.Trainer(
        default_root_dir=str(run_dir),
        max_steps=t.max_steps,
        accelerator="gpu" if t.accelerator == "cuda" else t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        precision=t.precision,
        accumulate_grad_batches=t.accumulate_grad_batches,
        gradient_clip_val=t.gradient_clip_val or None,
        deterministic=t.deterministic,
        strategy=_strategy(cfg),
        logger=loggers or False,
        log_every_n_steps=cfg.telemetry.log_every_n_steps,
        enable_model_summary=False,
        callbacks=[
            Fp8StateCallback(config=quant_config(cfg), audit=cfg.telemetry.audit, verbose=verbose, report_dir=run_dir),
            TelemetryCallback(run_dir=run_dir, log_every_n_steps=cfg.telemetry.log_every_n_steps),
            ModelCheckpoint(
                dirpath=run_dir / "checkpoints",
                every_n_train_steps=t.checkpoint_every_n_steps,
                save_last=True,
                save_top_k=0,
            ),
        ],
    )
    (run_dir / "provenance.json").write_text(json.dumps(provenance(), indent=1, default=str))
    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    finally:
        if trainer.is_global_zero:
            for logger in loggers:  # close the W&B run: a later run in this process gets its own
                logger.experiment.finish()
    if trainer.is_global_zero:  # again: the CUDA extension (and its hash) is known only now
        (run_dir / "provenance.json").write_text(json.dumps(provenance(), indent=1, default=str))
        loss = trainer.callback_metrics.get("train/loss")
        print(f"run directory: {run_dir}")
        print(f"steps: {trainer.global_step}, last loss: {float(loss):.4f}" if loss is not None else "")
    return 0
