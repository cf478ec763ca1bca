"""Who may own a slot: a request, or a node of the radix tree."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TypeAlias

__all__ = ["SlotId", "RequestOwner", "NodeOwner", "Owner"]


class SlotId(int):
    """Index of a slot in a :class:`~linear_state.LinearStatePool`, in ``[0, capacity)``, that
    remembers which pool handed it out.

    It is an ``int`` everywhere (indexing, tensors, arithmetic, equality and hashing by value);
    ``pool_id`` is the :attr:`~linear_state.LinearStatePool.pool_id` of the pool that made it, or 0
    for an id built by hand. Every pool call given a slot id of another pool raises
    :class:`~linear_state.ForeignSlot` before it touches anything; plain ints (and ids with
    ``pool_id`` 0) are taken as indices into the pool they are passed to.
    """

    # NOTE: no per-object storage: the pool is a class attribute of one subclass per pool, so an
    # id costs what an int costs (a pool of 100k slots keeps 100k of them).
    __slots__ = ()
    pool_id: int = 0

    def __new__(cls, index: int, pool_id: int = 0) -> SlotId:
        return int.__new__(_slot_class(pool_id) if pool_id else cls, index)

    def __reduce__(self) -> tuple[object, tuple[int, int]]:
        return (SlotId, (int(self), self.pool_id))


# Weak: a pool's class goes with its last id (fuzz runs make hundreds of thousands of pools).
_CLASSES: weakref.WeakValueDictionary[int, type[SlotId]] = weakref.WeakValueDictionary()


def _slot_class(pool_id: int) -> type[SlotId]:
    cls = _CLASSES.get(pool_id)
    if cls is None:
        cls = _CLASSES[pool_id] = type("SlotId", (SlotId,), {"__slots__": (), "pool_id": pool_id})
    return cls


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
