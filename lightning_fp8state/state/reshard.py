"""The quantizer state of N saved ranks mapped onto M ranks: a resume on another world size.

Each rank saves its own :class:`~lightning_fp8state.fp8state.Fp8State` (bank, clock, ledger).
An owner is identified across ranks by (layer, role, stream, site): the rank is what differs.
For each identity the saved ranks' bank columns are compared bit for bit:

- **copied**: every saved rank holds the owner and the same bytes in every state tensor (its
  amax was all-reduced each event, or it saw the same data on every rank, as a replicated
  weight does). Each new rank gets that column unchanged: the mapping is exact.
- **merged**: the ranks differ (no reduction, per-stream owners, an owner some ranks never
  registered). ``QuantConfig.world_size_merge`` says what happens: ``refuse`` raises
  :class:`WorldSizeMergeError` naming them; ``max`` gives every new rank one merged column:
  the amax history is the elementwise maximum over the ranks (the history a MAX all-reduce of
  the amax in every event would have built, when the ranks committed the same events), and
  scale, descale and the running center are those of the rank whose scale is smallest (the
  largest amax: the scale that merged history gives); the pending amax, the non-finite count
  and the center's running maximum take the maximum, its running minimum the minimum.

The clock (the last logical event, which every snapshot stamp continues from) must be the same
on every saved rank and carries over; the ledger's totals per owner take the maximum over the
ranks (equal for owners committed in every event). The mapping is a pure function of the saved
states: nothing live is read or changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config import WORLD_SIZE_MERGES, require_choice, require_int
from ..errors import StateLoadError

__all__ = ["ReshardReport", "WorldSizeMergeError", "plan_reshard", "reshard_state", "reshard_states"]

# scopes whose owner keys carry the rank: the mapped keys carry the new rank
_RANKED_SCOPES = ("per_layer_rank", "per_layer_rank_stream")
# bank tensors with one column (or row) per owner; the history is [H, n], the others [n, ...]
_PER_OWNER = ("scale", "descale", "amax_pending", "nonfinite_count", "center", "center_max", "center_min")


class WorldSizeMergeError(StateLoadError):
    """A resume on another world size that the ownership configuration does not allow."""


def _identity(owner: list) -> tuple:
    """(layer, role, stream, site): an owner across ranks."""
    return (str(owner[0]), str(owner[1]), int(owner[3]), int(owner[4]))


def _name(identity: tuple) -> str:
    layer, role, stream, site = identity
    return f"{layer}#{site}.{role}" + (f"/stream{stream}" if stream else "")


def _roles(names: tuple[str, ...]) -> str:
    """The roles among owner names (``layer#site.role[/streamN]``), sorted: ``grad_output, input``."""
    return ", ".join(sorted({n.split("/", 1)[0].rsplit(".", 1)[1] for n in names})) or "none"


@dataclass(frozen=True)
class ReshardReport:
    """What a mapping of ``saved_world`` ranks onto ``world`` did, owner by owner."""

    saved_world: int
    world: int
    rule: str
    copied: tuple[str, ...]
    merged: tuple[str, ...]

    def line(self) -> str:
        """One line for the log: the world sizes, and which owners (by role; every name is in
        :meth:`to_dict`) were copied and merged."""
        merged = (
            f"{len(self.merged)} merged by quant.world_size_merge={self.rule} (roles {_roles(self.merged)}: they "
            "differed per rank; elementwise max of the amax histories)"
            if self.merged
            else "none merged"
        )
        return (
            f"lightning_fp8state: resuming the quantizer state of {self.saved_world} rank(s) on {self.world}: "
            f"{len(self.copied)} owner(s) copied bitwise (roles {_roles(self.copied)}: the same on every saved rank), "
            f"{merged}"
        )

    def to_dict(self) -> dict:
        """Plain values (``provenance.json``)."""
        return {
            "saved_world_size": self.saved_world,
            "world_size": self.world,
            "world_size_merge": self.rule,
            "copied": list(self.copied),
            "merged": list(self.merged),
        }


def _ranks_in_order(ranks: Mapping, saved_world: int) -> list[dict]:
    keys = sorted(int(r) for r in ranks)
    if keys != list(range(saved_world)):
        raise StateLoadError(
            f"the checkpoint's quantizer state is corrupt: it says {saved_world} rank(s) but holds ranks {keys}"
        )
    by_int = {int(r): sd for r, sd in ranks.items()}
    out = [by_int[r] for r in keys]
    for r, sd in enumerate(out):
        if not isinstance(sd, Mapping) or not all(k in sd for k in ("config", "bank", "clock", "ledger")):
            raise StateLoadError(f"the checkpoint's quantizer state of rank {r} is corrupt: not an Fp8State state")
    return out


def _check_alike(states: list[dict]) -> None:
    """The same configuration, clock and converted layers on every saved rank."""
    first = states[0]
    for r, sd in enumerate(states[1:], start=1):
        for key in ("config", "clock", "converted_layers", "format_version"):
            if sd.get(key) != first.get(key):
                raise StateLoadError(
                    f"the checkpoint's quantizer state differs between rank 0 and rank {r} in {key!r} "
                    f"({first.get(key)!r} vs {sd.get(key)!r}): the ranks did not save the same logical event; "
                    "the checkpoint cannot be resumed on another world size"
                )


def _check_fallback_alike(states: list[dict]) -> None:
    """The fallback's moves (QuantConfig.fallback) on every saved rank: decided from flags reduced
    over the ranks, so equal on each; ranks that disagree did not save one run's state."""
    moves = [(sd.get("fallback") or {}).get("events") for sd in states]
    for r, m in enumerate(moves[1:], start=1):
        if m != moves[0]:
            raise StateLoadError(
                f"the checkpoint's quantizer state differs between rank 0 and rank {r} in 'fallback' moves "
                f"({moves[0]!r} vs {m!r}): the checkpoint cannot be resumed on another world size"
            )


def _mapped_fallback(states: list[dict]) -> dict | None:
    """The fallback's state for every new rank: the saved moves, each layer's streak of saturated
    events the longest any rank saw (equal where the flags were reduced)."""
    first = states[0].get("fallback")
    if first is None:
        return None
    streaks: dict[str, int] = {}
    for sd in states:
        for layer, n in sd["fallback"]["streaks"].items():
            streaks[layer] = max(streaks.get(layer, 0), int(n))
    return dict(first, streaks=streaks)


def _columns(states: list[dict]) -> dict[tuple, dict[int, int]]:
    """identity -> {saved rank: column in that rank's bank}, identities in first-seen order."""
    found: dict[tuple, dict[int, int]] = {}
    for r, sd in enumerate(states):
        try:
            owners = sd["bank"]["owners"]
            for i, owner in enumerate(owners):
                found.setdefault(_identity(owner), {})[r] = i
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise StateLoadError(f"the checkpoint's quantizer state of rank {r} is corrupt ({exc!r})") from None
    return found


def _column(bank: dict, i: int) -> dict[str, torch.Tensor]:
    col = {"amax_history": bank["amax_history"][:, i]}
    col |= {k: bank[k][i] for k in _PER_OWNER if k in bank}
    return col


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _same(cols: list[dict[str, torch.Tensor]]) -> bool:
    """Bitwise equal in every tensor (bytes compared: -0.0 and NaN patterns count)."""
    first = cols[0]
    return all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))
        for c in cols[1:]
        for a, b in ((first[k], c[k]) for k in first)
    )


