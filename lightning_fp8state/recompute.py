"""Recompute tracking: checkpoint regions, forward-vs-recompute phase, the snapshot stash.

``checkpoint(fn, *args, engine=...)`` wraps torch's or DeepSpeed's activation
checkpointing. Every call of a region in the true forward gets a region key; the engine's
later re-run of ``fn`` runs under the same key with phase RECOMPUTE, so each quantizer
call inside finds exactly the snapshot its true forward made, in any traversal order.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import itertools
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .config import require_choice
from .errors import AmbiguousRecomputeError, ConfigError, SelectiveCheckpointError
from .sac import outside_selective_checkpoint, storage_mismatch
from .state import Event, OwnerKey, QuantSnapshot

__all__ = [
    "ENGINES",
    "AutocastState",
    "BufferRestore",
    "CallRecord",
    "Phase",
    "RegionFrame",
    "SnapshotStash",
    "bind_event_engine",
    "buffers_restored",
    "checkpoint",
    "current_frame",
    "default_engine",
    "in_backward",
    "unbind_event_engine",
]

ENGINES = ("torch", "deepspeed")
# The engine of ``checkpoint(fn, *args)`` calls that name none travels with the state, not
# through a process-wide default: an Fp8State binds its ``checkpoint_engine`` here while its
# logical event is open (in this thread's context), and unbinds it when the event closes.
_event_engine: contextvars.ContextVar[str | None] = contextvars.ContextVar("fp8state_event_engine", default=None)


def _check_engine(engine: str) -> None:
    require_choice("engine", engine, ENGINES)


def default_engine() -> str:
    """The engine :func:`checkpoint` uses here when called without ``engine``.

    The ``checkpoint_engine`` of the Fp8State whose event is open in this context; inside a
    region where that binding is not visible (a recompute run by the autograd engine's device
    thread), the one its enclosing region's call resolved; else ``"torch"``.
    """
    bound = _event_engine.get()
    if bound is not None:
        return bound
    frame = current_frame()
    return frame.default_engine if frame is not None else "torch"


def bind_event_engine(engine: str) -> contextvars.Token:
    """Make ``engine`` the default of :func:`checkpoint` in this context until
    :func:`unbind_event_engine` (called by a state at its event's open and close)."""
    _check_engine(engine)
    return _event_engine.set(engine)


def unbind_event_engine(token: contextvars.Token) -> None:
    """Undo :func:`bind_event_engine`."""
    try:
        _event_engine.reset(token)
    except ValueError:  # closed from another context than it was opened in
        _event_engine.set(None)


class Phase(enum.Enum):
    FORWARD = "forward"  # the true forward: records amax, stashes snapshots
    RECOMPUTE = "recompute"  # checkpoint re-run during backward: read-only
    INFERENCE = "inference"  # outside any event with grad off: read live state, record nothing


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings a region's true forward ran under, re-entered by its recompute.

    torch's checkpoint saves them itself; DeepSpeed's does not, and its recompute (run by the
    autograd engine, outside the user's ``torch.autocast``) then computed the region's
    non-quantized ops in float32: inputs of the quantized layers differed from the true
    forward's. :func:`checkpoint` captures this at every region's true forward and re-enters it
    around every recompute, whatever the engine.

    Attributes:
        devices: ``(device_type, enabled, dtype)`` for each device type whose autocast state
            is kept (the CPU, CUDA when it is available, and the device types of the region's
            tensor inputs).
        cache_enabled: the process's autocast weight-cache setting.
    """

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache_enabled: bool

    @classmethod
    def capture(cls, args: tuple) -> AutocastState:
        """The autocast state in force now, for the CPU, CUDA and the devices of ``args``."""
        types = ["cpu"]
        if torch.cuda.is_available():
            types.append("cuda")
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type not in types:
                types.append(a.device.type)
        devices = []
        for t in types:
            try:
                devices.append((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)))
            except RuntimeError:  # a device type autocast does not know (e.g. "meta")
                continue
        return cls(tuple(devices), torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body under exactly this autocast state (enabled or not, dtype, cache)."""
        with contextlib.ExitStack() as stack:
            for device_type, enabled, dtype in self.devices:
                stack.enter_context(
                    torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled)
                )
            yield


@dataclass
class RegionFrame:
    """One running instance of a checkpoint region on this thread."""

    key: tuple
    phase: Phase
    layer_calls: defaultdict = field(default_factory=lambda: defaultdict(int))
    child_regions: int = 0
    default_engine: str = "torch"  # what an unnamed checkpoint() nested in this region runs

    def next_ordinal(self, layer: str) -> int:
        n = self.layer_calls[layer]
        self.layer_calls[layer] = n + 1
        return n


_tls = threading.local()
_region_counter = itertools.count()


def _stack() -> list[RegionFrame]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def current_frame() -> RegionFrame | None:
    """The innermost checkpoint region running on this thread, if any."""
    stack = _stack()
    return stack[-1] if stack else None


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (recompute too)."""
    return torch._C._current_graph_task_id() != -1


def _new_region_key() -> tuple:
    parent = current_frame()
    if parent is None:
        return ("region", next(_region_counter))
    parent.child_regions += 1
    return (*parent.key, parent.child_regions - 1)


def checkpoint(
    fn: Callable,
    *args: Any,
    engine: str | None = None,
    use_reentrant: bool = False,
    restore_buffers: bool | nn.Module | Iterable[nn.Module] = True,
    **kwargs: Any,
):
    """Activation-checkpoint ``fn(*args, **kwargs)`` so that stateful quantizers inside
    replay their true-forward snapshots during recompute.

    Args:
        fn: the region body (a module or function).
        *args: its positional inputs.
        engine: ``"torch"`` (``torch.utils.checkpoint.checkpoint``) or ``"deepspeed"``
            (``deepspeed.checkpointing.checkpoint``, always reentrant; no ``configure``
            needed on the CPU). ``None``: :func:`default_engine` (the open event's state's
            ``checkpoint_engine``: ``"torch"`` unless set, e.g. by the fp8state_deepspeed
            strategy), or ``"torch"`` when torch-only keyword arguments are given.
        use_reentrant: torch engine only: the reentrant (True) or non-reentrant variant.
        restore_buffers: keep the recompute from changing module buffers (BatchNorm's
            running statistics and ``num_batches_tracked``, any registered buffer): every
            buffer the region's true forward changed is copied when the recompute enters the
            region and written back when it leaves it (early stop included), so after backward
            the buffers hold what the forward left, as without checkpointing. ``True``: the
            buffers of the modules the region can be seen to run: ``fn`` itself if it is a
            module, the module of a bound method (``block.forward``, ``layer.__call__``), the
            modules in a ``functools.partial`` or directly in ``fn``'s closure, and modules
            passed as region arguments; pass the module(s) instead for anything else (a
            compiled function, modules reached through other objects). ``False``: off. See
            :class:`BufferRestore` for what it covers.
        **kwargs: passed to the engine (torch: ``preserve_rng_state``, ``context_fn``,
            ``determinism_check``, ``debug``, ``early_stop``; region keyword inputs are
            passed to ``fn`` only by the non-reentrant torch engine).

    Returns:
        Whatever ``fn`` returns.
    """
    nested_default = default_engine()
    if engine is None:  # torch-only keywords keep the torch engine
        engine = "torch" if kwargs else nested_default
    _check_engine(engine)
    buffers = BufferRestore.for_region(fn, args, kwargs, restore_buffers)
    region = _region_body(fn, _new_region_key(), buffers, nested_default)
    if engine == "deepspeed":
        import deepspeed  # noqa: PLC0415  (heavy; only when asked for)

        if kwargs:
            raise ConfigError(f"engine='deepspeed' takes no keyword arguments; got {sorted(kwargs)}")
        return deepspeed.checkpointing.checkpoint(region, *args)
    return torch_checkpoint(region, *args, use_reentrant=use_reentrant, **kwargs)


def _region_body(fn: Callable, key: tuple, buffers: BufferRestore, nested_default: str) -> Callable:
    """The function an engine checkpoints in place of ``fn``: its first call outside backward is
    the true forward (its autocast state kept), every later call a recompute (run under that
    autocast state); each call runs inside a :class:`RegionFrame` of region ``key`` with its
    buffers restored around a recompute (:class:`BufferRestore`)."""
    calls = itertools.count()
    forward_autocast: list[AutocastState] = []  # the true forward's, set at its call

    def region(*inner_args, **inner_kwargs):
        first = next(calls) == 0
        phase = Phase.FORWARD if first and not in_backward() else Phase.RECOMPUTE
        if phase is Phase.FORWARD:
            forward_autocast.append(AutocastState.capture(inner_args))
            autocast = contextlib.nullcontext()
        else:  # every engine's recompute runs under the true forward's autocast state
            autocast = forward_autocast[0].entered() if forward_autocast else contextlib.nullcontext()
        stack = _stack()
        stack.append(RegionFrame(key, phase, default_engine=nested_default))
        buffers.enter(phase)
        try:
            with autocast:
                return fn(*inner_args, **inner_kwargs)
        except RuntimeError as exc:
            if phase is Phase.RECOMPUTE and storage_mismatch(exc):  # torch SAC: say what to do
                raise _recompute_mismatch(key, exc) from exc
            raise
        finally:
            # torch's early stop raises out of the region mid-body: leave it here anyway.
            buffers.exit(phase)
            stack.pop()

    return region


def _recompute_mismatch(key: tuple, exc: RuntimeError) -> SelectiveCheckpointError:
    """torch's selective checkpointing saw other ops in the recompute of region ``key``
    (``exc``): the error that says why, and what to do."""
    return SelectiveCheckpointError(
        f"checkpoint region {key}: torch's selective activation checkpointing saw another op "
        f"sequence in the recompute than in the true forward ({exc}). lightning_fp8state's "
        "quantizers issue the same ops in both runs, so the region's own code differs between "
        "them: a branch on state that changed after the forward (a counter or module attribute "
        "written in forward, randomness outside torch's RNG). Make the region's forward a "
        "function of its inputs, or checkpoint it without context_fn. A region that "
        "torch.compile compiled during its true forward (the process's first compile) shows the "
        "compiler's ops in the forward only: run the compiled region once before checkpointing "
        "it selectively (under torch.no_grad, or a step without context_fn)"
    )


@dataclass
class CallRecord:
    """One true-forward call of a converted module: its identity and its snapshots."""

    event: Event | None
    layer: str
    site: int
    region: tuple | None
    ordinal: int
    stream: int  # stream ordinal
    stream_ident: tuple
    owners: dict[str, OwnerKey]
    indices: dict[str, int]
    snapshots: dict[str, QuantSnapshot]
    recomputes: int = 0
    used: dict = field(default_factory=dict)  # role -> the snapshot the last run consumed
    # what the call derives from its parameters once per event, for its recomputes to reuse
    # (the parameters do not change inside an event): e.g. Fp8Linear's bias in the GEMM's dtype
    derived: dict = field(default_factory=dict)
    # whether a recompute of the call may come in the event (read at the call's entry:
    # records.recompute_may_follow); where none can, the weight codes are not held for one
    may_recompute: bool = True


class SnapshotStash:
    """True-forward call records of the open event, keyed by (event, region, layer, ordinal).

    Released at every event's end: torch's early stop may leave some never read.
    """

    def __init__(self) -> None:
        self._by_region: dict[tuple, CallRecord] = {}
        self._by_layer: defaultdict[tuple, list[CallRecord]] = defaultdict(list)
        self._lock = threading.Lock()

    def put(self, record: CallRecord) -> None:
        with self._lock:
            if record.region is not None:
                self._by_region[(record.event, record.region, record.layer, record.ordinal)] = record
            self._by_layer[(record.event, record.layer)].append(record)

    def find(self, event: Event, frame: RegionFrame | None, layer: str) -> CallRecord:
        """The true-forward call a recompute of ``layer`` replays.

        Inside a wrapped region the (region, ordinal) key decides. Outside one (a plain
        torch or DeepSpeed checkpoint), the layer's only call in the event is served.

        Raises:
            AmbiguousRecomputeError: no unique true-forward call matches.
        """
        with self._lock:
            if frame is not None:
                ordinal = frame.next_ordinal(layer)
                hit = self._by_region.get((event, frame.key, layer, ordinal))
                if hit is not None:
                    hit.recomputes += 1
                    return hit
            candidates = self._by_layer.get((event, layer), [])
            if len(candidates) == 1:
                candidates[0].recomputes += 1
                return candidates[0]
        if not candidates:
            raise AmbiguousRecomputeError(
                f"layer {layer!r} is being recomputed in event {event} but ran no true forward in "
                "it: was the model called outside state.step(), or the event closed before backward?"
            )
        raise AmbiguousRecomputeError(
            f"layer {layer!r} ran {len(candidates)} times in event {event} and is being recomputed "
            "by a checkpoint this package cannot see, so which call's snapshot to replay is "
            "ambiguous: wrap each checkpointed region in lightning_fp8state.checkpoint(fn, *args, "
            "engine='torch'|'deepspeed')"
        )

    def records(self) -> list[CallRecord]:
        with self._lock:
            return [r for recs in self._by_layer.values() for r in recs]

    def release(self) -> None:
        with self._lock:
            self._by_region.clear()
            self._by_layer.clear()

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_layer.values())


def _restoring() -> dict[int, int]:
    """id(module) -> recomputes in flight on this thread that will restore its buffers."""
    restoring = getattr(_tls, "restoring", None)
    if restoring is None:
        restoring = _tls.restoring = {}
    return restoring


def buffers_restored(module: nn.Module) -> bool:
    """Whether a recompute running on this thread will write ``module``'s buffers back when its
    region ends (:class:`BufferRestore`): what the recompute changes there does not last."""
    return id(module) in _restoring()


def _modules_seen_in(obj: Any, found: dict[int, nn.Module], depth: int = 0) -> None:
    """The modules ``obj`` visibly runs: itself, a bound method's owner, a ``functools.partial``'s
    function and arguments, ``__wrapped__``, and modules directly in a function's closure."""
    if depth > 3 or obj is None:
        return
    if isinstance(obj, nn.Module):
        found.setdefault(id(obj), obj)
        return
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, nn.Module):
        found.setdefault(id(owner), owner)
    if isinstance(obj, functools.partial):
        for part in (obj.func, *obj.args, *obj.keywords.values()):
            _modules_seen_in(part, found, depth + 1)
        return
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None and wrapped is not obj:
        _modules_seen_in(wrapped, found, depth + 1)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(content, nn.Module) or isinstance(getattr(content, "__self__", None), nn.Module):
            _modules_seen_in(content, found, depth + 1)


