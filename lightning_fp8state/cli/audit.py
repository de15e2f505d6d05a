"""``fp8state audit``: run N logical events of a recipe's model under the recompute auditor.

Prints per layer whether every recomputed call was bit-identical to its true forward, the
ledger's verdict, and a gradient summary in the manner of the seed's "focused verification"
table. Exit code 0 when forward and recompute agree everywhere, 1 otherwise.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from ..audit import AuditReport, RecomputeAuditor
from ..errors import AmbiguousRecomputeError, StateTransitionError
from ..fp8state import Fp8State
from ..models import make_dataset
from .config import quant_config
from .models import build_model

__all__ = ["AuditOutcome", "run_audit"]


class AuditOutcome:
    def __init__(
        self, mode: str, report: AuditReport, grad_norms: list[float], state: Fp8State, refused: str | None = None
    ) -> None:
        self.mode, self.report, self.grad_norms, self.state = mode, report, grad_norms, state
        self.refused = refused  # why a recompute was refused (the protocol failing closed), or None

    @property
    def ok(self) -> bool:
        return self.report.ok and self.refused is None

    @property
    def nonfinite_steps(self) -> int:
        return sum(not math.isfinite(g) for g in self.grad_norms)

    @property
    def max_grad_norm(self) -> float:
        finite = [g for g in self.grad_norms if math.isfinite(g)]
        return max(finite) if finite else float("nan")

    def summary_row(self) -> str:
        events = len({r.event for r in self.report.rows})
        bad_events = len({r.event for r in self.report.mismatches})
        verdict = "bit-identical at all" if self.report.ok else f"mismatch in {bad_events} of"
        text = f"{verdict} {events} events" if self.refused is None else "recompute refused (fails closed)"
        return (
            f"{self.mode:<6} | {text:<33} | {len(self.report.violations):>5} | "
            f"{self.max_grad_norm:>12.4g} | {self.nonfinite_steps:>4}"
        )


def run_audit(cfg: DictConfig, steps: int) -> AuditOutcome:
    """Train ``steps`` events (AdamW, one microbatch each) with the auditor attached."""
    device = torch.device("cuda" if cfg.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.trainer.seed)
    qcfg = quant_config(cfg)
    state = Fp8State(qcfg)
    model = state.convert(build_model(cfg)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
    data = make_dataset(
        cfg.data.source,
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.model.seq_len,
        length=max(steps * cfg.data.batch_size, 1),
        seed=cfg.data.seed,
        path=cfg.data.path,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=cfg.data.batch_size, shuffle=False, drop_last=True)
    batches = iter(loader)
    grad_norms = []
    mode = "bf16" if not state.protocol.recipe.quantized else qcfg.mode
    refused = None
    with RecomputeAuditor(state, model=model) as auditor:
        for step in range(steps):
            try:
                x, y = next(batches)
            except StopIteration:
                batches = iter(loader)
                x, y = next(batches)
            x, y = x.to(device), y.to(device)
            try:
                with state.step(step):
                    loss = model.loss(x, y)
                    state.commit_forward()
                    loss.backward()
            except (StateTransitionError, AmbiguousRecomputeError) as exc:
                # a recompute the protocol refuses (e.g. the naive mode's changed activations route
                # a mixture of experts' tokens elsewhere): caught, reported, the audit ends here
                refused = f"event {step}: {type(exc).__name__}: {exc}"
                break
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            grad_norms.append(float(norm))
            if math.isfinite(grad_norms[-1]):
                opt.step()
            opt.zero_grad(set_to_none=True)
    return AuditOutcome(mode, auditor.report(), grad_norms, state, refused)


HEADER = f"{'mode':<6} | {'forward vs recompute':<33} | {'viol':>5} | {'max grad norm':>12} | {'skip':>4}"
