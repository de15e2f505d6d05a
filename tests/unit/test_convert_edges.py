"""convert_model at the edges users met on Hugging Face models (issue 43, edges 4-7): a pattern
that matches nothing warns with the nearest names, and patterns match with or without a
LightningModule's attribute prefix; a conversion that converts nothing says so, and every module
doing a Linear's work that is not converted is in the report (F.linear on its own parameter,
3-D expert weights); peft's LoRA adapters stay in high precision; a Linear whose weight its
parent's forward reads is not converted. Stand-ins here keep these tests free of transformers
and peft (tests/integration/test_peft.py runs peft itself)."""

from __future__ import annotations

import contextlib
import difflib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_fp8state as f8s

LORA_WHY = "a LoRA adapter (peft): kept in high precision; name it in an include pattern to quantize it"


def convert(model, **config):
    state = f8s.Fp8State(f8s.QuantConfig(**config))
    state.convert(model)
    return state, state.last_conversion


def convert_quietly(model, **config):
    with quiet():
        return convert(model, **config)


@contextlib.contextmanager
def quiet():
    """Every ConversionWarning an error: nothing to say."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", f8s.ConversionWarning)
        yield


class RobertaLike(nn.Module):
    """Heads named as RoBERTa's/DistilBERT's/Whisper's: none ends in "head"."""

    def __init__(self, d=16):
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.classifier = nn.Module()
        self.classifier.out_proj = nn.Linear(d, 2)
        self.vocab_projector = nn.Linear(d, 32)
        self.proj_out = nn.Linear(d, 32)

    def forward(self, x):
        h = self.dense(x)
        return self.classifier.out_proj(h).sum() + self.vocab_projector(h).sum() + self.proj_out(h).sum()


# -- edge 4: a pattern that matches nothing ---------------------------------------------------


def test_an_exclude_pattern_that_matches_nothing_warns_once_with_the_nearest_names():
    """The README's ``"*head"`` misses heads named ``classifier.out_proj``, ``vocab_projector``,
    ``proj_out``: before, every one of them was converted and nothing said so."""
    state = f8s.Fp8State(f8s.QuantConfig(exclude=("*head", "dense")))
    model = RobertaLike()
    with pytest.warns(f8s.ConversionWarning) as record:
        state.convert(model)
    messages = [str(w.message) for w in record if "pattern" in str(w.message)]
    assert len(messages) == 1, messages  # "dense" matched
    assert "the exclude pattern '*head' matches no Linear-like module of RobertaLike" in messages[0]
    names = ["dense", "classifier.out_proj", "vocab_projector", "proj_out"]
    nearest = difflib.get_close_matches("*head", names, n=3, cutoff=0)
    assert f"the nearest names: {nearest}." in messages[0] and len(nearest) == 3
    assert state.last_conversion.converted == names[1:]  # as before: the pattern excluded nothing
    assert state.last_conversion.warnings == messages
    with quiet():
        state.convert(model)  # the Lightning callback's second convert: said once


def test_an_include_pattern_that_matches_nothing_warns_and_the_default_include_does_not():
    model = RobertaLike()
    with pytest.warns(f8s.ConversionWarning, match=r"the include pattern 'blocks\.\*' matches no Linear-like"):
        _, report = convert(model, include=("dense", "blocks.*"))
    assert report.converted == ["dense"]
    with quiet():
        convert(RobertaLike())  # include ("*",), no exclude: nothing to say
        convert(RobertaLike(), include=("*", "dense"))


class LightningModule(nn.Module):
    """Stands in for lightning.pytorch.LightningModule: recognised by its class name."""


