"""AmaxReducer: one collective that combines every owner's pending amax across data-parallel ranks.

Right before a batched commit, the whole pending-amax vector of the bank is all-reduced with
MAX in one call; only owners that are being committed *and* whose role is configured
``data_parallel`` take the reduced value (a cached device mask and ``torch.where``). NaN is
mapped to +inf first, so a non-finite amax on any rank stays non-finite everywhere and the
event is counted as non-finite on every rank instead of vanishing in the MAX.

The vector is combined index by index, so every rank must register the same owners in the
same order. A fingerprint of the registry rides in the same collective; whenever the local
registry changed, the reduced fingerprint is read back (one host sync, at the first steps
only) and compared: ranks that disagree raise :class:`OwnerAlignmentError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import OwnerAlignmentError
from .bank import StateBank, device_constant

__all__ = ["AmaxReducer"]

_HEADER = 4  # owner count and three 20-bit pieces of the registry hash: exact in float32


def registry_fingerprint(bank: StateBank) -> list[int]:
    """``[n, h0, h1, h2]``: the owner count and a hash of (layer, role, stream, site, format)
    in index order. The rank is left out: it differs between ranks by design."""
    desc = repr([(o.layer, o.role, o.stream, o.site, f) for o, f in zip(bank.owners, bank.formats, strict=True)])
    h = int.from_bytes(hashlib.sha256(desc.encode()).digest()[:8], "little")
    return [len(bank.owners), h & 0xFFFFF, (h >> 20) & 0xFFFFF, (h >> 40) & 0xFFFFF]


class AmaxReducer:
    """MAX-reduces pending amaxes of the roles configured ``data_parallel``.

    Args:
        reduction_of: role -> ``"none"`` | ``"data_parallel"`` (``QuantConfig.reduction_of``).
        group: the data-parallel process group (``None``: the default group).
        device: where the collective's buffer lives (defaults to the bank's device); NCCL
            needs a CUDA device, gloo takes CPU tensors.

    Every rank must call :meth:`reduce` at the same commit points (the protocol does so
    deterministically: at ``commit_forward`` and at the event's end, whenever a role of
    that phase reduces).
    """

    def __init__(
        self,
        reduction_of: Callable[[str], str],
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("AmaxReducer needs an initialized torch.distributed process group")
        self.reduction_of = reduction_of
        self.group = group
        self.device = device
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.collectives = 0  # how many all-reduces ran (tests, telemetry)
        self._version: int | None = None  # bank version the caches below belong to
        self._verified: int | None = None  # bank version whose alignment was checked
        self._header: torch.Tensor | None = None
        self._role_mask: torch.Tensor | None = None
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def reduces(self, role: str) -> bool:
        return self.reduction_of(role) == "data_parallel"

    def _device(self, bank: StateBank) -> torch.device:
        return bank.device or self.device or torch.device("cpu")

    def _prepare(self, bank: StateBank) -> None:
        if self._version == bank.version:
            return
        device = self._device(bank)
        fp = registry_fingerprint(bank)
        self._header = device_constant(torch.tensor(fp + [-v for v in fp], dtype=torch.float32), device)
        self._role_mask = device_constant(
            torch.tensor([self.reduces(o.role) for o in bank.owners], dtype=torch.bool), device
        )
        self._masks = {}
        self._version = bank.version

    def _mask(self, bank: StateBank, indices: tuple[int, ...]) -> torch.Tensor:
        m = self._masks.get(indices)
        if m is None:
            m = self._masks[indices] = bank.mask(indices) & self._role_mask
        return m

    def reduce(self, bank: StateBank, indices: tuple[int, ...]) -> None:
        """All-reduce (MAX) the pending amaxes; owners at ``indices`` with a reducing role
        take the group's value. One collective, no host sync once the registry is stable.

        Raises:
            OwnerAlignmentError: the ranks' registries differ (checked whenever this rank's
                registry changed since the last check).
        """
        self._prepare(bank)
        n = len(bank)
        device = self._device(bank)
        buf = torch.empty(2 * _HEADER + n, dtype=torch.float32, device=device)
        buf[: 2 * _HEADER].copy_(self._header)
        pending = bank.amax_pending
        if n:
            buf[2 * _HEADER :].copy_(torch.where(torch.isnan(pending), torch.inf, pending))
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        self.collectives += 1
        if self._verified != bank.version:
            self._verify(buf[: 2 * _HEADER], bank)
            self._verified = bank.version
        if indices:
            mask = self._mask(bank, indices)
            pending.copy_(torch.where(mask, buf[2 * _HEADER :], pending))

    def _verify(self, reduced: torch.Tensor, bank: StateBank) -> None:
        got = reduced.cpu()
        high, low = got[:_HEADER], -got[_HEADER:]
        local = self._header[:_HEADER].cpu()
        if torch.equal(high, low) and torch.equal(high, local):
            return
        count = f"{int(low[0])}..{int(high[0])}" if low[0] != high[0] else str(int(high[0]))
        first = ", ".join(str(o) for o in bank.owners[:4])
        raise OwnerAlignmentError(
            f"rank {self.rank}: the data-parallel ranks registered different quantizer owners "
            f"(owner counts across the group: {count}; this rank has {len(bank)}: {first}"
            f"{', ...' if len(bank) > 4 else ''}), or the same owners in another order, so their "
            "amaxes cannot be reduced index by index. Every rank must run the same converted layers "
            "in the same order each event (same model, no rank- or data-dependent branches around "
            "them); or set QuantConfig(amax_reduction='none') to keep per-rank state"
        )
