"""lightning_fp8state: stateful low-precision training that stays correct under recompute.

The public contract (see docs/ARCHITECTURE.md)::

    import lightning_fp8state as f8s
    state = f8s.Fp8State(f8s.QuantConfig(recipe="fp8_delayed", mode="safe"))
    model = state.convert(model)
    with state.step(step, microbatch=0):
        y = f8s.checkpoint(block, x)
        ...
"""

import importlib

from . import ops
from .audit import AuditReport, AuditRow, DeviceRecomputeAuditor, RecomputeAuditor
from .config import QuantConfig
from .errors import (
    AmbiguousRecomputeError,
    ConcurrentEntryError,
    ConfigError,
    ConversionWarning,
    OwnerAlignmentError,
    RunDirectoryError,
    SelectiveCheckpointError,
    StaleSnapshotError,
    StateLoadError,
    StateTransitionError,
)
from .formats import E4M3, E5M2, MXFP4, NVFP4, Fp4Layout, Fp8Format
from .fp8state import STATE_FORMAT_VERSION, Fp8State
from .graphs import GraphedStep
from .nn import Fp4AttentionQuantizer, Fp8Linear, convert_model
from .recompute import Phase, checkpoint
from .sac import MATMUL_OPS, QUANTIZE_OPS, selective_checkpoint_context, selective_checkpoint_policy
from .state import OwnerKey, QuantSnapshot

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``lightning_fp8state.lightning`` imports Lightning: load it on first use only, so that
    # ``import lightning_fp8state`` stays free of Lightning.
    if name == "lightning":
        return importlib.import_module(f"{__name__}.lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "E4M3",
    "E5M2",
    "MXFP4",
    "NVFP4",
    "STATE_FORMAT_VERSION",
    "AmbiguousRecomputeError",
    "AuditReport",
    "AuditRow",
    "ConcurrentEntryError",
    "ConfigError",
    "ConversionWarning",
    "Fp4AttentionQuantizer",
    "Fp4Layout",
    "Fp8Format",
    "Fp8Linear",
    "Fp8State",
    "GraphedStep",
    "OwnerAlignmentError",
    "RunDirectoryError",
    "OwnerKey",
    "Phase",
    "QuantConfig",
    "QuantSnapshot",
    "DeviceRecomputeAuditor",
    "RecomputeAuditor",
    "MATMUL_OPS",
    "QUANTIZE_OPS",
    "SelectiveCheckpointError",
    "StaleSnapshotError",
    "StateLoadError",
    "StateTransitionError",
    "checkpoint",
    "convert_model",
    "ops",
    "selective_checkpoint_context",
    "selective_checkpoint_policy",
]
