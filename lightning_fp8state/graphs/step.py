"""GraphedStep: one training event captured in a CUDA graph, replayed with its protocol bookkeeping.

At the model sizes where Python issues a step slower than the GPU runs it, the per-call host
work of every layer (ours and torch's) sets the pace. A CUDA graph removes it: the step's
device work is recorded once and replayed by one launch. The protocol stays exact under a
replay because everything it decides per call is decided once, in Python, at the capture,
and checked there by the usual rules:

- the capture runs one real event under Python (owners, frozen snapshot, records, the
  read-only recompute, one batched commit per phase, the ledger's checks); its device work
  is what every replay runs again: the event's freeze, records into the same pending slots,
  the same batched commits — the state advances exactly once per owner per replay;
- per replay, the host replays the bookkeeping: the clock advances to the replay's event
  (events only move forward) and the ledger counts the captured event's per-owner records
  for it (one commit per owner), without Python per call;
- what would make a replay disagree with its capture is checked on the host before each
  replay, with no device sync: the state bank reallocated (a new owner, a load), an open
  event, an attached auditor (it needs Python per call: audit eagerly), a config change.

The first events run eagerly (``warmup``): owners register and calibrate their first scale
there (both host decisions that a replay could not repeat). Warm-up and capture run on a
side stream that the protocol treats as the caller's stream (one entrant, not two).

Under ``QuantConfig.fallback`` the capture records the event's end too, whose decision reads its
flags on the host: the monitor defers it while the graph captures, and each replay (the capture's
first included) takes it right after the graph ran, reading the flags the replay updated in place
(one host read per event, as eagerly). A move changes what the moved layer's calls do, which the
graph holds: the next call drops the graph and captures again, once per move
(:meth:`GraphedStep.drop_if_stale`; no new warm-up: a move registers no owner).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..config import require_type
from ..errors import ConfigError, StateTransitionError
from ..protocol import QuantProtocol
from .capture import on_side_stream, require_warmup

__all__ = ["GraphedStep"]


class GraphedStep:
    """Run ``body`` as one logical event per call, eagerly for ``warmup`` calls, then from a
    CUDA graph captured at the next call.

    Example::

        def body(x, y):                       # one event: forward + backward
            loss = loss_fn(model(x), y)
            state.commit_forward()
            loss.backward()
            return loss.detach()

        opt = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
        graphed = f8s.GraphedStep(state, body, x0, y0, optimizer=opt)
        for step, (x, y) in enumerate(loader):
            loss = graphed(step, x, y)        # copies x, y into the captured inputs

    Args:
        state: the :class:`~lightning_fp8state.Fp8State` the model was converted with, or
            ``None`` for a model with no quantizer state (a bf16 control captured the same way).
        body: the event's work on the static inputs (forward, ``commit_forward()``,
            backward); what it returns is returned by every call (the same tensors,
            overwritten by each replay: copy them to keep a value).
        *sample_inputs: CUDA tensors of the shapes and dtypes every call passes.
        optimizer: if given, its ``step()`` runs after each event inside the graph (it must
            be built with ``capturable=True``), and gradients live in the graph: each replay
            writes them afresh. One event per optimizer step (no accumulation).
        warmup: eager events before the capture (at least 1).
        microbatch: the microbatch number of every event.

    Raises:
        ConfigError: no CUDA, non-CUDA inputs, ``warmup < 1``, an optimizer that is not
            capturable, or an auditor attached to ``state``.
    """

    def __init__(
        self,
        state,
        body: Callable[..., object],
        *sample_inputs: torch.Tensor,
        optimizer: torch.optim.Optimizer | None = None,
        warmup: int = 3,
        microbatch: int = 0,
    ) -> None:
        if state is not None:
            require_type("state", _protocol_of(state), QuantProtocol, "an Fp8State or None")
            problem = _protocol_of(state).recipe.graph_problem()
            if problem is not None:
                raise ConfigError(f"GraphedStep: {problem}")
        if not torch.cuda.is_available():
            raise ConfigError("GraphedStep needs a CUDA device (CUDA graphs); none is available")
        require_warmup(warmup)
        for i, t in enumerate(sample_inputs):
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                raise ConfigError(f"sample_inputs[{i}]: expected a CUDA tensor, got {_describe(t)}")
        if optimizer is not None and not all(g.get("capturable", False) for g in optimizer.param_groups):
            raise ConfigError(
                f"optimizer: {type(optimizer).__name__} must be built with capturable=True to run inside a "
                "CUDA graph (its step counter then stays on the device)"
            )
        self._refuse_auditors(state)
        self.state = state
        self.body = body
        self.optimizer = optimizer
        self.warmup = warmup
        self.microbatch = int(microbatch)
        self.device = sample_inputs[0].device if sample_inputs else torch.device("cuda", torch.cuda.current_device())
        self.static_inputs = tuple(t.detach().clone() for t in sample_inputs)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs = None
        self.eager_calls = 0
        self.replays = 0
        self._side = torch.cuda.Stream(self.device)
        self._template: dict | None = None
        self._captured_version: int | None = None
        self._captured_config = None
        self.recaptures = 0  # captures after the first (a layer moved by QuantConfig.fallback)
        self._fallback_version: int | None = None  # the fallback's moves the graph holds

    # -- checks ----------------------------------------------------------------------
    @staticmethod
    def _refuse_auditors(state) -> None:
        if state is not None and _protocol_of(state).auditors:
            raise ConfigError(
                "GraphedStep: an auditor is attached to this state; the audit compares every call in "
                "Python, which a CUDA-graph replay does not run. Audit with eager steps, then detach it"
            )

    def _check_replayable(self) -> None:
        state = self.state
        if state is None:
            return
        self._refuse_auditors(state)
        if state.clock.event is not None:
            raise StateTransitionError(
                f"GraphedStep: event {state.clock.event} is still open; a replay is a whole event of its own"
            )
        if state.bank.version != self._captured_version:
            raise StateTransitionError(
                "GraphedStep: the state bank was reallocated after the capture (a new owner registered, "
                "or load_state_dict/to() ran), so the graph would read and write the old tensors: build "
                "a new GraphedStep"
            )
        if state.config is not self._captured_config:
            raise StateTransitionError("GraphedStep: the state's config changed after the capture: build a new one")

    def drop_if_stale(self) -> bool:
        """Drop the graph if ``QuantConfig.fallback`` moved a layer since its capture (the graph
        holds that layer's old calls); the next call captures again. Returns whether it dropped
        it (a caller that keeps the gradients in the graph clears them before that capture)."""
        monitor = None if self.state is None else _protocol_of(self.state).fallback
        if self.graph is None or monitor is None or monitor.version == self._fallback_version:
            return False
        self.graph, self.outputs, self._template = None, None, None
        self.recaptures += 1
        return True

    def _decide_replayed(self, event) -> None:
        """The fallback's decision of the event a replay just ran (deferred at the capture)."""
        monitor = None if self.state is None else _protocol_of(self.state).fallback
        if monitor is not None:
            monitor.decide_replayed(event)

    # -- running ---------------------------------------------------------------------
    def _load_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        if len(inputs) != len(self.static_inputs):
            raise ConfigError(f"GraphedStep: expected {len(self.static_inputs)} inputs, got {len(inputs)}")
        for i, (static, x) in enumerate(zip(self.static_inputs, inputs, strict=True)):
            if not isinstance(x, torch.Tensor) or x.shape != static.shape or x.dtype != static.dtype:
                raise ConfigError(
                    f"GraphedStep input {i}: expected a tensor of shape {tuple(static.shape)} and {static.dtype} "
                    f"(the captured one), got {_describe(x)}"
                )
            if x is not static:
                static.copy_(x, non_blocking=True)

    def _event(self, step: int):
        if self.state is None:
            out = self.body(*self.static_inputs)
        else:
            with self.state.step(step, self.microbatch):
                out = self.body(*self.static_inputs)
        if self.optimizer is not None:
            self.optimizer.step()
        return out

    def _on_side_stream(self, fn):
        """Run ``fn`` on the side stream, as the caller's stream for the protocol."""
        return on_side_stream(self._side, None if self.state is None else _protocol_of(self.state), fn)

    def __call__(self, step: int, *inputs: torch.Tensor):
        """Run event ``(step, microbatch)`` on ``inputs``; returns ``body``'s outputs."""
        self.drop_if_stale()
        if self.graph is not None:
            self._check_replayable()
            self._load_inputs(inputs)
            state = self.state
            if state is not None:
                event = state.clock.begin(step, self.microbatch)
                try:
                    state.ledger.replay(event, self._template)
                finally:
                    state.clock.end()
            self.graph.replay()
            self.replays += 1
            if state is not None:
                self._decide_replayed(event)
            return self.outputs
        self._refuse_auditors(self.state)
        self._load_inputs(inputs)
        if self.eager_calls < self.warmup:
            self.eager_calls += 1

            def eager():
                out = self._event(step)
                if self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                return out

            return self._on_side_stream(eager)
        return self._capture(step)

    def _capture(self, step: int):
        state = self.state
        if state is not None and state.bank.fresh:
            first = state.bank.owners[min(state.bank.fresh)]
            raise StateTransitionError(
                f"GraphedStep: {len(state.bank.fresh)} owner(s) have no delayed scale yet (e.g. {first}): "
                "their first event calibrates on the host's decision, which a replay cannot repeat; "
                "raise warmup so that every owner runs in an eager event first"
            )
        if self.optimizer is not None:
            # gradients are allocated inside the graph and written afresh by every replay
            self.optimizer.zero_grad(set_to_none=True)
        version = None if state is None else state.bank.version
        graph = torch.cuda.CUDAGraph()

        def capture():
            # thread_local: only this thread's work must be capturable. Under the default
            # ("global") a CUDA call that is illegal during a capture made by *any* thread
            # invalidates it, and a DataLoader's pin-memory thread (pin_memory=True, as in
            # every GPU recipe) allocates pinned host memory whenever it likes: the capture
            # then failed at random (cudaErrorStreamCaptureInvalidated).
            with torch.cuda.graph(graph, stream=self._side, capture_error_mode="thread_local"):
                return self._event(step)

        outputs = self._on_side_stream(capture)
        if state is not None:
            self._template = self._captured_template(version)
            self._captured_version, self._captured_config = version, state.config
            monitor = _protocol_of(state).fallback
            self._fallback_version = None if monitor is None else monitor.version
        self.graph, self.outputs = graph, outputs
        graph.replay()  # the capture recorded the work of this call's event; run it
        self.replays += 1
        if state is not None:
            self._decide_replayed(state.clock.last)
        return outputs

    def _captured_template(self, version: int) -> dict:
        """The captured event's per-owner ledger records (what every replay counts again;
        in strict mode a violation already raised during the capture)."""
        state = self.state
        if state.bank.version != version:
            raise StateTransitionError(
                "GraphedStep: an owner registered during the capture (the bank was reallocated); "
                "raise warmup so that every layer runs in an eager event first"
            )
        return state.ledger.event(state.clock.last)


def _protocol_of(state):
    """The protocol behind an ``Fp8State`` (or a protocol itself)."""
    return getattr(state, "protocol", state)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}, {x.dtype} on {x.device}"
    return type(x).__name__
