"""Slot-checksum forensics: fingerprint every snapshot at donation, verify before every restore,
and say which branch was poisoned, when, and which requests could have written it.

A :class:`~radixcache.CacheManager` watches a sample of its donations by default
(``forensics="sampled"``: one in ten, :data:`SAMPLED`, findings recorded and warned about once per
kind). Watch every one with ``CacheManager(..., forensics=Forensics(pool, ledger=Ledger(path)))``;
``forensics=None`` turns it off (the manager then pays nothing). Each watched donation costs one
fingerprint of the snapshot (taken once its clone fence completed), each of its restores one more,
and each event one buffered ledger line.

Findings (:class:`SnapshotCorruption`):

==============  ===============================================================================
changed         the snapshot's fingerprint differs from the one taken at donation: someone wrote a
                tree slot after its donate fence (aliasing, a late write, a stray kernel).
never-written   at donation the snapshot equals the zero state, or the snapshot of its nearest
                ancestor although tokens were consumed in between: the host never wrote the state
                it claimed to capture (the bug in shared/reference/004).
shared-*        the shared tier refused a fetched blob (``shared-fingerprint``: its state is not
                what was published; ``shared-format``, ``shared-length``, ``shared-layout``): a
                miss, recorded but never raised (nothing was restored from it).
==============  ===============================================================================

Suspects: every request that held the snapshot's slot id since it was last known clean (donation
or the last passing verification), in the order they took it, then the last holder before that
(whose late write may have landed after). For never-written, the donor comes first.
"""

from __future__ import annotations

import hashlib
import random
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from linear_state import Fence, FingerprintJob, LinearStatePool, ThreadStream

from .ledger import Ledger

__all__ = ["HOLDERS_KEPT", "SAMPLED", "Forensics", "SnapshotCorruption", "fingerprint_text", "key_digest"]

Mode = Literal["raise", "record"]


def key_digest(key_bytes: bytes | memoryview) -> str:
    """A short stable name for a branch: blake2b of the key's canonical bytes (16 hex digits; a
    view of them gives the same)."""
    return hashlib.blake2b(key_bytes, digest_size=8).hexdigest()


def fingerprint_text(fingerprint: int | None) -> str:
    """A fingerprint as findings print it: 16 hex digits, or ``unknown`` (``None``: not read)."""
    return "unknown" if fingerprint is None else f"{fingerprint:#018x}"


class SnapshotCorruption(Exception):
    """A snapshot that is not what was donated (``kind="changed"``) or that was never written
    (``kind="never-written"``).

    :ivar node: tree node id; :ivar depth: its depth; :ivar key: digest of the branch's key.
    :ivar slot: the snapshot slot; :ivar expected: fingerprint at donation (or the fingerprint it
        should differ from); :ivar found: fingerprint now (either ``None`` when not known: a
        shared blob refused before its state was read).
    :ivar donor: the request that donated it; :ivar suspects: requests that could have written it,
        most likely first.
    """

    def __init__(
        self,
        kind: str,
        *,
        node: int,
        depth: int,
        key: str,
        slot: int,
        expected: int | None,
        found: int | None,
        donor: Hashable,
        suspects: list[Hashable],
        step: int,
    ) -> None:
        self.kind, self.node, self.depth, self.key, self.slot = kind, node, depth, key, slot
        self.expected, self.found, self.donor, self.suspects, self.step = expected, found, donor, suspects, step
        super().__init__(
            f"snapshot {kind}: branch {key} depth {depth} (node {node}), slot {slot}: "
            f"expected {fingerprint_text(expected)}, found {fingerprint_text(found)}; "
            f"donor {donor!r}; suspects {suspects!r}"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "kind": self.kind,
            "node": self.node,
            "depth": self.depth,
            "key": self.key,
            "slot": self.slot,
            "expected": self.expected,
            "found": self.found,
            "donor": _jsonable(self.donor),
            "suspects": [_jsonable(s) for s in self.suspects],
            "step": self.step,
        }


