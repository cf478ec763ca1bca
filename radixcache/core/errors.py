"""The errors radixcache raises for misuse, one base class, subclasses by cause.

Each also derives from the Python exception a caller would expect (``KeyError`` for an unknown
request, ``RuntimeError`` for calls in the wrong order or from two threads at once), so code
written against the builtin types keeps working.
"""

from __future__ import annotations

__all__ = [
    "AdmissionFailed",
    "ConcurrentUseError",
    "ForeignObjectError",
    "LockError",
    "ProtocolError",
    "RadixCacheError",
    "SnapshotRefused",
    "UnknownRequest",
]


class RadixCacheError(Exception):
    """Base class of radixcache's own errors. A call that raises one changed nothing."""


class UnknownRequest(RadixCacheError, KeyError):
    """A request id the manager does not hold (never admitted, or already finished or aborted)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ProtocolError(RadixCacheError, RuntimeError):
    """A call out of the host protocol's order: a second window planned before the first was
    committed, a plan committed twice or by another manager, a finish with a window still open."""


class ConcurrentUseError(RadixCacheError, RuntimeError):
    """The manager was entered while another call was running in it (from another thread, or
    from a callback of its own). The manager is not thread-safe by design: one scheduler thread
    drives it. The call that raises this changed nothing."""


class ForeignObjectError(RadixCacheError, ValueError):
    """A node, plan or result made by another cache or manager was passed to this one. Acting on
    it would copy another pool's slot or corrupt this tree's counters, so it is refused."""


class LockError(RadixCacheError, RuntimeError):
    """A lock used against its rule: an unlock without a lock, the eviction of a locked snapshot,
    a reset while requests still hold locks."""


class AdmissionFailed(RadixCacheError, RuntimeError):
    """Code the manager called during an admission raised (the policy, the host's stream).
    radixcache's own errors and forensics' ``SnapshotCorruption`` (``mode="raise"``) are raised
    as themselves, after the same give-back. Everything the admission had taken was given
    back (its slots to the pool, its lock on the tree, its record and counters), so the pool, the
    tree's locks and the manager are as they were; the cause is chained (``__cause__``). A
    snapshot verified and inserted from the shared tier before the failure stays in the tree,
    unlocked (it is valid), and snapshots evicted to make room stay evicted."""


class SnapshotRefused(RadixCacheError, RuntimeError):
    """A hit the manager would not serve: forensics named its snapshot in a finding (changed
    since its donation, or never written), found at this restore or before it. Nothing was
    copied and the policy heard of no hit; the snapshot is dropped (the one change such a call
    makes), at once or, while a lock holds it, at the unlock that lets it go or at the next
    admission after the request holding it ended. Take the request as a miss, or look up again:
    once it is dropped the lookup returns the next shallower snapshot (until then the same node,
    which ``forensics.flagged(node.id)`` names).

    :ivar node: the refused node's id; :ivar depth: its depth in tokens; :ivar kind: the
        finding's kind (``"changed"``, ``"never-written"``).
    """

    def __init__(self, node: int, depth: int, kind: str) -> None:
        super().__init__(
            f"node {node}'s snapshot at depth {depth} is not served: forensics found it {kind} "
            "(it is dropped; look up again for a shallower hit)"
        )
        self.node = node
        self.depth = depth
        self.kind = kind
