"""Fp8StateCallback(graph_blocks=True): a LightningModule holding a tiny transformers Llama has its
decoder layers graphed at fit start (graphs emulated on the CPU), bitwise the eager fit."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_fp8state.lightning import Fp8StateCallback
from tests.conftest import bitwise_equal
from tests.graph_emulation import EmulatedGraphBackend
from tests.unit.test_hf_decoder_graphs import batches, make_model

pytest.importorskip("transformers")

STEPS = 5


class HfModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.net(input_ids=batch, labels=batch, use_cache=False).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.stack(batches(STEPS)), batch_size=None)


def fit(**callback_kw):
    module = HfModule()
    callback = Fp8StateCallback(log_metrics=False, **callback_kw)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module)
    return module, callback


def test_graph_blocks_switch_graphs_the_decoder_layers_bitwise_the_eager_fit():
    ref, _ = fit()
    module, callback = fit(graph_blocks=True, graph_warmup=2, graph_backend=EmulatedGraphBackend())
    runner = callback.graph_runner
    assert runner is not None and runner.eager_calls == 2 and runner.replays == STEPS - 2
    for i, (a, b) in enumerate(zip(ref.losses, module.losses, strict=True)):
        assert bitwise_equal(a, b), f"step {i}: loss differs"
    for (name, p), q in zip(ref.named_parameters(), module.parameters(), strict=True):
        assert bitwise_equal(p, q), name
    assert callback.state.ledger.ok


def test_graph_blocks_switch_arguments():
    with pytest.raises(MisconfigurationException, match="graph_blocks=True, audit=True"):
        Fp8StateCallback(graph_blocks=True, audit=True)
    with pytest.raises(Exception, match="graph_blocks"):
        Fp8StateCallback(graph_blocks="yes")


def test_graph_blocks_on_a_cpu_trainer_is_refused_at_setup_naming_the_switch():
    """The docs' example run on a laptop: a clear refusal before any batch, not torch.cuda's
    "Stream requires CUDA support" from inside the first pass (the emulated backend of the tests
    above is what may run there)."""
    with pytest.raises(MisconfigurationException, match=r"graph_blocks=True\): per-layer CUDA graphs need a CUDA"):
        fit(graph_blocks=True)


def test_graphed_blocks_on_a_cpu_input_is_refused_by_the_cuda_backend():
    from lightning_fp8state import ConfigError, GraphedBlocks

    runner = GraphedBlocks(torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2)), warmup=1)
    with pytest.raises(ConfigError, match="capture on a CUDA device; the blocks' input is on 'cpu'"):
        runner(torch.randn(2, 8, requires_grad=True))
