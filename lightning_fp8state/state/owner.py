"""Owner identity: who a piece of delayed quantizer state belongs to."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import require_choice
from ..errors import ConfigError

__all__ = [
    "ATTENTION_ROLES",
    "BACKWARD_ROLES",
    "FORWARD_ROLES",
    "OwnerKey",
    "register_role",
    "role_phase",
    "scoped_owner",
]

# Roles whose amax is observed in the forward pass (committed by commit_forward) and in
# the backward pass (committed at the event's end).
FORWARD_ROLES: set[str] = {"input", "weight", "attn_q", "attn_k", "attn_v"}
BACKWARD_ROLES: set[str] = {"grad_output"}
# Attention operands, quantized as packed FP4 (QuantConfig.attn_format) rather than FP8.
ATTENTION_ROLES: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")


def register_role(name: str, phase: str) -> None:
    """Add a quantization role; ``phase`` is ``"forward"`` or ``"backward"``."""
    require_choice("phase", phase, ("forward", "backward"), why=f"the phase of role {name!r}")
    (FORWARD_ROLES if phase == "forward" else BACKWARD_ROLES).add(name)


def role_phase(role: str) -> str:
    """``"forward"`` or ``"backward"``: when the role's amax is observed and committed."""
    if role in FORWARD_ROLES:
        return "forward"
    if role in BACKWARD_ROLES:
        return "backward"
    raise ConfigError(f"unknown quantization role {role!r}: expected one of {sorted(FORWARD_ROLES | BACKWARD_ROLES)}")


@dataclass(frozen=True, order=True)
class OwnerKey:
    """One independent entrant of a stateful quantizer: layer × role × rank × stream × site.

    ``site`` tells apart calls of one module inside one logical event (weight tying):
    each call site owns its own history.
    """

    layer: str
    role: str
    rank: int = 0
    stream: int = 0
    site: int = 0

    # Owner keys are hashed on every quantize call (ledger, stash, pending maps): the hash is
    # computed once. It is derived state, so pickling carries the fields only and the hash is
    # recomputed on load (string hashes differ between processes).
    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.layer, self.role, self.rank, self.stream, self.site)))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict:
        return {"layer": self.layer, "role": self.role, "rank": self.rank, "stream": self.stream, "site": self.site}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __str__(self) -> str:
        return f"{self.layer}#{self.site}.{self.role}@rank{self.rank}/stream{self.stream}"

    def as_list(self) -> list:
        """Plain values for checkpoints (loadable with ``weights_only=True``)."""
        return [self.layer, self.role, self.rank, self.stream, self.site]

    @classmethod
    def from_list(cls, values: list) -> OwnerKey:
        layer, role, rank, stream, site = values
        return cls(str(layer), str(role), int(rank), int(stream), int(site))


def scoped_owner(scope: str, layer: str, role: str, rank: int, stream: int, site: int) -> OwnerKey:
    """The owner key that ``scope`` (QuantConfig.ownership) gives this entrant.

    ``per_model`` collapses every layer onto one owner per role: the seed's defect.
    """
    if scope == "per_model":
        return OwnerKey("*", role)
    if scope == "per_layer":
        return OwnerKey(layer, role, 0, 0, site)
    if scope == "per_layer_rank":
        return OwnerKey(layer, role, rank, 0, site)
    return OwnerKey(layer, role, rank, stream, site)
