"""Token data: a seeded Markov source with learnable structure, or a user's text / token file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..config import require_choice
from ..errors import ConfigError

__all__ = ["DATA_SOURCES", "MarkovTokens", "ResumableLoader", "TokenFile", "make_dataset"]

# markov: generated, seeded; text: a UTF-8 file, bytes as tokens; bin: a uint16 token memmap
DATA_SOURCES = ("markov", "text", "bin")


class MarkovTokens(Dataset):
    """Sequences from a random sparse Markov chain: each token has ``branching`` equally
    likely successors, so the best achievable loss is ``log(branching)``. Item ``i`` is a
    pure function of (seed, i): any worker, rank or resumed run sees the same data."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, seed: int = 0, branching: int = 3) -> None:
        self.vocab_size, self.seq_len, self.length, self.seed = vocab_size, seq_len, length, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        self.branching = branching
        # the chain walk runs on Python ints: a tensor index per token put the data generation
        # of a large batch on the training loop's path (figures: docs/PERFORMANCE.md)
        self._next = self.successors.tolist()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 1)
        picks = torch.randint(0, self.branching, (self.seq_len,), generator=g).tolist()
        token = int(torch.randint(0, self.vocab_size, (1,), generator=g))
        walk, succ = [token], self._next
        for p in picks:
            token = succ[token][p]
            walk.append(token)
        tokens = torch.tensor(walk, dtype=torch.long)
        return tokens[:-1], tokens[1:]


class TokenFile(Dataset):
    """Windows of ``seq_len + 1`` tokens from a UTF-8 text file (bytes as tokens, vocab 256)
    or a memory-mapped file of uint16 token ids.

    ``source`` says which (``"text"`` or ``"bin"``, as ``data.source``); left out, a ``.bin``
    suffix means token ids and any other a text file.
    """

    def __init__(self, path: str, seq_len: int, vocab_size: int, *, source: str | None = None) -> None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"data.path={path!r} is a directory: expected a file of tokens")
        if not p.is_file():
            raise ConfigError(f"data.path={path!r}: no such file")
        if source is None:
            source = "bin" if p.suffix == ".bin" else "text"
        require_choice("data.source", source, ("text", "bin"))
        if source == "bin":
            size = p.stat().st_size
            if size % 2:
                raise ConfigError(
                    f"data.path={path!r} holds {size} bytes, an odd number: data.source='bin' is uint16 token ids "
                    "(2 bytes each); write it with numpy's uint16 tofile(), or pass data.source=text"
                )
            # an empty file cannot be mapped: it holds no token, said below like any short file
            self.tokens = np.memmap(p, dtype=np.uint16, mode="r") if size else np.empty(0, dtype=np.uint16)
        else:
            self.tokens = np.frombuffer(p.read_bytes(), dtype=np.uint8)
        top = int(self.tokens.max()) if len(self.tokens) else 0
        if top >= vocab_size:
            raise ConfigError(f"data.path={path!r} holds token id {top} but model.vocab_size={vocab_size}")
        if len(self.tokens) < seq_len + 1:
            raise ConfigError(f"data.path={path!r} holds {len(self.tokens)} tokens; need at least {seq_len + 1}")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


def make_dataset(source: str, *, vocab_size: int, seq_len: int, length: int, seed: int, path: str | None = None):
    """``markov`` (generated, seeded), ``text`` or ``bin`` (a user's file at ``path``)."""
    require_choice("data.source", source, DATA_SOURCES)
    if source == "markov":
        return MarkovTokens(vocab_size, seq_len, length, seed)
    if not path:
        raise ConfigError(f"data.source={source!r} needs data.path")
    return TokenFile(path, seq_len, vocab_size, source=source)


class ResumableLoader(DataLoader):
    """A DataLoader that remembers how many batches of the epoch were consumed and skips them
    after ``load_state_dict``.

    Lightning saves and restores any train loader with ``state_dict``/``load_state_dict``,
    which is what a mid-epoch resume needs to continue on the very next batch. Lightning does
    not prefetch from sized loaders, so the count is exact when a checkpoint is written. The
    skipped batches are loaded and dropped (any sampler, including Lightning's distributed
    one, keeps its order).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._consumed = 0
        self._skip = 0

    def __iter__(self):
        skip, self._skip = self._skip, 0
        self._consumed = 0
        it = super().__iter__()
        for _ in range(skip):
            next(it)
            self._consumed += 1
        for batch in it:
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"consumed": self._consumed}

    def load_state_dict(self, state_dict: dict) -> None:
        self._skip = int(state_dict["consumed"])
