"""fp8state_ddp and fp8state_deepspeed: thin Lightning strategies around Fp8StateCallback.

The callback does the protocol's work; the strategies check that it is there, name the
data-parallel group the amax reduction uses, and (DeepSpeed) pass the activation
checkpointing settings through to ``deepspeed.checkpointing.configure``, route
``lightning_fp8state.checkpoint`` to DeepSpeed's engine when those settings need it, and keep
the engine's gradient-accumulation window in checkpoints (``deepspeed_accumulation``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import os
import re
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ..config import require_bool, require_choice, require_int
from ..errors import StateLoadError
from ..nn.fsdp import mark_sharded
from ..state.checkpoint_files import check_checkpoint, zero_world_size
from . import deepspeed_guard
from .callback import Fp8StateCallback
from .contract import Fp8StateStrategyContract
from .deepspeed_accumulation import (
    ACCUMULATION_FORMAT_VERSION,
    ACCUMULATION_KEY,
    LIGHTNING_TAG,
    capture_window,
    check_format_version,
    rank_file,
    restore_window,
    unsupported_reason,
    window_position,
)

__all__ = ["CHECKPOINT_ENGINES", "Fp8StateDDPStrategy", "Fp8StateDeepSpeedStrategy", "register_strategies"]

# Which engine lightning_fp8state.checkpoint(fn, *args) uses under fp8state_deepspeed:
# auto = DeepSpeed's when partitioned activations, CPU checkpointing or contiguous memory
# are on (only its engine implements them), else torch's non-reentrant one.
CHECKPOINT_ENGINES = ("auto", "torch", "deepspeed")


def _require_callback(trainer: pl.Trainer, name: str) -> None:
    if not any(isinstance(cb, Fp8StateCallback) for cb in trainer.callbacks):
        raise MisconfigurationException(
            f"strategy '{name}' needs an Fp8StateCallback, which converts the model and drives the "
            f"quantizer state: Trainer(strategy='{name}', callbacks=[lightning_fp8state.lightning."
            "Fp8StateCallback(config=...)])"
        )


class Fp8StateDDPStrategy(Fp8StateStrategyContract, DDPStrategy):
    """``DDPStrategy`` for stateful FP8 training (CPU with gloo, or CUDA with NCCL).

    Registered as ``fp8state_ddp`` (subprocess launch, like ``ddp``) and
    ``fp8state_ddp_spawn`` (``start_method="spawn"``). Takes every ``DDPStrategy`` argument.

    Args:
        dynamo_ddp_optimizer: leave ``torch._dynamo.config.optimize_ddp`` as it is (True:
            dynamo's DDPOptimizer). By default (False) setup turns it off. A module compiled inside
            DDP's forward (the CLI compiles each block) is split at DDP's bucket boundaries, a
            checkpointed block's recompute (outside DDP's forward) may compile it unsplit, and the
            two then save the same tensors in another order: torch's checkpoint refuses the
            backward (measured on the H200: the 1B Llama recipe, compiled, under fp8state_ddp).
            Unsplit, each compiled block's gradients reach DDP's buckets as the block's backward
            ends.
    """

    strategy_name = "fp8state_ddp"
    compiles_blocks = True

    def __init__(self, *args: Any, dynamo_ddp_optimizer: bool = False, **kwargs: Any) -> None:
        require_bool("dynamo_ddp_optimizer", dynamo_ddp_optimizer)
        super().__init__(*args, **kwargs)
        self.dynamo_ddp_optimizer = dynamo_ddp_optimizer

    @classmethod
    def from_cli(cls, strategy_cfg: Any) -> Fp8StateDDPStrategy:
        """The strategy ``fp8state train`` builds for ``strategy.name=fp8state_ddp``."""
        return cls()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        _require_callback(trainer, self.strategy_name)
        if not self.dynamo_ddp_optimizer:
            torch._dynamo.config.optimize_ddp = False
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("fp8state_ddp", "popen"), ("fp8state_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"DDP with lightning_fp8state (start_method '{start_method}')",
                    start_method=start_method,
                )


def _zero_stage(args: tuple, kwargs: dict) -> int:
    """The ZeRO stage ``DeepSpeedStrategy(*args, **kwargs)`` is built for (its default: 2)."""
    try:
        bound = inspect.signature(DeepSpeedStrategy.__init__).bind_partial(None, *args, **kwargs)
    except TypeError:  # DeepSpeedStrategy itself names the bad argument
        return kwargs.get("stage", 2)
    return bound.arguments.get("stage", 2)


DEEPSPEED_CPU_ENV = "DS_ACCELERATOR"
# the universal form's folder, beside the tag Lightning's DeepSpeedStrategy saves under
UNIVERSAL_TAG = "checkpoint_universal"
_RANK_OF_FILE = re.compile(r"(?:zero_pp_rank_|fp8state_accumulation_rank)0*(\d+)")


def _remove_universal_form(root: Path) -> None:
    """``<root>/checkpoint_universal`` and the ``latest_universal`` naming it, where present."""
    shutil.rmtree(root / UNIVERSAL_TAG, ignore_errors=True)
    (root / "latest_universal").unlink(missing_ok=True)


def _clear_stale_files(checkpoint: str | os.PathLike, world_size: int) -> None:
    """Before a save into an existing checkpoint directory: remove what the save will not rewrite
    and a load would read, the files of ranks ``>= world_size`` (a run resumed on fewer ranks
    than saved the directory first) and an earlier universal form of it."""
    root = Path(checkpoint)
    _remove_universal_form(root)
    tag = root / LIGHTNING_TAG
    if tag.is_dir():
        for path in tag.iterdir():
            match = _RANK_OF_FILE.search(path.name)
            if match and int(match.group(1)) >= world_size:
                path.unlink()


def to_universal_checkpoint(checkpoint: str | os.PathLike) -> None:
    """Convert a checkpoint directory ``fp8state_deepspeed`` saved (ZeRO 1-3, any number of ranks)
    to DeepSpeed's universal checkpoint, in place: ``<checkpoint>/checkpoint_universal`` and
    ``<checkpoint>/latest_universal`` naming it (DeepSpeed's ``ds_to_universal``), which loads on
    any number of ranks (:meth:`Fp8StateDeepSpeedStrategy.use_universal_checkpoint`). A universal
    form left by an earlier conversion is replaced. The source must have passed
    ``check_checkpoint`` (the converter unpickles it). CPU work, on one process."""
    from deepspeed.checkpoint import ds_to_universal  # noqa: PLC0415  (DeepSpeed loads when a conversion runs)

    root = Path(checkpoint)
    _remove_universal_form(root)
    # Converted beside the checkpoint, then moved in: a conversion killed halfway leaves its files
    # outside it (removed by the next conversion), never a partial universal form inside, which
    # would make the checkpoint unreadable and send the resume back to an older one.
    staging = _universal_staging(root)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    args = argparse.Namespace(
        input_folder=str(root / LIGHTNING_TAG),
        output_folder=str(staging / UNIVERSAL_TAG),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # Lightning's client state has no universal_checkpoint_info
    )
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ds_to_universal.main(args)  # writes staging/checkpoint_universal, then staging/latest_universal
        os.replace(staging / UNIVERSAL_TAG, root / UNIVERSAL_TAG)
        os.replace(staging / "latest_universal", root / "latest_universal")  # last: names a complete form
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _universal_staging(root: Path) -> Path:
    """Where :func:`to_universal_checkpoint` converts ``root``: a hidden folder beside it (on the
    same file system, so the finished form moves in by rename), named as the temporaries a killed
    save leaves (``.NAME....tmp``), which a run's start removes too."""
    return root.parent / f".{root.name}.universal.tmp"


def deepspeed_cpu_requested() -> bool:
    """Whether DeepSpeed's CPU accelerator was chosen explicitly (``DS_ACCELERATOR=cpu``)."""
    return os.environ.get(DEEPSPEED_CPU_ENV) == "cpu"


def _skip_shared_memory_allreduce() -> None:
    """DeepSpeed's CPU accelerator would compile a shared-memory all-reduce op (C++, on first use)
    when its process group starts; gloo's all-reduce serves CPU ranks, so that op is marked
    unavailable (no compiler is needed, none runs)."""
    import deepspeed.ops  # noqa: PLC0415

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Fp8StateDeepSpeedStrategy(Fp8StateStrategyContract, DeepSpeedStrategy):
    """``DeepSpeedStrategy`` (ZeRO stages 1-3, CUDA only) for stateful FP8 training.

    Registered as ``fp8state_deepspeed`` (ZeRO-2) and ``fp8state_deepspeed_stage_{1,2,3}``.
    Takes every ``DeepSpeedStrategy`` argument; the activation checkpointing ones
    (``partition_activations``, ``cpu_checkpointing``, ``contiguous_memory_optimization``,
    ``synchronize_checkpoint_boundary``, or the ``activation_checkpointing`` section of a
    DeepSpeed ``config``) reach ``deepspeed.checkpointing.configure`` in full. Checkpoints
    also keep the engine's micro-step counter and, under ZeRO stage 2 (no offload), each rank's
    accumulated gradient partition when saved inside an accumulation window, so a resume there
    continues bit-identically; other configurations warn, naming what is unsupported.

    Args:
        checkpoint_engine: the engine of ``lightning_fp8state.checkpoint`` calls that name
            none: ``auto`` (DeepSpeed's when one of its activation checkpointing features is
            on, else torch's), ``torch`` or ``deepspeed``.
        num_checkpoints: checkpointed regions per forward; DeepSpeed needs it for
            ``contiguous_memory_optimization`` (its ``number_checkpoints``).
        device_guard: under bf16 with ZeRO-1/2 and a fused torch Adam/AdamW, check the gradients
            for inf/NaN and clip them on the device (``deepspeed_guard``), in place of
            DeepSpeed's own check and clipping, which sync the host every optimizer step. Where
            that is not possible DeepSpeed's check stays, with a warning that says why.
        overlap_comm: DeepSpeed's ``zero_optimization.overlap_comm``; ``None`` (the default):
            **off under ZeRO-1/2**, on under ZeRO-3 (Lightning turns it on for every stage).
            With it on, ZeRO-1/2 reduce each gradient bucket on a side stream and wait for the
            whole device (``get_accelerator().synchronize()``) before every bucket's reduction
            and at the end of every backward, so the host can never issue a step ahead of the
            GPU (measured on the H200: three waits a step). Off, the reductions run on the
            compute stream in order, and nothing waits. ZeRO-3 waits on its reduction stream at
            the end of every backward either way, so there the overlap costs no extra wait and
            stays on. A ``config=`` of your own keeps its own setting.

    DeepSpeed's throughput timer (``timers.throughput``) is left on but **not synchronized**
    unless the config sets ``synchronized``: synchronized, as DeepSpeed has it by default, it
    calls ``get_accelerator().synchronize()`` at every forward's start and every step's end
    (two waits for the whole device a step, found on the H200), so the host could not issue a
    step ahead of the GPU. Unsynchronized it times the host, which is what its progress line
    reports; ``TelemetryCallback`` measures the throughput this project logs.
    """

    strategy_name = "fp8state_deepspeed"
    optimizer_owns_parameters = False  # DeepSpeed's flat fp32 partitions; its device guard clips there
    writes_checkpoint_directory = True
    needs_cuda = True  # Lightning's DeepSpeedStrategy refuses any other accelerator
    # DeepSpeed's ZeRO optimizer partitions are laid out for the saved number of ranks: a resume on
    # another one goes through DeepSpeed's universal checkpoint (to_universal_checkpoint, then
    # use_universal_checkpoint before the fit), which the CLI drives
    resumes_on_another_world_size = False
    resumes_through_universal_checkpoint = True

    @classmethod
    def cuda_required(cls) -> bool:
        # DeepSpeed's CPU accelerator chosen explicitly (DS_ACCELERATOR=cpu): gloo ranks
        return not deepspeed_cpu_requested()

    @classmethod
    def fused_optimizer(cls, strategy_cfg: Any) -> bool:
        """ZeRO-1/2 step a torch optimizer over DeepSpeed's flat partitions: fused there; ZeRO-3 not."""
        return int(strategy_cfg.zero_stage) <= 2

    def __init__(
        self,
        *args: Any,
        checkpoint_engine: str = "auto",
        num_checkpoints: int | None = None,
        device_guard: bool = True,
        overlap_comm: bool | None = None,
        **kwargs: Any,
    ):
        require_choice("checkpoint_engine", checkpoint_engine, CHECKPOINT_ENGINES)
        require_int("num_checkpoints", num_checkpoints, 1, optional=True)
        require_bool("device_guard", device_guard)
        if overlap_comm is None:
            overlap_comm = _zero_stage(args, kwargs) == 3
        require_bool("overlap_comm", overlap_comm)
        super().__init__(*args, overlap_comm=overlap_comm, **kwargs)
        # DeepSpeed's throughput timer waits for the whole device at every forward's start and
        # every step's end unless told not to; a config that sets it keeps its own setting
        self.config.setdefault("timers", {}).setdefault("throughput", {}).setdefault("synchronized", False)
        self.checkpoint_engine = checkpoint_engine
        self.device_guard = device_guard
        # why the device guard is not running (None: it is, or it was not asked for)
        self.device_guard_unsupported: str | None = None
        ac = self.activation_checkpointing_config
        if num_checkpoints is not None:
            ac["number_checkpoints"] = num_checkpoints
        if ac.get("contiguous_memory_optimization"):
            if not ac.get("partition_activations"):
                raise MisconfigurationException(
                    "contiguous_memory_optimization=True needs partition_activations=True: DeepSpeed copies "
                    "the partitioned activation checkpoints into one contiguous buffer"
                )
            if ac.get("number_checkpoints") is None:
                raise MisconfigurationException(
                    "contiguous_memory_optimization=True needs num_checkpoints=<checkpointed regions per "
                    "forward>: DeepSpeed sizes the contiguous buffer from it"
                )

    @property
    def activation_checkpointing_config(self) -> dict:
        """The ``activation_checkpointing`` section of the DeepSpeed config (created if absent)."""
        return self.config.setdefault("activation_checkpointing", {})

    @property
    def routed_engine(self) -> str | None:
        """The engine ``lightning_fp8state.checkpoint`` is routed to (``None``: left as it is)."""
        if self.checkpoint_engine != "auto":
            return self.checkpoint_engine
        ac = self.activation_checkpointing_config
        features = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
        return "deepspeed" if any(ac.get(k) for k in features) else None

    @classmethod
    def from_cli(cls, strategy_cfg: Any) -> Fp8StateDeepSpeedStrategy:
        """The strategy ``fp8state train`` builds from its ``strategy`` section."""
        s = strategy_cfg
        return cls(
            stage=s.zero_stage,
            partition_activations=s.partition_activations,
            cpu_checkpointing=s.cpu_checkpointing,
            contiguous_memory_optimization=s.contiguous_memory_optimization,
            overlap_comm=s.overlap_comm,
        )

    # -- the contract Fp8StateCallback reads (Lightning's DeepSpeed strategy runs data parallel
    # only, so the amax reduction's group is the default one) --------------------------------
    @property
    def fp8state_checkpoint_engine(self) -> str | None:
        """The ``checkpoint_engine`` of the callback's state (the engine of unnamed
        ``lightning_fp8state.checkpoint`` calls inside its events); ``None`` leaves the state's own."""
        return self.routed_engine

    @property
    def fp8state_converts_before_wrap(self) -> bool:
        """ZeRO stage 3 partitions the parameters when the engine wraps the model."""
        return self.zero_stage_3

    @property
    def on_cpu(self) -> bool:
        """Whether this run is DeepSpeed on CPU ranks (gloo): the CPU accelerator with DeepSpeed's
        own CPU accelerator chosen explicitly (``DS_ACCELERATOR=cpu``), for tests and laptops."""
        return not isinstance(self.accelerator, CUDAAccelerator) and deepspeed_cpu_requested()

    @override
    def setup_environment(self) -> None:
        if self.on_cpu:
            # Lightning's DeepSpeedStrategy refuses every accelerator but CUDA; DDP's setup is the rest
            DDPStrategy.setup_environment(self)
            return
        if not isinstance(self.accelerator, CUDAAccelerator):
            raise MisconfigurationException(
                f"strategy '{self.strategy_name}' needs CUDA GPUs: Lightning's DeepSpeedStrategy refuses "
                f"{type(self.accelerator).__name__}. On the CPU use strategy='fp8state_ddp' (gloo), or set "
                f"{DEEPSPEED_CPU_ENV}=cpu to run DeepSpeed's CPU accelerator on gloo ranks; "
                "lightning_fp8state.checkpoint(..., engine='deepspeed') and deepspeed.checkpointing.checkpoint "
                "work inside fp8state_ddp"
            )
        super().setup_environment()

    def use_universal_checkpoint(self) -> None:
        """Load the checkpoint of this fit from its universal form (``latest_universal``:
        :func:`to_universal_checkpoint`), which DeepSpeed reshards to this run's ranks."""
        self.config.setdefault("checkpoint", {})["load_universal"] = True

    @override
    def setup_distributed(self) -> None:
        if not self.on_cpu:
            super().setup_distributed()
            return
        # Lightning's checks a GPU index per rank; CPU ranks have none
        reset_seed()
        self.set_world_ranks()
        _skip_shared_memory_allreduce()
        self._init_deepspeed_distributed()

    @property
    @override
    def root_device(self) -> torch.device:
        # DeepSpeed's engine reads the device's index as its rank's device: the one CPU is cpu:0
        return torch.device("cpu", 0) if self.on_cpu else super().root_device

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        _require_callback(trainer, self.strategy_name)
        super().setup(trainer)
        if self.zero_stage_3:  # partitioned weights: no codes held from forward to recompute (memory)
            mark_sharded(self.lightning_module, every_layer=True)

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        engine, ds_optimizer = super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        if self.device_guard:
            self.device_guard_unsupported = deepspeed_guard.install(engine)
            if self.device_guard_unsupported is not None:
                rank_zero_warn(
                    f"{self.strategy_name}: DeepSpeed's non-finite check and clipping stay on the host (one sync "
                    f"per optimizer step each): {self.device_guard_unsupported}. Use bf16 with ZeRO-1/2 and "
                    "torch.optim.AdamW(..., fused=True) to move them onto the device"
                )
        return engine, ds_optimizer

    @override
    def _set_deepspeed_activation_checkpointing(self) -> None:
        # Lightning's version drops synchronize_checkpoint_boundary and number_checkpoints.
        import deepspeed  # noqa: PLC0415  (as Lightning does: only once DeepSpeed runs)

        ac = self.config.get("activation_checkpointing")
        if not ac:
            return
        deepspeed.checkpointing.configure(
            mpu_=None,
            partition_activations=ac.get("partition_activations"),
            contiguous_checkpointing=ac.get("contiguous_memory_optimization"),
            num_checkpoints=ac.get("number_checkpoints"),
            checkpoint_in_cpu=ac.get("cpu_checkpointing"),
            synchronize=ac.get("synchronize_checkpoint_boundary"),
            profile=ac.get("profile"),
        )

    # -- the engine's gradient-accumulation window in checkpoints ---------------------------
    @property
    def fp8state_saves_accumulation(self) -> bool:
        """This strategy keeps the engine's accumulation window in checkpoints itself."""
        return True

    def _save_accumulated_grads_wanted(self) -> bool:
        trainer = self.lightning_module.trainer
        callbacks = [cb for cb in trainer.callbacks if isinstance(cb, Fp8StateCallback)]
        return all(cb.save_accumulated_grads for cb in callbacks)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's checkpoint, plus the engine's micro-step counter (client state) and, saved
        inside an accumulation window under ZeRO-2, each rank's accumulated gradient partition
        (one file per rank beside DeepSpeed's own, see ``deepspeed_accumulation``)."""
        filepath = self.broadcast(filepath)
        if self.is_global_zero:
            _clear_stale_files(filepath, self.world_size)
        self.barrier("fp8state stale checkpoint files removed")
        window = None
        if "loops" in checkpoint:  # a full checkpoint (weights-only ones resume no window)
            engine = self.deepspeed_engine
            micro_steps, gas = window_position(engine)
            mid_window = micro_steps % gas != 0
            reason = unsupported_reason(engine) if mid_window else None
            grads = "none"
            if mid_window:
                if reason is not None:
                    grads = "lost"
                    rank_zero_warn(
                        "lightning_fp8state: a checkpoint is saved inside a gradient-accumulation window "
                        f"({micro_steps % gas} of {gas} microbatches), but the engine's accumulated gradients "
                        f"cannot be saved with {reason}: resuming from it loses this window's earlier "
                        "microbatches. Save at an optimizer-step boundary (ModelCheckpoint(every_n_train_steps"
                        "=...)) or use ZeRO stage 2 without offload for an exact resume"
                    )
                elif self._save_accumulated_grads_wanted():
                    grads = "saved"
                    window = capture_window(engine, self.global_rank, self.world_size)
                else:
                    grads = "lost"
            checkpoint[ACCUMULATION_KEY] = {
                "format_version": ACCUMULATION_FORMAT_VERSION,
                "micro_steps": micro_steps,
                "gradient_accumulation_steps": gas,
                "world_size": self.world_size,
                "mid_window": mid_window,
                "grads": grads,
                "unsupported": reason,
            }
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if window is not None:
            path = rank_file(str(filepath), self.global_rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(window, path)
        self.barrier("fp8state accumulation window saved")

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        check_checkpoint(checkpoint_path, deepspeed=True)  # DeepSpeed's engine unpickles: refuse foreign code first
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        saved_world = zero_world_size(checkpoint_path)
        # DeepSpeed's universal checkpoint (its config's checkpoint.load_universal) reshards itself
        universal = bool((self.config or {}).get("checkpoint", {}).get("load_universal"))
        if fitting and not universal and saved_world not in (None, self.world_size):  # before the engine reads one
            raise StateLoadError(
                f"{checkpoint_path}: DeepSpeed's ZeRO optimizer partitions were saved by {saved_world} rank(s), this run "
                f"has {self.world_size}: they reshard only through DeepSpeed's universal checkpoint (convert it with "
                "lightning_fp8state.lightning.strategies.to_universal_checkpoint(path) and call the strategy's "
                "use_universal_checkpoint() before the fit: `fp8state train --resume` does both), or resume with "
                f"devices x num_nodes = {saved_world}"
            )
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        entry = checkpoint.get(ACCUMULATION_KEY)
        if entry is None or not fitting or (self.load_full_weights and self.zero_stage_3):
            return checkpoint
        check_format_version(entry.get("format_version"), f"checkpoint['{ACCUMULATION_KEY}']")
        engine = self.deepspeed_engine
        _, gas = window_position(engine)
        if entry["mid_window"] and (
            entry["world_size"] != self.world_size or entry["gradient_accumulation_steps"] != gas
        ):
            raise StateLoadError(
                f"the checkpoint was saved inside a gradient-accumulation window of {entry['gradient_accumulation_steps']} "
                f"microbatches on {entry['world_size']} rank(s); this run accumulates {gas} on {self.world_size}. "
                "Resume with the same devices x num_nodes and accumulate_grad_batches"
            )
        if entry["gradient_accumulation_steps"] != gas:
            return checkpoint  # saved at a boundary: the engine's fresh counter is aligned already
        if entry["grads"] == "saved":
            saved = torch.load(rank_file(str(checkpoint_path), self.global_rank), map_location="cpu", weights_only=True)
            restore_window(engine, saved, self.global_rank, self.world_size, self.root_device)
        else:
            # Boundaries stay where Lightning's restored loop expects them.
            engine.micro_steps = int(entry["micro_steps"])
            if entry["grads"] == "lost":
                why = f" ({entry['unsupported']})" if entry.get("unsupported") else ""
                rank_zero_warn(
                    "lightning_fp8state: this checkpoint was saved inside a gradient-accumulation window without "
                    f"the engine's accumulated gradients{why}: the resumed run is not an exact continuation"
                )
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (
            ("fp8state_deepspeed", 2, "DeepSpeed ZeRO-2 with lightning_fp8state"),
            ("fp8state_deepspeed_stage_1", 1, "DeepSpeed ZeRO-1 with lightning_fp8state"),
            ("fp8state_deepspeed_stage_2", 2, "DeepSpeed ZeRO-2 with lightning_fp8state"),
            ("fp8state_deepspeed_stage_3", 3, "DeepSpeed ZeRO-3 with lightning_fp8state"),
        )
        for name, stage, description in entries:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, stage=stage)


def register_strategies(strategy_registry: _StrategyRegistry) -> None:
    """Register ``fp8state_ddp*`` and ``fp8state_deepspeed*`` (idempotent)."""
    Fp8StateDDPStrategy.register_strategies(strategy_registry)
    Fp8StateDeepSpeedStrategy.register_strategies(strategy_registry)
