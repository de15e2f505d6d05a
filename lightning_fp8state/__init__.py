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
from .collector import ManagedCollector
from .config import QuantConfig
from .errors import (
    AlreadyConvertedError,
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
    UntrustedCheckpointError,
)
from .formats import E4M3, E5M2, MXFP4, NVFP4, Fp4Layout, Fp8Format
from .fp8state import STATE_FORMAT_VERSION, Fp8State
from .graphs import GraphedBlocks, GraphedStep, graph_decoder_layers
from .models.hf_fuse import fuse_decoder_projections, unfuse_decoder_projections
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
    # the contract: state, config, checkpointing, CUDA graphs
    "Fp8State",
    "QuantConfig",
    "checkpoint",
    "GraphedStep",
    "GraphedBlocks",
    "graph_decoder_layers",
    "fuse_decoder_projections",
    "unfuse_decoder_projections",
    "ManagedCollector",
    "selective_checkpoint_context",
    "selective_checkpoint_policy",
    "MATMUL_OPS",
    "QUANTIZE_OPS",
    # modules and conversion
    "Fp8Linear",
    "Fp4AttentionQuantizer",
    "convert_model",
    # what the ledger, snapshots and audit speak of
    "OwnerKey",
    "QuantSnapshot",
    "Phase",
    "RecomputeAuditor",
    "DeviceRecomputeAuditor",
    "AuditReport",
    "AuditRow",
    "STATE_FORMAT_VERSION",
    # formats
    "E4M3",
    "E5M2",
    "NVFP4",
    "MXFP4",
    "Fp8Format",
    "Fp4Layout",
    # errors and warnings
    "AlreadyConvertedError",
    "AmbiguousRecomputeError",
    "ConcurrentEntryError",
    "ConfigError",
    "ConversionWarning",
    "OwnerAlignmentError",
    "RunDirectoryError",
    "SelectiveCheckpointError",
    "StaleSnapshotError",
    "StateLoadError",
    "StateTransitionError",
    "UntrustedCheckpointError",
    # the custom ops (torch.ops.fp8state) and their references
    "ops",
]
