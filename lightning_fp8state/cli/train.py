"""``fp8state train``: a Lightning run of a run recipe with the project's callbacks and strategy.

The run directory (``out_dir/name``, numbered if taken; claimed by rank 0 alone, see
``cli/rundir.py``) holds the resolved ``config.yaml``, ``provenance.json`` (what produced the
run), ``telemetry.jsonl``, the W&B run id and W&B's offline files under ``wandb/``, and
Lightning checkpoints under ``checkpoints/`` (``last.ckpt`` and the two newest ``step=N.ckpt``,
written atomically). ``--resume RUN_DIR`` continues from the newest readable checkpoint with
that directory's configuration, once the resume is validated in full (``cli/resume.py``).

A run, step by step (:func:`run_training`): the resume plan or the run recipe's configuration;
the checks before the run (``cli/checks.py``); the run directory, held for the fit; the
loggers, the module and data (``cli/gpt_module.py``), the callbacks and the trainer; the fit;
and the lines that say how it ended.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import torch
from omegaconf import DictConfig

from ..errors import ConfigError
from .checks import require_runnable
from .config import load_config, quant_config
from .gpt_module import lr_factor, module_and_data
from .resume import ResumePlan, plan_resume
from .rundir import (
    launch_rank,
    report_interrupted,
    rewrite_run_files,
    run_directory,
    run_files_callback,
    shared_run_dir_callback,
    wandb_run_id,
)
from .schema import strategy_facts

__all__ = ["quiet_lightning", "run_training", "set_cpu_threads", "telemetry_clips"]


def run_training(recipe: str | None, overrides: list[str], *, resume: str | None = None, verbose: bool = False) -> int:
    """Validate everything, then train. Nothing is created (new run) or changed (resume)
    until the configuration, the overrides and (on resume) the checkpoint are validated.

    Args:
        recipe: the run recipe (a name or a YAML path); None for the default, or with ``resume``.
        overrides: ``key=value`` items.
        resume: a run directory to continue (``--resume``).
        verbose: log the full conversion report.

    Returns:
        The exit code: 0, or 130 for a run interrupted by Ctrl-C or a signal.
    """
    rank = launch_rank()
    plan = plan_resume(resume, recipe, overrides) if resume is not None else None
    cfg = plan.cfg if plan is not None else load_config(recipe, overrides)
    require_runnable(cfg, recipe, rank=rank)
    threads = torch.get_num_threads()  # the caller's, put back when the run ends (main() in a process of its own)
    set_cpu_threads(cfg)
    try:
        return _run_validated(cfg, plan, rank, resume, verbose=verbose)
    finally:
        torch.set_num_threads(threads)


def _run_validated(cfg: DictConfig, plan: ResumePlan | None, rank: int, resume: str | None, *, verbose: bool) -> int:
    """The validated run: a resume of a complete run says so and ends; any other resume says
    where it continues; then the fit, in the run directory held for it."""
    if plan is not None and plan.complete:
        if rank == 0:
            print(plan.complete_message(Path(resume)))
        return 0
    if plan is not None and rank == 0:
        _announce_resume(cfg, plan)
    with run_directory(cfg, resume, rank) as run_dir:
        return _fit(cfg, run_dir, plan, rank, verbose=verbose)


def _announce_resume(cfg: DictConfig, plan: ResumePlan) -> None:
    """The plan's notes (a checkpoint passed over) as warnings, and the learning rate the resume
    continues with, beside what it was on the run's schedule."""
    for note in plan.notes:
        print(f"fp8state: warning: {note}", file=sys.stderr)
    t = cfg.trainer
    before = t.lr * lr_factor(plan.saved_cfg, plan.step)
    after = t.lr * lr_factor(cfg, plan.step)
    total = t.schedule_steps or t.max_steps
    if math.isclose(before, after, rel_tol=1e-9):
        print(f"fp8state: learning rate at step {plan.step + 1}: {after:.3g}, on the run's schedule of {total} steps")
    else:
        print(
            f"fp8state: learning rate at step {plan.step + 1}: {before:.3g} on the run's schedule, {after:.3g} on "
            f"the schedule of trainer.schedule_steps={total} (re-stretched, as asked)"
        )


