"""Fp8StateCallback: drives the quantizer protocol from Lightning's training hooks.

One logical event per training batch (microbatch), opened in ``on_train_batch_start`` at
``(step, microbatch)`` = (optimizer steps so far, index in the accumulation window); forward
roles commit in ``on_before_backward``, the event closes in ``on_after_backward`` (backward
roles commit, the ledger is checked, the snapshot stash is released). A batch whose
backward never ran (skipped) or that raised is aborted: its amaxes are discarded.
Every rank's state is gathered into the checkpoint and each rank restores its own; a resume on
another number of ranks restores the saved ranks' state mapped onto the new ones
(``state/reshard.py``, by ``QuantConfig.world_size_merge``).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from ..audit import AuditReport, RecomputeAuditor
from ..config import QuantConfig, require_bool, require_type
from ..errors import StateLoadError, StateTransitionError
from ..fp8state import Fp8State
from ..graphs import graph_decoder_layers, require_warmup
from ..nn import ConversionReport
from ..state.reshard import ReshardReport, plan_reshard, reshard_state
from .contract import contract_of

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CHECKPOINT_KEY",
    "DRIVES_EVENTS",
    "Fp8StateCallback",
    "check_resume_world_size",
]

# a LightningModule with this attribute set to True opens and closes its quantizer events
# itself (GraphedTrainingStep); Fp8StateCallback then leaves them alone
DRIVES_EVENTS = "fp8state_drives_events"

log = logging.getLogger(__name__)

# checkpoint[CHECKPOINT_KEY] = {"format_version", "world_size", "ranks": {rank: Fp8State
# state dict}, "accumulated_grads": {rank: {param name: grad}} | None, "callback": {...}}
CHECKPOINT_KEY = "fp8state"
CHECKPOINT_FORMAT_VERSION = 1


def check_resume_world_size(entry: Mapping, world: int, fitting: bool, rule: str) -> ReshardReport | None:
    """How a checkpoint's quantizer state maps onto ``world`` ranks, checked before anything is
    loaded: ``None`` when nothing is mapped (the same world size, or an evaluation, which reads
    saved rank ``r mod N``), else the report of :func:`~lightning_fp8state.state.reshard.plan_reshard`.

    Raises:
        WorldSizeMergeError: owners differ per rank and ``rule`` (``QuantConfig.world_size_merge``)
            is ``refuse``.
        StateLoadError: the checkpoint holds each rank's accumulated gradients (saved inside an
            accumulation window): they belong to each rank's data and are not mapped.
    """
    saved_world = int(entry["world_size"])
    if saved_world == world or not fitting:
        return None
    if entry.get("accumulated_grads") is not None:
        raise StateLoadError(
            f"the checkpoint of {saved_world} rank(s) was saved inside a gradient-accumulation window, with each "
            f"rank's accumulated gradients: they cannot be mapped onto {world} rank(s). Resume with devices x "
            f"num_nodes = {saved_world}, or from a checkpoint saved at an optimizer-step boundary"
        )
    return plan_reshard(entry["ranks"], world, rule)


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a collective: every rank must call it), or ``[obj]`` alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


_AUTOMATIC_STEPS = "epoch_loop.automatic_optimization.optim_progress"
_MANUAL_STEPS = "epoch_loop.manual_optimization.optim_step_progress"


def carry_optimizer_steps(checkpoint: dict, automatic: bool) -> None:
    """Resume a checkpoint of one optimization mode in the other, in place, before Lightning
    restores its loops (the callbacks' ``on_load_checkpoint`` runs first).

    A run may go on eagerly after CUDA graphs (``GraphedTrainingStep`` switches the module to
    manual optimization), or the reverse. Lightning counts optimizer steps, which are the
    trainer's ``global_step``, per mode, so the resumed mode would start again at step 0 and the
    quantizer's clock would refuse that step (events only move forward). The saved mode's count
    is copied to the resumed mode's, when the resumed mode's is zero."""
    try:
        loop = checkpoint["loops"]["fit_loop"]
        auto, manual = loop[_AUTOMATIC_STEPS], loop[_MANUAL_STEPS]
        done = auto["optimizer"]["step"]["total"]["completed"], manual["total"]["completed"]
    except (KeyError, TypeError):  # another layout (another Lightning): left to Lightning's own restore
        return
    if automatic and done[0] == 0 and done[1] > 0:
        auto["optimizer"]["step"] = copy.deepcopy(manual)
        auto["optimizer"]["zero_grad"] = {
            part: {**counts, "started": counts["completed"]} for part, counts in manual.items()
        }
    elif not automatic and done[1] == 0 and done[0] > 0:
        loop[_MANUAL_STEPS] = copy.deepcopy(auto["optimizer"]["step"])


class Fp8StateCallback(Callback):
    """Stateful FP8 quantization that stays correct under activation checkpointing.

    Example::

        import lightning_fp8state as f8s
        cfg = f8s.QuantConfig(history_len=16, amax_algo="max")
        trainer = Trainer(strategy="fp8state_ddp", callbacks=[f8s.lightning.Fp8StateCallback(config=cfg)])

    Args:
        config: the quantizer configuration (a :class:`QuantConfig` or a mapping of its
            fields); default ``QuantConfig()``.
        audit: attach a :class:`RecomputeAuditor` (diagnostic: copies every converted
            layer's output and operands to the host, and reports module state a recompute
            changes); read it with :meth:`audit_report`.
        save_accumulated_grads: when a checkpoint is written inside a gradient-accumulation
            window, store every rank's accumulated gradients in it and restore them on
            resume, so the window continues bit-identically (Lightning itself does not).
            Under ``fp8state_deepspeed`` the strategy stores its engine's window instead
            (ZeRO stage 2) and reads this flag.
        log_metrics: log ``fp8state/violations`` (ledger violations so far) every
            optimizer step.
        verbose: log the full conversion report (every candidate with its status and
            reason) instead of the one summary line with counts.
        report_dir: write the full conversion report there as ``conversion.json`` (rank
            zero); the report is also :attr:`conversion`.
        graph_blocks: train the decoder layers of a Hugging Face model the LightningModule
            holds from per-layer CUDA graphs (:func:`lightning_fp8state.graph_decoder_layers`,
            applied at fit start; each layer checkpointed by the graphs' runner). The layers
            are the ModuleList at ``*.model.layers``, or at ``graph_layers_path``.
        graph_layers_path: the decoder layers' attribute path in the LightningModule
            (``"net.model.layers"``), where ``*.model.layers`` does not find them.
        graph_warmup: eager training batches before the capture (``graph_blocks``).
        graph_backend: what captures and replays (CUDA graphs by default; a stand-in with its
            interface runs the same path on the CPU, for tests).
    """

    def __init__(
        self,
        *,
        config: QuantConfig | Mapping[str, Any] | None = None,
        audit: bool = False,
        save_accumulated_grads: bool = True,
        log_metrics: bool = True,
        verbose: bool = False,
        report_dir: str | os.PathLike | None = None,
        graph_blocks: bool = False,
        graph_layers_path: str | None = None,
        graph_warmup: int = 3,
        graph_backend: Any = None,
    ) -> None:
        super().__init__()
        if config is None:
            config = QuantConfig()
        elif isinstance(config, Mapping):
            config = QuantConfig.from_dict(dict(config))
        require_type("config", config, QuantConfig, "a QuantConfig, a mapping of its fields or None")
        require_bool("audit", audit)
        require_bool("save_accumulated_grads", save_accumulated_grads)
        require_bool("log_metrics", log_metrics)
        require_bool("verbose", verbose)
        require_type("report_dir", report_dir, (str, os.PathLike, type(None)), "a directory path or None")
        require_bool("graph_blocks", graph_blocks)
        require_type("graph_layers_path", graph_layers_path, (str, type(None)), "an attribute path or None")
        require_warmup(graph_warmup)
        if graph_blocks and audit:
            raise MisconfigurationException(
                "Fp8StateCallback(graph_blocks=True, audit=True): the audit compares every call in Python, which a "
                "CUDA-graph replay does not run. Audit a run without graphs"
            )
        self.graph_blocks = graph_blocks
        self.graph_layers_path = graph_layers_path
        self.graph_warmup = graph_warmup
        self.graph_backend = graph_backend
        self.graph_runner = None  # the GraphedBlocks of the decoder layers (graph_blocks=True)
        self.verbose = verbose
        self.report_dir = report_dir
        self.config = config
        self.audit = audit
        self.save_accumulated_grads = save_accumulated_grads
        self.log_metrics = log_metrics
        self.state: Fp8State | None = None
        self.conversion = ConversionReport()
        self.auditor: RecomputeAuditor | None = None
        self.violations_seen = 0
        self._module_id: int | None = None
        self._step_offset = 0
        self._restored = False
        self._grads_pending = False  # gradients accumulated since the last optimizer step
        self._grads_to_restore: dict[str, torch.Tensor] | None = None
        self._close_after_backward = True
        self._drives_events = False
        # a resume on another world size: what the mapping of the saved ranks' state did
        self.reshard_report: ReshardReport | None = None

    # -- setup ---------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._module_id is not None and self._module_id != id(pl_module):
            raise MisconfigurationException(
                "this Fp8StateCallback already serves another LightningModule: its quantizer state "
                "belongs to that model's layers. Create a new Fp8StateCallback for each model"
            )
        if self.state is None:
            self.state = Fp8State(self.config, rank=trainer.global_rank)
        elif self.state.rank != trainer.global_rank:
            raise MisconfigurationException(
                f"this Fp8StateCallback's state belongs to rank {self.state.rank}, but it runs on rank "
                f"{trainer.global_rank}: create a new callback for a run with another process layout"
            )
        # the strategy's choice of engine for unnamed lightning_fp8state.checkpoint calls
        # travels with the state (bound while its events are open), not through a global
        engine = contract_of(trainer.strategy).fp8state_checkpoint_engine
        if engine is not None:
            self.state.checkpoint_engine = engine
        self._module_id = id(pl_module)
        self._convert(trainer, pl_module)
        if self.audit and self.auditor is None:
            self.auditor = RecomputeAuditor(self.state, model=pl_module).__enter__()

    def _convert(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ConversionReport:
        self.state.convert(pl_module)
        report = self.state.last_conversion
        new = self.conversion.merge(report)
        if new.entries():  # one summary line with counts; the full list with verbose=True
            rank_zero_info(f"lightning_fp8state: {new if self.verbose else new.summary()}")
            if self.report_dir is not None and trainer.is_global_zero:
                path = Path(self.report_dir) / "conversion.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(self.conversion.to_dict(), indent=1))
        return report

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers created in LightningModule.configure_model (after setup) are converted now.
        late = self._convert(trainer, pl_module)
        contract = contract_of(trainer.strategy)
        if late.converted and contract.fp8state_converts_before_wrap:
            raise MisconfigurationException(
                f"layers {late.converted} were created in configure_model, after Fp8StateCallback.setup: "
                "under ZeRO stage 3 they must be converted before DeepSpeed wraps the model. Call "
                "`callback.state.convert(self)` at the end of configure_model"
            )
        if late.converted and contract.fp8state_sharded:
            raise MisconfigurationException(
                f"layers {late.converted} were created in configure_model, after Fp8StateCallback.setup: under "
                "FSDP2 they must be converted before fully_shard. Call `callback.state.convert(self)` (then "
                "lightning_fp8state.nn.fsdp.enable_fp8_all_gather(self)) before fully_shard in configure_model"
            )
        self._close_after_backward = pl_module.automatic_optimization
        self._drives_events = bool(getattr(pl_module, DRIVES_EVENTS, False))
        if self.graph_blocks and self.graph_backend is None and trainer.strategy.root_device.type != "cuda":
            raise MisconfigurationException(
                f"Fp8StateCallback(graph_blocks=True): per-layer CUDA graphs need a CUDA device, and this trainer "
                f"runs on {trainer.strategy.root_device.type!r}. Train on a GPU (accelerator='gpu'), or pass "
                "graph_blocks=False: the same training, eagerly"
            )
        if self.graph_blocks and self.graph_runner is None:
            self.graph_runner = graph_decoder_layers(
                pl_module, warmup=self.graph_warmup, backend=self.graph_backend, layers_path=self.graph_layers_path
            )
        if self.state.protocol.amax_reducer is None and trainer.world_size > 1:
            group = contract.fp8state_process_group
            self.state.enable_amax_reduction(group=group, device=trainer.strategy.root_device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        last = self.state.clock.last
        if not self._restored and last is not None and last[0] >= trainer.global_step + self._step_offset:
            # This callback trained before, in another fit: keep its logical clock moving forward.
            self._step_offset = last[0] + 1 - trainer.global_step
        self._restored = False

    # -- events --------------------------------------------------------------------
    def _abort(self, why: str) -> None:
        if self.state is not None and self.state.event is not None:
            log.debug("lightning_fp8state: aborting event %s (%s)", self.state.event, why)
            self.state.abort_event()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._abort("the previous batch was skipped before its end")
        if self._grads_to_restore is not None:
            self._restore_grads(pl_module)
        if self._drives_events:  # the module opens and closes its events (GraphedTrainingStep)
            return
        self.state.begin_event(*self.next_event(trainer))

    def next_event(self, trainer: pl.Trainer) -> tuple[int, int]:
        """The ``(step, microbatch)`` of the next batch's event: optimizer steps so far (moving
        on from an earlier fit of this callback), and the index in the accumulation window."""
        step = trainer.global_step + self._step_offset
        last = self.state.clock.last
        microbatch = last[1] + 1 if last is not None and last[0] == step else 0
        return step, microbatch

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.state.event is not None:
            self.state.commit_forward()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._grads_pending = True
        if self._close_after_backward and self.state.event is not None:
            self.state.end_event()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.state.event is None:
            return
        if self._close_after_backward:
            self._abort("training_step returned None: the batch was skipped")
        else:  # manual optimization: the batch may run several backward passes
            self.state.end_event()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._abort("the rest of the epoch was skipped")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abort(f"{type(exception).__name__} was raised")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._abort("teardown")

    # -- ledger --------------------------------------------------------------------
    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._grads_pending = False
        violations = self.state.ledger.violations
        new = violations[self.violations_seen :]
        self.violations_seen = len(violations)
        if new and self.state.config.strict:
            detail = "; ".join(v.message for v in new[:3])
            raise StateTransitionError(
                f"{len(new)} quantizer protocol violation(s) before this optimizer step: {detail}"
            )
        if self.log_metrics:  # a CPU tensor: a number would be copied to the device, a sync per step
            count = torch.tensor(float(len(violations)), dtype=torch.float32)
            pl_module.log("fp8state/violations", count, on_step=True, on_epoch=False)

    # -- audit ---------------------------------------------------------------------
    def audit_report(self) -> AuditReport:
        """The recompute audit of this rank (requires ``audit=True``)."""
        if self.auditor is None:
            raise MisconfigurationException("audit_report() needs Fp8StateCallback(audit=True)")
        return self.auditor.report()

    # -- checkpoints ---------------------------------------------------------------
    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.state is None:
            return
        grads = None
        # fp8state_deepspeed keeps its engine's window itself (and marks what it could not keep)
        contract = contract_of(trainer.strategy)
        mid_window = self._grads_pending and not contract.fp8state_saves_accumulation
        if mid_window and self.save_accumulated_grads:
            sharded = contract.fp8state_sharded
            if trainer.strategy.handles_gradient_accumulation or sharded:
                where = "sharded across ranks" if sharded else "inside its engine"
                rank_zero_warn(
                    f"lightning_fp8state: a checkpoint is saved inside a gradient-accumulation window, but "
                    f"{type(trainer.strategy).__name__} keeps the accumulated gradients {where}, "
                    "where they cannot be saved: resuming from it loses this window's earlier microbatches. Save at an "
                    "optimizer-step boundary (ModelCheckpoint(every_n_train_steps=...)) for an exact resume"
                )
            else:
                grads = {
                    name: p.grad.detach().cpu().clone()
                    for name, p in pl_module.named_parameters()
                    if p.grad is not None
                }
        try:
            state_dict = self.state.state_dict()
        except StateTransitionError as exc:
            raise StateTransitionError(
                f"{exc}. A Lightning checkpoint can hold the quantizer state between batches only: save from "
                "on_train_batch_end or later (ModelCheckpoint does), not from inside training_step or backward; "
                "SLURM's auto-requeue signal handler saves wherever training is, so pair it with "
                "ModelCheckpoint(every_n_train_steps=...) and resume from that"
            ) from exc
        local = {"state": state_dict, "grads": grads}
        gathered = _gather(local)  # every rank reaches on_save_checkpoint: Lightning dumps on all ranks
        checkpoint[CHECKPOINT_KEY] = {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "world_size": len(gathered),
            "ranks": {r: g["state"] for r, g in enumerate(gathered)},
            "accumulated_grads": {r: g["grads"] for r, g in enumerate(gathered)} if grads is not None else None,
            "callback": {"step_offset": self._step_offset, "violations_seen": self.violations_seen},
            # saved inside an accumulation window whose gradients could not be kept
            "accumulation_lost": bool(mid_window and grads is None),
        }

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if self.state is None:
            raise StateTransitionError("Fp8StateCallback.on_load_checkpoint before setup: nothing to load into")
        carry_optimizer_steps(checkpoint, pl_module.automatic_optimization)
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is None:
            rank_zero_warn(
                "lightning_fp8state: the checkpoint holds no quantizer state (it was written without "
                "Fp8StateCallback): delayed scaling starts from fresh histories"
            )
            return
        if not isinstance(entry, Mapping) or entry.get("format_version") != CHECKPOINT_FORMAT_VERSION:
            version = entry.get("format_version") if isinstance(entry, Mapping) else None
            raise StateLoadError(
                f"checkpoint['{CHECKPOINT_KEY}'] format_version {version!r} is not supported: "
                f"expected {CHECKPOINT_FORMAT_VERSION}"
            )
        saved_world, world, rank = entry["world_size"], trainer.world_size, trainer.global_rank
        ranks = entry["ranks"]
        fitting = trainer.state.fn == TrainerFn.FITTING
        if saved_world != world and check_resume_world_size(entry, world, fitting, self.config.world_size_merge):
            # training on: every rank takes the mapped state (state/reshard.py), copied or merged
            sd, self.reshard_report = reshard_state(ranks, world, rank, self.config.world_size_merge)
            rank_zero_info(self.reshard_report.line())
        elif saved_world != world:
            # Read-only stages (validate/test/predict) may run on another world size: each rank
            # reads the state of saved rank (rank mod saved world size).
            source = rank % saved_world
            rank_zero_info(
                f"lightning_fp8state: evaluating a checkpoint of {saved_world} rank(s) on {world}; "
                f"rank r uses the quantizer state of saved rank r mod {saved_world}"
            )
            sd = Fp8State.remap_rank(ranks[source], rank)
        else:
            sd = ranks[rank]
        self._check_same_model(sd)
        self.state.load_state_dict(sd)
        if entry.get("accumulation_lost"):
            rank_zero_warn(
                "lightning_fp8state: this checkpoint was saved inside a gradient-accumulation window without "
                "its accumulated gradients: the resumed run is not an exact continuation"
            )
        grads = entry.get("accumulated_grads")
        self._grads_to_restore = grads[rank] if grads is not None and saved_world == world else None
        callback_state = entry.get("callback", {})
        self._step_offset = int(callback_state.get("step_offset", 0))
        self.violations_seen = min(int(callback_state.get("violations_seen", 0)), len(self.state.ledger.violations))
        self._restored = True

    def _check_same_model(self, sd: dict) -> None:
        saved_layers = {o[0] for o in sd["bank"]["owners"]} - {"*"}
        # the owners' layer names (an Fp8Experts' are per expert, a packed in-projection's per part)
        unknown = sorted(saved_layers - set(self.conversion.layers()))
        if unknown:
            raise StateLoadError(
                "the checkpoint's quantizer state belongs to a different model: it holds state for "
                f"layers {unknown[:5]}{' ...' if len(unknown) > 5 else ''} that this model does not have "
                f"(converted here: {sorted(self.conversion.converted)[:5]}{' ...' if len(self.conversion.converted) > 5 else ''})"
            )

    def _restore_grads(self, pl_module: pl.LightningModule) -> None:
        grads, self._grads_to_restore = self._grads_to_restore, None
        params = dict(pl_module.named_parameters())
        missing = sorted(set(grads) - set(params))
        if missing:
            raise StateLoadError(
                f"the checkpoint's accumulated gradients name parameters this model lacks: {missing[:5]}"
            )
        for name, grad in grads.items():
            p = params[name]
            p.grad = grad.to(device=p.device, dtype=grad.dtype)
        self._grads_pending = True
