"""A CUDA graph's semantics on any device, for testing what runs from graphs on the CPU.

A CUDA graph records the kernels a capture launched, on the memory they touched, and a replay
launches exactly those again: no Python runs, so nothing the host decided per call is decided
again. ``RecordedGraph`` does the same one level up: a dispatch mode records every operator a
capture ran, with the very tensors it read and wrote (kept alive, like a graph's memory pool),
and a replay runs those operators again and writes each result into the tensor the capture
produced. What a capture must not do on a GPU (read a value back to the host) is refused here
too. ``EmulatedGraphBackend`` is GraphedBlocks' backend interface on top of it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class RecordedGraph:
    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.replays = 0

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, outs in self.ops:
                result = func(*args, **kwargs)
                for recorded, fresh in zip(tree_leaves(outs), tree_leaves(result), strict=True):
                    if isinstance(recorded, torch.Tensor) and recorded is not fresh:
                        recorded.copy_(fresh)
        self.replays += 1


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    """Records a capture's operators. A capture on a GPU launches nothing, so memory that
    existed before it keeps its values: what the recorded operators wrote there is put back
    when the capture ends (memory they allocated keeps what they computed, where a GPU would
    hold garbage until the first replay)."""

    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph
        self.fresh: set[int] = set()  # storages the capture allocated
        self.saved: dict[int, tuple] = {}  # storage -> (storage, its bytes before the capture)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a value read back to the host during a graph capture (a device sync)")
        schema_args = func._schema.arguments
        inputs = {**dict(zip([a.name for a in schema_args], args, strict=False)), **kwargs}
        before = set()
        for a in schema_args:
            value = inputs.get(a.name)
            for t in tree_leaves(value):
                if not isinstance(t, torch.Tensor):
                    continue
                key = _storage_key(t)
                before.add(key)
                if (
                    a.alias_info is not None
                    and a.alias_info.is_write
                    and key not in self.fresh
                    and key not in self.saved
                ):
                    storage = t.untyped_storage()
                    self.saved[key] = (storage, torch.empty(0, dtype=torch.uint8).set_(storage.clone()))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in before:
                self.fresh.add(_storage_key(t))
        self.graph.ops.append((func, args, kwargs, out))
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        for storage, copy in self.saved.values():
            torch.empty(0, dtype=torch.uint8).set_(storage).copy_(copy)
        return result


class EmulatedGraphBackend:
    """GraphedBlocks' backend on the CPU: recorded operator sequences for graphs, no streams."""

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []

    def new_graph(self) -> RecordedGraph:
        graph = RecordedGraph()
        self.graphs.append(graph)
        return graph

    def new_pool(self):
        return None

    def capture(self, graph, pool, side):
        return _Recorder(graph)

    def side_stream(self, device):
        return None

    def on_side(self, side, protocol, fn):
        return fn()

    def rng_state(self, device):
        return torch.get_rng_state()