def _fit(cfg: DictConfig, run_dir: Path, plan: ResumePlan | None, rank: int, *, verbose: bool = False) -> int:
    """Build the trainer and fit in ``run_dir``; the exit code (130: interrupted)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    quiet_lightning()
    import lightning.pytorch as pl

    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    loggers = _loggers(cfg, run_dir, rank)
    module, data = module_and_data(cfg)
    telemetry = _telemetry(cfg, run_dir)
    universal = plan is not None and plan.universal
    if universal and rank == 0:
        # DeepSpeed's partitions of another world size: their universal form, made once before any
        # rank starts (the others join the process group after this; they load what it wrote)
        from ..lightning.strategies import to_universal_checkpoint

        print(f"fp8state: converting {plan.checkpoint} to DeepSpeed's universal checkpoint", file=sys.stderr)
        to_universal_checkpoint(plan.checkpoint)
    trainer = _trainer(cfg, run_dir, loggers, _callbacks(cfg, run_dir, plan, telemetry, verbose=verbose))
    if universal:
        trainer.strategy.use_universal_checkpoint()
    interrupted = _run_fit(trainer, module, data, cfg, plan, loggers)
    if not trainer.is_global_zero:
        return 130 if interrupted else 0
    failures = telemetry.sink_failures
    for line in failures:
        print(f"fp8state: warning: {line}", file=sys.stderr)
    if interrupted:
        return report_interrupted(
            run_dir,
            trainer.global_step,
            fresh=plan is None,
            stopping=trainer.received_sigterm,
            checkpointing=cfg.trainer.enable_checkpointing,
        )
    rewrite_run_files(run_dir, cfg)
    _print_summary(run_dir, trainer, telemetry, module.last_loss, failures)
    return 0


def _loggers(cfg: DictConfig, run_dir: Path, rank: int) -> list:
    """The W&B logger unless ``telemetry.wandb=disabled``, continuing the run's W&B run (its id
    is kept in the run directory); an online run is started now, on rank 0 (:func:`_start_wandb`)."""
    if cfg.telemetry.wandb == "disabled":
        return []
    from ..lightning import wandb_logger

    online = cfg.telemetry.wandb == "online"
    logger = wandb_logger(
        run_dir,
        project=cfg.telemetry.project,
        online=online,
        name=run_dir.name,
        id=wandb_run_id(run_dir, create=rank == 0),
        resume="allow",
        **({"settings": _wandb_settings()} if online else {}),
    )
    if online and rank == 0:
        _start_wandb(logger)
    return [logger]


WANDB_INIT_TIMEOUT_S = 30  # W&B's own default waits 90 s for a network that is not there, then raises


def _wandb_settings():
    import wandb  # noqa: PLC0415

    return wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S)


def _start_wandb(logger) -> None:
    """Start the online W&B run now, before training, so that a W&B that cannot be reached says so
    in one line (ConfigError) within WANDB_INIT_TIMEOUT_S, not with a traceback after a long wait."""
    import wandb  # noqa: PLC0415

    try:
        logger.experiment  # noqa: B018  (the property starts the run)
    except wandb.errors.Error as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"telemetry.wandb='online': W&B could not start the run ({reason}); check the network and "
            "`wandb login`, or pass telemetry.wandb=offline (`wandb sync` uploads the run later)"
        ) from None


def telemetry_clips(cfg: DictConfig) -> bool:
    """Whether the telemetry callback clips (Lightning's mixed-precision plugin refuses to clip a
    fused optimizer; DeepSpeed clips in its own buffers)."""
    return strategy_facts(cfg.strategy).optimizer_owns_parameters and bool(cfg.trainer.gradient_clip_val)


def _telemetry(cfg: DictConfig, run_dir: Path):
    """The telemetry callback. With the fused AdamW it clips, reusing the norm it measures:
    Lightning's mixed-precision plugin refuses to clip for a fused optimizer."""
    from ..lightning import TelemetryCallback

    t = cfg.trainer
    clip_here = telemetry_clips(cfg)
    return TelemetryCallback(
        run_dir=run_dir,
        log_every_n_steps=cfg.telemetry.log_every_n_steps,
        clip_threshold=t.gradient_clip_val if clip_here else None,
        apply_clipping=clip_here,
    )


