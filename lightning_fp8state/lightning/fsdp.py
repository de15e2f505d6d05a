"""fp8state_fsdp: Lightning's FSDP2 path (``ModelParallelStrategy``) with FP8 all-gather of weights.

The strategy shards the model itself with ``fully_shard`` (each block of every ``nn.ModuleList``,
or the modules ``shard_modules`` names, then the root) over a one-dimensional data-parallel
mesh, after :class:`Fp8StateCallback` converted it, so no ``configure_model`` is needed (a
model that shards itself there is taken as it is, and checked). With ``fp8_all_gather`` (the
default) every converted weight is all-gathered as FP8 codes at the event's frozen delayed
scale (:mod:`lightning_fp8state.nn.fsdp`); the weight owners' amaxes are MAX-reduced over the
shard group in the one all-reduce at ``commit_forward``, so every rank commits the same scale.

Checkpoints are sharded (torch distributed checkpoint: a directory, one shard file per rank);
the quantizer state of every rank travels in Lightning's metadata file of that directory, as
under DDP. A resume on another world size reshards the weights and optimizer state through DCP
(each tensor read by its global offsets) and maps the quantizer state from the same metadata
file (``state/reshard.py``); a mapping ``QuantConfig.world_size_merge=refuse`` forbids is refused
before anything is loaded.
"""

from __future__ import annotations

import errno
import tempfile
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from typing_extensions import override

from ..config import require_bool, require_choice, require_strings
from ..errors import ConfigError, StateLoadError
from ..nn import Fp8Linear
from ..nn.fsdp import (
    enable_fp8_all_gather,
    fp8_all_gather_problem,
    gathered_layers,
    mark_sharded,
    plain_shard,
    step_on_local_shards,
    uneven_fp8_gathers,
)
from ..quant_recipes import recipe_class
from ..state.checkpoint_files import check_checkpoint, load_checkpoint_file, safe_dcp_load
from .callback import CHECKPOINT_KEY, Fp8StateCallback, check_resume_world_size
from .checkpoint_io import (
    TMP_SUFFIX,
    checkpoint_nbytes,
    no_room_cause,
    no_room_error,
    remove_temporary,
    replace_directory,
)
from .contract import Fp8StateStrategyContract
from .strategies import _require_callback

__all__ = ["Fp8StateFSDPStrategy", "default_shard_units"]


def default_shard_units(model: nn.Module) -> list[str]:
    """The modules FSDP2 shards by default: every member of every ``nn.ModuleList`` (a
    transformer's blocks), then every direct child of ``model`` holding parameters outside
    those (the network a LightningModule wraps, e.g. ``self.model``, whose forward its
    ``training_step`` calls: its remaining parameters are gathered when that forward runs,
    not at the LightningModule's own forward, which ``training_step`` may never call). The
    root is sharded too, holding what is left."""
    names = [
        f"{name}.{i}" if name else str(i)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        for i in range(len(module))
    ]
    modules = dict(model.named_modules())
    covered = {id(p) for n in names for p in modules[n].parameters()}
    for name, child in model.named_children():
        if not isinstance(child, nn.ModuleList) and any(id(p) not in covered for p in child.parameters()):
            names.append(name)
    return names


