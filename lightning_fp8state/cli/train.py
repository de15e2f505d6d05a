"""``fp8state train``: a Lightning run of a recipe with the project's callbacks and strategy.

The run directory (``out_dir/name``, numbered if taken; claimed by rank 0 alone, see
``cli/rundir.py``) holds the resolved ``config.yaml``, ``provenance.json`` (what produced the
run), ``telemetry.jsonl``, the W&B run id and W&B's offline files under ``wandb/``, and
Lightning checkpoints under ``checkpoints/`` (``last.ckpt`` and the two newest ``step=N.ckpt``,
written atomically). ``--resume RUN_DIR`` continues from the newest readable checkpoint with
that directory's configuration, once the resume is validated in full.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import urlparse

import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, DiskFullError
from ..models import GPT, ResumableLoader, make_dataset
from ..ops import cuda as cuda_ext
from ..quant_recipes import RECIPE_CLASSES, Recipe, recipe_for
from .audit import model_config
from .config import load_config, quant_config
from .rundir import (
    RUN_CONFIG_KEY,
    RUN_DIR_ENV,
    claim_run_dir,
    launch_rank,
    lock_run_dir,
    plan_resume,
    remove_if_empty_run,
    wandb_run_id,
    write_text_atomic,
)
from .schema import strategy_facts

__all__ = ["lr_factor", "provenance", "resume_command", "run_training", "set_cpu_threads"]


def resume_command(run_dir: Path, *overrides: str) -> str:
    """The command that continues the run in ``run_dir``, quoted for the shell."""
    return shlex.join(["fp8state", "train", "--resume", str(run_dir), *overrides])


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


def _set_fused(optimizers, fused: bool) -> None:
    """Every param group of ``optimizers`` (optimizers or their state dicts) fused or not."""
    for opt in optimizers:
        groups = opt.get("param_groups", ()) if isinstance(opt, dict) else opt.param_groups
        for group in groups:
            group["fused"] = fused
            if fused:
                group["foreach"] = None  # fused and foreach are exclusive


def _module_and_data(cfg: DictConfig):
    import lightning.pytorch as pl

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(model_config(cfg))
            if cfg.trainer.compile:  # compiled on first use, after the callback converted the linears
                for block in self.model.blocks:
                    block.compile()
            self.graphed = None
            self.last_loss = None  # the last step's loss, on the device: read once, when the run ends
            if cfg.trainer.cuda_graphs and strategy_facts(cfg.strategy).cuda_graphs == "blocks":
                # per-block graphs: the strategy's gradient hooks stay eager between the blocks
                from ..graphs import GraphedBlocks  # noqa: PLC0415

                self.model.blocks_runner = GraphedBlocks(
                    self.model.blocks, warmup=cfg.trainer.cuda_graphs_warmup, checkpoint=cfg.model.checkpoint
                )
            elif cfg.trainer.cuda_graphs:  # manual optimization: the step runs the optimizer itself
                from ..lightning import GraphedTrainingStep  # noqa: PLC0415

                self.graphed = GraphedTrainingStep(self, self.model.loss, warmup=cfg.trainer.cuda_graphs_warmup)

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

    return GPTModule(), TokenData()


def _strategy(cfg: DictConfig):
    """The ``strategy`` argument of ``Trainer`` for ``strategy.name``, built from the section."""
    return strategy_facts(cfg.strategy).from_cli(cfg.strategy)


def last_checkpoint(run_dir: Path) -> Path:
    """The run's ``checkpoints/last.ckpt``: a file, or under DeepSpeed a directory of
    per-rank shards (a link to either counts too); ConfigError if there is none."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        raise ConfigError(f"--resume {str(run_dir)!r}: no checkpoints/last.ckpt to continue from")
    return last


def require_finite(cfg: DictConfig) -> None:
    """Refuse a NaN or infinite number anywhere in the configuration (``trainer.lr=nan``)."""

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name}={value!r} is not allowed: expected a finite number")

    walk(OmegaConf.to_container(cfg, resolve=True), "")