def _callbacks(cfg: DictConfig, run_dir: Path, plan: ResumePlan | None, telemetry, *, verbose: bool) -> list:
    """The run's callbacks, in the order they run: the shared run directory, the FP8 state, the
    run files (``conversion.json`` is written there), the telemetry, the checkpoints, the bar
    and the managed collector."""
    from ..lightning import Fp8StateCallback
    from ..lightning.checkpoint_io import RunCheckpoint

    checkpoint = None
    if cfg.trainer.enable_checkpointing:
        checkpoint = RunCheckpoint(  # ModelCheckpoint that still prunes when the run directory moved
            dirpath=run_dir / "checkpoints",
            filename="{step}",
            every_n_train_steps=cfg.trainer.checkpoint_every_n_steps,
            monitor="step",  # keep the two newest step=N.ckpt: the previous good one survives
            mode="max",
            save_top_k=2,
            save_last=True,
            enable_version_counter=False,  # a resume rewrites last.ckpt / step=N.ckpt (atomically), never last-v1.ckpt
        )
    fp8 = Fp8StateCallback(config=quant_config(cfg), audit=cfg.telemetry.audit, verbose=verbose)
    return [
        shared_run_dir_callback(run_dir, telemetry, checkpoint),
        fp8,
        run_files_callback(run_dir, cfg, plan, fp8),
        telemetry,
        *([checkpoint] if checkpoint is not None else []),
        _progress_bar(),
        *_garbage_collection(cfg.trainer),
    ]


