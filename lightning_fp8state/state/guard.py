"""Concurrency guard: an owner not scoped by stream may be entered by one stream per event."""

from __future__ import annotations

import threading

import torch

from ..errors import ConcurrentEntryError
from .owner import OwnerKey

__all__ = ["ConcurrencyGuard", "current_stream_ident"]


def current_stream_ident(device: torch.device, stream: torch.cuda.Stream | None = None) -> tuple:
    """Who is entering: the current CUDA stream on a GPU (``stream``, when the caller already
    looked it up), the calling thread on the CPU."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device) if stream is None else stream
        return ("cuda", device.index, stream.cuda_stream)
    return ("thread", threading.get_ident())


class ConcurrencyGuard:
    """Tracks which stream holds each in-flight owner (recorded, not yet committed)."""

    def __init__(self) -> None:
        self._holder: dict[OwnerKey, tuple] = {}
        self._lock = threading.Lock()

    def enter(self, owner: OwnerKey, ident: tuple, *, stream_scoped: bool) -> None:
        """Claim ``owner`` for ``ident``.

        Raises:
            ConcurrentEntryError: another stream holds ``owner`` in this event.
        """
        with self._lock:
            holder = self._holder.setdefault(owner, ident)
        if holder != ident:
            hint = "" if stream_scoped else "; set ownership='per_layer_rank_stream' to give each stream its own state"
            raise ConcurrentEntryError(
                f"{owner} is in flight on {holder} and was entered from {ident}: two streams "
                f"must not advance one delayed-scaling state{hint}"
            )

    def release(self, owners) -> None:
        with self._lock:
            for owner in owners:
                self._holder.pop(owner, None)

    def clear(self) -> None:
        with self._lock:
            self._holder.clear()