class TinyLM(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.lm_head(self.mlp(self.embed(tokens)))


class LitTinyLM(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyLM()

    def forward(self, tokens):
        return self.model(tokens)


def test_patterns_match_without_the_lightning_module_attribute_prefix():
    """``exclude=["lm_head"]`` written for the bare model excludes ``model.lm_head`` of the
    LightningModule holding it; the report keeps the full name."""
    lit = LitTinyLM()
    _, report = convert_quietly(lit, exclude=("lm_head",))
    assert report.skipped == {"model.lm_head": "matches an exclude pattern ['lm_head']"}
    assert report.converted == ["model.mlp.0", "model.mlp.2"]
    assert type(lit.model.lm_head) is nn.Linear
    _, report = convert_quietly(LitTinyLM(), include=("mlp.*",))
    assert report.converted == ["model.mlp.0", "model.mlp.2"]
    # the full name matches too, and a bare model gets no prefix stripped
    _, report = convert_quietly(LitTinyLM(), exclude=("model.lm_head",))
    assert list(report.skipped) == ["model.lm_head"]
    with pytest.warns(f8s.ConversionWarning, match=r"pattern 'lm_head'.*nearest names: \['0\.model\.lm_head'"):
        convert(nn.Sequential(LitTinyLM()), exclude=("lm_head",))


def test_a_real_lightning_module_is_recognised():
    pl = pytest.importorskip("lightning.pytorch")

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyLM()

    _, report = convert_quietly(Lit(), exclude=("lm_head",))
    assert list(report.skipped) == ["model.lm_head"]


# -- edge 5: a conversion that converts nothing, and what it does not convert -----------------


class FalconLinear(nn.Linear):
    """transformers' FalconLinear: an nn.Linear subclass with its own forward."""

    def forward(self, input):
        hidden_state = input @ self.weight.T
        return hidden_state if self.bias is None else hidden_state + self.bias


def test_a_conversion_that_converts_nothing_warns_with_each_reason():
    model = nn.Sequential(FalconLinear(8, 8), nn.GELU(), FalconLinear(8, 8))
    with pytest.warns(f8s.ConversionWarning, match=r"nothing of Sequential was converted: its 2 Linear-like") as rec:
        state, report = convert(model)
    assert report.converted == [] and set(report.not_quantizable) == {"0", "2"}
    message = str(rec[0].message)
    assert "0: nn.Linear subclass FalconLinear has its own forward" in message
    assert "2: nn.Linear subclass FalconLinear has its own forward" in message
    with quiet():
        state.convert(model)  # once


def test_a_model_without_any_linear_like_module_warns():
    with pytest.warns(f8s.ConversionWarning, match=r"LayerNorm has no Linear-like module"):
        convert(nn.LayerNorm(8))


def test_the_nothing_converted_warning_lists_eight_reasons_then_a_count():
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(11)))
    with pytest.warns(f8s.ConversionWarning, match=r"nothing of Sequential was converted: its 11") as rec:
        convert(model, include=())
    message = str(rec[0].message)
    assert "7: matches no include pattern []" in message and "8: matches" not in message
    assert "... and 3 more" in message


def test_converting_a_converted_model_again_and_attention_only_models_do_not_warn():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    state, report = convert_quietly(model, exclude=("1",))
    assert report.converted == ["0"]
    with quiet():
        state.convert(model)  # converts nothing new, but the model is converted: nothing to say
    assert state.last_conversion.converted == [] and list(state.last_conversion.skipped) == ["1"]
    attention = nn.Sequential(nn.Linear(8, 8), f8s.Fp4AttentionQuantizer())
    state, report = convert_quietly(attention, include=())
    assert report.attention == ["1"]
    with quiet():
        state.convert(attention)


class RouterLike(nn.Module):
    """transformers 5's MixtralTopKRouter: F.linear on its own 2-D weight."""

    def __init__(self, d=16, experts=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, d) * 0.1)

    def forward(self, x):
        return F.softmax(F.linear(x, self.weight).float(), dim=-1)


class MatmulProjection(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(d, d) * 0.1)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return torch.matmul(x, self.proj) * self.scale


class TransposedProjection(MatmulProjection):
    def forward(self, x):
        return (x @ self.proj.t()) * self.scale


class RMSNorm(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Experts(nn.Module):
    """transformers 5's MixtralExperts: every expert's weights in one 3-D parameter."""

    def __init__(self, d=16, hidden=32, experts=4):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, d) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(experts, d, hidden) * 0.1)

    def forward(self, x, expert):
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert])


class MoeBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.gate = nn.Linear(d, 4, bias=False)  # the router: converted as any Linear
        self.experts = Experts(d)
        self.shared_expert = nn.Linear(d, d)

    def forward(self, x):
        expert = int(self.gate(x).float().mean(dim=(0, 1)).argmax())
        return self.experts(x, expert) + self.shared_expert(x)


class PatchEmbeddings(nn.Module):
    """ViT-style: a [1, N, D] position parameter and a Conv1d: neither is an expert weight."""

    def __init__(self, d=16):
        super().__init__()
        self.position = nn.Parameter(torch.zeros(1, 8, d))
        self.conv = nn.Conv1d(d, d, 3, padding=1)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2) + self.position


def test_modules_applying_their_own_parameter_as_a_linear_are_reported_not_quantizable():
    model = nn.Sequential(RouterLike(), nn.Linear(4, 16), MatmulProjection(), TransposedProjection(), RMSNorm())
    _, report = convert_quietly(model)
    assert report.converted == ["1"]
    assert report.not_quantizable == {
        "0": "calls F.linear on its own parameter weight in forward: not a Linear module; convert by hand or exclude",
        "2": "calls torch.matmul on its own parameter proj in forward: not a Linear module; convert by hand or exclude",
        "3": "calls @ on its own parameter proj in forward: not a Linear module; convert by hand or exclude",
    }
    with torch.no_grad():
        assert model(torch.randn(2, 16)).shape == (2, 16)


