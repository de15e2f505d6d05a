"""BoringModel with checkpointed blocks, deterministic data and a resumable loader.

Shared by the in-process Lightning tests, the two-rank scenario script and the GPU tests.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.data import Dataset

import lightning_fp8state as f8s
from tests.conftest import Block

# How each block is checkpointed: the wrapper (torch non-reentrant / DeepSpeed engine),
# the wrapper with no engine named (routed by the strategy), DeepSpeed's or torch's own call.
CKPT_MODES = ("f8s_torch", "f8s_deepspeed", "f8s_default", "plain_deepspeed", "plain_torch", "none")


class CheckpointedBoring(BoringModel):
    """BoringModel whose single Linear becomes inp -> checkpointed blocks -> head.

    The input projection is not checkpointed, so the first block's input requires grad:
    reentrant checkpointing (DeepSpeed's) gives a region's parameters no gradient otherwise.
    ``lr``: SGD with momentum 0.9 on ScaledDataset's loud samples diverged within 7 steps at
    0.01 (every recipe, bf16 too), which made the runs' bitwise comparisons compare NaN weights;
    at 1e-3 the loss stays finite for 32 steps (tests/lightning/scenarios.py checks every fit).
    """

    def __init__(
        self,
        ckpt: str = "f8s_torch",
        d: int = 16,
        n_blocks: int = 2,
        lr: float = 1e-3,
        frozen: bool = False,
        optimizer: str = "sgd",
    ):
        super().__init__()
        self.optimizer = optimizer  # "sgd" (momentum 0.9) or "adamw" (fused, as fp8state train's)
        del self.layer
        assert ckpt in CKPT_MODES, ckpt
        self.ckpt = ckpt
        self.lr = lr
        self.inp = nn.Linear(32, d)
        self.blocks = nn.ModuleList(Block(d, gain=1.0) for _ in range(n_blocks))
        self.head = nn.Linear(d, 2)
        # A frozen layer: its weight is never updated by the optimizer, so a rank-dependent
        # perturbation (see perturb_frozen) keeps replicas' weights apart for the whole run.
        self.frozen = nn.Linear(d, d) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.blocks_runner = None  # e.g. GraphedBlocks: runs the blocks while training, in place of the loop

    def run_block(self, block, x):
        if self.ckpt == "f8s_torch":
            return f8s.checkpoint(block, x, engine="torch")
        if self.ckpt == "f8s_deepspeed":
            return f8s.checkpoint(block, x, engine="deepspeed")
        if self.ckpt == "f8s_default":
            return f8s.checkpoint(block, x)
        if self.ckpt == "plain_deepspeed":
            import deepspeed

            return deepspeed.checkpointing.checkpoint(block, x)
        if self.ckpt == "plain_torch":
            return torch_checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, x):
        h = self.inp(x)
        if self.frozen is not None:
            h = h + self.frozen(h)
        if self.blocks_runner is not None and torch.is_grad_enabled():
            return self.head(self.blocks_runner(h))
        for block in self.blocks:
            h = self.run_block(block, h)
        return self.head(h)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.1, fused=True)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def perturb_frozen(self, rank: int) -> None:
        """Make this replica's frozen weight differ from the other ranks' (after DDP's broadcast)."""
        with torch.no_grad():
            self.frozen.weight.mul_(1.0 + rank)


class ScaledDataset(Dataset):
    """Sample i: a fixed random vector (seeded by i), times 8 for odd i: with a DistributedSampler
    over two ranks without shuffling, rank 0 gets the even samples and rank 1 the louder odd ones."""

    def __init__(self, length: int = 32, size: int = 32, loud: float = 8.0) -> None:
        self.length, self.size, self.loud = length, size, loud

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.randn(self.size, generator=g) * (self.loud if i % 2 else 1.0)


class HfLlamaModule(pl.LightningModule):
    """A tiny transformers LlamaForCausalLM (tests/unit/test_hf_decoder_graphs.py's) as a user
    writes its LightningModule; ``checkpointed``: each decoder layer through
    ``lightning_fp8state.checkpoint`` (the eager reference of ``Fp8StateCallback(graph_blocks=True)``,
    whose runner checkpoints the layers itself)."""

    frozen = None  # the scenarios' Perturb callback asks

    def __init__(self, checkpointed: bool, lr: float = 0.05) -> None:
        super().__init__()
        from tests.unit.test_hf_decoder_graphs import checkpoint_layers, make_model  # noqa: PLC0415

        self.net = make_model()
        if checkpointed:
            checkpoint_layers(self.net)
        self.lr = lr
        self.blocks_runner = None
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = self.net(input_ids=batch, labels=batch, use_cache=False).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class TokenRows(Dataset):
    """Row i: fixed random tokens (seeded by i) below ``vocab``."""

    def __init__(self, length: int, seq: int, vocab: int) -> None:
        self.length, self.seq, self.vocab = length, seq, vocab

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(2000 + i)
        return torch.randint(0, self.vocab, (self.seq,), generator=g)