def _names(fact) -> list[str]:
    """The strategy names for which ``fact(contract class)`` holds (for messages)."""
    from .schema import strategy_choices  # noqa: PLC0415

    return [name for name, cls in strategy_choices().items() if fact(cls)]


def fused_optimizer(cfg: DictConfig) -> bool:
    """Whether the run's AdamW is fused: the guard then skips on the device (the strategy says,
    ``Fp8StateStrategyContract.fused_optimizer``). Where the optimizer owns the parameters the
    telemetry clips (:func:`telemetry_clips`); under DeepSpeed ZeRO-1/2 the optimizer steps
    DeepSpeed's flat fp32 partitions, and the strategy's device guard
    (``lightning.deepspeed_guard``) checks and clips there."""
    return strategy_facts(cfg.strategy).fused_optimizer(cfg.strategy)


def telemetry_clips(cfg: DictConfig) -> bool:
    """Whether the telemetry callback clips (Lightning's mixed-precision plugin refuses to clip a
    fused optimizer; DeepSpeed clips in its own buffers)."""
    return strategy_facts(cfg.strategy).optimizer_owns_parameters and bool(cfg.trainer.gradient_clip_val)


def require_compile_strategy(cfg: DictConfig) -> None:
    """trainer.compile with the strategies it has run with only (the contract's ``compiles_blocks``)."""
    if cfg.trainer.compile and not strategy_facts(cfg.strategy).compiles_blocks:
        raise ConfigError(
            f"trainer.compile=true with strategy.name={cfg.strategy.name!r} is not allowed: expected a strategy "
            f"in {_names(lambda c: c.compiles_blocks)}, or trainer.compile=false"
        )


CUDA_GRAPHS_ACCELERATORS = ("gpu", "cuda")


def require_cuda_graphs_setup(cfg: DictConfig) -> None:
    """trainer.cuda_graphs: on GPUs, under a strategy whose contract has graphs (``"step"``: the
    whole step, one GPU, no accumulation; ``"blocks"``: per-block graphs), no recompute audit, none
    of DeepSpeed's activation-checkpointing features; each refusal names the key to change and why."""
    t, s = cfg.trainer, cfg.strategy
    if not t.cuda_graphs:
        return
    graphs = strategy_facts(s).cuda_graphs  # "step": the whole step (GraphedTrainingStep); "blocks": GraphedBlocks
    whole_step = graphs == "step"
    one_graph = f"1 under strategy.name={s.name!r}"
    why_step = "the whole step is one graph on one GPU that writes its gradients afresh each step"
    why_blocks = "per-block graphs recompute through torch's checkpoint inside the graph"
    needs = [
        (
            "trainer.accelerator",
            t.accelerator in CUDA_GRAPHS_ACCELERATORS,
            f"{t.accelerator!r}",
            "'gpu'",
            "graphs are CUDA's",
        ),
        (
            "strategy.name",
            graphs is not None,
            f"{s.name!r}",
            f"one of {_names(lambda c: c.cuda_graphs is not None)}",
            "graphs run under these strategies only",
        ),
        (
            "trainer.devices",
            not whole_step or (t.devices == 1 and t.num_nodes == 1),
            f"{t.devices} x {t.num_nodes} node(s)",
            one_graph,
            why_step,
        ),
        (
            "trainer.accumulate_grad_batches",
            not whole_step or t.accumulate_grad_batches == 1,
            str(t.accumulate_grad_batches),
            one_graph,
            why_step,
        ),
        (
            "telemetry.audit",
            not cfg.telemetry.audit,
            "true",
            "false",
            "the audit runs Python on every quantized call, which a replay does not",
        ),
        ("trainer.compile", whole_step or not t.compile, "true", "false under a data-parallel strategy", why_blocks),
    ]
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        needs.append((f"strategy.{key}", not s[key], "true", "false", f"{why_blocks}, not DeepSpeed's"))
    problem = recipe_for(quant_config(cfg)).graph_problem()
    if problem is not None:
        graphable = [name for name, cls in RECIPE_CLASSES.items() if cls.graph_problem is Recipe.graph_problem]
        needs.append(("quant.recipe", False, repr(cfg.quant.recipe), f"one of {graphable}", problem))
    for key, ok, found, allowed, why in needs:
        if not ok:
            raise ConfigError(
                f"trainer.cuda_graphs=true with {key}={found} is not allowed: expected {key}={allowed} ({why}), "
                "or trainer.cuda_graphs=false"
            )


