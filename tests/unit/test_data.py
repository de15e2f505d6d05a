"""The generated token data: a pure function of (seed, index), unchanged by the fast walk."""

from __future__ import annotations

import torch

from lightning_fp8state.models import MarkovTokens


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
