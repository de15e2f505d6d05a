"""``--resume RUN_DIR``: a resume validated in full before anything in the run directory changes.

Its ``config.yaml`` loads, the overrides are valid and are ones a resume can take
(:data:`RESUMABLE_KEYS`), a checkpoint is readable (a corrupt ``last.ckpt`` falls back to the
newest good ``step=N.ckpt``, saying so), that checkpoint was made with this configuration, and
``config.yaml`` says what the checkpoint records it was trained with. Every failure is a
:class:`~lightning_fp8state.errors.RunDirectoryError` naming the file and what to do. The result
is a :class:`ResumePlan`; nothing is written.

Another world size (``trainer.devices`` / ``trainer.num_nodes``) is a resume too, where the
strategy's checkpoint loads on another number of ranks: the quantizer state is mapped
(``state/reshard.py``; a mapping ``quant.world_size_merge=refuse`` forbids is refused here, before
anything runs) and the data loader's position is carried over in samples
(:func:`~lightning_fp8state.cli.loader_position.map_loader_position`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError, RunDirectoryError, StateLoadError, UntrustedCheckpointError
from ..fp8state import Fp8State
from ..state.checkpoint_files import (
    DEEPSPEED_LATEST,
    check_checkpoint,
    deepspeed_safe_globals,
    load_checkpoint_file,
    zero_world_size,
)
from ..state.reshard import ReshardReport, plan_reshard
from .config import quant_config
from .rundir import RUN_CONFIG_KEY, require_no_links, resume_command
from .schema import strategy_facts

__all__ = ["RESUMABLE_KEYS", "ResumePlan", "last_checkpoint", "plan_resume"]

# What a resume may change: how long to train, how often to save and log, where W&B goes,
# loader workers, CPU threads, garbage collection and strictness. Everything else defines what the checkpoint holds (or the
# data position and learning rate the optimizer state restores), so it is refused.
RESUMABLE_KEYS = (  # (not trainer.cpu_threads: another thread count changes CPU sums, so the losses)
    "trainer.max_steps",
    "trainer.gc",
    "trainer.gc_full_every_n_steps",
    "trainer.schedule_steps",
    "trainer.checkpoint_every_n_steps",
    "trainer.enable_checkpointing",
    "telemetry.log_every_n_steps",
    "telemetry.wandb",
    "telemetry.audit",
    "data.num_workers",
    "quant.strict",
    "quant.weight_codes_once",  # how a call runs, bitwise the same either way
    "trainer.cuda_graphs",  # how a step runs, bitwise the same either way: a resume warms up and captures again
    "trainer.cuda_graphs_warmup",
    # another number of ranks, where the strategy's checkpoint loads on it (its contract's
    # resumes_on_another_world_size): the quantizer state is mapped, the data position carried
    "trainer.devices",
    "trainer.num_nodes",
    "quant.world_size_merge",
)
_STEP_CKPT = re.compile(r"^step=(\d+)\.ckpt$")


@dataclass
class ResumePlan:
    """A validated resume: the configuration to run, the checkpoint to load and its step."""

    cfg: DictConfig
    checkpoint: Path
    step: int
    notes: list[str] = field(default_factory=list)
    saved_cfg: DictConfig | None = None  # the run's config.yaml as it was (before the overrides)
    # on another world size: what the quantizer state's mapping will do (checked before the run)
    reshard: ReshardReport | None = None
    # DeepSpeed: how many ranks wrote the checkpoint's ZeRO optimizer partitions (None: not such
    # a checkpoint)
    partitions: int | None = None

    @property
    def universal(self) -> bool:
        """Whether the checkpoint loads through DeepSpeed's universal checkpoint: its ZeRO
        partitions were written by another number of ranks than this run has, under a strategy
        whose partitions reshard only that way. Converted before the fit. (The partitions decide,
        not the quantizer state's world size: they are what DeepSpeed's engine reads.)"""
        world = int(self.cfg.trainer.devices) * int(self.cfg.trainer.num_nodes)
        return (
            self.partitions not in (None, world)
            and strategy_facts(self.cfg.strategy).resumes_through_universal_checkpoint
        )

    @property
    def complete(self) -> bool:
        return self.step >= int(self.cfg.trainer.max_steps)

    def complete_message(self, run_dir: Path) -> str:
        """What a resume of a run already at ``trainer.max_steps`` says: the command that trains on."""
        max_steps = self.cfg.trainer.max_steps
        return (
            f"run {run_dir} is already complete at step {self.step} (trainer.max_steps={max_steps}); "
            "to train on, pass a larger trainer.max_steps, e.g. "
            + resume_command(run_dir, f"trainer.max_steps={self.step + int(max_steps)}")
        )


def last_checkpoint(run_dir: Path) -> Path:
    """The run's ``checkpoints/last.ckpt``: a file, or under DeepSpeed a directory of
    per-rank shards (a link to either counts too); ConfigError if there is none."""
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        raise ConfigError(f"--resume {str(run_dir)!r}: no checkpoints/last.ckpt to continue from")
    return last


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _checkpoint_candidates(run_dir: Path) -> list[Path]:
    """``last.ckpt`` first, then ``step=N.ckpt`` newest first (the previous good ones)."""
    ckpts = run_dir / "checkpoints"
    found = []
    if (ckpts / "last.ckpt").exists():
        found.append(ckpts / "last.ckpt")
    steps = []
    if ckpts.is_dir():
        for p in ckpts.iterdir():
            m = _STEP_CKPT.match(p.name)
            if m:
                steps.append((int(m.group(1)), p))
    found += [p for _, p in sorted(steps, reverse=True)]
    return found


def _read_checkpoint(path: Path) -> dict:
    """The checkpoint's contents (memory-mapped: tensors are not read), or an error.

    Every file a loader would unpickle (a DeepSpeed directory's shards, FSDP2's ``meta.pt`` and
    DCP ``.metadata``) is read with ``weights_only=True`` and our allowlist first
    (:func:`~lightning_fp8state.state.checkpoint_files.check_checkpoint`): a file that names
    anything else raises UntrustedCheckpointError, and nothing in it has run."""
    check_checkpoint(path)  # every file a loader would unpickle (each shard), and no link: before anything reads one
    target = path
    if path.is_dir() and (path / "meta.pt").is_file():  # FSDP2 (DCP): Lightning's state beside the shards
        target = path / "meta.pt"
    elif path.is_dir():  # DeepSpeed: a directory of shards; the client state is in mp_rank_00
        latest = path / DEEPSPEED_LATEST  # the tag folder DeepSpeed's engine will open (checked above)
        tag_dir = path / latest.read_text(encoding="utf-8").strip() if latest.is_file() else path
        shards = sorted(tag_dir.rglob("*mp_rank_00_model_states.pt"))  # ZeRO-3: zero_pp_rank_0_...
        if not shards:
            raise ValueError("a checkpoint directory without mp_rank_00_model_states.pt")
        target = shards[0]
    if target.stat().st_size == 0:
        raise ValueError("the file is empty")
    allowed = deepspeed_safe_globals() if path.is_dir() and target.name != "meta.pt" else ()
    ckpt = load_checkpoint_file(target, mmap=True, safe_globals=allowed)
    if not isinstance(ckpt, dict) or "global_step" not in ckpt:
        raise ValueError(f"not a Lightning checkpoint (no 'global_step'; got {type(ckpt).__name__})")
    return ckpt


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check_against_checkpoint(cfg: DictConfig, ckpt: dict, path: Path) -> None:
    """The checkpoint was made by a run of this configuration: same quantizer state layout,
    exactly the model's weights (none missing, none extra, each of its shape), and
    quantizer owners of exactly the layers this configuration converts."""
    entry = ckpt.get("fp8state")
    if isinstance(entry, dict) and entry.get("ranks"):
        saved = next(iter(entry["ranks"].values())).get("config", {})
        live = quant_config(cfg)
        diff = [
            f"quant.{k}: checkpoint {v!r}, config {getattr(live, k)!r}"
            for k, v in saved.items()
            if hasattr(live, k) and getattr(live, k) != v
        ]
        if diff:
            raise RunDirectoryError(
                f"{path}: the quantizer state was made with another configuration ({'; '.join(diff)}); "
                "resume with the configuration the run was started with"
            )
    weights = ckpt.get("state_dict")  # (DeepSpeed's shards hold the weights in their own layout)
    from .models import build_model  # noqa: PLC0415

    with torch.device("meta"):  # the shapes only: no checkpoint's weights read
        model = build_model(cfg, weights=False)
    if isinstance(weights, dict) and weights:
        _check_weights(path, {f"model.{k}": tuple(v.shape) for k, v in model.state_dict().items()}, weights)
    if isinstance(entry, dict) and entry.get("ranks"):
        state = Fp8State(quant_config(cfg))
        state.convert(model)
        _check_owners(path, {f"model.{name}" for name in state.converted_layers}, entry["ranks"], state)


def _check_weights(path: Path, expected: dict[str, tuple], weights: dict) -> None:
    """Exactly the model's weights: none missing, none extra, each of its shape."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = sorted(
        k for k in expected if k in weights and hasattr(weights[k], "shape") and tuple(weights[k].shape) != expected[k]
    )
    if not (missing or extra or wrong):
        return
    if missing:
        detail = f"missing {_few(missing)}"
    elif extra:
        detail = f"extra {_few(extra)} that this configuration's model does not have"
    else:
        detail = f"{wrong[0]}: checkpoint {tuple(weights[wrong[0]].shape)}, config {expected[wrong[0]]}"
    raise RunDirectoryError(
        f"{path}: the model weights do not fit this configuration's model ({detail}); "
        "resume with the model.* settings the run was started with"
    )


