"""CUDA graphs of training work, the protocol's bookkeeping replayed on the host per event.

Two ways to graph a step, one module each, on shared capture machinery:

- :mod:`.step`: :class:`GraphedStep`, a whole event (forward, backward, optimizer) in one
  graph, for a single device or a strategy whose backward runs no Python;
- :mod:`.blocks`: :class:`GraphedBlocks`, each checkpointed block's forward and backward in
  graphs of their own, so a data-parallel strategy's gradient hooks stay eager between them;
- :mod:`.capture`: what a capture runs on (side stream, warm-up, :class:`CudaGraphBackend`)
  and the chained capture of a stack of blocks;
- :mod:`.replay`: one block's graphs, their static buffers and the autograd Function that
  replays them;
- :mod:`.fsdp_units`: FSDP2 units inside per-block graphs (static parameter copies, their
  input cast, what a capture refuses).
"""

from .blocks import GraphedBlocks
from .capture import CudaGraphBackend, on_side_stream, require_warmup
from .step import GraphedStep

__all__ = ["CudaGraphBackend", "GraphedBlocks", "GraphedStep", "on_side_stream", "require_warmup"]