def _merge(cols: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The ``max`` rule (module docstring): elementwise max of the histories; scale, descale
    and center of the rank with the smallest scale; max of the pending amax, the non-finite
    count and the center's maximum, min of its minimum."""
    pick = min(range(len(cols)), key=lambda r: (float(cols[r]["scale"]), r))
    out = {
        "amax_history": torch.stack([c["amax_history"] for c in cols]).amax(dim=0),
        "scale": cols[pick]["scale"].clone(),
        "descale": cols[pick]["descale"].clone(),
        "amax_pending": torch.stack([c["amax_pending"] for c in cols]).amax(dim=0),
        "nonfinite_count": torch.stack([c["nonfinite_count"] for c in cols]).amax(dim=0),
    }
    if "center" in cols[0]:
        out["center"] = cols[pick]["center"].clone()
        out["center_max"] = torch.stack([c["center_max"] for c in cols]).amax(dim=0)
        out["center_min"] = torch.stack([c["center_min"] for c in cols]).amin(dim=0)
    return out


def _classify(states: list[dict], columns: dict[tuple, dict[int, int]]) -> tuple[list[tuple], list[tuple]]:
    copied, merged = [], []
    n = len(states)
    for ident, where in columns.items():
        banks = [states[r]["bank"] for r in where]
        kinds = {
            (b["dtypes"][i], int(b.get("center_width", [0] * len(b["owners"]))[i]))
            for b, i in zip(banks, where.values(), strict=True)
        }
        if len(kinds) > 1:
            raise StateLoadError(
                f"the checkpoint's quantizer state is corrupt: owner {_name(ident)} has another format or center "
                f"width on different ranks ({sorted(kinds)})"
            )
        cols = [_column(states[r]["bank"], i) for r, i in where.items()]
        (copied if len(where) == n and _same(cols) else merged).append(ident)
    return copied, merged


def plan_reshard(ranks: Mapping, world: int, rule: str) -> ReshardReport:
    """Which owners a mapping of the saved ``ranks`` onto ``world`` ranks copies and merges.

    Args:
        ranks: saved rank -> Fp8State state dict (``checkpoint["fp8state"]["ranks"]``).
        world: the new world size.
        rule: ``QuantConfig.world_size_merge`` (``max`` | ``refuse``).

    Raises:
        WorldSizeMergeError: owners differ per rank and ``rule`` is ``refuse``.
        StateLoadError: the saved states are corrupt or not of one logical event.
    """
    require_int("world_size", world, 1)
    require_choice("world_size_merge", rule, WORLD_SIZE_MERGES)
    states = _ranks_in_order(ranks, len(ranks))
    _check_alike(states)
    _check_fallback_alike(states)
    copied, merged = _classify(states, _columns(states))
    report = ReshardReport(len(states), world, rule, tuple(map(_name, copied)), tuple(map(_name, merged)))
    if merged and rule == "refuse":
        shown = ", ".join(report.merged[:3]) + (f" and {len(merged) - 3} more" if len(merged) > 3 else "")
        raise WorldSizeMergeError(
            f"the quantizer state of {len(states)} rank(s) cannot be mapped onto {world}: {len(merged)} owner(s) differ "
            f"per rank ({shown}) and quant.world_size_merge=refuse forbids merging them; pass "
            f"quant.world_size_merge=max to merge them (elementwise max of the amax histories), or resume with "
            f"{len(states)} rank(s)"
        )
    return report


def _mapped_bank(states: list[dict], columns: dict, merged: set, rank: int, ranked: bool) -> dict:
    first = states[0]["bank"]
    owners, dtypes, widths, cols = [], [], [], []
    for ident, where in columns.items():
        r0, i0 = next(iter(where.items()))
        bank = states[r0]["bank"]
        layer, role, stream, site = ident
        owners.append([layer, role, rank if ranked else int(bank["owners"][i0][2]), stream, site])
        dtypes.append(bank["dtypes"][i0])
        widths.append(int(bank.get("center_width", [0] * len(bank["owners"]))[i0]))
        source = [_column(states[r]["bank"], i) for r, i in where.items()]
        cols.append(_merge(source) if ident in merged else {k: v.clone() for k, v in source[0].items()})
    h = first["amax_history"].shape[0]
    out = {"owners": owners, "dtypes": dtypes}
    if "center_width" in first:
        out["center_width"] = widths
    out["amax_history"] = (
        torch.stack([c["amax_history"] for c in cols], dim=1) if cols else first["amax_history"].new_zeros((h, 0))
    )
    for key in _PER_OWNER:
        if key in first:
            out[key] = torch.stack([c[key] for c in cols]) if cols else first[key][:0].clone()
    return out


def _mapped_ledger(states: list[dict], rank: int, ranked: bool) -> dict:
    """Per owner identity, the largest of the ranks' commit and observation totals."""
    totals: dict[tuple, list] = {}
    for sd in states:
        led = sd["ledger"]
        for owner, c, o in zip(led["owners"], led["commits"], led["observations"], strict=True):
            ident = _identity(owner)
            prev = totals.get(ident)
            keep_rank = int(owner[2])
            totals[ident] = [
                keep_rank,
                max(int(c), prev[1]) if prev else int(c),
                max(int(o), prev[2]) if prev else int(o),
            ]
    owners = [[i[0], i[1], rank if ranked else v[0], i[2], i[3]] for i, v in totals.items()]
    return {
        "owners": owners,
        "commits": [v[1] for v in totals.values()],
        "observations": [v[2] for v in totals.values()],
        "violations": max(int(sd["ledger"].get("violations", 0)) for sd in states),
    }


def reshard_states(ranks: Mapping, world: int, rule: str) -> tuple[dict[int, dict], ReshardReport]:
    """Every new rank's state: ``{rank: state dict}`` for ranks ``0 .. world-1``, and the report.

    Copied owners are bitwise the saved column; merged ones follow ``rule`` (module docstring).
    Raises as :func:`plan_reshard`.
    """
    report = plan_reshard(ranks, world, rule)
    return {r: _state_for(ranks, r, report) for r in range(world)}, report


def reshard_state(ranks: Mapping, world: int, rank: int, rule: str) -> tuple[dict, ReshardReport]:
    """The state new rank ``rank`` of ``world`` loads, and the report (see :func:`reshard_states`)."""
    require_int("rank", rank, 0, world - 1)
    report = plan_reshard(ranks, world, rule)
    return _state_for(ranks, rank, report), report


def _state_for(ranks: Mapping, rank: int, report: ReshardReport) -> dict:
    states = _ranks_in_order(ranks, len(ranks))
    columns = _columns(states)
    merged = {ident for ident in columns if _name(ident) in set(report.merged)}
    first = states[0]
    try:
        ranked = first["config"]["ownership"] in _RANKED_SCOPES
        return dict(
            first,
            rank=int(rank),
            bank=_mapped_bank(states, columns, merged, rank, ranked),
            ledger=_mapped_ledger(states, rank, ranked),
            clock=dict(first["clock"]),
            **({"fallback": _mapped_fallback(states)} if "fallback" in first else {}),
        )
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise StateLoadError(f"the checkpoint's quantizer state is corrupt: cannot map it ({exc!r})") from None