class Fp8StateFSDPStrategy(Fp8StateStrategyContract, ModelParallelStrategy):
    """FSDP2 (``fully_shard``) for stateful FP8 training; registered as ``fp8state_fsdp``.

    Args:
        fp8_all_gather: all-gather converted weights as FP8 codes (1 byte an element) at the
            event's frozen delayed scale, or under ``fp8_current`` at the full weight's scale
            (one all-reduce of the shards' amaxes per event); ``False`` gathers them in the parameters' dtype
            and each layer quantizes its full weight, as under DDP.
        shard_modules: ``fnmatch`` patterns over module names: each match is its own FSDP2
            unit (one all-gather); default: :func:`default_shard_units` (every member of every
            ``nn.ModuleList``, and each direct child with other parameters). The root is
            always a unit.
        reshard_after_forward: free each unit's gathered parameters after its forward and
            gather them again in the backward (FSDP2's default; with FP8 all-gather the
            backward gather quantizes with the forward's snapshot: the same bytes).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` for every unit (default:
            none, parameters gathered in their own dtype; FP8-gathered weights are quantized
            from their high-precision shard either way).
        local_optimizer_step: run each ``torch.optim.Adam`` / ``AdamW`` step on the local
            shards of its DTensor parameters and states (bitwise the same update, without
            DTensor's Python dispatch over every tensor: host time a step;
            :func:`~lightning_fp8state.nn.fsdp.step_on_local_shards`). Other optimizers step
            as they are.
        process_group_backend: as ``ModelParallelStrategy``.
        **kwargs: ``ModelParallelStrategy``'s other arguments (``timeout``, ...).

    Data parallel only: every rank holds a shard of every unit (a one-dimensional mesh of the
    world size); tensor parallelism is not supported.
    """

    strategy_name = "fp8state_fsdp"
    writes_checkpoint_directory = True  # torch distributed checkpoint: one shard file per rank
    restores_optimizer_late = True  # through DCP in load_checkpoint, past on_load_checkpoint

    def __init__(
        self,
        *,
        fp8_all_gather: bool = True,
        shard_modules: tuple[str, ...] | list[str] | None = None,
        reshard_after_forward: bool = True,
        mp_policy: Any = None,
        local_optimizer_step: bool = True,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        require_bool("fp8_all_gather", fp8_all_gather)
        require_bool("reshard_after_forward", reshard_after_forward)
        require_bool("local_optimizer_step", local_optimizer_step)
        why = "fp8state_fsdp shards over every rank: data parallel only, a one-dimensional mesh"
        require_choice("data_parallel_size", kwargs.pop("data_parallel_size", "auto"), ("auto",), why=why)
        require_choice("tensor_parallel_size", kwargs.pop("tensor_parallel_size", "auto"), ("auto", 1), why=why)
        require_choice(
            "save_distributed_checkpoint",
            kwargs.pop("save_distributed_checkpoint", True),
            (True,),
            why="fp8state_fsdp writes sharded checkpoints: torch distributed checkpoint, one shard per rank",
        )
        shard_modules = require_strings("shard_modules", shard_modules, "a list of module-name patterns", optional=True)
        super().__init__(process_group_backend=process_group_backend, save_distributed_checkpoint=True, **kwargs)
        self.fp8_all_gather = fp8_all_gather
        self.shard_modules = shard_modules
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.local_optimizer_step = local_optimizer_step

    @classmethod
    def from_cli(cls, strategy_cfg: Any) -> Fp8StateFSDPStrategy:
        """The strategy ``fp8state train`` builds from its ``strategy`` section."""
        return cls(
            fp8_all_gather=strategy_cfg.fp8_all_gather,
            reshard_after_forward=strategy_cfg.reshard_after_forward,
            local_optimizer_step=strategy_cfg.local_optimizer_step,
        )

    # -- the contract Fp8StateCallback reads ---------------------------------------------
    @property
    def fp8state_process_group(self) -> Any:
        """The shard group: the weight owners' amaxes are MAX-reduced over it (each rank
        records its shard's amax; the MAX is the full weight's)."""
        return self.device_mesh["data_parallel"].get_group()

    @property
    def fp8state_sharded(self) -> bool:
        """Parameters are sharded: layers must be converted before the strategy's setup, and a
        mid-window checkpoint cannot hold the (sharded) accumulated gradients."""
        return True

    # -- setup ---------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    def _callback(self, trainer: pl.Trainer) -> Fp8StateCallback:
        return next(cb for cb in trainer.callbacks if isinstance(cb, Fp8StateCallback))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415  (FSDP2, torch >= 2.6)

        _require_callback(trainer, self.strategy_name)
        config = self._callback(trainer).state.config
        self.check_config(config)
        assert self.model is not None
        self.accelerator.setup(trainer)
        if any(isinstance(m, FSDPModule) for m in self.model.modules()):
            self._check_presharded(self.model, config)
        else:
            self._shard(self.model)
        mark_sharded(self.model)  # no weight codes held from forward to recompute (memory)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.local_optimizer_step:
                # Adam/AdamW step on the local shards, not through DTensor's dispatch (host time)
                for optimizer in self.optimizers:
                    step_on_local_shards(optimizer)

    def check_config(self, config) -> None:
        """Refuse a quantizer configuration this strategy cannot serve (before anything is
        sharded): with ``fp8_all_gather``, see :func:`~lightning_fp8state.nn.fsdp.fp8_all_gather_problem`."""
        if self.fp8_all_gather and recipe_class(config.recipe).quantized:
            problem = fp8_all_gather_problem(config)
            if problem is not None:
                raise MisconfigurationException(
                    f"strategy '{self.strategy_name}' with fp8_all_gather=True cannot run {problem}; or pass "
                    "Fp8StateFSDPStrategy(fp8_all_gather=False)"
                )

    def _shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        model.to(self.root_device)  # the shards live where the rank computes
        gathered = enable_fp8_all_gather(model) if self.fp8_all_gather else []
        names = default_shard_units(model)
        if self.shard_modules is not None:
            names = [n for n, _ in model.named_modules() if n and any(fnmatch(n, p) for p in self.shard_modules)]
            if not names:
                raise MisconfigurationException(
                    f"shard_modules={list(self.shard_modules)} matches no module of {type(model).__name__}"
                )
        modules = dict(model.named_modules())
        kwargs = {"mesh": self.device_mesh["data_parallel"], "reshard_after_forward": self.reshard_after_forward}
        uneven = uneven_fp8_gathers(model, kwargs["mesh"].size()) if gathered else []
        if uneven:  # refused now, not at the first forward (after a resume's restore): a ConfigError, as there
            raise ConfigError(
                f"strategy '{self.strategy_name}' with fp8_all_gather=True over {kwargs['mesh'].size()} ranks: the "
                f"weights of layers {uneven[:3]}{f' and {len(uneven) - 3} more' if len(uneven) > 3 else ''} have "
                f"out_features not divisible by {kwargs['mesh'].size()}, and one FP8 scale per weight gathers even "
                "shards only. Run on a world size that divides them, start the run with "
                "strategy.fp8_all_gather=false (Fp8StateFSDPStrategy(fp8_all_gather=False)), or exclude those "
                "layers from conversion"
            )
        if self.mp_policy is not None:
            kwargs["mp_policy"] = self.mp_policy
        for name in names:
            fully_shard(modules[name], **kwargs)
        fully_shard(model, **kwargs)
        rank_zero_info(
            f"lightning_fp8state: FSDP2 over {self.world_size} rank(s): {len(names)} unit(s) + the root; "
            f"{len(gathered)} weight(s) all-gathered in FP8"
        )

    def _check_presharded(self, model: nn.Module, config) -> None:
        """A model sharded in ``configure_model``: with FP8 all-gather on, every converted
        weight must have been prepared before ``fully_shard``."""
        if not (self.fp8_all_gather and recipe_class(config.recipe).quantized):
            return
        converted = {m.layer_name for m in model.modules() if isinstance(m, Fp8Linear)}
        missing = sorted(converted - set(gathered_layers(model)))
        if missing:
            raise MisconfigurationException(
                f"the model was sharded in configure_model, but layers {missing[:5]} do not gather their weight "
                "in FP8: call lightning_fp8state.nn.fsdp.enable_fp8_all_gather(self) before fully_shard there, "
                "or let fp8state_fsdp shard the model (leave configure_model out), or pass fp8_all_gather=False"
            )

    # -- checkpoints ---------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Lightning's sharded save, into a temporary folder beside ``filepath`` that replaces it
        once every rank has written its part. Lightning writes into ``filepath`` itself: a save that
        failed (a full disk) left a half-written folder, or a half-overwritten ``last.ckpt``.

        Raises:
            DiskFullError: on every rank, when a rank's write failed for lack of space or past the
                file-size limit (torch's shard writer keeps no ``OSError``: see ``no_room_cause``).
        """
        path = Path(self.broadcast(str(filepath)))
        nbytes = checkpoint_nbytes(checkpoint)  # (before the save: it takes the state dict out)
        error: BaseException | None = None
        tmp = None
        if self.global_rank == 0:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=path.parent)
            except OSError as exc:
                error = exc
        tmp = self.broadcast(tmp)
        if tmp is not None:
            try:
                super().save_checkpoint(checkpoint, Path(tmp), storage_options)
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                error = exc
        if self.reduce_boolean_decision(error is None, all=True):
            if self.global_rank == 0:
                replace_directory(tmp, path)
            self.barrier("fp8state checkpoint in place")
            return
        # a full disk is judged before the temporary folder is removed (that frees what it held)
        cause = no_room_cause(error, path, nbytes) if error is not None else None
        any_full = not self.reduce_boolean_decision(cause is None, all=True)
        if self.global_rank == 0 and tmp is not None:
            remove_temporary(Path(tmp))
        self.barrier("fp8state failed checkpoint removed")
        if any_full:  # on every rank, also those whose part was written: the same error everywhere
            raise no_room_error(cause or OSError(errno.ENOSPC, "on another rank"), path, nbytes) from None
        if error is None:
            raise RuntimeError(f"another rank could not write its part of {path}; nothing of this checkpoint is kept")
        raise error

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The sharded state dict, each FP8-gathered weight as its plain high-precision shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        return {k: plain_shard(v) for k, v in state.items()}  # DCP writes device tensors itself

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Refuse a mapping onto another world size that the config forbids (before anything is
        loaded), then load the shards in place (DCP reshards them onto this world size)."""
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(checkpoint_path))
        if not _is_sharded_checkpoint(path):
            raise StateLoadError(
                f"{str(path)!r} is not a sharded checkpoint (a directory written by torch distributed checkpoint): "
                f"strategy '{self.strategy_name}' resumes from the checkpoints it writes"
            )
        # DCP unpickles .metadata itself: every file is read the safe way first (refused if it
        # names a type outside our allowlist, a storage path outside the folder or a link), meta.pt
        # is read weights_only whatever is asked, and the shards' bytes items too (safe_dcp_load)
        check_checkpoint(path, deepspeed=False)
        metadata = load_checkpoint_file(path / _METADATA_FILENAME, map_location="cpu")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        entry = metadata.get(CHECKPOINT_KEY)
        if isinstance(entry, dict) and "world_size" in entry:  # a mapping the config forbids: before any load
            rules = [
                cb.config.world_size_merge
                for cb in self.lightning_module.trainer.callbacks
                if isinstance(cb, Fp8StateCallback)
            ]
            check_resume_world_size(entry, self.world_size, fitting, rules[0] if rules else "max")
        # another world size: DCP reshards the weights and optimizer state by their global offsets
        # the plain shards alias the parameters' storage: the load fills them in place
        model_state = {"state_dict": {k: plain_shard(v) for k, v in get_model_state_dict(self.model).items()}}
        safe_dcp_load(model_state, path)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            safe_dcp_load(optim_state, path)
            set_optimizer_state_dict(
                self.model, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
            )
        return metadata

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if "fp8state_fsdp" not in strategy_registry:
            strategy_registry.register(
                "fp8state_fsdp", cls, description="FSDP2 with lightning_fp8state: FP8 all-gather at the delayed scale"
            )
