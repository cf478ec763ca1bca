"""Who may own a slot: a request, or a node of the radix tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType, TypeAlias

__all__ = ["SlotId", "RequestOwner", "NodeOwner", "Owner"]

SlotId = NewType("SlotId", int)
"""Index of a slot in a :class:`~linear_state.LinearStatePool`, in ``[0, capacity)``."""


@dataclass(frozen=True, slots=True)
class RequestOwner:
    """A request of the host scheduler. Its forward passes may write the slots it owns."""

    rid: object

    def __str__(self) -> str:
        return f"request {self.rid!r}"


@dataclass(frozen=True, slots=True)
class NodeOwner:
    """A node of the radix tree. A slot it owns is a frozen snapshot: nobody writes it again."""

    node_id: int

    def __str__(self) -> str:
        return f"tree node {self.node_id}"


Owner: TypeAlias = RequestOwner | NodeOwner
