"""StateBank: one set of device tensors holding the delayed state of every owner."""

from __future__ import annotations

import threading

import torch

from .. import ops
from ..config import require_that
from ..errors import StateLoadError
from ..formats import state_format_fmax, state_format_name
from .owner import OwnerKey

__all__ = ["FrozenScales", "StateBank", "device_constant"]


def device_constant(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a small CPU tensor that never changes) on ``device``.

    Outside a capture this is a plain copy. While the current stream captures a CUDA graph (a
    step captured again after a fallback move meets an owner set no eager event has seen), CUDA
    refuses a pageable copy and pinning would allocate host memory mid-capture: the value is
    written instead by one captured fill per run of equal elements, so it holds from the
    graph's first replay on (``GraphedStep`` replays right after its capture).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
        return host.to(device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    flat, values = out.view(-1), host.reshape(-1).tolist()
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            flat[start:i].fill_(values[start])
            start = i
    return out


class FrozenScales:
    """A copy of every owner's scale and descale (and running center, where any owner is
    centered), taken once per event before any commit.

    Snapshots are views into it; nothing ever writes to it. Each value sits at the start
    of its own 16-byte cell (layout ``[2, n, 4]``) because cuBLASLt's FP8 GEMM wants
    16-byte-aligned scale pointers.
    """

    def __init__(self, scales: torch.Tensor, version: int, center: torch.Tensor | None = None) -> None:
        self.scales = scales  # [2, n, 4]: [0, i, 0] scale, [1, i, 0] descale
        self.version = version
        self.centers = center  # [n, C] or None
        self._views: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None

    def views(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Every owner's ``(scale views, descale views)``, by bank index."""
        return self._views or self._cells()

    def _cells(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        # every owner's scale and descale view, made in two calls on the event's first use
        # (one Python-level index per view and call cost more than the rest of a call's host work)
        if self._views is None:
            first = self.scales[:, :, 0]
            self._views = (first[0].unbind(0), first[1].unbind(0))
        return self._views

    def scale(self, index: int) -> torch.Tensor:
        return self._cells()[0][index]

    def descale(self, index: int) -> torch.Tensor:
        return self._cells()[1][index]

    def center(self, index: int, width: int) -> torch.Tensor:
        """The frozen center of owner ``index`` ([width], a contiguous view)."""
        return self.centers[index, :width]


class StateBank:
    """Contiguous per-owner state: ``amax_history [H, n]``, ``scale``/``descale [n]``
    (rows of one ``[2, n]`` buffer), ``amax_pending [n]``, ``nonfinite_count [n]``,
    ``fmax [n]``, ``saturation [2, n]`` (int64: elements clipped, elements quantized, added by
    the recording quantize kernels; only grows: the telemetry and the fallback read its growth),
    and the registry owner -> index, with each owner's format name
    (``e4m3``, ``e5m2``, ``nvfp4``, ``mxfp4``).

    Centered FP4 owners also keep a running center: ``center [n, C]`` (C = the widest
    centered owner; row ``i`` uses its first ``center_width[i]`` columns, other owners have
    width 0) and its pending statistics ``center_max``/``center_min [n, C]`` (``-inf``/``+inf``
    when nothing was recorded).

    All owners advance in one batched :func:`ops.update_scales` call (plus one
    :func:`ops.update_centers` call when any owner is centered). Owners register on first
    use; the tensors are reallocated then (at the first step), never on a steady step.
    """

    def __init__(self, history_len: int) -> None:
        self.history_len = history_len
        self.device: torch.device | None = None
        self.owners: list[OwnerKey] = []
        self.formats: list[str] = []
        self.center_width: list[int] = []
        self.index: dict[OwnerKey, int] = {}
        self.version = 0
        self._lock = threading.RLock()
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        # Owners with no delayed scale yet: registered and never committed since, or loaded
        # with an empty history. Kept on the host, so the protocol knows which calls may
        # calibrate (QuantConfig.initial_scale) without reading the device.
        self.fresh: set[int] = set()
        self._alloc(torch.device("cpu"), 0)

    @torch.inference_mode(False)  # an owner first seen in evaluation (inference_mode) stays trainable
    def _alloc(self, device: torch.device, n: int) -> None:
        f32 = {"dtype": torch.float32, "device": device}
        c = max(self.center_width, default=0)
        self.amax_history = torch.zeros(self.history_len, n, **f32)
        self.scales = torch.ones(2, n, **f32)
        self.amax_pending = torch.zeros(n, **f32)
        self.nonfinite_count = torch.zeros(n, dtype=torch.int32, device=device)
        self.saturation = torch.zeros(2, n, dtype=torch.int64, device=device)
        self.center = torch.zeros(n, c, **f32)
        self.center_max = torch.full((n, c), float("-inf"), **f32)
        self.center_min = torch.full((n, c), float("inf"), **f32)
        self.fmax = torch.tensor([state_format_fmax(f) for f in self.formats], **f32).reshape(n)

    @property
    def centered(self) -> bool:
        """Whether any owner keeps a running center."""
        return self.center.shape[1] > 0

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
            "saturation": self.saturation,
            "center": self.center,
            "center_max": self.center_max,
            "center_min": self.center_min,
        }

    @torch.inference_mode(False)
    def to(self, device: torch.device) -> None:
        """Move every tensor to ``device`` (the bank follows the first tensor it serves)."""
        with self._lock:
            for name, t in self._tensors().items():
                setattr(self, name, t.to(device))
            self.fmax = self.fmax.to(device)
            self.device = device
            self._masks.clear()
            self.version += 1

    def register(self, owner: OwnerKey, fmt, device: torch.device, center_width: int = 0) -> int:
        """Index of ``owner``, adding it (scale 1, empty history, center 0) if new.

        Args:
            owner: the owner key.
            fmt: its format: an FP8 format name or float8 dtype, or an FP4 layout name.
            device: where its data lives (one bank serves one device).
            center_width: channels of its running center (centered FP4 owners; 0 = none).
                An owner registered with a center keeps that width for good.

        Raises:
            ValueError: another device, or a centered owner entered with another width.
        """
        idx = self.index.get(owner)
        if idx is not None and self.device is not None and self.center_width[idx] == center_width:
            return idx
        with self._lock:
            if self.device is None:  # first use, possibly right after loading a checkpoint
                self.to(device)
            idx = self.index.get(owner)
            if idx is not None:
                require_that(
                    self.center_width[idx] == center_width,
                    f"{owner}: the channels of its running center",
                    center_width,
                    f"{self.center_width[idx]}, as before (one owner quantizes one operand shape)",
                )
                return idx
            require_that(
                self.device == device,
                f"{owner}: the device",
                device,
                f"{self.device}, where this state bank lives (one Fp8State serves one device)",
            )
            old = self._tensors()
            n = len(self.owners)
            self.owners.append(owner)
            self.formats.append(state_format_name(fmt))
            self.center_width.append(int(center_width))
            self._alloc(self.device, n + 1)
            for name, t in old.items():
                if t.dim() == 2 and name.startswith("center"):
                    getattr(self, name)[:n, : t.shape[1]].copy_(t)
                else:
                    getattr(self, name)[..., :n].copy_(t)
                if t.is_cuda:  # the copy may run on another stream than t's allocation
                    t.record_stream(torch.cuda.current_stream(t.device))
            self.index[owner] = n
            self.fresh.add(n)
            self._masks.clear()
            self.version += 1
            return n

    def freeze(self) -> FrozenScales:
        """One copy of all scales and descales (one device op; one more for the centers if
        any owner is centered), for this event's snapshots."""
        return FrozenScales(
            torch.nn.functional.pad(self.scales.unsqueeze(-1), (0, 3)),
            self.version,
            self.center.clone() if self.centered else None,
        )

    def freeze_into(self, frozen: FrozenScales) -> FrozenScales:
        """:meth:`freeze` into an earlier event's copy (same bank version): the copy a
        captured CUDA graph reads, refreshed for this event by one device op (two when
        centered). Only when no snapshot of that earlier event is read any more."""
        require_that(frozen.version == self.version, "frozen.version", frozen.version, f"the bank's {self.version}")
        frozen.scales.select(-1, 0).copy_(self.scales)
        if frozen.centers is not None:
            frozen.centers.copy_(self.center)
        return frozen

    def calibrate(
        self,
        index: int,
        x: torch.Tensor,
        scale: torch.Tensor,
        descale: torch.Tensor,
        margin: int,
        center: torch.Tensor | None = None,
    ) -> None:
        """Set one call's frozen ``scale``/``descale`` cells from ``x``'s own amax (of
        ``x - center`` for a centered owner): exactly what a commit computes from a one-entry
        history, by the same op (``fmax / amax / 2**margin``; the cells stay as they are when
        that amax is zero or non-finite, so a non-finite tensor calibrates nothing). For the
        first call of a fresh owner; on the tensor's device, no host sync; the bank itself is
        not touched (its scale advances at the commit, from the recorded amax, as always).
        """
        if x.numel() == 0:
            return
        self.calibrate_from_amax(index, self.amax_of(x, center), scale, descale, margin)

    @staticmethod
    def amax_of(x: torch.Tensor, center: torch.Tensor | None = None) -> torch.Tensor:
        """``max |x|`` (of ``x - center`` for a centered owner) as a float32 ``[1]`` tensor, on
        ``x``'s device (no host sync)."""
        with torch.no_grad():  # x may require grad (an attention operand): the scale must not
            lo, hi = torch.aminmax(x if center is None else x.float() - center)
            return torch.maximum(lo.abs(), hi.abs()).float().reshape(1)

    def calibrate_from_amax(
        self, index: int, amax: torch.Tensor, scale: torch.Tensor, descale: torch.Tensor, margin: int
    ) -> None:
        """:meth:`calibrate` from an amax already computed (``[1]``, float32): e.g. the MAX of
        the shards' amaxes of a weight sharded across ranks (FSDP), which is the full weight's."""
        with torch.no_grad():
            pending = amax.reshape(1)
            device = pending.device
            ops.update_scales(
                torch.zeros(1, 1, dtype=torch.float32, device=device),  # an empty one-entry history
                scale.view(1),
                descale.view(1),
                pending,
                torch.zeros(1, dtype=torch.int32, device=device),
                torch.ones(1, dtype=torch.bool, device=device),
                self.fmax[index : index + 1],
                "max",
                margin,
            )

    @torch.inference_mode(False)
    def mask(self, indices: tuple[int, ...]) -> torch.Tensor:
        """A device bool mask selecting ``indices`` (cached: the same set recurs every step)."""
        m = self._masks.get(indices)
        if m is None:
            m = torch.zeros(len(self.owners), dtype=torch.bool)
            m[list(indices)] = True
            m = self._masks[indices] = device_constant(m, self.device)
        return m

    def commit(self, indices: tuple[int, ...], amax_algo: str, margin: int, center_momentum: float = 1.0) -> None:
        """Advance the owners at ``indices`` by one event, all in one batched update (and
        their running centers in one more, if any owner is centered)."""
        if not indices:
            return
        self.fresh.difference_update(indices)
        mask = self.mask(indices)
        ops.update_scales(
            self.amax_history,
            self.scale,
            self.descale,
            self.amax_pending,
            self.nonfinite_count,
            mask,
            self.fmax,
            amax_algo,
            margin,
        )
        if self.centered:
            ops.update_centers(self.center, self.center_max, self.center_min, mask, center_momentum)

    def discard_pending(self, indices: tuple[int, ...]) -> None:
        """Forget the pending amax (and center statistics) of ``indices`` (an aborted event
        commits nothing)."""
        if indices:
            mask = self.mask(indices)
            self.amax_pending.masked_fill_(mask, 0.0)
            if self.centered:
                self.center_max.masked_fill_(mask.unsqueeze(1), float("-inf"))
                self.center_min.masked_fill_(mask.unsqueeze(1), float("inf"))

    # -- checkpoint ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Owners, their format names, and every state tensor (host copies).

        ``center_width`` and the ``center*`` tensors were added with state format 2; a
        format-1 bank (no centered owners, FP8 formats only) omits them.
        """
        return {
            "owners": [o.as_list() for o in self.owners],
            "dtypes": list(self.formats),
            "center_width": list(self.center_width),
            "amax_history": self.amax_history.detach().cpu().clone(),
            "scale": self.scale.detach().cpu().clone(),
            "descale": self.descale.detach().cpu().clone(),
            "amax_pending": self.amax_pending.detach().cpu().clone(),
            "nonfinite_count": self.nonfinite_count.detach().cpu().clone(),
            "center": self.center.detach().cpu().clone(),
            "center_max": self.center_max.detach().cpu().clone(),
            "center_min": self.center_min.detach().cpu().clone(),
        }

    @staticmethod
    def validate_state_dict(sd: dict, history_len: int) -> tuple[list[OwnerKey], list[str], list[int]]:
        """Check a saved bank without touching any live state; returns its owners, their
        format names and center widths (all 0 for a format-1 bank)."""
        try:
            owners = [OwnerKey.from_list(o) for o in sd["owners"]]
            formats = [state_format_name(name) for name in sd["dtypes"]]
            widths = [int(w) for w in sd.get("center_width", [0] * len(owners))]
        except (KeyError, TypeError, ValueError) as exc:
            raise StateLoadError(f"saved state bank is corrupt: bad owners, dtypes or center widths ({exc})") from exc
        n = len(owners)
        if len(formats) != n or len(widths) != n or len(set(owners)) != n:
            raise StateLoadError(
                f"saved state bank is corrupt: {n} owners, {len(formats)} dtypes, {len(widths)} center widths, "
                "or duplicate owners"
            )
        if any(w < 0 for w in widths):
            raise StateLoadError("saved state bank is corrupt: a negative center width")
        c = max(widths, default=0)
        expect = {
            "amax_history": ((history_len, n), torch.float32),
            "scale": ((n,), torch.float32),
            "descale": ((n,), torch.float32),
            "amax_pending": ((n,), torch.float32),
            "nonfinite_count": ((n,), torch.int32),
        }
        if "center_width" in sd:
            expect |= {name: ((n, c), torch.float32) for name in ("center", "center_max", "center_min")}
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
        if "center" in expect and not bool(torch.isfinite(sd["center"]).all()):
            raise StateLoadError("saved state bank is corrupt: 'center' holds non-finite values")
        return owners, formats, widths

    def load_state_dict(self, sd: dict) -> None:
        """Replace the bank by a saved one; the live owners, if any, must be the same set
        (with the same formats and center widths)."""
        owners, formats, widths = self.validate_state_dict(sd, self.history_len)
        if self.owners and set(self.owners) != set(owners):
            missing = sorted(map(str, set(self.owners) - set(owners)))[:5]
            extra = sorted(map(str, set(owners) - set(self.owners)))[:5]
            raise StateLoadError(
                "saved quantizer state belongs to a different model or world size: "
                f"owners only live here {missing}, owners only in the checkpoint {extra}"
            )
        if self.owners:
            live = {o: (f, w) for o, f, w in zip(self.owners, self.formats, self.center_width, strict=True)}
            saved = {o: (f, w) for o, f, w in zip(owners, formats, widths, strict=True)}
            differ = sorted(str(o) for o in owners if live[o] != saved[o])[:5]
            if differ:
                raise StateLoadError(
                    f"saved quantizer state quantizes {differ} with another format or center width than this model does"
                )
        with self._lock:
            device = self.device or torch.device("cpu")
            self.owners, self.formats, self.center_width = list(owners), list(formats), list(widths)
            self.index = {o: i for i, o in enumerate(owners)}
            recorded = (sd["amax_history"] != 0).any(dim=0).tolist()  # the saved (host) copy
            self.fresh = {i for i, r in enumerate(recorded) if not r}
            self._alloc(device, len(owners))
            self.amax_history.copy_(sd["amax_history"])
            self.scale.copy_(sd["scale"])
            self.descale.copy_(sd["descale"])
            self.amax_pending.copy_(sd["amax_pending"])
            self.nonfinite_count.copy_(sd["nonfinite_count"])
            if "center_width" in sd:
                self.center.copy_(sd["center"])
                self.center_max.copy_(sd["center_max"])
                self.center_min.copy_(sd["center_min"])
            self._masks.clear()
            self.version += 1