WANDB_INIT_TIMEOUT_S = 30  # W&B's own default waits 90 s for a network that is not there, then raises


def require_wandb_credentials(cfg: DictConfig) -> None:
    """``telemetry.wandb=online`` needs an API key for the server W&B will use; without one W&B
    asks on a terminal (or fails) after the run has started. W&B decides both itself, here
    without any network call: the server from ``WANDB_BASE_URL`` or its settings file (``wandb
    login --host``), the key from ``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, a netrc
    entry for that server (``host:port``; ``api.wandb.ai`` for W&B's cloud under any of its
    addresses) or its settings. A key W&B would reject (too short, two sources at once) is
    refused here too. A wandb without this lookup (``wandb.sdk.lib.wbauth``, older releases)
    leaves the answer to ``wandb.init``, whose failure is one line as well (:func:`_start_wandb`).
    """
    if cfg.telemetry.wandb != "online":
        return
    import wandb  # noqa: PLC0415

    try:
        from wandb.sdk import wandb_setup  # noqa: PLC0415
        from wandb.sdk.lib import wbauth  # noqa: PLC0415
    except ImportError:
        return
    setup = wandb_setup.singleton()
    # W&B reads its settings from the environment once per process: settings loaded only for this
    # check are dropped after it, so that wandb.init reads them afresh (WANDB_SILENT is set later)
    loaded_here = getattr(setup, "settings_if_loaded", False) is None
    try:
        host = setup.settings.base_url
        found = wbauth.authenticate_session(host=host, source="fp8state", prompt=False, update_session=False)
    except TypeError:  # an authenticate_session of another signature: wandb.init answers
        return
    except (wandb.errors.Error, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"telemetry.wandb='online': W&B cannot use its credentials or server setting ({reason}); fix them or "
            "run `wandb login`, or pass telemetry.wandb=offline (`wandb sync` uploads the run later)"
        ) from None
    finally:
        if loaded_here:
            wandb.teardown()
    if found is None:
        raise ConfigError(
            f"telemetry.wandb='online' needs a W&B API key for {host}, and W&B finds none (no WANDB_API_KEY, no "
            f"netrc entry for {urlparse(host).netloc}): run `wandb login` or set WANDB_API_KEY, or pass "
            "telemetry.wandb=offline (the run is kept under RUN_DIR/wandb; `wandb sync` uploads it later)"
        )


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


def require_accelerator(cfg: DictConfig, recipe: str | None) -> None:
    """Refuse a GPU configuration on a machine without (enough) GPUs, before anything is created."""
    t = cfg.trainer
    needs_cuda = strategy_facts(cfg.strategy).needs_cuda
    if not (t.accelerator in ("gpu", "cuda") or needs_cuda):
        return
    what = f"recipe {recipe!r}" if recipe else f"recipe {cfg.name!r}"
    need = f"strategy.name={cfg.strategy.name}" if needs_cuda else f"trainer.accelerator={t.accelerator!r}"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise ConfigError(
            f"{what}: {need} needs a CUDA GPU, and none is visible here (torch.cuda.is_available() is False). "
            "Run it on a GPU machine, or train the CPU recipe: fp8state train tiny_gpt_cpu"
        )
    if t.accelerator in ("gpu", "cuda") and t.num_nodes == 1 and t.devices > have:
        raise ConfigError(
            f"{what}: trainer.devices={t.devices} but {have} GPU(s) are visible here: "
            f"pass trainer.devices={have} or run on a machine with {t.devices}"
        )


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


