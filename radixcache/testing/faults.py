"""A shared store and a KV codec that misbehave on purpose, seeded: what the fuzzers put under a
manager's shared tier so that every fault a real store or a host's codec can commit keeps costing
a hit, never an answer and never a half-made admission.

:class:`FaultyStore` wraps a store (an in-memory :class:`~radixcache.tiers.shared.MemoryStore` by
default, or a real Redis through :class:`~radixcache.tiers.shared.RedisStore`) and corrupts a byte
of a blob it hands out, drops blobs (a fetch finds nothing: evicted by the server), delays
publications (a put lands only some calls later, after its depth is already listed), misplaces
them (a put also lands under another key already there: another prompt's address), raises
:class:`~radixcache.tiers.shared.SharedStoreError` (the server is down) or an exception outside the
protocol (a client library's bug). :class:`FaultyCodec` wraps a host's codec and raises, or
answers ``import_kv`` out of contract (too few indices, floats, a 2-D tensor). Each fault is
counted, and every bad blob handed out is remembered until the tier deletes it (what it does with
a blob it refuses), so a test or the hammer can assert the tier refused every corrupted or
misplaced blob it was handed (:attr:`StoreFaults.accepted_bad`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from linear_state import Fence

from ..tiers.shared import KVCodec
from ..tiers.store import MemoryStore, SharedStore, SharedStoreError, deepest_of

__all__ = ["FUZZ_STORE_FAULTS", "FaultRates", "FaultyCodec", "FaultyStore", "StoreFaults"]


class FaultRates(TypedDict):
    """Probabilities of :class:`FaultyStore`'s faults on stored blobs."""

    corrupt: float
    drop: float
    delay: float
    misplace: float


FUZZ_STORE_FAULTS: FaultRates = {"corrupt": 0.2, "drop": 0.2, "delay": 0.1, "misplace": 0.2}
"""The fault rates of the fuzzing kit's default shared store (``FaultyStore(**FUZZ_STORE_FAULTS)``)."""


@dataclass
class StoreFaults:
    """What a :class:`FaultyStore` did on purpose (monotonic counters).

    :ivar corrupted: blobs handed out with one byte flipped; :ivar dropped: fetches answered
        with nothing although a blob was there; :ivar delayed: puts held back for a few calls;
        :ivar misplaced: puts that also overwrote another key's blob; :ivar failed: calls that
        raised ``SharedStoreError``; :ivar foreign: calls that raised an exception outside the
        protocol; :ivar served_bad: keys whose bad blob (corrupted or misplaced) was handed out;
        :ivar rejected_bad: bad blobs handed out that the tier then deleted (refused);
        :ivar unrejected: keys whose bad blob was handed out and not deleted since.
    """

    corrupted: int = 0
    dropped: int = 0
    delayed: int = 0
    misplaced: int = 0
    failed: int = 0
    foreign: int = 0
    served_bad: set[str] = field(default_factory=set)
    rejected_bad: int = 0
    unrejected: set[str] = field(default_factory=set)

    @property
    def accepted_bad(self) -> int:
        """Bad blobs handed out that the tier kept (never deleted): each one a verification the
        tier skipped. 0 in a correct run."""
        return len(self.unrejected)


