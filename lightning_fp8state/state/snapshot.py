"""QuantSnapshot: the frozen scale/descale (and center) one call used, stamped with whose it is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import StaleSnapshotError
from .owner import OwnerKey

__all__ = ["QuantSnapshot"]

_new, _set = object.__new__, object.__setattr__


@dataclass(frozen=True, eq=False)
class QuantSnapshot:
    """Metadata paired with one quantized tensor.

    ``scale`` and ``descale`` (and ``center``, for the centered FP4 variant) are views of a
    copy taken before any state advanced in the event; nothing writes to that copy, so a
    snapshot never changes after it is taken. Under a stateless recipe (``fp8_current``,
    ``fp8_rowwise``) they are the call's own, derived from its tensor (with ``amax``). Their
    shape is the recipe's :class:`~lightning_fp8state.formats.ScaleLayout` for the role
    (``Recipe.scale_layout``): the snapshot carries the tensors, the recipe says how they
    cover the data. Consumers call :meth:`expect` before reading it.
    """

    owner: OwnerKey
    step: int | None  # None outside any event (inference)
    microbatch: int | None
    region: tuple | None  # checkpoint region key, None outside regions
    ordinal: int  # call ordinal of the layer inside the region (or event)
    dtype: torch.dtype  # storage dtype of the quantized data (torch.uint8 for packed FP4)
    scale: torch.Tensor
    descale: torch.Tensor
    layout: str | None = None  # FP4 block layout ("nvfp4" | "mxfp4"); None for FP8
    center: torch.Tensor | None = None  # centered FP4: the running center [channels]
    amax: torch.Tensor | None = None  # stateless recipes: the amax(es) this call's scale came from

    @classmethod
    def stamped(
        cls, owner, step, microbatch, region, ordinal, dtype, scale, descale, layout=None, center=None
    ) -> QuantSnapshot:
        """``cls(owner, step, ..., center)`` (``amax`` None), built with one attribute write
        instead of the frozen dataclass's one per field: the protocol makes one per operand of
        every true-forward call. The same object in every respect (fields, frozenness, repr)."""
        snap = _new(cls)
        _set(
            snap,
            "__dict__",
            {
                "owner": owner,
                "step": step,
                "microbatch": microbatch,
                "region": region,
                "ordinal": ordinal,
                "dtype": dtype,
                "scale": scale,
                "descale": descale,
                "layout": layout,
                "center": center,
                "amax": None,
            },
        )
        return snap

    def with_scales(self, scale: torch.Tensor, descale: torch.Tensor, amax: torch.Tensor) -> QuantSnapshot:
        """``dataclasses.replace(self, scale=..., descale=..., amax=...)`` with one attribute
        write (replace reads the fields' definitions on every call): a stateless recipe's
        snapshot, made at every call of every operand, recompute and backward included."""
        snap = _new(type(self))
        _set(snap, "__dict__", {**self.__dict__, "scale": scale, "descale": descale, "amax": amax})
        return snap

    @property
    def event(self) -> tuple[int, int] | None:
        return None if self.step is None else (self.step, self.microbatch)

    def expect(
        self,
        *,
        owner: OwnerKey | None = None,
        event: tuple[int, int] | None = None,
        layer: str | None = None,
        role: str | None = None,
    ) -> QuantSnapshot:
        """Assert this snapshot belongs to the consumer; returns ``self``.

        Raises:
            StaleSnapshotError: a stamp differs from what the consumer expects.
        """
        checks = (
            ("owner", owner, self.owner),
            ("event", event, self.event),
            ("layer", layer, self.owner.layer),
            ("role", role, self.owner.role),
        )
        for name, want, have in checks:
            if want is not None and want is not have and want != have:
                raise StaleSnapshotError(
                    f"snapshot {name} mismatch: the consumer expects {want!r} but the snapshot "
                    f"belongs to {have!r} (snapshot of {self.owner} at event {self.event}); "
                    "a consumer must read the snapshot paired with its data, never another call's"
                )
        return self