def _trainer(cfg: DictConfig, run_dir: Path, loggers: list, callbacks: list):
    """Lightning's Trainer of ``trainer.*`` and ``strategy.*``; a setting Lightning refuses is a
    ConfigError naming it."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from ..lightning import AtomicCheckpointIO

    t = cfg.trainer
    facts = strategy_facts(cfg.strategy)
    # DeepSpeed and FSDP2 write their own (sharded) checkpoint directories
    plugins = [] if facts.writes_checkpoint_directory else [AtomicCheckpointIO()]
    try:
        return pl.Trainer(
            default_root_dir=str(run_dir),
            max_steps=t.max_steps,
            accelerator="gpu" if t.accelerator == "cuda" else t.accelerator,
            devices=t.devices,
            num_nodes=t.num_nodes,
            precision=t.precision,
            accumulate_grad_batches=t.accumulate_grad_batches,
            gradient_clip_val=None if telemetry_clips(cfg) else (t.gradient_clip_val or None),
            deterministic=t.deterministic,
            strategy=facts.from_cli(cfg.strategy),
            logger=loggers or False,
            log_every_n_steps=cfg.telemetry.log_every_n_steps,
            enable_model_summary=False,
            plugins=plugins,
            callbacks=callbacks,
            enable_checkpointing=t.enable_checkpointing,
        )
    except MisconfigurationException as exc:
        raise ConfigError(f"trainer: {exc}") from exc


def _run_fit(trainer, module, data, cfg: DictConfig, plan: ResumePlan | None, loggers: list) -> bool:
    """``trainer.fit`` (from the plan's checkpoint on a resume); whether a Ctrl-C or a signal
    stopped it (Lightning exits after a graceful stop; anything else goes on). The W&B run is
    closed either way: a later run in this process gets its own."""
    try:
        with warnings.catch_warnings():
            if plan is not None:  # a resumed run's checkpoint directory holds its earlier checkpoints
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            if cfg.trainer.cuda_graphs:  # manual optimization: Lightning warns that a checkpoint holds the state
                # after the optimizer step, which is what every run of this CLI saves
                warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
            trainer.fit(module, datamodule=data, ckpt_path=str(plan.checkpoint) if plan is not None else None)
    except SystemExit:
        if not trainer.interrupted:
            raise
        return True
    finally:
        if trainer.is_global_zero:
            for logger in loggers:
                logger.experiment.finish()
    return False


def _print_summary(run_dir: Path, trainer, telemetry, loss, failures: list[str]) -> None:
    """The run directory, the steps (and how many were skipped), the last loss (read once, now)
    and the telemetry sinks that failed."""
    print(f"run directory: {run_dir}")
    text = f"steps: {trainer.global_step}"
    skipped = (telemetry.state_dict().get("counters") or {}).get("skipped") or 0
    if skipped:  # throughput is not progress: say how much of the run did not update the model
        text += f" ({skipped} skipped: their gradients were not finite; see telemetry.jsonl)"
    if loss is not None:
        text += f", last loss: {float(loss):.4f}"
    if failures:
        text += f", telemetry sink failures: {len(failures)} sink(s) (see the warnings above)"
    print(text)


def _garbage_collection(t) -> list:
    """``trainer.gc=managed``: Python's collector at batch boundaries (``ManagedCollection``)."""
    if t.gc != "managed":
        return []
    from ..lightning import ManagedCollection

    return [ManagedCollection(full_every_n_steps=t.gc_full_every_n_steps)]


def _progress_bar():
    """Lightning's rich bar says "Epoch 0/-2" when only max_steps bounds the run: say "Epoch 0"."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    if not _RICH_AVAILABLE:
        return TQDMProgressBar()  # its description is "Epoch N" already

    class StepBoundRichProgressBar(RichProgressBar):
        def _get_train_description(self, current_epoch: int) -> str:
            max_epochs = self.trainer.max_epochs
            if max_epochs is None or max_epochs < 0:
                return f"Epoch {current_epoch}"
            return super()._get_train_description(current_epoch)

        @property
        def total_train_batches(self):
            # The bar counts the epoch's batches from its start, also in a resumed run (which
            # starts at the restored batch): its total must too, not only the steps left.
            t = self.trainer
            if t.max_epochs == -1 and t.max_steps is not None and t.max_steps > 0:
                done = t.fit_loop.epoch_loop.batch_progress.current.ready
                left = (t.max_steps - t.global_step) * t.accumulate_grad_batches
                return min(t.num_training_batches, done + left)
            return super().total_train_batches

    return StepBoundRichProgressBar()


class _NoLitLoggerTip:
    """Drops Lightning's "Tip: ... try installing litlogger" advertisement (one INFO record of
    its rank_zero logger on every run); every other record of that logger passes."""

    def filter(self, record) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_lightning() -> None:
    """The noise of every run, silenced where it comes from: Lightning's litlogger tip (a
    filter on that one record) and Lightning's use of torch's deprecated ``LeafSpec`` (that
    one message from that one module); W&B's "anonymous" warning is fixed in ``wandb_logger``."""
    import logging

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoLitLoggerTip) for f in rank_zero.filters):
        rank_zero.addFilter(_NoLitLoggerTip())
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def set_cpu_threads(cfg: DictConfig | None = None) -> int:
    """Torch's intra-op threads: ``trainer.cpu_threads`` when set, else ``OMP_NUM_THREADS`` when
    set, else the cores this process may run on (``os.sched_getaffinity``: a container's or
    ``taskset``'s share), not the machine's count. DataLoader workers run one thread each (torch
    sets that in every worker). Returns the count in force."""
    wanted = int(cfg.trainer.cpu_threads) if cfg is not None else 0
    if wanted == 0:
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            return torch.get_num_threads()
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, wanted))
    return torch.get_num_threads()