class FaultyStore:
    """A :class:`~radixcache.tiers.shared.SharedStore` over ``inner`` (a fresh
    :class:`~radixcache.tiers.shared.MemoryStore` by default) that misbehaves with the given
    probabilities. Each decision is a hash of ``seed``, the fault, the key (or index) and how many
    times that fault was decided for it: the same calls meet the same faults, whatever ran
    before (a fuzzer's shrunk program replays exactly), and stores with the same seed still fault
    on different keys.

    :param corrupt: a ``get`` flips one byte of the blob it returns.
    :param drop: a ``get`` returns None although the blob is there.
    :param delay: a ``put`` answers True but lands in ``inner`` only after 1 to 8 more calls.
    :param misplace: a ``put`` also writes the blob over another key's (another address).
    :param fail: any call raises :class:`SharedStoreError` instead of answering.
    :param foreign: any call raises ``RuntimeError`` (outside the store protocol).
    :param prefix: prepended to every key and index name in ``inner`` (not in the draws): stores
        over one Redis database keep apart, and meet the same faults.
    :raises ValueError: a probability outside [0, 1]. :raises TypeError: ``inner`` is not a store.
    """

    def __init__(
        self,
        inner: SharedStore | None = None,
        *,
        seed: int = 0,
        corrupt: float = 0.0,
        drop: float = 0.0,
        delay: float = 0.0,
        misplace: float = 0.0,
        fail: float = 0.0,
        foreign: float = 0.0,
        prefix: str = "",
    ) -> None:
        if inner is not None and not isinstance(inner, SharedStore):
            raise TypeError(f"inner must implement SharedStore, got {type(inner).__name__}")
        p = {"corrupt": corrupt, "drop": drop, "delay": delay, "misplace": misplace, "fail": fail, "foreign": foreign}
        for name, v in p.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {v!r}")
        self.inner: SharedStore = inner if inner is not None else MemoryStore()
        self.p = p
        self.seed = seed
        self.prefix = prefix
        self._draws: dict[tuple[str, str], int] = {}
        self.faults = StoreFaults()
        self._moved: set[str] = set()  # keys holding another key's blob
        self._keys: dict[str, None] = {}  # keys put through this store and not deleted (insertion order)
        self._held: list[tuple[int, str, bytes]] = []  # delayed puts: (calls left, key, blob)

    @property
    def blobs(self) -> dict[str, bytes]:
        """The inner store's blobs, when it is a :class:`~radixcache.tiers.shared.MemoryStore`.

        :raises AttributeError: another kind of inner store."""
        if not isinstance(self.inner, MemoryStore) or self.prefix:
            raise AttributeError(f"a FaultyStore over {type(self.inner).__name__} does not list its blobs")
        return self.inner.blobs

    def _draw(self, what: str, key: str) -> int:
        """A 64-bit draw for fault ``what`` on ``key`` (its n-th for them)."""
        n = self._draws.get((what, key), 0)
        self._draws[(what, key)] = n + 1
        h = hashlib.blake2b(f"{self.seed}\0{what}\0{key}\0{n}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little")

    def _roll(self, what: str, key: str) -> bool:
        p = self.p[what]
        return p > 0.0 and self._draw(what, key) < p * 2.0**64

    def _tick(self, call: str, key: str) -> None:
        """Every call: delayed puts come due, then the call may fail."""
        if self._held:
            due = [h for h in self._held if h[0] <= 1]
            self._held = [(n - 1, k, b) for n, k, b in self._held if n > 1]
            for _, k, b in due:
                self._land(k, b)
        if self._roll("fail", f"{call} {key}"):
            self.faults.failed += 1
            raise SharedStoreError(f"faulty store: {call} failed on purpose")
        if self._roll("foreign", f"{call} {key}"):
            self.faults.foreign += 1
            raise RuntimeError(f"faulty store: {call} raised outside the protocol on purpose")

    def _land(self, key: str, blob: bytes | memoryview) -> bool:
        stored = self.inner.put(self.prefix + key, blob)
        if stored:
            self._keys[key] = None
        others = [k for k in self._keys if k != key]
        if stored and others and self._roll("misplace", key):
            victim = others[self._draw("victim", key) % len(others)]
            self.inner.delete(self.prefix + victim)
            self.inner.put(self.prefix + victim, bytes(blob))
            self._moved.add(victim)
            self.faults.misplaced += 1
        return stored

    def get(self, key: str) -> bytes | memoryview | None:
        """See :class:`~radixcache.tiers.shared.SharedStore`; may drop or corrupt the blob."""
        self._tick("get", key)
        blob = self.inner.get(self.prefix + key)
        if blob is None:
            return None
        if self._roll("drop", key):
            self.faults.dropped += 1
            return None
        bad = key in self._moved
        if blob and self._roll("corrupt", key):
            where = self._draw("where", key)
            at = where % len(blob)
            self.faults.corrupted += 1
            flipped = bytearray(blob)  # a copy of its own: the store's reply may be a read-only view
            flipped[at] ^= 1 << (where >> 56) % 8
            blob = bytes(flipped)
            bad = True
        if bad:
            self.faults.served_bad.add(key)
            self.faults.unrejected.add(key)
        return blob

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        """See :class:`~radixcache.tiers.shared.SharedStore`; may land later, or also overwrite
        another key."""
        self._tick("put", key)
        if self._roll("delay", key):
            self.faults.delayed += 1
            self._held.append((1 + self._draw("delay for", key) % 8, key, bytes(blob)))
            return True
        return self._land(key, blob)

    def delete(self, key: str) -> None:
        """See :class:`~radixcache.tiers.shared.SharedStore`."""
        self._tick("delete", key)
        self.inner.delete(self.prefix + key)
        self._moved.discard(key)
        self._keys.pop(key, None)
        if key in self.faults.unrejected:
            self.faults.unrejected.discard(key)
            self.faults.rejected_bad += 1

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """See :class:`~radixcache.tiers.shared.SharedStore`."""
        self._tick("exists", ",".join(keys))
        return self.inner.exists([self.prefix + k for k in keys])

    def add_depth(self, index: str, depth: int) -> None:
        """See :class:`~radixcache.tiers.shared.SharedStore`."""
        self._tick("add_depth", f"{index} {depth}")
        self.inner.add_depth(self.prefix + index, depth)

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        """See :class:`~radixcache.tiers.shared.SharedStore`."""
        self._tick("depths", f"{index} {lo} {hi}")
        return self.inner.depths(self.prefix + index, lo, hi)

    def deepest(self, index: str, lo: int, hi: int, count: int) -> list[int]:
        """See :func:`~radixcache.tiers.store.deepest_of` (the inner store's, or cut from its depths)."""
        self._tick("deepest", f"{index} {lo} {hi} {count}")
        return deepest_of(self.inner)(self.prefix + index, lo, hi, count)


class FaultyCodec:
    """A host's :class:`~radixcache.tiers.shared.KVCodec` that, with probability ``p`` per call,
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

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> bytes | memoryview:
        """The inner codec's, or a raise."""
        if self.p and self.rng.random() < self.p:
            self.faults += 1
            raise RuntimeError("faulty codec: export_kv raised on purpose")
        return self.inner.export_kv(kv_indices, after)

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
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
