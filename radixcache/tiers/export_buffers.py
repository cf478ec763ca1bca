"""The buffers a KV codec exports a prefix's KV into, and takes back once the shared tier has
encoded them (a :class:`~radixcache.tiers.shared.KVCodec`'s optional ``reuse_kv``).

An export runs on the thread that files the snapshot (an engine's scheduler thread): it copies
the prefix's KV into a buffer of its own, which the tier encodes later on its writer thread. A
copy into fresh memory pays the pages' first touch; one into memory written before does not
(``benchmarks/bench_vllm_store.py``: 4.7-5.1 against 8.7-9.2 ms for 48 MiB). So a codec keeps a
few of the buffers the tier handed back and exports into the smallest that fits.

Thread-safe: exports take buffers on one thread while the writer hands them back on another.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

__all__ = ["ExportBuffers", "KEPT_BUFFERS"]

KEPT_BUFFERS = 2  # buffers kept for later exports, at most


class ExportBuffers:
    """Flat byte buffers lent to exports and kept, once handed back, for later ones.

    - :meth:`take`: the smallest kept buffer of at least the bytes asked for, else a new one;
      lent until handed back.
    - :meth:`give_back`: what an export returned (a flat ``memoryview`` of a lent buffer, or of a
      slice of one), once nothing reads it any more: kept, the largest :data:`KEPT_BUFFERS`
      within ``cap_bytes`` together; anything else is ignored (bytes, a view of memory it did
      not lend, a buffer handed back before), so nothing it did not lend is ever written.

    :param cap_bytes: what the kept buffers take together, at most (a buffer larger is never kept).
    :raises ValueError: ``cap_bytes`` not an int >= 0.
    """

    def __init__(self, cap_bytes: int) -> None:
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, (int, np.integer)) or cap_bytes < 0:
            raise ValueError(f"cap_bytes must be an int >= 0, got {cap_bytes!r}")
        self.cap_bytes = int(cap_bytes)
        self._lock = threading.Lock()
        self._spares: list[np.ndarray] = []  # flat uint8 buffers, written before, nobody's now, largest first
        # the buffers lent and not handed back, by id; weak: one its borrower dropped is forgotten
        self._lent: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def take(self, need: int) -> np.ndarray:
        """A flat uint8 buffer of at least ``need`` bytes (slice it to ``need``), lent: the
        smallest kept one that fits, else a new one. O(kept).

        :raises ValueError: ``need`` not an int >= 0 (nothing lent)."""
        if isinstance(need, bool) or not isinstance(need, (int, np.integer)) or need < 0:
            raise ValueError(f"need must be an int >= 0 (bytes), got {need!r}")
        with self._lock:
            fits = [k for k, b in enumerate(self._spares) if b.size >= need]
            buf = self._spares.pop(min(fits, key=lambda k: self._spares[k].size)) if fits else np.empty(need, np.uint8)
            self._lent[id(buf)] = buf
        return buf

    def give_back(self, kv: object) -> None:
        """``kv``, a view of a buffer :meth:`take` lent (what an export returned), is no longer
        read: its buffer may be written by a later export. Anything else is ignored."""
        obj = kv.obj if isinstance(kv, memoryview) else None
        buf = obj.base if isinstance(obj, np.ndarray) and obj.base is not None else obj
        if not isinstance(buf, np.ndarray):
            return
        with self._lock:
            if self._lent.get(id(buf)) is not buf:
                return
            del self._lent[id(buf)]
            if buf.size > self.cap_bytes:
                return
            self._spares.append(buf)
            self._spares.sort(key=lambda b: b.size, reverse=True)
            del self._spares[KEPT_BUFFERS:]
            while sum(b.size for b in self._spares) > self.cap_bytes:
                self._spares.pop()

    @property
    def spare_bytes(self) -> int:
        """Bytes of the buffers kept for later exports."""
        with self._lock:
            return sum(b.size for b in self._spares)

    def check_invariants(self) -> None:
        """The kept buffers: at most :data:`KEPT_BUFFERS`, within the cap, flat bytes, each kept
        once and none both kept and lent (``AssertionError`` otherwise)."""
        with self._lock:
            spares = list(self._spares)
            lent = {id(b) for b in self._lent.values()}
        assert len(spares) <= KEPT_BUFFERS, f"{len(spares)} KV buffers kept, cap {KEPT_BUFFERS}"
        assert sum(b.size for b in spares) <= self.cap_bytes, f"KV buffers kept past {self.cap_bytes} bytes"
        assert all(b.dtype == np.uint8 and b.ndim == 1 for b in spares), "a kept KV buffer not flat bytes"
        assert len({id(b) for b in spares}) == len(spares), "a KV buffer kept twice"
        assert not lent & {id(b) for b in spares}, "a KV buffer both kept and lent"
