"""Lightning integration: Fp8StateCallback, TelemetryCallback and the fp8state_ddp /
fp8state_deepspeed / fp8state_fsdp strategies (the only layer, with the CLI, that imports Lightning).

Importing this module (``import lightning_fp8state.lightning``, or touching
``lightning_fp8state.lightning.Fp8StateCallback``) registers the strategies with Lightning's
registry, so ``Trainer(strategy="fp8state_ddp" | "fp8state_deepspeed" | "fp8state_fsdp")`` finds them.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .callback import Fp8StateCallback
from .checkpoint_io import AtomicCheckpointIO
from .collector import ManagedCollection
from .contract import AutoStrategy, Fp8StateStrategyContract, contract_of
from .fsdp import Fp8StateFSDPStrategy
from .graphed import GraphedTrainingStep
from .strategies import Fp8StateDDPStrategy, Fp8StateDeepSpeedStrategy, register_strategies
from .telemetry_callback import LightningLoggerSink, TelemetryCallback, wandb_logger

register_strategies(StrategyRegistry)
Fp8StateFSDPStrategy.register_strategies(StrategyRegistry)

# the fp8state strategies by name, each built from the CLI's ``strategy`` section by ``from_cli``
STRATEGIES = {cls.strategy_name: cls for cls in (Fp8StateDDPStrategy, Fp8StateDeepSpeedStrategy, Fp8StateFSDPStrategy)}
# every strategy a run configuration may name (``strategy.name``), with the facts the CLI reads
STRATEGY_CHOICES = {AutoStrategy.strategy_name: AutoStrategy, **STRATEGIES}

__all__ = [
    "AtomicCheckpointIO",
    "Fp8StateCallback",
    "Fp8StateDDPStrategy",
    "Fp8StateDeepSpeedStrategy",
    "Fp8StateFSDPStrategy",
    "Fp8StateStrategyContract",
    "STRATEGIES",
    "STRATEGY_CHOICES",
    "AutoStrategy",
    "GraphedTrainingStep",
    "LightningLoggerSink",
    "ManagedCollection",
    "TelemetryCallback",
    "contract_of",
    "register_strategies",
    "wandb_logger",
]