def _shared_run_dir_callback(run_dir: Path, telemetry, checkpoint):
    """A callback that makes every rank use rank 0's run directory once the process group
    exists (``strategy.broadcast``): the telemetry and checkpoint directories follow it."""
    from lightning.pytorch.callbacks import Callback

    class SharedRunDir(Callback):
        def __init__(self) -> None:
            self.run_dir = run_dir

        def setup(self, trainer, pl_module, stage: str) -> None:
            self.run_dir = Path(trainer.strategy.broadcast(str(self.run_dir), src=0))
            telemetry.run_dir = self.run_dir
            checkpoint.dirpath = str(self.run_dir / "checkpoints")

    return SharedRunDir()


def _write_run_files(run_dir: Path, cfg: DictConfig, plan=None, conversion: dict | None = None) -> None:
    """``config.yaml``, ``provenance.json`` (and ``conversion.json`` when given), each replaced
    in one rename. A resumed run's provenance keeps what started the run (``started_as``) and
    says where it resumed."""
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if conversion is not None:
        write_text_atomic(run_dir / "conversion.json", json.dumps(conversion, indent=1))
    doc = provenance()
    try:
        prior = json.loads((run_dir / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        prior = {}
    if plan is not None or "started_as" in prior:
        doc["started_as"] = prior.get("started_as") or {
            k: prior.get(k) for k in ("version", "git_commit", "torch", "gpu", "command")
        }
        resumed = prior.get("resumed_from") if plan is None else {"checkpoint": str(plan.checkpoint), "step": plan.step}
        doc["resumed_from"] = resumed
    write_text_atomic(run_dir / "provenance.json", json.dumps(doc, indent=1, default=str))


def _run_files_callback(run_dir: Path, cfg: DictConfig, plan, fp8_callback):
    """A callback that writes the run's files at fit start: after a resume's checkpoint has been
    loaded (a load that fails leaves the directory as it was), before the first step."""
    from lightning.pytorch.callbacks import Callback

    class RunFiles(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            # the configuration the checkpoint was trained with (plain values: weights_only loads
            # it): a resume compares config.yaml with it key by key
            checkpoint[RUN_CONFIG_KEY] = OmegaConf.to_container(cfg, resolve=True)

        def on_fit_start(self, trainer, pl_module) -> None:
            if trainer.is_global_zero:
                _write_run_files(run_dir, cfg, plan, conversion=fp8_callback.conversion.to_dict())
                if plan is not None:
                    _stale_temporaries(run_dir)

    return RunFiles()


def _stale_temporaries(run_dir: Path) -> None:
    """Remove what saves killed mid-write left behind (``.last.ckpt.XXXX.tmp``, a file or, for a
    sharded checkpoint, a folder)."""
    from ..lightning.checkpoint_io import TMP_SUFFIX, remove_temporary

    for tmp in (run_dir / "checkpoints").glob(f".*{TMP_SUFFIX}"):
        remove_temporary(tmp)


def _print_resumed_lr(cfg: DictConfig, plan) -> None:
    """Say the learning rate the resume continues with, and what it was on the run's schedule."""
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


def run_training(recipe: str | None, overrides: list[str], *, resume: str | None = None, verbose: bool = False) -> int:
    """Validate everything, then train. Nothing is created (new run) or changed (resume)
    until the configuration, the overrides and (on resume) the checkpoint are validated."""
    rank = launch_rank()
    plan = None
    if resume is not None:
        plan = plan_resume(resume, recipe, overrides)
        cfg = plan.cfg
    else:
        cfg = load_config(recipe, overrides)
    require_finite(cfg)
    require_compile_strategy(cfg)
    require_cuda_graphs_setup(cfg)
    require_accelerator(cfg, recipe)
    if rank == 0:
        require_wandb_credentials(cfg)
    threads = torch.get_num_threads()  # the caller's, put back when the run ends (main() in a process of its own)
    set_cpu_threads(cfg)
    try:
        return _run_validated(cfg, plan, recipe, rank, resume, verbose=verbose)
    finally:
        torch.set_num_threads(threads)


def _run_validated(cfg: DictConfig, plan, recipe: str | None, rank: int, resume: str | None, *, verbose: bool) -> int:
    if plan is not None:
        run_dir = Path(resume)
        if plan.complete:
            if rank == 0:
                print(
                    f"run {run_dir} is already complete at step {plan.step} (trainer.max_steps={cfg.trainer.max_steps}); "
                    "to train on, pass a larger trainer.max_steps, e.g. "
                    + resume_command(run_dir, f"trainer.max_steps={plan.step + int(cfg.trainer.max_steps)}")
                )
            return 0
        if rank == 0:
            for note in plan.notes:
                print(f"fp8state: warning: {note}", file=sys.stderr)
            _print_resumed_lr(cfg, plan)
    elif rank == 0:
        run_dir = claim_run_dir(cfg.out_dir, cfg.name)
    else:  # a launched rank: rank 0's directory (the broadcast in SharedRunDir confirms it)
        run_dir = Path(os.environ.get(RUN_DIR_ENV) or Path(cfg.out_dir) / cfg.name)
    lock = lock_run_dir(run_dir) if rank == 0 else None  # a concurrent resume of this run is refused
    exported = rank == 0 and plan is None
    if exported:
        os.environ[RUN_DIR_ENV] = str(run_dir)  # the ranks Lightning launches inherit it
    try:
        return _fit(cfg, run_dir, plan, rank, verbose=verbose)
    except BaseException:
        if plan is None and rank == 0:
            if lock is not None:
                lock.close()
                lock = None
            remove_if_empty_run(run_dir)  # a run that failed before its first checkpoint leaves nothing
        raise
    finally:
        if exported:
            os.environ.pop(RUN_DIR_ENV, None)
        if lock is not None:
            lock.close()


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


def _interrupted(run_dir: Path, step: int, *, fresh: bool, stopping: bool) -> int:
    """Say where an interrupted run stands (exit 130). With a checkpoint: which one, and the command
    that continues from it. Without one (a new run stopped before its first save): nothing can be
    resumed, so the run's directory is removed and the line says to start again."""
    saved = sorted((run_dir / "checkpoints").glob("step=*.ckpt"), key=lambda p: p.stat().st_mtime)
    how = "stopped by a signal (SIGTERM or SIGHUP)" if stopping else "interrupted"
    if saved:
        print(
            f"fp8state: {how} at step {step}; the last checkpoint is {saved[-1]}. "
            f"Continue with: {resume_command(run_dir)}",
            file=sys.stderr,
        )
    elif fresh:
        remove_if_empty_run(run_dir)
        print(
            f"fp8state: {how} at step {step}, before the first checkpoint: nothing to resume, and the run "
            f"directory {run_dir} was removed; start the run again",
            file=sys.stderr,
        )
    else:
        print(f"fp8state: {how} at step {step}; no checkpoint was saved in {run_dir / 'checkpoints'}", file=sys.stderr)
    return 130


def _fit(cfg: DictConfig, run_dir: Path, plan, rank: int, *, verbose: bool = False) -> int:
    os.environ.setdefault("WANDB_SILENT", "true")
    quiet_lightning()
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from ..lightning import AtomicCheckpointIO, Fp8StateCallback, TelemetryCallback, wandb_logger
    from ..lightning.checkpoint_io import RunCheckpoint

    pl.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    loggers = []
    if cfg.telemetry.wandb != "disabled":
        run_id = wandb_run_id(run_dir, create=rank == 0)
        loggers.append(
            wandb_logger(
                run_dir,
                project=cfg.telemetry.project,
                online=cfg.telemetry.wandb == "online",
                name=run_dir.name,
                id=run_id,
                resume="allow",
                **({"settings": _wandb_settings()} if cfg.telemetry.wandb == "online" else {}),
            )
        )
        if cfg.telemetry.wandb == "online" and rank == 0:
            _start_wandb(loggers[-1])
    module, data = _module_and_data(cfg)
    t = cfg.trainer
    # With the fused AdamW the telemetry clips, reusing the norm it measures: Lightning's
    # mixed-precision plugin refuses to clip for a fused optimizer
    clip_here = telemetry_clips(cfg)
    telemetry = TelemetryCallback(
        run_dir=run_dir,
        log_every_n_steps=cfg.telemetry.log_every_n_steps,
        clip_threshold=t.gradient_clip_val if clip_here else None,
        apply_clipping=clip_here,
        saturation=not t.cuda_graphs,  # the saturation count runs Python per call: a replay does not
    )
    checkpoint = RunCheckpoint(  # ModelCheckpoint that still prunes when the run directory moved
        dirpath=run_dir / "checkpoints",
        filename="{step}",
        every_n_train_steps=t.checkpoint_every_n_steps,
        monitor="step",  # keep the two newest step=N.ckpt: the previous good one survives
        mode="max",
        save_top_k=2,
        save_last=True,
        enable_version_counter=False,  # a resume rewrites last.ckpt / step=N.ckpt (atomically), never last-v1.ckpt
    )
    fp8 = Fp8StateCallback(config=quant_config(cfg), audit=cfg.telemetry.audit, verbose=verbose)
    # DeepSpeed and FSDP2 write their own (sharded) checkpoint directories
    plugins = [] if strategy_facts(cfg.strategy).writes_checkpoint_directory else [AtomicCheckpointIO()]
    try:
        trainer = pl.Trainer(
            default_root_dir=str(run_dir),
            max_steps=t.max_steps,
            accelerator="gpu" if t.accelerator == "cuda" else t.accelerator,
            devices=t.devices,
            num_nodes=t.num_nodes,
            precision=t.precision,
            accumulate_grad_batches=t.accumulate_grad_batches,
            gradient_clip_val=None if clip_here else (t.gradient_clip_val or None),
            deterministic=t.deterministic,
            strategy=_strategy(cfg),
            logger=loggers or False,
            log_every_n_steps=cfg.telemetry.log_every_n_steps,
            enable_model_summary=False,
            plugins=plugins,
            callbacks=[
                _shared_run_dir_callback(run_dir, telemetry, checkpoint),
                fp8,
                _run_files_callback(run_dir, cfg, plan, fp8),  # conversion.json is written there
                telemetry,
                checkpoint,
                _progress_bar(),
                *_garbage_collection(t),
            ],
        )
    except MisconfigurationException as exc:
        raise ConfigError(f"trainer: {exc}") from exc
    interrupted = False
    try:
        with warnings.catch_warnings():
            if plan is not None:  # a resumed run's checkpoint directory holds its earlier checkpoints
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            if t.cuda_graphs:  # manual optimization: Lightning warns that a checkpoint holds the state
                # after the optimizer step, which is what every run of this CLI saves
                warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
            trainer.fit(module, datamodule=data, ckpt_path=str(plan.checkpoint) if plan is not None else None)
    except SystemExit:
        if not trainer.interrupted:  # Lightning exits after a graceful Ctrl-C; anything else goes on
            raise
        interrupted = True
    finally:
        if trainer.is_global_zero:
            for logger in loggers:  # close the W&B run: a later run in this process gets its own
                logger.experiment.finish()
    if not trainer.is_global_zero:
        return 130 if interrupted else 0
    failures = telemetry.sink_failures
    for line in failures:
        print(f"fp8state: warning: {line}", file=sys.stderr)
    if interrupted:
        return _interrupted(run_dir, trainer.global_step, fresh=plan is None, stopping=trainer.received_sigterm)
    try:
        if run_dir.is_dir():  # (moved or deleted mid-run: the telemetry has said so; nothing is recreated)
            _write_run_files(run_dir, cfg)  # again: the CUDA extension (and its hash) is known only now
    except DiskFullError as exc:  # the run itself is saved: say what is stale, do not fail it
        print(f"fp8state: warning: {exc}; the run's files keep what they said at its start", file=sys.stderr)
    loss = module.last_loss  # the last step's (one read, at the end)
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
    return 0
