"""The token data: the generated one a pure function of (seed, index), unchanged by the fast walk;
a user's file read as ``data.source`` says."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fp8state.errors import ConfigError
from lightning_fp8state.models import MarkovTokens, make_dataset


def walk_with_tensor_indexing(data: MarkovTokens, i: int) -> torch.Tensor:
    """The chain walk as first written (one tensor index per token): the oracle."""
    g = torch.Generator().manual_seed(data.seed * 1_000_003 + i + 1)
    picks = torch.randint(0, data.branching, (data.seq_len,), generator=g)
    tokens = torch.empty(data.seq_len + 1, dtype=torch.long)
    tokens[0] = torch.randint(0, data.vocab_size, (1,), generator=g)
    for t in range(data.seq_len):
        tokens[t + 1] = data.successors[tokens[t], picks[t]]
    return tokens


def test_items_equal_the_tensor_walk_and_follow_the_chain():
    data = MarkovTokens(vocab_size=97, seq_len=50, length=10, seed=3)
    for i in (0, 1, 7):
        x, y = data[i]
        expected = walk_with_tensor_indexing(data, i)
        assert torch.equal(x, expected[:-1]) and torch.equal(y, expected[1:])
        assert x.dtype == torch.long and x.shape == (50,)
        # every step is one of the token's successors
        assert all(int(b) in data.successors[int(a)].tolist() for a, b in zip(x, y, strict=True))
    assert not torch.equal(data[0][0], data[1][0])  # items differ
    assert torch.equal(MarkovTokens(97, 50, 10, seed=3)[7][0], data[7][0])  # and are reproducible


def test_a_token_file_is_read_as_its_data_source_says_whatever_its_suffix(tmp_path):
    """data.source decided nothing: a ``.bin`` suffix meant uint16 ids and any other bytes, so
    data.source=bin on ``tokens.dat`` trained on its bytes, and data.source=text on ``notes.bin``
    on pairs of characters."""
    ids = (np.arange(40, dtype=np.uint16) * 7 + 300) % 500  # ids above 255: not bytes
    ids.tofile(tmp_path / "tokens.dat")
    x, y = make_dataset("bin", vocab_size=512, seq_len=8, length=1, seed=0, path=str(tmp_path / "tokens.dat"))[1]
    assert x.tolist() == ids[8:16].tolist() and y.tolist() == ids[9:17].tolist()
    (tmp_path / "notes.bin").write_text("the quick brown fox jumps over the lazy dog")
    x, _ = make_dataset("text", vocab_size=256, seq_len=8, length=1, seed=0, path=str(tmp_path / "notes.bin"))[0]
    assert bytes(x.tolist()) == b"the quic"


def test_an_empty_token_bin_says_it_holds_no_tokens(tmp_path):
    """``np.memmap`` of an empty file raised ``ValueError: cannot mmap an empty file``."""
    (tmp_path / "empty.bin").touch()
    with pytest.raises(ConfigError, match=r"empty\.bin' holds 0 tokens; need at least 9"):
        make_dataset("bin", vocab_size=512, seq_len=8, length=1, seed=0, path=str(tmp_path / "empty.bin"))
