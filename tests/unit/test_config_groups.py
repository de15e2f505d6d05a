"""QuantConfig's fields by concern: flat keys for users, read-only sections for the code."""

from __future__ import annotations

import copy
import pickle
from dataclasses import fields

import pytest

import lightning_fp8state as f8s
from lightning_fp8state.config import FIELD_GROUPS, GROUP_OF, ConfigSection, QuantConfig

# The keys users write (YAML, ``quant.xxx=`` overrides, the stored checkpoints): grouping the
# fields must not change one of them.
USER_KEYS = {
    "recipe", "history_len", "margin", "amax_algo", "initial_scale", "mode", "ownership", "strict",
    "include", "exclude", "forward_format", "backward_format", "gemm", "fuse_prologues", "weight_codes_once", "ledger_window",
    "amax_reduction", "attn_format", "attn_centered", "attn_center_momentum", "attn_quantize_v", "world_size_merge",
    "fallback", "fallback_to", "fallback_on_nonfinite", "fallback_saturation", "fallback_patience",
    "policy",
}  # fmt: skip


def test_every_field_is_in_exactly_one_group_and_declared_in_the_groups_order():
    grouped = [key for keys in FIELD_GROUPS.values() for key in keys]
    assert grouped == QuantConfig.keys()
    assert len(set(grouped)) == len(grouped)
    assert set(GROUP_OF) == set(grouped)


def test_the_keys_users_write_are_unchanged():
    assert set(QuantConfig.keys()) == USER_KEYS
    assert [f.name for f in fields(QuantConfig)][-1] == "extra"


@pytest.mark.parametrize("group", list(FIELD_GROUPS))
def test_each_section_reads_its_fields_and_no_other(group):
    cfg = QuantConfig(margin=3, exclude=("head",), strict=False, attn_centered=True)
    section = getattr(cfg, group)
    assert isinstance(section, ConfigSection)
    assert section.keys() == FIELD_GROUPS[group]
    assert section.as_dict() == {k: getattr(cfg, k) for k in FIELD_GROUPS[group]}
    for key in FIELD_GROUPS[group]:
        assert getattr(section, key) == getattr(cfg, key)
    foreign = next(k for k in QuantConfig.keys() if GROUP_OF[k] != group)
    with pytest.raises(AttributeError, match=rf"QuantConfig.{group} has no field '{foreign}'.*{GROUP_OF[foreign]}"):
        getattr(section, foreign)
    with pytest.raises(AttributeError, match="read-only"):
        setattr(section, FIELD_GROUPS[group][0], None)


def test_sections_compare_by_value_and_survive_copy_and_pickle():
    a, b = QuantConfig(margin=2), QuantConfig(margin=2, strict=False)
    assert a.scaling == b.scaling and a.diagnostics != b.diagnostics
    assert hash(a.scaling) == hash(b.scaling)
    assert copy.deepcopy(a.scaling) == a.scaling
    assert pickle.loads(pickle.dumps(a.sharing)) == a.sharing
    assert copy.deepcopy(a) == a and pickle.loads(pickle.dumps(a)) == a
    assert repr(a.selection).startswith("selection(include=('*',), exclude=(), policy=PrecisionPolicy(keep_first=0,")


def test_a_flat_mapping_still_builds_the_config_and_attribute_access_is_flat():
    cfg = QuantConfig.from_dict({"margin": 2, "include": ["blocks.*"], "amax_reduction": {"*": "data_parallel"}})
    assert cfg.margin == cfg.scaling.margin == 2
    assert cfg.include == cfg.selection.include == ("blocks.*",)
    assert cfg.reduction_of("input") == "data_parallel" == dict(cfg.sharing.amax_reduction)["*"]


def test_conversion_reads_the_selection_section():
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    state = f8s.Fp8State(QuantConfig(exclude=("1",)))
    state.convert(model)
    report = state.last_conversion
    assert report.converted == ["0"] and report.skipped == {"1": "matches an exclude pattern ['1']"}
