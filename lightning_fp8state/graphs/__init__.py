"""CUDA graphs of training work, the protocol's bookkeeping replayed on the host per event.

Two ways to graph a step, one module each, on shared capture machinery:

- :mod:`.step`: :class:`GraphedStep`, a whole event (forward, backward, optimizer) in one
  graph, for a single device or a strategy whose backward runs no Python;
- :mod:`.blocks`: :class:`GraphedBlocks`, each checkpointed block's forward and backward in
  graphs of their own, so a data-parallel strategy's gradient hooks stay eager between them;
- :mod:`.capture`: what a capture runs on (side stream, warm-up, :class:`CudaGraphBackend`)
  and the chained capture of a stack of blocks;
- :mod:`.layer_pass`: a pass of :meth:`GraphedBlocks.call_block` over the stack (warm-up,
  capture or replay decided at block 0; FSDP2 units run inside their own call);
- :mod:`.replay`: one block's graphs, their static buffers and the autograd Function that
  replays them;
- :mod:`.fsdp_units`: FSDP2 units inside per-block graphs (static parameter copies, their
  input cast, what a capture refuses);
- :mod:`.side_inputs`: a block's arguments besides the chained hidden state (static buffers
  for tensors, plain values held constant, what is refused);
- :mod:`.hf_layers`: :func:`graph_decoder_layers`, a Hugging Face model's decoder layers run
  through one :class:`GraphedBlocks` from its own forward loop.
"""

from .blocks import GraphedBlocks
from .capture import CudaGraphBackend, on_side_stream, require_warmup
from .hf_layers import find_decoder_layers, graph_decoder_layers
from .step import GraphedStep

__all__ = [
    "CudaGraphBackend",
    "GraphedBlocks",
    "GraphedStep",
    "find_decoder_layers",
    "graph_decoder_layers",
    "on_side_stream",
    "require_warmup",
]
