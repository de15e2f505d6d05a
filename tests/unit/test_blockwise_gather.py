"""fp8_blockwise's FSDP2 all-gather pieces, without processes: shards of whole 128-row blocks
encoded on their own and concatenated as the all-gather does give the full weight's encode
bitwise (any column count: the edge blocks are cut the same way); other splits are named."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from lightning_fp8state.quant_recipes import recipe_for
from lightning_fp8state.state import OwnerKey, QuantSnapshot
from tests.conftest import bitwise_equal


def _snap(scale, descale, amax) -> QuantSnapshot:
    snap = QuantSnapshot.stamped(OwnerKey("fc", "weight"), 0, 0, None, 0, torch.float8_e4m3fn, scale, descale)
    return QuantSnapshot(**{**snap.__dict__, "amax": amax})


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_blockwise_pow2"])
@pytest.mark.parametrize("world", [2, 4])
def test_concatenated_shard_blocks_are_the_full_weights(recipe, world):
    r = recipe_for(f8s.QuantConfig(recipe=recipe))
    assert r.shard_scales and r.shard_gather_problem((512, 320), [512 // world] * world) is None
    g = torch.Generator().manual_seed(3)
    w = torch.randn(512, 320, generator=g) * torch.logspace(-3, 3, 512).reshape(-1, 1)  # blocks differ
    enc = r.encoder("weight")
    sent = []
    for shard in w.chunk(world):
        q, scale, descale, amax = enc.encode_dynamic(shard)
        sent.append(r.all_gather_inputs(q, _snap(scale, descale, amax)))
    assert all(a.dtype == torch.uint8 and b.dtype == torch.float32 for a, b in sent)
    outputs = tuple(torch.cat(parts) for parts in zip(*sent, strict=True))  # what FSDP2's all-gather makes
    codes, snap = r.all_gathered(outputs, _snap(None, None, None), torch.float8_e4m3fn)
    q, scale, descale, amax = enc.encode_dynamic(w)
    assert bitwise_equal(codes, q)
    for got, want in ((snap.scale, scale), (snap.descale, descale), (snap.amax, amax)):
        assert got.shape == (4, 3) and bitwise_equal(got, want)
        assert got.untyped_storage().data_ptr() != outputs[1].untyped_storage().data_ptr()  # not the buffer
    assert snap.owner == OwnerKey("fc", "weight")


@pytest.mark.parametrize(("rows", "split"), [(192, [96, 96]), (131, [66, 65]), (384, [192, 192]), (256, [128, 128, 0])])
def test_splits_that_cut_blocks_are_named(rows, split):
    problem = recipe_for(f8s.QuantConfig(recipe="fp8_blockwise")).shard_gather_problem((rows, 256), split)
    assert problem is not None and str(split) in problem and "multiple of 128" in problem


def test_a_stack_of_weights_is_named():
    problem = recipe_for(f8s.QuantConfig(recipe="fp8_blockwise")).shard_gather_problem((4, 256, 256), [2, 2])
    assert problem is not None and "2-D" in problem


def test_per_tensor_recipes_gather_any_split_and_send_the_codes_alone():
    r = recipe_for(f8s.QuantConfig(recipe="fp8_current"))
    assert not r.shard_scales and r.shard_gather_problem((192, 16), [96, 96]) is None
    q = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    (sent,) = r.all_gather_inputs(q, None)
    assert sent.dtype == torch.uint8 and sent.data_ptr() == q.data_ptr()