def _check_owners(path: Path, layers: set[str], ranks: dict, state: Fp8State) -> None:
    """The quantizer state of every rank belongs to exactly the layers this configuration converts."""
    if not state.protocol.recipe.quantized or state.config.ownership == "per_model":
        return
    for rank, sd in ranks.items():
        try:
            saved = {o[0] for o in sd["bank"]["owners"]} - {"*"}
        except (KeyError, TypeError, IndexError) as exc:
            raise RunDirectoryError(f"{path}: the quantizer state of rank {rank} is corrupt ({exc!r})") from None
        if not saved:
            continue  # saved before the first step: no owner registered yet
        unknown, missing = sorted(saved - layers), sorted(layers - saved)
        if unknown or missing:
            detail = (
                f"owners of layers {_few(unknown)} that this configuration's model does not convert"
                if unknown
                else f"no owners for the converted layers {_few(missing)}"
            )
            raise RunDirectoryError(
                f"{path}: the quantizer state of rank {rank} does not fit this configuration ({detail}); "
                "resume with the model.* and quant.* settings the run was started with"
            )


def _world_size_change(cfg: DictConfig, ckpt: dict, path: Path, resume: str) -> ReshardReport | None:
    """None on the saved world size; else what mapping the quantizer state does, once the
    strategy, the saved accumulation window and ``quant.world_size_merge`` allow it."""
    entry = ckpt.get("fp8state")
    if not isinstance(entry, dict) or not entry.get("ranks") or "world_size" not in entry:
        return None
    saved, world = int(entry["world_size"]), int(cfg.trainer.devices) * int(cfg.trainer.num_nodes)
    if saved == world:
        return None
    where = f"--resume {resume!r}: {path} was saved by {saved} rank(s), this configuration runs {world}"
    facts = strategy_facts(cfg.strategy)
    if not (facts.resumes_on_another_world_size or facts.resumes_through_universal_checkpoint):
        raise RunDirectoryError(
            f"{where}, and strategy.name={cfg.strategy.name!r} cannot load it there (its checkpoint is laid out "
            f"per rank). Resume with trainer.devices x trainer.num_nodes = {saved}"
        )
    try:
        return plan_reshard(entry["ranks"], world, quant_config(cfg).world_size_merge)
    except StateLoadError as exc:
        raise RunDirectoryError(f"{where}: {exc}") from None


