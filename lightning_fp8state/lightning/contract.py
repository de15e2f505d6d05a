"""What Fp8StateCallback needs from a Lightning strategy, declared in one class.

The fp8state strategies (``fp8state_ddp``, ``fp8state_deepspeed``, ``fp8state_fsdp``) inherit
:class:`Fp8StateStrategyContract` and override what differs; the callback reads any strategy through
:func:`contract_of`, which answers for Lightning's own strategies (``auto``, single device,
Lightning's DDP or DeepSpeed) from what they are. Nobody probes a strategy with ``getattr``.

The same class declares what a launcher must know *before* a strategy exists (the CLI validates a
run configuration and builds the trainer from them): its name, whether blocks may be compiled,
which CUDA graphs it runs, whether the optimizer is fused, whether it writes a checkpoint as a
directory, whether it needs CUDA. These are class attributes; :data:`AutoStrategy` answers for
Lightning's default (``strategy.name=auto``). The CLI reads only these, and names no strategy.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

__all__ = ["AutoStrategy", "Fp8StateStrategyContract", "contract_of"]


class Fp8StateStrategyContract:
    """The strategy's side of the protocol (defaults: one process group, nothing sharded)."""

    # -- what a launcher reads before the strategy exists (class attributes) -------------------
    strategy_name: ClassVar[str]
    #: ``trainer.compile`` (every block through torch.compile) has run under it and is allowed
    compiles_blocks: ClassVar[bool] = False
    #: ``trainer.cuda_graphs``: ``"blocks"`` per-block graphs (the strategy's hooks stay eager
    #: between them), ``"step"`` the whole step as one graph (one GPU), ``None`` not supported
    cuda_graphs: ClassVar[Literal["blocks", "step"] | None] = "blocks"
    #: the optimizer steps plain parameters (or FSDP2's shards): a fused AdamW, and the telemetry
    #: clips gradients itself (Lightning's plugin refuses to clip for a fused optimizer)
    optimizer_owns_parameters: ClassVar[bool] = True
    #: a checkpoint is a directory the strategy writes itself (not one file through a CheckpointIO)
    writes_checkpoint_directory: ClassVar[bool] = False
    #: the optimizer state comes back in the strategy's ``load_checkpoint``, after the module's
    #: ``on_load_checkpoint``: optimizer settings must be put back at train start
    restores_optimizer_late: ClassVar[bool] = False
    #: runs on CUDA devices only, whatever ``trainer.accelerator`` says
    needs_cuda: ClassVar[bool] = False
    #: its checkpoint's weights and optimizer state load on another number of ranks (replicated,
    #: or resharded by DCP); the quantizer state is mapped by the callback (``state/reshard.py``)
    resumes_on_another_world_size: ClassVar[bool] = True
    #: its checkpoint loads on another number of ranks once converted to DeepSpeed's universal
    #: checkpoint (``to_universal_checkpoint``), the CLI converting it before such a resume
    resumes_through_universal_checkpoint: ClassVar[bool] = False

    @classmethod
    def cuda_required(cls) -> bool:
        """:attr:`needs_cuda`, unless this environment opted the strategy into CPU ranks."""
        return cls.needs_cuda

    @classmethod
    def fused_optimizer(cls, strategy_cfg: Any) -> bool:
        """Whether the run's AdamW is fused (its non-finite guard then skips on the device) for
        the CLI's ``strategy`` section ``strategy_cfg``."""
        return cls.optimizer_owns_parameters

    @classmethod
    def from_cli(cls, strategy_cfg: Any) -> Any:
        """The ``strategy`` argument of ``Trainer`` for the CLI's ``strategy`` section."""
        raise NotImplementedError(f"{cls.__name__} does not say how the CLI builds it")

    @property
    def fp8state_process_group(self) -> Any:
        """The data-parallel group pending amaxes are MAX-reduced over (``None``: the default group)."""
        return None

    @property
    def fp8state_checkpoint_engine(self) -> str | None:
        """The engine of ``lightning_fp8state.checkpoint`` calls that name none, set on the state at
        setup (``None``: leave the state's own)."""
        return None

    @property
    def fp8state_sharded(self) -> bool:
        """Parameters are sharded (FSDP2): layers must be converted before the strategy's setup, and a
        mid-window checkpoint cannot hold the sharded accumulated gradients."""
        return False

    @property
    def fp8state_converts_before_wrap(self) -> bool:
        """Layers must be converted before the strategy wraps the model (DeepSpeed ZeRO stage 3)."""
        return False

    @property
    def fp8state_saves_accumulation(self) -> bool:
        """The strategy keeps the gradient-accumulation window in checkpoints itself (the callback's
        ``accumulated_grads`` path is for DDP)."""
        return False


class _LightningStrategy(Fp8StateStrategyContract):
    """The contract of a strategy that is not one of ours, from what it is."""

    def __init__(self, strategy: Strategy | None) -> None:
        self._strategy = strategy

    @property
    def fp8state_converts_before_wrap(self) -> bool:
        return isinstance(self._strategy, DeepSpeedStrategy) and self._strategy.zero_stage_3


class AutoStrategy(Fp8StateStrategyContract):
    """``strategy.name=auto``: Lightning's own choice (one device). Only its class facts are read."""

    strategy_name = "auto"
    compiles_blocks = True
    cuda_graphs = "step"

    @classmethod
    def from_cli(cls, strategy_cfg: Any) -> str:
        return "auto"


def contract_of(strategy: Strategy | None) -> Fp8StateStrategyContract:
    """``strategy`` itself when it declares the contract, else its answers for a Lightning strategy."""
    if isinstance(strategy, Fp8StateStrategyContract):
        return strategy
    return _LightningStrategy(strategy)
