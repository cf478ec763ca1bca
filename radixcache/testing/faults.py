"""A shared store and a KV codec that misbehave on purpose, seeded: what the fuzzers put under a
manager's shared tier so that every fault a real store or a host's codec can commit keeps costing
a hit, never an answer and never a half-made admission.

:class:`FaultyStore` (a :class:`~radixcache.core.shared.MemoryStore`) corrupts a byte of a blob it
hands out, drops blobs (a fetch finds nothing: evicted by the server), misplaces them (a put also
lands under another key already there: another prompt's address), raises
:class:`~radixcache.core.shared.SharedStoreError` (the server is down) or an exception outside the
protocol (a client library's bug). :class:`FaultyCodec` wraps a host's codec and raises, or
answers ``import_kv`` out of contract (too few indices, floats, a 2-D tensor). Each fault is
counted, so a test can assert the tier refused every corrupted or misplaced blob it was handed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from linear_state import Fence

from ..core.shared import KVCodec, MemoryStore, SharedStoreError

__all__ = ["FaultyCodec", "FaultyStore", "StoreFaults"]


@dataclass
class StoreFaults:
    """What a :class:`FaultyStore` did on purpose (monotonic counters).

    :ivar corrupted: blobs handed out with one byte flipped; :ivar dropped: fetches answered
        with nothing although a blob was there; :ivar misplaced: puts that also overwrote another
        key's blob; :ivar failed: calls that raised ``SharedStoreError``; :ivar foreign: calls that
        raised an exception outside the protocol; :ivar served_bad: keys whose bad blob (corrupted
        or misplaced) was handed out, which the tier must have refused.
    """

    corrupted: int = 0
    dropped: int = 0
    misplaced: int = 0
    failed: int = 0
    foreign: int = 0
    served_bad: set[str] = field(default_factory=set)


class FaultyStore(MemoryStore):
    """A :class:`~radixcache.core.shared.MemoryStore` that misbehaves with the given
    probabilities, from its own seeded generator (deterministic for a given sequence of calls).

    :param corrupt: a ``get`` flips one byte of the blob it returns.
    :param drop: a ``get`` returns None although the blob is there.
    :param misplace: a ``put`` also writes the blob over another key's (another address).
    :param fail: any call raises :class:`SharedStoreError` instead of answering.
    :param foreign: any call raises ``RuntimeError`` (outside the store protocol).
    :raises ValueError: a probability outside [0, 1].
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        corrupt: float = 0.0,
        drop: float = 0.0,
        misplace: float = 0.0,
        fail: float = 0.0,
        foreign: float = 0.0,
    ) -> None:
        super().__init__()
        for name, p in (
            ("corrupt", corrupt),
            ("drop", drop),
            ("misplace", misplace),
            ("fail", fail),
            ("foreign", foreign),
        ):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
        self.p = {"corrupt": corrupt, "drop": drop, "misplace": misplace, "fail": fail, "foreign": foreign}
        self.rng = random.Random(seed)
        self.faults = StoreFaults()
        self._moved: set[str] = set()  # keys holding another key's blob

    def _roll(self, what: str) -> bool:
        p = self.p[what]
        return p > 0.0 and self.rng.random() < p

    def _maybe_raise(self, call: str) -> None:
        if self._roll("fail"):
            self.faults.failed += 1
            raise SharedStoreError(f"faulty store: {call} failed on purpose")
        if self._roll("foreign"):
            self.faults.foreign += 1
            raise RuntimeError(f"faulty store: {call} raised outside the protocol on purpose")

    def get(self, key: str) -> bytes | None:
        """See :class:`~radixcache.core.shared.SharedStore`; may drop or corrupt the blob."""
        self._maybe_raise("get")
        blob = super().get(key)
        if blob is None:
            return None
        if self._roll("drop"):
            self.faults.dropped += 1
            return None
        if key in self._moved:
            self.faults.served_bad.add(key)
        if blob and self._roll("corrupt"):
            at = self.rng.randrange(len(blob))
            self.faults.corrupted += 1
            self.faults.served_bad.add(key)
            return blob[:at] + bytes([blob[at] ^ (1 << self.rng.randrange(8))]) + blob[at + 1 :]
        return blob

    def put(self, key: str, blob: bytes) -> bool:
        """See :class:`~radixcache.core.shared.SharedStore`; may also overwrite another key."""
        self._maybe_raise("put")
        stored = super().put(key, blob)
        others = [k for k in self.blobs if k != key]
        if stored and others and self._roll("misplace"):
            victim = self.rng.choice(sorted(others))
            self.blobs[victim] = bytes(blob)
            self._moved.add(victim)
            self.faults.misplaced += 1
        return stored

    def delete(self, key: str) -> None:
        """See :class:`~radixcache.core.shared.SharedStore`."""
        self._maybe_raise("delete")
        super().delete(key)
        self._moved.discard(key)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """See :class:`~radixcache.core.shared.SharedStore`."""
        self._maybe_raise("exists")
        return super().exists(keys)

    def add_depth(self, index: str, depth: int) -> None:
        """See :class:`~radixcache.core.shared.SharedStore`."""
        self._maybe_raise("add_depth")
        super().add_depth(index, depth)

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        """See :class:`~radixcache.core.shared.SharedStore`."""
        self._maybe_raise("depths")
        return super().depths(index, lo, hi)


class FaultyCodec:
    """A host's :class:`~radixcache.core.shared.KVCodec` that, with probability ``p`` per call,
    raises (export or import) or answers ``import_kv`` out of contract: fewer indices than asked
    (allocated by the inner codec; the one left out goes back through ``free``, the rest the
    manager must hand back), float or 2-D indices (none taken).

    :raises ValueError: ``p`` outside [0, 1].
    """

    def __init__(
        self, inner: KVCodec, *, seed: int = 0, p: float = 0.0, free: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a probability in [0, 1], got {p!r}")
        self.inner, self.p, self.rng, self.free = inner, p, random.Random(seed), free
        self.identity = inner.identity
        self.faults = 0

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> bytes:
        """The inner codec's, or a raise."""
        if self.p and self.rng.random() < self.p:
            self.faults += 1
            raise RuntimeError("faulty codec: export_kv raised on purpose")
        return self.inner.export_kv(kv_indices, after)

    def import_kv(self, data: bytes, num_tokens: int) -> torch.Tensor | None:
        """The inner codec's, or one of its faults."""
        if not (self.p and self.rng.random() < self.p):
            return self.inner.import_kv(data, num_tokens)
        self.faults += 1
        how = self.rng.randrange(4)
        if how == 0:
            raise RuntimeError("faulty codec: import_kv raised on purpose")
        if how == 1 and num_tokens > 1:
            got = self.inner.import_kv(data, num_tokens)
            if got is None:
                return None
            if self.free is not None:
                self.free(got[-1:].clone())
            return got[:-1].clone()
        if how == 2:
            return torch.arange(num_tokens, dtype=torch.float32)
        return torch.zeros(1, num_tokens, dtype=torch.int64)
