"""QuantProtocol: the rules, enforced per call — own, snapshot, pair, commit once, replay.

Every converted module asks :meth:`QuantProtocol.enter_call` who it is and in which phase
it runs, then quantizes through :meth:`QuantProtocol.quantize`, and checks each snapshot it
consumes with :meth:`QuantProtocol.check_consumer`:

1. Ownership: each call gets owners for its roles (layer × role × rank × stream × site).
2. Snapshot before advance: a true-forward call's snapshot is a view of the event's frozen
   copy of all scales, taken before any commit in the event.
3. Pairing: quantize returns the snapshot with the data; consumers read only it.
4. One commit per owner per event: :meth:`commit_forward` / :meth:`end_event`, batched.
5. Recompute is read-only: it looks up the true forward's call record and records nothing.
6. Stamps: snapshots carry (event, owner, region, ordinal); consumers check them.

This package decides only *which* snapshot a call uses and *whether* it records; *how* a
role's tensor is encoded is its encoder's, and which encoder a role has is the recipe's
(:mod:`lightning_fp8state.quant_recipes`, the one ``config.recipe`` names: ``self.recipe``).
The seed's defects, reproduced on purpose for the audit (``mode="naive"`` /
``"naive_snapshot"``), are quantize policies in :mod:`lightning_fp8state.defects`, handed in
by the facade; this package does not import them.

One concern per module: :mod:`.facade` (:class:`QuantProtocol`: the events and the per-call
entry points), :mod:`.records` (owners and call records), :mod:`.encode` (quantize and
encode), :mod:`.events` (the open event, commits, the amax reduction), :mod:`.sharded`
(FP8 all-gather of sharded weights), :mod:`.templates` (CUDA-graph templates) and
:mod:`.policy` (the quantize-policy port and the audit hooks).
"""

from .encode import release_weight_codes
from .events import take_kept
from .facade import QuantProtocol
from .sharded import ShardSource
from .templates import GraphTemplate

__all__ = ["GraphTemplate", "QuantProtocol", "ShardSource", "release_weight_codes", "take_kept"]
