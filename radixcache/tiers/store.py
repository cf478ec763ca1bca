"""Stores the shared tier talks to: the :class:`SharedStore` protocol, :class:`RedisStore` (a real
server, the ``redis`` extra) and :class:`MemoryStore` (one process, tests).

A store keeps opaque blobs under string keys, and per index a set of published depths; it knows
nothing of blobs' contents (the format is :mod:`radixcache.tiers.blob`'s, the verification the
tier's). A store that cannot be reached raises :class:`SharedStoreError`. Another backend (a disk
directory, an object store) is one new module implementing :class:`SharedStore`.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ..core.errors import RadixCacheError

__all__ = [
    "REDIS_URL_SCHEMES",
    "MemoryStore",
    "RedisStore",
    "SharedStore",
    "SharedStoreError",
    "deepest_of",
    "finite_seconds",
]

REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")
"""The URLs :class:`RedisStore` takes (redis-py's ``from_url``)."""


def finite_seconds(v: object) -> bool:
    """Whether ``v`` is a finite real number of seconds (an int or float, not a bool)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_tail(tail: object) -> None:
    """``delete_version``'s ``tail`` is bytes (a str would compare as never equal in memory and be
    encoded by the Redis client: the two stores would disagree)."""
    if not isinstance(tail, (bytes, bytearray, memoryview)):
        raise TypeError(f"tail must be bytes (the end of the blob read), got {type(tail).__name__}")


class SharedStoreError(RadixCacheError, ConnectionError):
    """The shared store could not be reached or answered out of protocol."""


@runtime_checkable
class SharedStore(Protocol):
    """What the shared tier needs of a store (keys and index names are ASCII strings).

    Every method raises :class:`SharedStoreError` when the store cannot be reached.

    Optional methods the tier uses when a store has them: ``deepest`` (see :func:`deepest_of`) and
    ``delete_version(key, tail) -> bool``: remove ``key`` only while its blob still ends in
    ``tail`` (the bytes of the version the tier read and refused), atomically; True when removed.
    Without it a refused blob is removed by :meth:`delete`, and a valid blob another replica
    stored under the key between the read and the removal goes with it.
    """

    def get(self, key: str) -> bytes | memoryview | None:
        """The blob under ``key`` (bytes, or a read-only view of a buffer nobody else writes), or
        None. One version of it: a store that reads a blob in parts answers None when the blob
        changed between them (a mix would fail the tier's digest and the valid blob be deleted)."""
        ...

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        """Store ``blob`` under ``key`` unless a blob is there already; True when it was stored.
        The tier hands a read-only view of a buffer nothing else writes (:func:`encode_blob`'s):
        a store may keep it as it is or send it without copying."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key`` (nothing when absent)."""
        ...

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """For each key, whether a blob is stored under it (one round trip)."""
        ...

    def add_depth(self, index: str, depth: int) -> None:
        """Record that a blob of ``depth`` tokens was published under ``index``."""
        ...

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        """Depths recorded under ``index`` in ``(lo, hi]``, ascending."""
        ...


def deepest_of(store: SharedStore) -> Callable[[str, int, int, int], list[int]]:
    """``store.deepest(index, lo, hi, count)``: the ``count`` deepest depths recorded under
    ``index`` in ``(lo, hi]``, deepest first, in one round trip (an optional method of a store:
    :class:`RedisStore` has it). For a store without it (:class:`MemoryStore`), the same answers
    cut from :meth:`SharedStore.depths`, asked once per ``(index, lo)`` for the widest ``hi`` seen:
    make one per probe (a probe asks for ever shallower batches of one range).

    :raises TypeError: ``store`` is not a :class:`SharedStore`.
    """
    if not isinstance(store, SharedStore):
        raise TypeError(f"store must be a SharedStore, got {type(store).__name__}")
    deepest = getattr(store, "deepest", None)
    if deepest is not None:
        return deepest  # type: ignore[no-any-return]
    read: dict[tuple[str, int], tuple[int, list[int]]] = {}  # (index, lo) -> (hi read up to, depths)

    def from_depths(index: str, lo: int, hi: int, count: int) -> list[int]:
        top = read.get((index, lo))
        if top is None or hi > top[0]:
            top = read[(index, lo)] = (hi, list(store.depths(index, lo, hi)))
        got = top[1]  # all in (lo, top's hi], ascending
        j = bisect.bisect_right(got, hi)
        return got[max(0, j - max(count, 0)) : j][::-1]

    return from_depths


class MemoryStore:
    """A :class:`SharedStore` in this process's memory (tests, a single process). Not thread-safe."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.indexes: dict[str, set[int]] = {}

    def get(self, key: str) -> bytes | None:
        """See :class:`SharedStore`."""
        return self.blobs.get(key)

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        """See :class:`SharedStore`."""
        if key in self.blobs:
            return False
        self.blobs[key] = bytes(blob)
        return True

    def delete(self, key: str) -> None:
        """See :class:`SharedStore`."""
        self.blobs.pop(key, None)

    def delete_version(self, key: str, tail: bytes) -> bool:
        """See :class:`SharedStore` (the optional method).

        :raises TypeError: ``tail`` is not bytes (nothing removed)."""
        _check_tail(tail)
        blob = self.blobs.get(key)
        if blob is None or not tail or not blob.endswith(tail):
            return False
        del self.blobs[key]
        return True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """See :class:`SharedStore`."""
        return [k in self.blobs for k in keys]

    def add_depth(self, index: str, depth: int) -> None:
        """See :class:`SharedStore`."""
        self.indexes.setdefault(index, set()).add(int(depth))

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        """See :class:`SharedStore`."""
        return sorted(d for d in self.indexes.get(index, ()) if lo < d <= hi)


class RedisStore:
    """A :class:`SharedStore` on a Redis server (needs the ``redis`` extra).

    Blobs are plain string values written with ``SET NX``; each index is a sorted set of depths.
    The client reconnects by itself once the server is back.

    :param url: e.g. ``redis://127.0.0.1:6379/0``.
    :param timeout_s: socket connect and read timeout: a dead server costs at most this per call.
    :param ttl_s: expire blobs after this many seconds, at least 0.001 (Redis counts whole
        milliseconds; ``None``: keep them; bound the server's memory with its own ``maxmemory``
        and an eviction policy instead).
    :param read_chunk: bytes read per range (:meth:`get`), at least 4,096:
        each range's reply holds the interpreter lock while the client builds it (about 0.5 ms
        per MiB on a 2-core machine), each costs the client some microseconds.
    :raises ValueError: a URL that is not a Redis URL, a ``timeout_s`` that is not a finite number
        above 0, a ``ttl_s`` below a millisecond or not finite, a ``read_chunk`` below 4,096.
    :raises TypeError: a ``read_chunk`` that is not an int.
    :raises ImportError: the ``redis`` package is not installed.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 0.5, ttl_s: float | None = None, read_chunk: int = 1 << 20
    ) -> None:
        if isinstance(read_chunk, bool) or not isinstance(read_chunk, int):
            raise TypeError(f"read_chunk must be an int (bytes), got {type(read_chunk).__name__}")
        if read_chunk < 4096:
            raise ValueError(f"read_chunk must be at least 4096 bytes, got {read_chunk}")
        if not isinstance(url, str) or not url.startswith(REDIS_URL_SCHEMES):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL string, got {url!r}")
        if not (finite_seconds(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        if ttl_s is not None and not (finite_seconds(ttl_s) and ttl_s >= 0.001):
            # Redis expires in whole milliseconds: below one a SET with PX fails, and a replica
            # whose every publication fails would never publish at all.
            raise ValueError(f"ttl_s must be None or a finite number of seconds >= 0.001, got {ttl_s!r}")
        try:
            import redis
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("RedisStore needs the redis client: pip install 'radixcache[redis]'") from e
        self.url = url
        self.ttl_s = ttl_s
        self.read_chunk = read_chunk
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._refused: type[BaseException] = redis.ResponseError
        self._changed: type[BaseException] = redis.WatchError
        self._r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # One server-side loop answers a probe's existence checks: 1,024 keys in 1.6 ms against
        # 4.7 ms for a pipeline of EXISTS (redis-py builds each command in Python). A server that
        # refuses scripts (or a cluster's cross-slot rule) falls back to the pipeline for good.
        self._exists_script: Callable[..., object] | None = self._r.register_script(
            "local r = {} for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end return r"
        )
        # A refused blob removed only while it is the version read (its last bytes, the digest):
        # a valid blob stored under the key since then stays.
        self._delete_script: Callable[..., object] | None = self._r.register_script(
            "if redis.call('GETRANGE', KEYS[1], -#ARGV[1], -1) == ARGV[1] then "
            "return redis.call('DEL', KEYS[1]) end return 0"
        )
        # Depths last published before the cutoff, removed from the index and its publish times
        # in one server-side step (so a depth published meanwhile is not removed), in chunks.
        self._trim_script: Callable[..., object] = self._r.register_script(
            "local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1]) "
            "for i = 1, #old, 1000 do local c = {unpack(old, i, math.min(i + 999, #old))} "
            "redis.call('ZREM', KEYS[1], unpack(c)) redis.call('ZREM', KEYS[2], unpack(c)) end "
            "return #old"
        )

    def close(self) -> None:
        """Close the client's connections (idempotent; a later call reconnects)."""
        self._r.close()

    def _call(self, what: str, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except self._errors as e:
            raise SharedStoreError(f"redis at {self.url}: {what} failed: {e}") from e

    def get(self, key: str) -> bytes | memoryview | None:
        """See :class:`SharedStore`. The first ``read_chunk`` bytes come in one round trip (a
        smaller blob is then whole, as one ``GET`` would bring it); a larger blob comes in ranges of
        ``read_chunk`` bytes, pipelined, into a buffer of its own (returned as a read-only view):
        the client builds each reply while holding the interpreter lock, about 0.5 ms per MiB here,
        so one ``GET`` of a 100 MB snapshot stopped the scheduler's thread for 45 ms while the
        fetcher thread read it (``benchmarks/bench_shared_threads.py``). The ranges are read under
        a ``WATCH`` of the key, checked by an empty transaction after them (five round trips in
        all): they are one version of the blob, or the blob changed while it was read (removed,
        expired, replaced) and the answer is None (absent), never a mix of two versions, which the
        tier's digest would refuse as a corrupted blob, and delete."""
        chunk = self.read_chunk
        head = self._call("GET", lambda: self._r.getrange(key, 0, chunk - 1))
        assert isinstance(head, bytes)
        if len(head) < chunk:
            return head or None  # the whole blob; nothing: absent (a blob is never empty)
        got = self._call("GET", lambda: self._get_watched(key, chunk))
        assert got is None or isinstance(got, (bytes, memoryview))
        return got

    def _get_watched(self, key: str, chunk: int) -> bytes | memoryview | None:
        """The blob under ``key`` read in ranges of ``chunk`` bytes while one connection watches it,
        or None when it is absent or changed before the check that ends the watch."""
        with self._r.pipeline(transaction=True) as watch:
            watch.watch(key)  # type: ignore[no-untyped-call]
            size = watch.strlen(key)
            assert isinstance(size, int)
            if size == 0:
                return None
            starts = range(0, size, chunk)  # the first range again: the one read above was not watched
            ranges = self._r.pipeline(transaction=False)
            for at in starts:
                ranges.getrange(key, at, min(at + chunk, size) - 1)
            parts = ranges.execute()
            try:
                watch.execute()  # an empty transaction: refused when the key changed since the WATCH
            except self._changed:
                return None
        whole = (isinstance(p, bytes) and len(p) == min(chunk, size - at) for at, p in zip(starts, parts, strict=True))
        if not all(whole):
            return None  # a store that let the key change under the watch (a proxy that ignores it)
        if size <= chunk:
            first: bytes = parts[0]
            return first
        out = np.empty(size, dtype=np.uint8)
        for at, part in zip(starts, parts, strict=True):
            out[at : at + len(part)] = np.frombuffer(part, dtype=np.uint8)  # copied without the lock
        return out.data.toreadonly()

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        """See :class:`SharedStore`."""
        px = None if self.ttl_s is None else int(self.ttl_s * 1000)
        return bool(self._call("SET", lambda: self._r.set(key, blob, nx=True, px=px)))

    def delete(self, key: str) -> None:
        """See :class:`SharedStore`."""
        self._call("DEL", lambda: self._r.delete(key))

    def delete_version(self, key: str, tail: bytes) -> bool:
        """See :class:`SharedStore` (the optional method): one server-side step compares the
        value's last ``len(tail)`` bytes and deletes it only if they are ``tail``. A server that
        refuses scripts: :meth:`delete` (the race it closes open again), for good.

        :raises TypeError: ``tail`` is not bytes (nothing removed)."""
        _check_tail(tail)
        if not tail:
            return False

        def run() -> object:
            if self._delete_script is not None:
                try:
                    return self._delete_script(keys=[key], args=[tail])
                except self._refused:  # scripting off here (inside _call, which would convert it)
                    self._delete_script = None
            self._r.delete(key)
            return True

        return bool(self._call("DEL", run))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """See :class:`SharedStore`."""
        if not keys:
            return []

        def run() -> list[object]:
            if self._exists_script is not None:
                try:
                    out = self._exists_script(keys=list(keys))
                    assert isinstance(out, list)
                    return out
                except self._refused:  # scripting off here: a per-key pipeline from now on
                    self._exists_script = None
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return list(pipe.execute())

        out = self._call("EXISTS", run)
        assert isinstance(out, list)
        return [bool(x) for x in out]

    def add_depth(self, index: str, depth: int) -> None:
        """See :class:`SharedStore`. With ``ttl_s`` the depth's last publication time is kept
        beside the index (``<index>:seen``), for :meth:`trim_depths`."""
        d = int(depth)
        if self.ttl_s is None:
            self._call("ZADD", lambda: self._r.zadd(index, {str(d): d}))
            return

        def both() -> object:
            pipe = self._r.pipeline(transaction=False)
            pipe.zadd(index, {str(d): d})
            pipe.zadd(index + ":seen", {str(d): time.time()})
            return pipe.execute()

        self._call("ZADD", both)

    def trim_depths(self, index: str) -> int:
        """Remove from ``index`` the depths whose every blob expired (last published more than
        ``ttl_s`` ago: any blob at that depth, of any prompt, is gone); returns how many. 0 and no
        round trip without ``ttl_s``. Blobs the server evicts for ``maxmemory`` before their TTL
        leave their depths listed until then (a probe finds them absent: a miss, not an error)."""
        if self.ttl_s is None:
            return 0
        cutoff = time.time() - self.ttl_s
        out = self._call("TRIM", lambda: self._trim_script(keys=[index, index + ":seen"], args=[repr(cutoff)]))
        return int(out) if isinstance(out, int) else 0

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        """See :class:`SharedStore`."""
        out = self._call("ZRANGEBYSCORE", lambda: self._r.zrangebyscore(index, f"({int(lo)}", int(hi)))
        return self._ints(index, out)

    def deepest(self, index: str, lo: int, hi: int, count: int) -> list[int]:
        """See :func:`deepest_of`: ``ZREVRANGEBYSCORE`` with a ``LIMIT``. NOTE: a probe used to
        read the whole range (2,048 members parsed and converted on the fetcher thread, 0.6 ms of
        CPU per probe, up to 2.4 ms holding the interpreter lock); its first batch is 64 deep."""
        if count <= 0:
            return []
        out = self._call(
            "ZREVRANGEBYSCORE", lambda: self._r.zrevrangebyscore(index, int(hi), f"({int(lo)}", start=0, num=int(count))
        )
        return self._ints(index, out)

    def _ints(self, index: str, members: object) -> list[int]:
        """An index's members as ints. :raises SharedStoreError: one is not an integer (somebody
        else wrote this index: the store is out of protocol)."""
        assert isinstance(members, list)
        try:
            return list(map(int, members))  # NOTE: half a list comprehension's time for 2,048 depths
        except (TypeError, ValueError) as e:
            raise SharedStoreError(f"redis at {self.url}: depth index {index!r} holds a non-integer member: {e}") from e