def test_three_d_expert_weights_are_reported_and_the_block_other_linears_convert():
    model = nn.Sequential(PatchEmbeddings(), MoeBlock())
    _, report = convert_quietly(model)
    assert report.converted == ["1.gate", "1.shared_expert"]
    assert report.not_quantizable == {
        "1.experts": "3-D expert weights gate_up_proj, down_proj [E, out, in] applied with batched/grouped "
        "matmuls: not converted (Fp8Experts takes gate_up_proj [E, 2F, D] and down_proj [E, D, F] with no biases, an "
        "act_fn, called as forward(hidden_states, top_k_index, top_k_weights); convert by hand or exclude)"
    }
    state, _ = convert_quietly(model := nn.Sequential(PatchEmbeddings(), MoeBlock()))
    with quiet(), state.step(0):  # the block trains, its converted Linears quantized
        model(torch.randn(2, 8, 16)).float().pow(2).mean().backward()


# -- edge 6: peft's LoRA adapters -------------------------------------------------------------


class LoraLinear(nn.Module):
    """peft's lora.Linear, as laid out: the base layer and per-adapter ModuleDicts."""

    def __init__(self, base: nn.Linear, r=4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        self.scaling = {"default": 2.0}

    def forward(self, x):
        result = self.base_layer(x)
        lora_A, lora_B = self.lora_A["default"], self.lora_B["default"]
        x = x.to(lora_A.weight.dtype)
        return result + lora_B(lora_A(x)) * self.scaling["default"]


def lora_model(d=16):
    return nn.Sequential(LoraLinear(nn.Linear(d, d)), nn.GELU(), LoraLinear(nn.Linear(d, d)))


def test_lora_adapters_stay_in_high_precision_and_the_base_layers_convert():
    model = lora_model()
    state, report = convert_quietly(model)
    assert report.converted == ["0.base_layer", "2.base_layer"]
    assert report.skipped == {f"{i}.lora_{ab}.default": LORA_WHY for i in (0, 2) for ab in "AB"}
    assert type(model[0].lora_A["default"]) is nn.Linear and isinstance(model[0].base_layer, f8s.Fp8Linear)
    with quiet(), state.step(0):
        model(torch.randn(4, 16)).pow(2).mean().backward()
    assert {"0.base_layer", "2.base_layer"} <= {o.layer for o in state.bank.owners}


def test_an_include_pattern_naming_lora_quantizes_the_adapters_it_matches():
    _, report = convert_quietly(lora_model(), include=("*base_layer", "*lora_A.*"))
    assert report.converted == ["0.base_layer", "0.lora_A.default", "2.base_layer", "2.lora_A.default"]
    assert report.skipped["0.lora_B.default"] == LORA_WHY
    _, report = convert_quietly(lora_model(), include=("*",), exclude=("2.*",))
    assert report.converted == ["0.base_layer"] and report.skipped["0.lora_A.default"] == LORA_WHY


def test_adapters_added_after_conversion_are_left_alone_by_the_second_convert():
    """peft wraps an Fp8Linear (an nn.Linear) as its base layer and adds plain nn.Linear adapters:
    the Lightning callback's second convert must not quantize them."""
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    state, _ = convert_quietly(model)
    model[0], model[2] = LoraLinear(model[0]), LoraLinear(model[2])
    with quiet():
        state.convert(model)
    report = state.last_conversion
    assert report.converted == [] and set(report.skipped) == {f"{i}.lora_{ab}.default" for i in (0, 2) for ab in "AB"}
    assert all(type(model[i].lora_A["default"]) is type(model[i].lora_B["default"]) is nn.Linear for i in (0, 2))
    assert isinstance(model[0].base_layer, f8s.Fp8Linear) and model[0].base_layer.layer_name == "0"


# -- edge 7: a Linear whose weight its parent's forward reads ---------------------------------


class ReadsChildWeight(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.used = nn.Linear(d, d)
        self.tied = nn.Linear(d, d)
        self.meta = nn.Linear(d, d)

    def forward(self, x):
        # T5's check: isinstance, dtype and shape reads use no values
        if isinstance(self.meta.weight, torch.Tensor) and x.dtype != self.meta.weight.dtype:
            x = x.to(self.meta.weight.dtype)
        assert self.meta.weight.shape[-1] == x.shape[-1] and self.meta.weight.size(0) > 0
        return self.meta(F.linear(self.used(x), self.tied.weight))


def test_a_linear_whose_weight_the_parent_forward_reads_is_not_converted():
    model = ReadsChildWeight()
    state, report = convert_quietly(model)
    assert report.converted == ["used", "meta"]
    assert report.not_quantizable == {
        "tied": "its weight is read by ReadsChildWeight's forward (self.tied.weight), which would use it "
        "unquantized: not converted"
    }
    assert type(model.tied) is nn.Linear
    with quiet(), state.step(0):  # nothing claimed converted goes unowned
        model(torch.randn(4, 16)).pow(2).mean().backward()
