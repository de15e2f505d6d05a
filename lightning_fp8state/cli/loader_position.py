"""Where the data continues when a run resumes on another world size: the loader position
Lightning saved (batches per rank) mapped to the new number of ranks, never skipping a sample."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoaderPosition", "carry_loader_position", "loader_consumed", "map_loader_position"]


@dataclass(frozen=True)
class LoaderPosition:
    """Where the data continues on another world size: each rank's loader skips ``batches``
    batches; ``sample`` is the first global sample the resumed run reads, ``done`` the samples the
    saved run had read (``repeated = done - sample`` are read again)."""

    batches: int
    sample: int
    done: int

    @property
    def repeated(self) -> int:
        return self.done - self.sample

    def describe(self) -> str:
        if not self.repeated:
            return f"the data continues at sample {self.sample} (none repeated or skipped)"
        return (
            f"the data cannot continue at sample {self.done} on this world size (it is not a whole number of "
            f"batches per rank): it continues at sample {self.sample}, and {self.repeated} sample(s) are read again"
        )


def map_loader_position(consumed: int, saved_world: int, world: int, batch_size: int) -> LoaderPosition:
    """The loader position on ``world`` ranks of one that had ``consumed`` batches on each of
    ``saved_world`` ranks.

    Every rank reads every ``world``-th sample of the epoch's order (Lightning's distributed
    sampler), so after ``k`` batches of ``batch_size`` the ranks together have read exactly the
    epoch's first ``k * batch_size * world`` samples. The saved run read ``consumed * batch_size *
    saved_world``; the resumed ranks skip ``consumed * saved_world // world`` batches each, which
    is that position exactly when it divides, else the whole batch before it (a few samples are
    read again; none is skipped)."""
    done = consumed * saved_world * batch_size
    batches = consumed * saved_world // world
    return LoaderPosition(batches=batches, sample=batches * world * batch_size, done=done)


def loader_consumed(ckpt: dict) -> int | None:
    """The batches each rank's loader had read (``ResumableLoader``'s state in Lightning's fit
    loop), or None when the checkpoint holds no such state."""
    try:
        states = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        return int(states[0]["consumed"]) if len(states) == 1 else None
    except (KeyError, TypeError, IndexError, ValueError):
        return None


def carry_loader_position(checkpoint: dict, world: int, batch_size: int):
    """Rewrite the saved loader position (batches per rank) for ``world`` ranks, in place, before
    Lightning restores its loops; the :class:`LoaderPosition`, or
    None where the checkpoint holds no loader position (the loader then starts the epoch again)."""
    consumed = loader_consumed(checkpoint)
    saved_world = int(checkpoint["fp8state"]["world_size"])
    if consumed is None:
        return None
    position = map_loader_position(consumed, saved_world, world, batch_size)
    checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] = position.batches
    return position