def _jsonable(x: object) -> object:
    return x if isinstance(x, (int, str, float, bool)) or x is None else repr(x)


@dataclass
class _Snap:
    node: int
    depth: int
    key_bytes: bytes | memoryview  # the branch's canonical key bytes (read only), digested when asked
    slot: int
    donor: Hashable
    fence: Fence
    step: int
    parent: int | None  # node id of the nearest ancestor holding a snapshot
    parent_depth: int
    fp: int | None = None
    clean_step: int = 0
    host: LinearStatePool | None = None  # the host tier's pool once demoted (``slot`` is its slot)
    job: FingerprintJob | None = None  # the donation's fingerprint, taken on the pool's worker thread
    _key: str | None = None

    @property
    def key(self) -> str:
        """The branch's name (:func:`key_digest` of its key), made when a finding or the ledger
        first names it. NOTE: not at donation: the digest cost ~2% of SGLang's scheduler time
        with one donation in ten watched, for names that are read only with a ledger or a finding
        (session 36)."""
        if self._key is None:
            self._key = key_digest(self.key_bytes)
        return self._key


SAMPLED = 0.1
"""The fraction of donations :class:`~radixcache.CacheManager` watches by default
(``forensics="sampled"``). A watched snapshot costs a fingerprint at donation and one per restore,
each about 0.5x the copy it checks on a 2-core CPU (``benchmarks/bench_forensics.py``: 0.495x to
0.516x): one in ten adds about 5% to the cost of the state copies. On a GPU the torch fingerprint
took 2.3x the clone (H200, before the fused Triton kernel): 23% there until the fused kernel's cost
is measured (``benchmarks/gpu_check.py``)."""

HOLDERS_KEPT = 64
"""Holders remembered per slot (the most recent): what a long-running server's suspects are drawn
from, bounded so that the record does not grow with every request served."""


@dataclass
class _Holds:
    # (from, to, rid), the latest HOLDERS_KEPT
    spans: deque[tuple[int, int | None, Hashable]] = field(default_factory=lambda: deque(maxlen=HOLDERS_KEPT))


