"""Per-block CUDA graphs for a Hugging Face model's decoder layers, its own forward loop kept.

A Hugging Face model loops over ``model.model.layers`` itself, calling each layer with the
hidden state and the step's side inputs (rotary cos/sin, mask, position ids, flags). So the
layers stay where they are (the state-dict keys, ``isinstance`` checks and hooks unchanged) and
each one's ``forward`` is routed, while training, to :meth:`GraphedBlocks.call_inside` of one
runner shared by the stack; the runner runs the layer's original forward (checkpointed) in the
warm-up and the capture, and its graphs after. The routing sits inside the layer's call, past
its module hooks: under FSDP2 each layer is a unit whose hooks gather its parameters, cast its
inputs (a ``MixedPrecisionPolicy``) and hook its backward around what the runner does, as
around the layer's own forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConfigError
from .blocks import GraphedBlocks

__all__ = ["find_decoder_layers", "graph_decoder_layers"]

# the runner a graphed ModuleList holds (a plain attribute: not a submodule, not in the state dict)
RUNNER_ATTR = "fp8state_graphs"


class _GraphedLayerForward:
    """A decoder layer's ``forward`` while graphed: training calls go to the shared runner,
    others (evaluation, no grad) to the layer's original forward."""

    def __init__(self, runner: GraphedBlocks, index: int, layer: nn.Module, original: Callable) -> None:
        self.runner, self.index, self.layer, self.original = runner, index, layer, original

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.original(hidden_states, *args, **kwargs)
        if getattr(self.layer, "gradient_checkpointing", False) and self.layer.training:
            raise ConfigError(
                f"graph_decoder_layers: layer {self.index} has Hugging Face gradient checkpointing on; the graphed "
                "runner checkpoints every layer itself. Call model.gradient_checkpointing_disable()"
            )
        # inside the layer's own call: an FSDP2 unit's hooks ran (parameters gathered, inputs cast)
        return self.runner.call_inside(self.index, hidden_states, *args, **kwargs)


def find_decoder_layers(module: nn.Module, path: str | None = None) -> nn.ModuleList:
    """The ModuleList of a Hugging Face model's decoder layers inside ``module``.

    Args:
        module: the model (``LlamaForCausalLM``, its ``.model``), or anything holding one
            (a LightningModule), or the ModuleList itself.
        path: the list's attribute path from ``module`` (``"net.model.layers"``); default:
            the one submodule whose name is ``model.layers`` or ends with ``.model.layers``
            (or ``layers`` on a bare decoder model).

    Raises:
        ConfigError: no such ModuleList, or several.
    """
    if isinstance(module, nn.ModuleList) and path is None:
        return module
    if path is not None:
        try:
            found = module.get_submodule(path)
        except AttributeError as exc:
            raise ConfigError(f"layers_path: {path!r} is not a submodule of {type(module).__name__}: {exc}") from exc
        if not isinstance(found, nn.ModuleList):
            raise ConfigError(f"layers_path: expected {path!r} to be an nn.ModuleList, got {type(found).__name__}")
        return found
    lists = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, nn.ModuleList) and (name == "model.layers" or name.endswith(".model.layers"))
    ]
    if not lists and isinstance(getattr(module, "layers", None), nn.ModuleList):
        lists = [("layers", module.layers)]
    if len(lists) != 1:
        names = [n for n, _ in lists]
        raise ConfigError(
            f"graph_decoder_layers: expected one ModuleList of decoder layers at '*.model.layers' in "
            f"{type(module).__name__}, found {names or 'none'}; pass its path (layers_path='...')"
        )
    return lists[0][1]


def graph_decoder_layers(
    model: nn.Module,
    *,
    warmup: int = 3,
    checkpoint: bool = True,
    backend=None,
    layers_path: str | None = None,
) -> GraphedBlocks:
    """Train a Hugging Face model's decoder layers from per-layer CUDA graphs, through its own
    forward loop.

    Example::

        model = state.convert(LlamaForCausalLM(config))
        f8s.graph_decoder_layers(model, warmup=3)
        # train as usual, inside the state's events (the Lightning callback opens them), with
        # use_cache=False, fixed shapes, dropout 0 and without HF gradient checkpointing

    Every layer of the list is checkpointed (``checkpoint=True``) and run, while training, by
    one :class:`GraphedBlocks` (warm-up, capture, replay per pass over the layers); the
    hidden state is chained, the other arguments are the step's constants (see
    :meth:`GraphedBlocks.call_block`). Evaluation (no grad) runs the layers as before.

    Args:
        model: the model, or anything holding it, or the ModuleList of its layers.
        warmup: eager training passes before the capture (at least 1).
        checkpoint: activation-checkpoint every layer (the runner's own checkpoint).
        backend: what captures and replays (CUDA graphs by default; a stand-in for tests).
        layers_path: the layers' attribute path, where ``*.model.layers`` does not find them.

    Returns:
        The runner (its ``eager_calls``, ``replays`` and ``graphs`` tell how training ran).

    Raises:
        ConfigError: no decoder layers found, layers already graphed, a layer with an
            instance ``forward`` of its own, HF gradient checkpointing on.
    """
    layers = find_decoder_layers(model, layers_path)
    if getattr(layers, RUNNER_ATTR, None) is not None:
        raise ConfigError("graph_decoder_layers: these decoder layers are graphed already")
    originals = []
    for i, layer in enumerate(layers):
        if "forward" in layer.__dict__:
            raise ConfigError(
                f"graph_decoder_layers: layer {i} ({type(layer).__name__}) has a forward of its own instance; "
                "the graphs route the class's forward. Remove it, or train without graphs"
            )
        if getattr(layer, "gradient_checkpointing", False):
            raise ConfigError(
                f"graph_decoder_layers: layer {i} has Hugging Face gradient checkpointing on; the graphed runner "
                "checkpoints every layer itself. Call model.gradient_checkpointing_disable() first"
            )
        originals.append(layer.forward)  # the class's forward, bound
    runner = GraphedBlocks(list(layers), warmup=warmup, checkpoint=checkpoint, backend=backend, forwards=originals)
    for i, (layer, original) in enumerate(zip(layers, originals, strict=True)):
        layer.forward = _GraphedLayerForward(runner, i, layer, original)
    object.__setattr__(layers, RUNNER_ATTR, runner)
    return runner
