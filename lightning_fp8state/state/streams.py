"""StreamOrder: device-side ordering of state-bank accesses across CUDA streams.

With one stream (the usual case) CUDA orders everything by itself and this does nothing.
Once a second stream enters (stream ownership: sub-batches on several streams), bank
accesses from different streams would race: a scale update on one stream and the next
event's frozen copy on another, a reallocation at registration and an amax record still
queued on another stream. The rule, with no host synchronization:

- a structural change (register an owner, freeze the scales, commit, discard) first waits
  for all work queued so far on every other stream that touched the bank;
- a use (quantize, record an amax, read a snapshot) waits for the stream of the last
  structural change, and marks the shared tensors as used by its stream for the allocator.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["StreamOrder"]


class StreamOrder:
    """Orders bank accesses across the CUDA streams that entered (see the module doc)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self._struct: torch.cuda.Stream | None = None
        self._lock = threading.Lock()
        # (device, stream handle) -> the stream it stands for: a CUDA-graph capture (or its
        # warm-up) runs on a side stream on behalf of the training stream (graphs.py)
        self._alias: dict[tuple[int, int], torch.cuda.Stream] = {}
        # Whether more than one CUDA stream has touched the bank (an attribute: callers on every
        # quantize test it before calling use())
        self.active = False

    def alias(self, stream: torch.cuda.Stream, as_stream: torch.cuda.Stream) -> None:
        """Treat work on ``stream`` as work of ``as_stream`` (one entrant, not a second stream)."""
        with self._lock:
            self._alias[(stream.device_index, stream.cuda_stream)] = as_stream

    def unalias(self, stream: torch.cuda.Stream) -> None:
        with self._lock:
            self._alias.pop((stream.device_index, stream.cuda_stream), None)

    def resolve(self, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """The stream ``stream`` stands for (itself unless aliased)."""
        if not self._alias:
            return stream
        return self._alias.get((stream.device_index, stream.cuda_stream), stream)

    def _current(self, device: torch.device | None, stream: torch.cuda.Stream | None = None):
        """The current stream (registered under the stream it stands for)."""
        if device is None or device.type != "cuda":
            return None
        if stream is None:
            stream = torch.cuda.current_stream(device)
        entrant = self.resolve(stream)
        key = (entrant.device_index, entrant.cuda_stream)
        if key not in self._streams:
            with self._lock:
                self._streams.setdefault(key, entrant)
                self.active = len(self._streams) > 1
        return stream

    def enter(self, device: torch.device | None, stream: torch.cuda.Stream | None = None) -> None:
        """Note the stream a call enters on (a new stream makes the ordering active);
        ``stream``: the current stream of ``device`` when the caller already has it."""
        self._current(device, stream)

    def structural(self, device: torch.device | None) -> None:
        """Call right before a structural change of the bank on the current stream."""
        cur = self._current(device)
        if cur is None:
            return
        entrant = self.resolve(cur)
        if self.active:
            for key, stream in list(self._streams.items()):
                if key != (entrant.device_index, entrant.cuda_stream):
                    cur.wait_stream(stream)
        self._struct = entrant

    def use(self, device: torch.device | None, *shared: torch.Tensor) -> None:
        """Call right before reading or writing bank (or frozen) tensors on the current stream."""
        if not self.active or device is None or device.type != "cuda":
            return
        cur = torch.cuda.current_stream(device)
        struct = self._struct
        if struct is not None and struct.cuda_stream != self.resolve(cur).cuda_stream:
            cur.wait_stream(struct)
            for t in shared:
                if t.is_cuda:
                    t.record_stream(cur)