class Forensics:
    """Fingerprint ledger and verifier for one pool; a :class:`CacheManager` calls its hooks.

    :param mode: ``"raise"`` raises :class:`SnapshotCorruption` at detection; ``"record"``
        appends it to :attr:`findings` and goes on.
    :param sample: the fraction of donations watched, in ``(0, 1]`` (default 1: all). A watched
        snapshot is fingerprinted at donation and verified before each of its restores, at its
        slot's events and by :meth:`verify_all`; the others cost nothing and are not checked.
        Drawn at random per donation (``seed``): a host whose donations come in a fixed pattern
        (two per request, say) is still sampled across the pattern. A corruption that hits every
        slot it touches is caught at about ``sample`` of its restores; one that hits a single
        snapshot, with that chance. :data:`SAMPLED` is the fraction chosen from the measured cost.
    :param seed: of the draw.
    :param warn: in ``"record"`` mode, also warn (``RuntimeWarning``) at the first finding of each
        kind, so that a host that never reads :attr:`findings` still hears of them.
    :raises TypeError: a bad pool or ledger. :raises ValueError: a bad mode or ``sample``.
    """

    def __init__(
        self,
        pool: LinearStatePool,
        *,
        ledger: Ledger | None = None,
        mode: Mode = "raise",
        sample: float = 1.0,
        seed: int = 0,
        warn: bool = False,
    ) -> None:
        if not isinstance(pool, LinearStatePool):
            raise TypeError(f"Forensics watches a LinearStatePool, got {type(pool).__name__}")
        if ledger is not None and not isinstance(ledger, Ledger):
            raise TypeError(f"ledger must be a Ledger or None, got {type(ledger).__name__}")
        if mode not in ("raise", "record"):
            raise ValueError(f"mode must be 'raise' or 'record', got {mode!r}")
        if isinstance(sample, bool) or not isinstance(sample, (int, float)) or not (0.0 < sample <= 1.0):
            raise ValueError(f"sample must be a fraction in (0, 1], got {sample!r}")
        self.sample = float(sample)
        self.warn = bool(warn)
        self._warned: set[str] = set()
        self._draw = random.Random(seed).random
        self.donations_seen = 0
        """Donations the manager reported, watched or not."""
        self.donations_watched = 0
        """Donations fingerprinted (about ``sample`` of :attr:`donations_seen`)."""
        self.pool = pool
        self.ledger = ledger
        self.mode: Mode = mode
        self.findings: list[SnapshotCorruption] = []
        self._flagged: dict[int, SnapshotCorruption] = {}  # node -> the finding that named its snapshot
        self.step = 0
        self._snaps: dict[int, _Snap] = {}  # by node id
        self._by_slot: dict[int, set[int]] = {}  # slot -> node ids claiming it (one, unless aliased)
        self._pending: list[_Snap] = []  # donated, fingerprint not taken yet (clone fence pending)
        self._holds: dict[int, _Holds] = {}
        # On CUDA the first fingerprint would compile Triton's kernel inside a donation (a scheduler
        # step): built here, at start-up, instead.
        pool.warm_fingerprint()

    # ------------------------------------------------------------- ledger
    @staticmethod
    def _where(snap: _Snap) -> dict[str, Any]:
        where = {"node": snap.node, "slot": snap.slot, "depth": snap.depth, "key": snap.key}
        if snap.host is not None:
            where["tier"] = "host"
        return where

    def _log(self, ev: str, **fields: Any) -> None:
        if self.ledger is not None:
            fields["ev"], fields["step"], fields["t"] = ev, self.step, time.time()
            self.ledger.write(fields)

    # --------------------------------------------------------------- hooks
    def request_slots(self, rid: Hashable, slots: Iterable[int]) -> None:
        """A request took these slots."""
        self.step += 1
        for s in slots:
            self._holds.setdefault(s, _Holds()).spans.append((self.step, None, rid))
            self._log("alloc", slot=s, owner=_jsonable(rid))
            self._check_slot(s)

    def request_freed(self, rid: Hashable, slots: Iterable[int]) -> None:
        """A request gave these slots back (after its last fence)."""
        self.step += 1
        self._settle()
        for s in slots:
            spans = self._holds.get(s)
            if spans is not None and spans.spans and spans.spans[-1][1] is None:
                start, _, who = spans.spans[-1]
                spans.spans[-1] = (start, self.step, who)
            self._log("free", slot=s, owner=_jsonable(rid))
            self._check_slot(s)  # a request just let go of a slot the tree claims: did it write it?

    def donated(
        self,
        node: int,
        depth: int,
        key: bytes | bytearray | memoryview,
        slot: int,
        donor: Hashable,
        fence: Fence,
        parent: int | Callable[[], tuple[int | None, int]] | None,
        parent_depth: int = 0,
    ) -> None:
        """The tree took a snapshot at ``node`` (depth ``depth``, filed under the canonical key
        bytes ``key``; its nearest snapshot ancestor: ``parent`` at ``parent_depth``, or
        ``parent`` a function returning both, called only when the donation is watched); its
        fingerprint is taken once ``fence`` completed, when it is drawn into the sample (always at
        ``sample=1``). NOTE: ``key`` is digested and ``parent`` asked only for a watched donation:
        slicing the key and walking to the ancestor cost ~3 us of every SGLang checkpoint for the
        nine in ten not watched (session 35)."""
        self.step += 1
        self.donations_seen += 1
        self._flagged.pop(node, None)  # a new snapshot there: what a finding said of the last one is past
        self._check_slot(slot)  # watched or not: a watched snapshot that still claims it was overwritten
        if self.sample < 1.0 and self._draw() >= self.sample:
            self._settle()
            return  # not watched: its restores are not verified
        self.donations_watched += 1
        if callable(parent):
            parent, parent_depth = parent()
        # the bytes kept to be digested later: bytes or a view of them as they are, any other
        # buffer copied (it may change); not a buffer at all: TypeError, as the digest raised
        kept = (
            key
            if type(key) is bytes or (isinstance(key, memoryview) and type(key.obj) is bytes)
            else bytes(memoryview(key))
        )
        snap = _Snap(node, depth, kept, slot, donor, fence, self.step, parent, parent_depth)
        if isinstance(self.pool.stream, ThreadStream):
            # the pool's work runs on a worker thread (the clone did): the fingerprint runs there
            # too, behind the clone, and _settle takes its value; the donor's thread pays nothing
            snap.job = self.pool.fingerprint_later(slot, after=(fence,))
        self._snaps[node] = snap
        self._by_slot.setdefault(slot, set()).add(node)
        self._pending.append(snap)
        self._settle()

    def before_restore(self, node: int, rid: Hashable, dst: int | None, *, taken: FingerprintJob | None = None) -> None:
        """Verify ``node``'s snapshot before it is restored into ``dst`` (``None``: the host copies
        it out of the snapshot's own slot, :meth:`CacheManager.serve_in_place
        <radixcache.CacheManager.serve_in_place>`). ``taken``: the snapshot slot's fingerprint,
        submitted on the pool's stream behind the donation (``pool.fingerprint_later``) while the
        host held the node locked, compared instead of one taken now (waited if not done).

        :raises ValueError: ``taken`` is of another pool or slot than the snapshot's. Nothing
            changed."""
        snap = self._snaps.get(node)
        if taken is not None and snap is not None and (taken.pool is not self.pool or taken.slot != snap.slot):
            raise ValueError(
                f"the fingerprint given for node {node} is of slot {taken.slot} of pool {taken.pool.pool_id}, "
                f"its snapshot is slot {snap.slot} of pool {self.pool.pool_id}"
            )
        self.step += 1
        if snap is None:
            return
        if snap.fp is None:
            self._wait_donation(snap)  # the restore waits the clone anyway
            self._settle()
        found = self._verify(snap, "restore", taken)
        if self.ledger is not None:  # NOTE: the event's fields are built only for a ledger
            self._log("restore", **self._where(snap), dst=dst, owner=_jsonable(rid), fp=found)

    def snapshot_freed(self, node: int, slot: int) -> None:
        """The tree dropped ``node``'s snapshot (from the device, or from the host tier)."""
        self.step += 1
        self._flagged.pop(node, None)
        snap = self._snaps.pop(node, None)
        if snap is None:
            return
        self._unclaim(snap)
        if snap in self._pending:
            self._pending.remove(snap)
        self._log("evict", **self._where(snap))

    def snapshot_demoted(self, node: int, host_pool: LinearStatePool, host_slot: int) -> None:
        """The tree moved ``node``'s snapshot into ``host_slot`` of its host tier: from now on the
        record follows the host copy, which is verified at once against the donation's
        fingerprint (the demotion copied exactly the donated bytes, or it is a finding)."""
        self.step += 1
        snap = self._snaps.get(node)
        if snap is None:
            return
        if snap.fp is None:
            self._wait_donation(snap)  # the demotion's copy waited the clone too
            self._settle()
        self._unclaim(snap)
        if snap in self._pending:  # its device slot is gone: no donation fingerprint to take now
            self._pending.remove(snap)
        snap.host, snap.slot = host_pool, int(host_slot)
        self._log("demote", **self._where(snap))
        if snap.fp is not None:
            self._verify(snap, "demote")

    def shared_rejected(
        self,
        reason: str,
        key: str,
        depth: int,
        publisher: str,
        expected: int | None = None,
        found: int | None = None,
    ) -> None:
        """The shared tier refused a blob (``reason``: format, layout, length, fingerprint; see
        :class:`~radixcache.tiers.shared.Rejection`). Recorded as a finding of kind
        ``shared-<reason>`` (its ``key`` the store key, its donor and suspect the publisher the blob
        names) in either mode: the refusal already made it a miss, so serving goes on."""
        self.step += 1
        finding = SnapshotCorruption(
            f"shared-{reason}",
            node=0,
            depth=depth,
            key=key,
            slot=-1,
            expected=expected,
            found=found,
            donor=publisher,
            suspects=[publisher],
            step=self.step,
        )
        self._log("corruption", note="shared tier: blob refused, served as a miss", **finding.as_dict())
        self.findings.append(finding)

    def verify_all(self) -> int:
        """Verify every snapshot whose fingerprint was taken; returns how many were checked."""
        self.step += 1
        self._settle()
        n = 0
        for snap in list(self._snaps.values()):
            if snap.fp is not None:
                self._verify(snap, "verify_all")
                n += 1
        return n

    def verify(self, node: int, why: str = "verify") -> bool:
        """Verify ``node``'s snapshot now, when it is watched (its donation fingerprint waited if
        still pending): before its bytes leave the engine (the manager calls this before it
        publishes a snapshot to the shared tier). Returns whether no finding names it (found now,
        or before); an unwatched snapshot is not read. Raises as any detection does in
        ``"raise"`` mode.

        :raises TypeError: ``node`` not an int node id, ``why`` not a string. Nothing changed."""
        _check_node_id(node, why)
        self.step += 1
        self.settle(node)  # its donation fingerprint, waited if still pending
        snap = self._snaps.get(node)
        if snap is not None and snap.fp is not None and node not in self._flagged:
            self._verify(snap, why)
        return node not in self._flagged

    def expected(self, node: int) -> int | None:
        """The fingerprint ``node``'s snapshot must have now: its donation fingerprint (waited if
        still pending) for a watched snapshot no finding names; ``None`` for one not watched or
        already named (:meth:`flagged`). Reads nothing. The manager hands it to the shared tier
        with a publication (``SharedTier.publish(expect=)``): the tier fingerprints its copy of
        the slot anyway, so comparing there verifies the snapshot before its bytes leave the
        engine without a second read on the scheduler's thread (:meth:`compared` records the
        outcome).

        :raises TypeError: ``node`` not an int node id."""
        _check_node_id(node)
        self.settle(node)
        snap = self._snaps.get(node)
        if snap is None or node in self._flagged:
            return None
        return snap.fp

    def compared(self, node: int, expected: int, found: int, why: str = "publish") -> bool:
        """Record a verification made elsewhere: ``found`` is the fingerprint of a copy of
        ``node``'s snapshot read while :meth:`expected` said ``expected`` (the shared tier's
        :class:`~radixcache.tiers.shared.PublishCheck`). When they differ and the snapshot still
        carries that donation fingerprint, it is a ``changed`` finding (raised in ``"raise"`` mode,
        as any detection); a snapshot dropped since, re-donated, or already named is left as it
        is. Returns whether no finding names ``node``.

        :raises TypeError: ``node`` not an int node id, ``expected`` or ``found`` not an int,
            ``why`` not a string. Nothing changed."""
        _check_node_id(node, why)
        for what, v in (("expected", expected), ("found", found)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{what} must be an int fingerprint, got {type(v).__name__}")
        self.step += 1
        snap = self._snaps.get(node)
        if snap is not None and snap.fp == expected and node not in self._flagged:
            # a clean copy says nothing of the steps since it was read: clean_step stays
            self._compare(snap, found, why, clean=False)
        return node not in self._flagged

    def check_invariants(
        self, live_snapshots: Mapping[int, int] | None = None, live_host: Mapping[int, int] | None = None
    ) -> None:
        """Verify the bookkeeping; raise ``AssertionError`` naming the first broken rule. O(snapshots).

        Every tracked device snapshot is claimed by its slot in the slot index and vice versa; a
        snapshot has a donation fingerprint exactly when it is no longer pending. With
        ``live_snapshots`` (tree node id -> snapshot slot) and ``live_host`` (node id -> host tier
        slot), every tracked snapshot is one the tree still holds there.
        """
        for node, snap in self._snaps.items():
            assert snap.node == node, f"snapshot record of node {node} names node {snap.node}"
            if snap.host is not None:
                assert not any(p is snap for p in self._pending), f"node {node} was demoted while still pending"
                if live_host is not None:
                    assert live_host.get(node) == snap.slot, (
                        f"forensics tracks node {node} at host slot {snap.slot}; the tree holds {live_host.get(node)}"
                    )
                continue
            assert node in self._by_slot.get(snap.slot, ()), f"node {node} missing from slot {snap.slot}'s claims"
            pending = any(p is snap for p in self._pending)
            assert pending == (snap.fp is None), f"node {node}: pending={pending} but fingerprint {snap.fp}"
            if live_snapshots is not None:
                assert live_snapshots.get(node) == snap.slot, (
                    f"forensics tracks node {node} at slot {snap.slot}; the tree holds {live_snapshots.get(node)}"
                )
        for slot, nodes in self._by_slot.items():
            assert nodes, f"slot {slot} keeps an empty claim set"
            for node in nodes:
                assert node in self._snaps and self._snaps[node].slot == slot, f"slot {slot} claims stale node {node}"
        assert all(p.node in self._snaps for p in self._pending), "a pending donation is not tracked"

    def flush(self) -> None:
        """Write the ledger's buffered events to its file."""
        if self.ledger is not None:
            self.ledger.flush()

    def close(self) -> None:
        """Flush the ledger and close its file (idempotent; recording goes on, reopening it)."""
        if self.ledger is not None:
            self.ledger.close()

    # ------------------------------------------------------------ internals
    def _unclaim(self, snap: _Snap) -> None:
        """Drop ``snap``'s claim on its device slot (none once it lives in the host tier)."""
        if snap.host is not None:
            return
        claim = self._by_slot.get(snap.slot)
        if claim is not None:
            claim.discard(snap.node)
            if not claim:
                del self._by_slot[snap.slot]

    @staticmethod
    def _wait_donation(snap: _Snap) -> None:
        (snap.job.fence if snap.job is not None else snap.fence).wait()

    def settle(self, node: int | None = None) -> int:
        """Take the donation fingerprint of every watched snapshot whose clone has completed (and
        report those never written); every hook does this too. Waits for none but ``node``'s
        (its clone and fingerprint), when given. Returns how many donations are still pending.
        A host that files snapshots on a stream of its own calls it before it hands a snapshot on
        (the manager does, before publishing one)."""
        snap = self._snaps.get(node) if node is not None else None
        if snap is not None and snap.fp is None and snap.host is None:
            self._wait_donation(snap)
        self._settle()
        return len(self._pending)

    def pending(self, node: int) -> bool:
        """Whether ``node``'s donation fingerprint is still to be taken (its clone, or the
        fingerprint itself, has not run yet). O(1)."""
        snap = self._snaps.get(node)
        return snap is not None and snap.fp is None and snap.host is None

    def flagged(self, node: int) -> bool:
        """Whether a finding named ``node``'s present snapshot (its donation was the last one
        there; ``findings`` cleared or not). O(1)."""
        return node in self._flagged

    def finding(self, node: int) -> SnapshotCorruption | None:
        """The latest finding that named ``node``'s present snapshot, or ``None`` (what
        :meth:`flagged` asks; ``findings`` cleared or not). O(1).

        :raises TypeError: ``node`` not an int node id."""
        _check_node_id(node)
        return self._flagged.get(node)

    def _settle(self) -> None:
        """Take the donation fingerprint of every snapshot whose clone has completed."""
        if not self._pending:
            return
        still: list[_Snap] = []
        for snap in self._pending:
            job = snap.job
            if job is not None:
                if not job.fence.is_complete():
                    still.append(snap)
                    continue
                snap.fp = job.result()
            elif not snap.fence.is_complete() or not self.pool.last_use(snap.slot).is_complete():
                still.append(snap)
                continue
            else:
                snap.fp = self.pool.fingerprint(snap.slot)
            snap.clean_step = self.step
            if self.ledger is not None:  # NOTE: the event's fields are built only for a ledger
                self._log("donate", **self._where(snap), fp=snap.fp, owner=_jsonable(snap.donor))
            parent = self._snaps.get(snap.parent) if snap.parent is not None else None
            parent_fp = parent.fp if parent is not None else None
            if snap.depth > 0 and (snap.fp == 0 or (parent_fp == snap.fp and snap.depth > snap.parent_depth)):
                what = "the zero state" if snap.fp == 0 else f"its ancestor's snapshot at depth {snap.parent_depth}"
                self._report(snap, "never-written", expected=parent_fp or 0, found=snap.fp, note=what)
        self._pending = still

    def _check_slot(self, slot: int) -> None:
        claims = self._by_slot.get(slot)
        if not claims:  # most slots: no watched snapshot claims them (nothing to copy and walk)
            return
        for node in list(claims):
            snap = self._snaps.get(node)
            if snap is not None and snap.fp is not None and self.pool.last_use(slot).is_complete():
                self._verify(snap, "slot-event")

    def _verify(self, snap: _Snap, why: str, taken: FingerprintJob | None = None) -> int:
        assert snap.fp is not None
        pool = snap.host if snap.host is not None else self.pool
        # the pool's fingerprint waits its own pending work on the slot; one taken on its stream
        # ran behind that work
        found = pool.fingerprint(snap.slot) if taken is None or snap.host is not None else taken.result()
        self._compare(snap, found, why)
        return found

    def _compare(self, snap: _Snap, found: int, why: str, clean: bool = True) -> None:
        """``found`` is ``snap``'s fingerprint now (read at this step, with ``clean``): log it, and
        report a change."""
        assert snap.fp is not None
        ok = found == snap.fp
        if self.ledger is not None:  # NOTE: the event's fields are built only for a ledger
            self._log("verify", **self._where(snap), fp=found, expected=snap.fp, ok=ok, why=why)
        if ok:
            if clean:
                snap.clean_step = self.step
        else:
            self._report(snap, "changed", expected=snap.fp, found=found, note=why)
            snap.fp = found  # report each change once
            snap.clean_step = self.step

    def _suspects(self, snap: _Snap, kind: str) -> list[Hashable]:
        spans = self._holds.get(snap.slot, _Holds()).spans if snap.host is None else []
        inside = [who for start, end, who in spans if end is None or end > snap.clean_step]
        before = [who for start, end, who in spans if end is not None and end <= snap.clean_step]
        ranked: list[Hashable] = []
        if kind == "never-written":
            ranked.append(snap.donor)
        for who in [*inside, *before[-1:]]:
            if who not in ranked:
                ranked.append(who)
        return ranked

    def _report(self, snap: _Snap, kind: str, *, expected: int, found: int, note: str) -> None:
        finding = SnapshotCorruption(
            kind,
            node=snap.node,
            depth=snap.depth,
            key=snap.key,
            slot=snap.slot,
            expected=expected,
            found=found,
            donor=snap.donor,
            suspects=self._suspects(snap, kind),
            step=self.step,
        )
        self._log("corruption", note=note, **finding.as_dict())
        self.findings.append(finding)
        self._flagged[snap.node] = finding
        if self.mode == "raise":
            self.flush()
            raise finding
        if self.warn and kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(
                f"radixcache forensics: {finding} (recorded in forensics.findings; later {kind!r} findings "
                "are recorded without a warning)",
                RuntimeWarning,
                stacklevel=2,
            )


def _check_node_id(node: object, why: object = "") -> None:
    """:raises TypeError: ``node`` is not a node id (an int; a ``TreeNode``'s ``id``), or ``why``
    (the reason a caller gives for a check) is not a string."""
    if isinstance(node, bool) or not isinstance(node, int):
        raise TypeError(f"node must be a node id (an int: TreeNode.id), got {type(node).__name__}")
    if not isinstance(why, str):
        raise TypeError(f"why must be a string, got {type(why).__name__}")
