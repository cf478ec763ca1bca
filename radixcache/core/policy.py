"""The interface every snapshot placement and eviction policy implements, and what a policy may
read of the tree (:class:`TreeView`).

A policy is a set of hooks that :class:`~radixcache.CacheManager` calls; it never drives the tree
itself. The manager asks it where to capture (:meth:`Policy.captures`, :meth:`Policy.donate_finish`)
and which snapshot goes next (:meth:`Policy.victim`), and tells it what happened (admitted,
touched, donated). Eviction itself, its cascade and its accounting stay in the tree.

The interface lives in core, the policies in :mod:`radixcache.policies`: core imports no policy.
The manager's default policy is the factory registered with :func:`set_default_policy`
(:mod:`radixcache.policies` registers :class:`~radixcache.policies.HitDensity` when imported,
which importing ``radixcache`` does).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple, Protocol

from .events import TreeEvent
from .tree import EvictResult, TreeNode

__all__ = ["DonationReason", "Policy", "RequestInfo", "TreeView", "default_policy", "set_default_policy"]


class TreeView(Protocol):
    """What a policy reads of the tree it ranks: queries only, nothing that changes it
    (:class:`~radixcache.HybridRadixCache` implements it). Node fields (``depth``, ``parent``,
    ``children``, ``snapshot``, ``host``, ``last_access``) are read directly."""

    @property
    def demotes(self) -> bool:
        """An eviction for slots would demote a snapshot now (it frees the slot alone)."""
        ...

    def eviction_cost(self, node: TreeNode, *, demote: bool = True) -> EvictResult:
        """What evicting ``node``'s snapshot would free, without changing anything."""
        ...

    def holds_snapshot(self, node: TreeNode) -> bool:
        """``node`` is in the tree and holds a device snapshot."""
        ...

    def is_evictable(self, node: TreeNode) -> bool:
        """``node`` holds a snapshot that no lock protects."""
        ...

    def snapshot_ancestors(self, node: TreeNode) -> Iterator[TreeNode]:
        """The ancestors of ``node`` holding a snapshot, nearest first."""
        ...

    def snapshots_below(self, node: TreeNode, *, through: Callable[[TreeNode], bool]) -> Iterator[TreeNode]:
        """The device snapshots below ``node``, each branch down to its first one ``through`` stops."""
        ...

    def cascade_stop(self, node: TreeNode) -> TreeNode:
        """Where removing leaf ``node`` stops its cascade."""
        ...

    def cost_dependent(self, node: TreeNode) -> TreeNode | None:
        """The snapshot whose eviction cost a change of ``node``'s children may have changed."""
        ...

    def cost_dependents(self, node: TreeNode) -> list[TreeNode]:
        """The snapshots whose eviction cost inserting ``node`` may have changed."""
        ...


class DonationReason(enum.Enum):
    """Why a snapshot was donated."""

    CAPTURE = "capture"  # a capture the policy planned during a prefill or decode window
    FINISH = "finish"  # the request's final state (or its deepest page-aligned capture), at finish


class RequestInfo(NamedTuple):
    """What a policy may know about a request when it places captures. Immutable (a named tuple:
    NOTE: built at every admission, hit and donation; a frozen dataclass's ``__init__`` sets each of
    its seven fields through ``object.__setattr__``, ~2 us a request inside SGLang's scheduler,
    session 36).

    :ivar prompt_len: prompt tokens; :ivar cached_length: tokens served from cache at admission
        (``Admission.cached_length``); :ivar token_length: depth to which the prompt agreed with
        the tree, where it leaves the tree: its branch point (``Admission.token_length``);
    :ivar session: the conversation the host says the request belongs to (``None``: unknown);
    :ivar ts: arrival time in seconds (the manager's clock unless the host passes ``now``);
    :ivar prompt_digest: a hash of the prompt's ids (equal digests: identical prompts; the
        manager's are Python's hash of the key, so compare them within one process; ``None``:
        unknown);
    :ivar image_starts: depths where image spans start in the prompt.
    """

    prompt_len: int
    cached_length: int
    token_length: int
    session: Hashable | None
    ts: float
    prompt_digest: int | None = None
    image_starts: tuple[int, ...] = ()