def _few(names: list[str], n: int = 3) -> str:
    return f"{names[:n]}{f' and {len(names) - n} more' if len(names) > n else ''}"


def _require_checkpoint_kind(cfg: DictConfig, candidates: list[Path], resume: str) -> None:
    """A strategy that writes one file per checkpoint finds no directory under a checkpoint's
    name: it would fall back past it, train, and then fail to save over it."""
    if strategy_facts(cfg.strategy).writes_checkpoint_directory:  # DeepSpeed's shards, FSDP2's DCP
        return
    for path in candidates:
        if path.is_dir():
            raise RunDirectoryError(
                f"--resume {resume!r}: {path} is a directory, but strategy.name={cfg.strategy.name!r} writes "
                "each checkpoint as one file there: move or remove that directory, then resume"
            )


def _select_checkpoint(cfg: DictConfig, run_dir: Path, resume: str) -> tuple[Path, dict, list[str]]:
    candidates = _checkpoint_candidates(run_dir)
    _require_checkpoint_kind(cfg, candidates, resume)
    if not candidates:
        raise RunDirectoryError(
            f"--resume {resume!r}: no checkpoint to continue from (expected {run_dir / 'checkpoints' / 'last.ckpt'} "
            "or checkpoints/step=N.ckpt); the run stopped before its first checkpoint: start it again"
        )
    bad: list[str] = []
    for path in candidates:
        try:
            ckpt = _read_checkpoint(path)
        except UntrustedCheckpointError as exc:  # refused, not "corrupt": never fall back past it
            raise RunDirectoryError(f"--resume {resume!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001  (any failure to read is "corrupt": say which and why)
            bad.append(f"{path} is not a readable checkpoint ({_reason(exc)})")
            continue
        _check_against_checkpoint(cfg, ckpt, path)
        if bad:
            bad.append(f"resuming from the previous good checkpoint {path} (step {ckpt['global_step']})")
        return path, ckpt, bad
    raise RunDirectoryError(
        f"--resume {resume!r}: no readable checkpoint: "
        + "; ".join(bad)
        + ". The files may be truncated or overwritten; start a new run"
    )


def _check_recorded_config(saved_path: Path, old: dict[str, Any], recorded: Any, path: Path) -> None:
    """``config.yaml`` against the configuration the checkpoint records, key by key, under the rule
    of the overrides: a hand edit of a key outside RESUMABLE_KEYS trained another run silently
    (or, for ``trainer.lr``, was written back and not used). Checkpoints of earlier versions record
    none; keys one side does not have (another version's schema) are not compared."""
    if not isinstance(recorded, dict):
        return
    rec = _flatten(recorded)
    edited = sorted(k for k in set(old) & set(rec) if old[k] != rec[k] and k not in RESUMABLE_KEYS)
    if edited:
        k = edited[0]
        raise RunDirectoryError(
            f"{saved_path}: {k}={old[k]!r}, but {path} was trained with {k}={rec[k]!r}: the file was edited. A resume "
            f"continues the run as it was configured and may change only {', '.join(RESUMABLE_KEYS)}; put back "
            f"{k}: {rec[k]!r}, or start a new run (without --resume) to change {k}"
        )


def plan_resume(resume: str, recipe: str | None, overrides: list[str]) -> ResumePlan:
    """Validate a resume of ``resume`` with ``overrides``; nothing is written.

    Raises:
        RunDirectoryError: not a run directory, a run recipe given, an invalid override or one a
            resume cannot take, no readable checkpoint, or a checkpoint of another configuration.
    """
    from .config import load_config  # noqa: PLC0415

    run_dir = Path(resume)
    if recipe is not None:
        raise RunDirectoryError(
            f"--resume {resume!r} continues that run with its own config.yaml, so a recipe ({recipe!r}) "
            "cannot be given too: pass only key=value overrides, or drop --resume to start a new run"
        )
    saved_path = run_dir / "config.yaml"
    require_no_links(run_dir)
    if not saved_path.is_file():
        raise RunDirectoryError(f"--resume {resume!r}: no config.yaml there (not a run directory)")
    try:
        saved = load_config(str(saved_path))
        cfg = load_config(str(saved_path), overrides) if overrides else saved
    except RunDirectoryError:
        raise
    except ConfigError as exc:
        raise RunDirectoryError(f"--resume {resume!r}: {exc}") from exc
    old = _flatten(OmegaConf.to_container(saved, resolve=True))
    new = _flatten(OmegaConf.to_container(cfg, resolve=True))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in RESUMABLE_KEYS)
    if changed:
        k = changed[0]
        raise RunDirectoryError(
            f"--resume {resume!r}: {k}={new.get(k)!r} differs from the run's {k}={old.get(k)!r} "
            f"(in {saved_path}); a resume continues the run as it was configured and may change only "
            f"{', '.join(RESUMABLE_KEYS)}. Start a new run (without --resume) to change {k}"
        )
    asked = any(item.split("=", 1)[0].strip() == "trainer.schedule_steps" for item in overrides)
    if not asked and not cfg.trainer.schedule_steps and cfg.trainer.max_steps != saved.trainer.max_steps:
        # a longer (or shorter) resume keeps the learning-rate curve the run was on; the user
        # re-stretches it only by asking (trainer.schedule_steps=N)
        cfg.trainer.schedule_steps = int(saved.trainer.schedule_steps or saved.trainer.max_steps)
    path, ckpt, notes = _select_checkpoint(cfg, run_dir, resume)
    _check_recorded_config(saved_path, old, ckpt.get(RUN_CONFIG_KEY), path)
    reshard = _world_size_change(cfg, ckpt, path, resume)
    step = int(ckpt["global_step"])
    partitions = zero_world_size(path) if path.is_dir() else None
    return ResumePlan(
        cfg=cfg, checkpoint=path, step=step, notes=notes, saved_cfg=saved, reshard=reshard, partitions=partitions
    )
