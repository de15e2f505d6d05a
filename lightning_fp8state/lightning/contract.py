"""What Fp8StateCallback needs from a Lightning strategy, declared in one class.

The fp8state strategies (``fp8state_ddp``, ``fp8state_deepspeed``, ``fp8state_fsdp``) inherit
:class:`Fp8StateStrategyContract` and override what differs; the callback reads any strategy through
:func:`contract_of`, which answers for Lightning's own strategies (``auto``, single device,
Lightning's DDP or DeepSpeed) from what they are. Nobody probes a strategy with ``getattr``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import DeepSpeedStrategy, Strategy

__all__ = ["Fp8StateStrategyContract", "contract_of"]


class Fp8StateStrategyContract:
    """The strategy's side of the protocol (defaults: one process group, nothing sharded)."""

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


def contract_of(strategy: Strategy | None) -> Fp8StateStrategyContract:
    """``strategy`` itself when it declares the contract, else its answers for a Lightning strategy."""
    if isinstance(strategy, Fp8StateStrategyContract):
        return strategy
    return _LightningStrategy(strategy)
