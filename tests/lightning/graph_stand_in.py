"""GraphedStep's interface run eagerly on the CPU, for the Lightning wiring of GraphedTrainingStep.

A CUDA graph needs a GPU; what the Lightning side must get right does not: the event numbers,
the callback standing down, the gradients cleared before the capture and never after, the
optimizer and schedule stepped through Lightning, the hooks, the checkpoints. This stand-in
runs the warm-up events eagerly like GraphedStep, "captures" at the next call, and runs every
later call as a replay does: the event writes its gradients afresh into the tensors the capture
left in ``.grad`` (the same objects, values overwritten). It asserts that those tensors are still
the parameters' gradients when a replay starts, as the real graph needs. The real replay is
tested on the GPU (tests/gpu/test_graphed_training_cuda.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class EagerGraphStandIn:
    def __init__(
        self,
        state,
        body: Callable,
        *sample_inputs: torch.Tensor,
        params: Callable[[], Iterable[torch.Tensor]],
        warmup: int = 3,
        microbatch: int = 0,
    ) -> None:
        self.state, self.body, self.warmup, self.microbatch = state, body, warmup, microbatch
        self.params = params
        self.graph = None
        self.eager_calls = 0
        self.replays = 0
        self.events: list[tuple[int, int]] = []
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.recaptures = 0
        self._fallback_version = None

    def _fallback_moves(self):
        monitor = None if self.state is None else self.state.protocol.fallback
        return None if monitor is None else monitor.version

    def drop_if_stale(self) -> bool:
        """GraphedStep's: drop the "graph" when QuantConfig.fallback moved a layer since the capture
        (the capture holds the moves made before its event: one its own event makes is later)."""
        if self.graph is None or self._fallback_moves() == self._fallback_version:
            return False
        self.graph = None
        self.recaptures += 1
        return True

    def _event(self, step: int, inputs):
        self.events.append((step, self.microbatch))
        if self.state is None:
            return self.body(*inputs)
        with self.state.step(step, self.microbatch):
            return self.body(*inputs)

    def __call__(self, step: int, *inputs: torch.Tensor):
        if self.graph is None:
            if any(p.grad is not None for p in self.params()):
                raise AssertionError("an eager or capture event started with gradients left from the last step")
            moves = self._fallback_moves()
            out = self._event(step, inputs)
            if self.eager_calls < self.warmup:
                self.eager_calls += 1
            else:  # the capture: what .grad holds now is what every replay writes
                self.graph = "captured"
                self._captured = [(p, p.grad) for p in self.params() if p.grad is not None]
                self._fallback_version = moves
                self.replays += 1
            return out
        for p, g in self._captured:
            if p.grad is not g:
                raise AssertionError("a replay started with a parameter's .grad not the captured gradient tensor")
            p.grad = None
        out = self._event(step, inputs)
        for p, g in self._captured:
            g.copy_(p.grad)  # the replay's write into the captured memory
            p.grad = g
        self.replays += 1
        return out


def for_model(model_of_body: Callable[[Callable], torch.nn.Module]):
    """A runner factory for GraphedTrainingStep(runner=...): the stand-in, its parameters those
    of the module ``model_of_body(body)`` returns."""

    def factory(state, body, *inputs, warmup: int = 3, microbatch: int = 0):
        model = model_of_body(body)
        return EagerGraphStandIn(state, body, *inputs, params=model.parameters, warmup=warmup, microbatch=microbatch)

    return factory


def model_of_graphed_body(body) -> torch.nn.Module:
    """The module whose bound ``loss`` method a GraphedTrainingStep's event body computes."""
    return body.__self__.loss_fn.__self__