class BufferRestore:
    """Keeps a checkpoint region's recompute from changing module buffers.

    A checkpointed region runs its forward twice; whatever state the forward updates (BatchNorm's
    ``running_mean``/``running_var``/``num_batches_tracked``, any registered buffer) is updated
    twice, so a checkpointed run drifts from the same run without checkpointing. When a recompute
    enters the region, every buffer of the watched modules is copied; when it leaves (also when
    torch's early stop raises out of it), each buffer is written back (and put back in its module,
    had the recompute replaced it), so after backward each holds what the true forward (and
    anything after it) left. Nothing is copied in the true forward. All buffers are copied, not
    only the ones the forward changed: BatchNorm's kernels update the running statistics in place
    without moving their version counters, so no cheap test tells which ones did. The copies are
    device ops (no host sync), outside torch SAC's modes (its recompute must issue the forward's
    ops); a region's buffers cost one copy and one write-back per recompute. The write-back leaves
    the buffers' version counters alone, as BatchNorm's own update does: the recompute's graph
    saved them, and the reentrant engines run its backward after the region has left.

    What it does not do: the recompute itself still reads the buffers as the whole forward left
    them, so a forward that *reads* state it writes (a counter deciding a branch) recomputes
    differently (the audit reports it: ``StateChange``; ``SelectiveCheckpointError`` under SAC);
    plain attributes are not buffers and are not restored; modules the region runs but
    :func:`checkpoint` cannot see (see its ``restore_buffers``) are not watched; torch's and
    DeepSpeed's own checkpoint functions (called without :func:`checkpoint`) restore nothing.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        seen: dict[int, nn.Module] = {}
        for root in modules:
            for module in root.modules():
                seen.setdefault(id(module), module)
        self.modules = [m for m in seen.values() if m._buffers]
        self._copies: list[list] = []  # a stack, one entry per recompute in flight

    @classmethod
    def for_region(cls, fn: Callable, args: tuple, kwargs: dict, restore_buffers) -> BufferRestore:
        """The restore :func:`checkpoint` runs for ``fn(*args, **kwargs)`` (see its
        ``restore_buffers``); one that does nothing when it is ``False`` or finds no buffer.

        Raises:
            ConfigError: ``restore_buffers`` is none of the allowed values.
        """
        if restore_buffers is False:
            return cls([])
        if restore_buffers is True:
            found: dict[int, nn.Module] = {}
            for obj in (fn, *args, *kwargs.values()):
                _modules_seen_in(obj, found)
            return cls(list(found.values()))
        if isinstance(restore_buffers, nn.Module):
            return cls([restore_buffers])
        modules = list(restore_buffers) if isinstance(restore_buffers, (list, tuple)) else None
        if modules is None or not all(isinstance(m, nn.Module) for m in modules):
            shown = (
                f"<{type(restore_buffers).__name__} of {', '.join(type(m).__name__ for m in modules)}>"
                if modules is not None
                else repr(restore_buffers)
            )
            raise ConfigError(
                f"restore_buffers={shown} is not allowed: expected True, False, an nn.Module "
                "or a list/tuple of nn.Modules (whose buffers the recompute must leave as the forward did)"
            )
        return cls(modules)

    @torch.compiler.disable
    def enter(self, phase: Phase) -> None:
        """Called as the region's body starts: a recompute copies the buffers."""
        if phase is Phase.RECOMPUTE and self.modules:
            self._copies.append(outside_selective_checkpoint(self._copy))
            restoring = _restoring()
            for module in self.modules:
                restoring[id(module)] = restoring.get(id(module), 0) + 1

    @torch.compiler.disable
    def exit(self, phase: Phase) -> None:
        """Called as the region's body ends (in ``finally``): a recompute writes them back."""
        if phase is Phase.RECOMPUTE and self.modules:
            outside_selective_checkpoint(self._restore, self._copies.pop())
            restoring = _restoring()
            for module in self.modules:
                left = restoring.pop(id(module)) - 1
                if left:
                    restoring[id(module)] = left

    def _copy(self) -> list:
        with torch.no_grad():
            return [
                (module, name, buf, buf.detach().clone())
                for module in self.modules
                for name, buf in module._buffers.items()
                if buf is not None
            ]

    @staticmethod
    def _restore(copies: list) -> None:
        with torch.no_grad():
            for module, name, buf, saved in copies:
                if module._buffers.get(name) is not buf:  # replaced (``self.count = self.count + 1``)
                    module._buffers[name] = buf
                # through .data: the buffer's version counter stays where the recompute left it.
                # Autograd saved it in the recompute's graph (BatchNorm's node keeps its running
                # statistics), and the reentrant engines run that graph's backward after this.
                buf.data.copy_(saved)
