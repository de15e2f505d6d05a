"""StateBank: one set of device tensors holding the delayed state of every owner."""

from __future__ import annotations

import threading

import torch

from .. import ops
from ..errors import StateLoadError
from ..formats import fp8_format
from .owner import OwnerKey

__all__ = ["FrozenScales", "StateBank"]


class FrozenScales:
    """A copy of every owner's scale and descale, taken once per event before any commit.

    Snapshots are views into it; nothing ever writes to it. Each value sits at the start
    of its own 16-byte cell (layout ``[2, n, 4]``) because cuBLASLt's FP8 GEMM wants
    16-byte-aligned scale pointers.
    """

    def __init__(self, scales: torch.Tensor, version: int) -> None:
        self.scales = scales  # [2, n, 4]: [0, i, 0] scale, [1, i, 0] descale
        self.version = version

    def scale(self, index: int) -> torch.Tensor:
        return self.scales[0, index, 0]

    def descale(self, index: int) -> torch.Tensor:
        return self.scales[1, index, 0]


class StateBank:
    """Contiguous per-owner state: ``amax_history [H, n]``, ``scale``/``descale [n]``
    (rows of one ``[2, n]`` buffer), ``amax_pending [n]``, ``nonfinite_count [n]``,
    ``fmax [n]``, and the registry owner -> index.

    All owners advance in one batched :func:`ops.update_scales` call. Owners register on
    first use; the tensors are reallocated then (at the first step), never on a steady step.
    """

    def __init__(self, history_len: int) -> None:
        self.history_len = history_len
        self.device: torch.device | None = None
        self.owners: list[OwnerKey] = []
        self.dtypes: list[torch.dtype] = []
        self.index: dict[OwnerKey, int] = {}
        self.version = 0
        self._lock = threading.RLock()
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._alloc(torch.device("cpu"), 0)

    def _alloc(self, device: torch.device, n: int) -> None:
        f32 = {"dtype": torch.float32, "device": device}
        self.amax_history = torch.zeros(self.history_len, n, **f32)
        self.scales = torch.ones(2, n, **f32)
        self.amax_pending = torch.zeros(n, **f32)
        self.nonfinite_count = torch.zeros(n, dtype=torch.int32, device=device)
        self.fmax = torch.tensor([fp8_format(d).max for d in self.dtypes], **f32).reshape(n)

    @property
    def scale(self) -> torch.Tensor:
        return self.scales[0]

    @property
    def descale(self) -> torch.Tensor:
        return self.scales[1]

    def __len__(self) -> int:
        return len(self.owners)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {
            "amax_history": self.amax_history,
            "scales": self.scales,
            "amax_pending": self.amax_pending,
            "nonfinite_count": self.nonfinite_count,
        }

    def to(self, device: torch.device) -> None:
        """Move every tensor to ``device`` (the bank follows the first tensor it serves)."""
        with self._lock:
            for name, t in self._tensors().items():
                setattr(self, name, t.to(device))
            self.fmax = self.fmax.to(device)
            self.device = device
            self._masks.clear()
            self.version += 1

    def register(self, owner: OwnerKey, dtype: torch.dtype, device: torch.device) -> int:
        """Index of ``owner``, adding it (scale 1, empty history) if new."""
        idx = self.index.get(owner)
        if idx is not None and self.device is not None:
            return idx
        with self._lock:
            if self.device is None:  # first use, possibly right after loading a checkpoint
                self.to(device)
            idx = self.index.get(owner)
            if idx is not None:
                return idx
            if self.device != device:
                raise ValueError(
                    f"{owner} is used on {device} but this state bank lives on {self.device}: "
                    "one Fp8State serves one device"
                )
            old = self._tensors()
            n = len(self.owners)
            self.owners.append(owner)
            self.dtypes.append(dtype)
            self._alloc(self.device, n + 1)
            for name, t in old.items():
                getattr(self, name)[..., :n].copy_(t)
                if t.is_cuda:  # the copy may run on another stream than t's allocation
                    t.record_stream(torch.cuda.current_stream(t.device))
            self.index[owner] = n
            self._masks.clear()
            self.version += 1
            return n

    def freeze(self) -> FrozenScales:
        """One copy of all scales and descales (one device op), for this event's snapshots."""
        return FrozenScales(torch.nn.functional.pad(self.scales.unsqueeze(-1), (0, 3)), self.version)

    def mask(self, indices: tuple[int, ...]) -> torch.Tensor:
        """A device bool mask selecting ``indices`` (cached: the same set recurs every step)."""
        m = self._masks.get(indices)
        if m is None:
            m = torch.zeros(len(self.owners), dtype=torch.bool)
            m[list(indices)] = True
            m = self._masks[indices] = m.to(self.device)
        return m

    def commit(self, indices: tuple[int, ...], amax_algo: str, margin: int) -> None:
        """Advance the owners at ``indices`` by one event, all in one batched update."""
        if not indices:
            return
        ops.update_scales(
            self.amax_history,
            self.scale,
            self.descale,
            self.amax_pending,
            self.nonfinite_count,
            self.mask(indices),
            self.fmax,
            amax_algo,
            margin,
        )

    def discard_pending(self, indices: tuple[int, ...]) -> None:
        """Forget the pending amax of ``indices`` (an aborted event commits nothing)."""
        if indices:
            self.amax_pending.masked_fill_(self.mask(indices), 0.0)

    # -- checkpoint ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "owners": [o.as_list() for o in self.owners],
            "dtypes": [fp8_format(d).name for d in self.dtypes],
            "amax_history": self.amax_history.detach().cpu().clone(),
            "scale": self.scale.detach().cpu().clone(),
            "descale": self.descale.detach().cpu().clone(),
            "amax_pending": self.amax_pending.detach().cpu().clone(),
            "nonfinite_count": self.nonfinite_count.detach().cpu().clone(),
        }

    @staticmethod
    def validate_state_dict(sd: dict, history_len: int) -> tuple[list[OwnerKey], list[torch.dtype]]:
        """Check a saved bank without touching any live state; returns its owners and dtypes."""
        try:
            owners = [OwnerKey.from_list(o) for o in sd["owners"]]
            dtypes = [fp8_format(name).dtype for name in sd["dtypes"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise StateLoadError(f"saved state bank is corrupt: bad owners or dtypes ({exc})") from exc
        n = len(owners)
        if len(dtypes) != n or len(set(owners)) != n:
            raise StateLoadError(f"saved state bank is corrupt: {n} owners, {len(dtypes)} dtypes, duplicates")
        expect = {
            "amax_history": ((history_len, n), torch.float32),
            "scale": ((n,), torch.float32),
            "descale": ((n,), torch.float32),
            "amax_pending": ((n,), torch.float32),
            "nonfinite_count": ((n,), torch.int32),
        }
        for name, (shape, dtype) in expect.items():
            t = sd.get(name)
            if not isinstance(t, torch.Tensor):
                raise StateLoadError(f"saved state bank is corrupt: '{name}' missing or not a tensor")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise StateLoadError(
                    f"saved state bank '{name}': expected shape {shape} and {dtype}, "
                    f"got {tuple(t.shape)} and {t.dtype} (history_len or owners differ?)"
                )
        for name in ("amax_history", "scale", "descale"):
            t = sd[name]
            if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
                raise StateLoadError(f"saved state bank is corrupt: '{name}' holds negative or non-finite values")
        if bool((sd["scale"] <= 0).any()):
            raise StateLoadError("saved state bank is corrupt: 'scale' holds a zero")
        return owners, dtypes

    def load_state_dict(self, sd: dict) -> None:
        """Replace the bank by a saved one; the live owners, if any, must be the same set."""
        owners, dtypes = self.validate_state_dict(sd, self.history_len)
        if self.owners and set(self.owners) != set(owners):
            missing = sorted(map(str, set(self.owners) - set(owners)))[:5]
            extra = sorted(map(str, set(owners) - set(self.owners)))[:5]
            raise StateLoadError(
                "saved quantizer state belongs to a different model or world size: "
                f"owners only live here {missing}, owners only in the checkpoint {extra}"
            )
        with self._lock:
            device = self.device or torch.device("cpu")
            self.owners, self.dtypes = list(owners), list(dtypes)
            self.index = {o: i for i, o in enumerate(owners)}
            self._alloc(device, len(owners))
            self.amax_history.copy_(sd["amax_history"])
            self.scale.copy_(sd["scale"])
            self.descale.copy_(sd["descale"])
            self.amax_pending.copy_(sd["amax_pending"])
            self.nonfinite_count.copy_(sd["nonfinite_count"])
            self._masks.clear()
            self.version += 1
