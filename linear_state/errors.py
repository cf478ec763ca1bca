"""Typed errors of the slot pool, split by cause.

``PoolExhausted`` is a capacity condition a scheduler handles (evict, queue, refuse).
``SlotMisuse`` is a bug in the caller: the message names the slot and both owners involved.
"""

from __future__ import annotations

from .owners import Owner

__all__ = ["DeviceUnavailable", "ForeignSlot", "PoolError", "PoolExhausted", "PrecisionLoss", "SlotMisuse"]


class PoolError(Exception):
    """Base class of every error raised by :mod:`linear_state`."""


class PoolExhausted(PoolError, MemoryError):
    """No free slot is left. Nothing was allocated.

    :ivar capacity: the pool's capacity.
    :ivar requested: how many slots the call needed.
    :ivar owner: who asked.
    """

    def __init__(self, capacity: int, requested: int, owner: Owner) -> None:
        self.capacity = capacity
        self.requested = requested
        self.owner = owner
        super().__init__(f"slot pool exhausted: {owner} asked for {requested} slot(s), all {capacity} are owned")


class SlotMisuse(PoolError, RuntimeError):
    """The caller broke the ownership rule; the pool is unchanged.

    :ivar slot: the slot involved.
    :ivar owner: who owns it now (``None`` when free).
    :ivar actor: who tried the operation (``None`` when the call names nobody).
    """

    def __init__(self, message: str, *, slot: int, owner: Owner | None, actor: Owner | None) -> None:
        self.slot = slot
        self.owner = owner
        self.actor = actor
        held = "free" if owner is None else f"owned by {owner}"
        by = "" if actor is None else f"; attempted by {actor}"
        super().__init__(f"{message}: slot {slot} is {held}{by}")


class ForeignSlot(PoolError, ValueError):
    """A slot id handed out by another pool was passed to this one. Acting on it would read or
    write an unrelated slot that happens to have the same index; nothing was done.

    :ivar slot: the index the id carries.
    :ivar slot_pool: the ``pool_id`` of the pool that handed it out.
    :ivar pool: the ``pool_id`` of the pool it was passed to.
    """

    def __init__(self, slot: int, *, slot_pool: int, pool: int) -> None:
        self.slot = slot
        self.slot_pool = slot_pool
        self.pool = pool
        super().__init__(
            f"slot {slot} was handed out by pool #{slot_pool}, not by this pool (#{pool}); nothing was done"
        )


class PrecisionLoss(PoolError, TypeError):
    """A state would be narrowed into a slot of a dtype that cannot hold it (float64 into a float32
    slot, a complex state into a real one; the HF bridge also refuses float32 into bf16 unless told
    to warn): a restored state would not be the one written, so nothing was written."""


class DeviceUnavailable(PoolError, ValueError):
    """A device this process cannot use was named (``cuda`` on a machine without CUDA, a device
    index past the last one, an unknown device type)."""