class Policy(ABC):
    """Where to capture snapshots and which to evict. One instance serves one manager.

    Call order for a request: :meth:`admitted` first, :meth:`touched` when it hit, then
    :meth:`captures` once per scheduled window (prefill chunk or decode window), :meth:`donated`
    for each snapshot the tree took, and :meth:`donate_finish` at finish. :meth:`victim` is asked
    whenever the manager must free a snapshot (for slots, for KV, or for a byte budget), and
    :meth:`tree_event` hears everything the tree let go or moved.
    """

    name: str = "policy"
    decode_captures: bool = True  # False: captures() never proposes a depth in a decode window
    snapshot_bytes: int = 2048
    kv_bytes_per_token: int = 1

    def bind(self, cache: TreeView) -> None:
        """Attach the policy to the tree it ranks (the manager calls this once).

        :raises RuntimeError: the policy already serves another tree (one instance per manager).
        """
        bound = getattr(self, "cache", None)
        if bound is not None and bound is not cache:
            raise RuntimeError(f"policy {self.name!r} already serves another cache; make one policy per manager")
        self.cache = cache

    def costs(self, snapshot_bytes: int, kv_bytes_per_token: int) -> None:
        """The model's bytes per snapshot and per KV token. Policies that weigh bytes use them;
        until told, a snapshot counts as 2,048 tokens of KV.

        :raises ValueError: a non-positive size.
        """
        if snapshot_bytes <= 0 or kv_bytes_per_token <= 0:
            raise ValueError(f"costs must be positive, got snapshot {snapshot_bytes}, kv/token {kv_bytes_per_token}")
        self.snapshot_bytes, self.kv_bytes_per_token = snapshot_bytes, kv_bytes_per_token

    def freed_bytes(self, node: TreeNode, *, demote: bool = True) -> int:
        """What evicting ``node``'s snapshot frees, in the model's bytes: the snapshot, plus, for a
        leaf, the KV it alone keeps (its edge and every parent the eviction would leave as a
        tombstone leaf; see :meth:`HybridRadixCache.eviction_cost`), unless the host tier takes the
        snapshot (``demote``, as an eviction for slots does; one for KV pressure drops the leaf:
        ``demote=False``). An inner node's KV stays for its children. The policy must be bound
        (:meth:`bind`)."""
        cost = self.cache.eviction_cost(node, demote=demote)
        return self.snapshot_bytes + cost.kv_tokens * self.kv_bytes_per_token

    def flops(self, prefill_flops: Callable[[int], float]) -> None:  # noqa: B027
        """The model's FLOP model: FLOPs to prefill positions ``[0, n)``. Policies that weigh
        compute use it (the replay passes its preset's; a host passes its model's); others ignore it."""

    def admitted(self, req: RequestInfo) -> None:  # noqa: B027
        """``req`` was admitted (called once per request, before its captures)."""

    def check_invariants(self) -> None:  # noqa: B027
        """Raise AssertionError if the policy's own bookkeeping is inconsistent (default: none kept)."""

    def describe(self) -> dict[str, object]:
        """The policy's own state (its fields, the bound cache left out), for digests and
        debugging. Reads only."""
        return {k: v for k, v in vars(self).items() if k != "cache"}

    @abstractmethod
    def captures(self, req: RequestInfo, start: int, end: int, *, decode: bool) -> list[int]:
        """Depths in ``(start, end]`` worth a snapshot, for the window over tokens ``[start, end)``
        (``decode``: the window is past the prompt). The manager cuts them to the page size,
        drops those already held, and keeps at most the request's track slots, in this order."""

    def donate_finish(self, req: RequestInfo) -> bool:
        """Whether the request's final state (prompt + answer) is worth a snapshot at finish."""
        return False

    def donated(self, node: TreeNode, req: RequestInfo, reason: DonationReason, now: float) -> None:  # noqa: B027
        """``node`` now holds a snapshot ``req`` donated. A host's checkpoint
        (:meth:`CacheManager.checkpoint`) describes its key, not a prompt: ``req.prompt_digest``
        is ``None`` there."""

    def touched(self, node: TreeNode, req: RequestInfo, now: float) -> None:  # noqa: B027
        """``node`` served a hit for ``req``."""

    def tree_event(self, event: TreeEvent) -> None:  # noqa: B027
        """The tree did ``event`` (:mod:`radixcache.core.events`): the manager hands the policy every
        one, in order, while the tree's call runs, those of the policy's own victims included. A
        policy that keeps numbers per snapshot learns here what went without its choosing (the
        tree's least recently used after a ``None``, a manager's direct eviction, ``reset``). It must
        not call into the tree from here: note, and act at the next hook."""

    def victim(self, now: float, *, kv: bool = False) -> TreeNode | None:
        """The snapshot to evict next: an evictable node (see
        :meth:`HybridRadixCache.is_evictable`), a leaf when ``kv`` (the eviction must free KV).
        The manager evicts it at once. ``None`` (the default): the tree's least recently used."""
        return None


_default: Callable[[], Policy] | None = None


def set_default_policy(factory: Callable[[], Policy]) -> None:
    """Register what :func:`default_policy` builds (:mod:`radixcache.policies` registers
    ``HitDensity``). :raises TypeError: not callable."""
    global _default
    if not callable(factory):
        raise TypeError(f"factory must build a Policy, got {factory!r}")
    _default = factory


def default_policy() -> Policy:
    """A fresh instance of the registered default policy.

    :raises RuntimeError: none registered (import :mod:`radixcache.policies`).
    :raises TypeError: the factory built something that is not a :class:`Policy`."""
    if _default is None:
        raise RuntimeError("no default policy registered: import radixcache.policies, or pass policy=")
    p = _default()
    if not isinstance(p, Policy):
        raise TypeError(f"the default policy factory built {type(p).__name__}, not a Policy")
    return p
