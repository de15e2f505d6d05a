"""Hugging Face transformers models as users train them: tiny Llama and GPT-2 configs (no weights
downloaded), HF's own ``gradient_checkpointing_enable()`` with both ``use_reentrant`` settings
(and with a SAC ``context_fn``), checkpointed gradients bitwise equal to plain ones over
several AdamW steps; the naive mode differs; GPT-2's Conv1D layers really quantized; and a
Lightning run with a mid-run resume bitwise equal to an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

import lightning_fp8state as f8s
from tests.conftest import bitwise_equal
from tests.integration.common import (
    STEPS,
    VOCAB,
    assert_audit_complete,
    assert_bitwise,
    batches,
    differing,
    need,
    train,
)

transformers = need("transformers")

CKPT = {
    "nonreentrant": {"use_reentrant": False},
    "reentrant": {"use_reentrant": True},
    "sac": {"use_reentrant": False, "context_fn": f8s.selective_checkpoint_context()},
}


def llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


MODELS = {"llama": llama, "gpt2": gpt2}


def lm_loss(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


def run(name, mode, ckpt):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    state = f8s.Fp8State(f8s.QuantConfig(mode=mode, strict=False))
    state.convert(model)
    if ckpt is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CKPT[ckpt]))
    grads, report = train(state, model, lm_loss, batches())
    return state, grads, report


@pytest.fixture(scope="module")
def plain():
    return {(name, mode): run(name, mode, None) for name in MODELS for mode in ("safe", "naive")}


@pytest.mark.parametrize("ckpt", sorted(CKPT))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_checkpointing_bitwise(plain, name, ckpt):
    _, ref, _ = plain[(name, "safe")]
    state, got, report = run(name, "safe", ckpt)
    assert_bitwise(ref, got)
    # 2 decoder layers x (Llama: q, k, v, o, gate, up, down | GPT-2: c_attn, c_proj, c_fc, c_proj)
    per_layer = 7 if name == "llama" else 4
    assert_audit_complete(report, min_recomputed=2 * per_layer * STEPS)
    layer_rows = [r for r in report.rows if ".layers." in r.layer or ".h." in r.layer]
    assert layer_rows and all(r.recomputed for r in layer_rows), report.format_table()
    for event in [(i, 0) for i in range(STEPS)]:
        assert all(rec.commits == 1 for rec in state.ledger.event(event).values())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_naive_mode_differs_under_checkpointing(plain, name):
    _, ref, _ = plain[(name, "naive")]
    _, got, report = run(name, "naive", "nonreentrant")
    assert differing(ref, got)
    assert not report.ok


def test_llama_early_stopped_calls_are_compared(plain):
    """Under HF's non-reentrant checkpointing torch stops each layer's recompute inside its last
    Linear (down_proj): its output is never rebuilt, its operands are compared."""
    _, _, report = run("llama", "safe", "nonreentrant")
    early = {r.layer.rsplit(".", 1)[-1] for r in report.rows if r.recomputed and not r.output_recomputed}
    assert early == {"down_proj"}
    assert report.early_stopped == 2 * STEPS


def test_gpt2_conv1d_layers_are_quantized():
    torch.manual_seed(0)
    model = gpt2()
    state = f8s.Fp8State(f8s.QuantConfig())
    state.convert(model)
    report = state.last_conversion
    conv = [n for n in report.converted if "Conv1D" in report.how[n]]
    assert sorted(conv) == sorted(
        f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
    assert "lm_head" in report.converted
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survives conversion
    assert report.not_quantizable == {}
    train(state, model, lm_loss, batches(2), audit=False)
    assert state.conversion.unowned(state) == []
    owned = {o.layer for o in state.bank.owners}
    assert set(conv) <= owned


# -- Lightning: the callback, checkpointing, and a mid-run resume ------------------------
def _lightning_run(tmp_path, *, save_at=None, resume=None, steps=6):
    import lightning.pytorch as pl

    from lightning_fp8state.lightning import Fp8StateCallback
    from lightning_fp8state.models import ResumableLoader

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = llama()
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            return lm_loss(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return ResumableLoader(torch.cat(batches(steps)), batch_size=2)

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == save_at:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    module = LitLlama()
    cb = Fp8StateCallback(config=f8s.QuantConfig(), audit=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="fp8state_ddp",
        max_steps=steps,
        max_epochs=1,
        callbacks=[cb, SaveAt()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, ckpt_path=resume)
    assert trainer.global_step == steps
    return module, cb


def test_lightning_callback_with_hf_checkpointing_resumes_bitwise(tmp_path):
    full, cb_full = _lightning_run(tmp_path, save_at=3)  # uninterrupted; writes a checkpoint after step 3
    assert cb_full.audit_report().ok and cb_full.audit_report().recomputed > 0
    resumed, cb_resumed = _lightning_run(tmp_path, resume=tmp_path / "mid.ckpt")
    assert [e[0] for e in cb_resumed.state.ledger.events()] == [3, 4, 5]  # it trained on from step 3
    for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        assert bitwise_equal(a.detach(), b.detach()), name
    sd_full, sd_resumed = cb_full.state.state_dict(), cb_resumed.state.state_dict()
    for key in ("amax_history", "scale", "descale"):
        assert torch.equal(sd_full["bank"][key], sd_resumed["bank"][key]), key
    assert sd_full["clock"] == sd_resumed["clock"]
    assert cb_resumed.audit_report().ok


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_compiled_layers_with_checkpointing_bitwise(plain, name):
    """Each decoder layer through torch.compile (each converted linear, GPT-2's Conv1D included,
    one op in the layer's graph), with HF's gradient checkpointing: gradients bitwise those of
    the plain eager run, the ledger clean."""
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    state = f8s.Fp8State(f8s.QuantConfig(mode="safe", strict=False))
    state.convert(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CKPT["nonreentrant"]))
    torch._dynamo.reset()
    for layer in model.model.layers if name == "llama" else model.transformer.h:
        layer.compile(backend="aot_eager")
    grads, _ = train(state, model, lm_loss, batches(), audit=False)
    _, grads_plain, _ = plain[(name, "safe")]
    assert not differing(grads_plain, grads)
    assert not state.ledger.violations
