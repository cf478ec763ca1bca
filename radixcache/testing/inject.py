"""The historical bugs, committed on purpose, so the hammer and the fuzzing kit prove they catch
them. Never use these classes outside tests.

================  =============================================================================
``alias``         ownership transfer instead of copy-on-donate: the tree records the donor's own
                  slot as its snapshot; the donor's later writes (and the next owner of the
                  slot once the donor frees it) poison every hit on that branch.
no-donate-fence   the donate clone is not ordered after the producer's fence: it can copy the
                  slot before the capturing forward wrote it.
no-restore-fence  the hit restore copies the snapshot at once, not ordered after the clone that
                  fills it.
================  =============================================================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from linear_state import COMPLETE, Fence, LinearStatePool, NodeOwner, Owner, SlotId, SlotWrite, Stream

from ..tree import HybridRadixCache, TreeNode

__all__ = ["BUGS", "make_cache"]


def _raw_restore(tree: HybridRadixCache, node: TreeNode, dst_slot: int, ordered: bool) -> Fence:
    """A restore as engines without an ownership-checking pool do it: a raw copy of the rows."""
    if node.snapshot is None:
        raise ValueError(f"node {node.id} holds no snapshot to restore")
    src, pool = node.snapshot, tree.pool

    def work() -> None:
        torch._foreach_copy_(
            (pool.conv[:, dst_slot], pool.recurrent[:, dst_slot]), (pool.conv[:, src], pool.recurrent[:, src])
        )

    if not ordered:
        work()  # BUG (no-restore-fence): runs now, whatever the clone filling ``src`` has done
        return COMPLETE
    assert tree.stream is not None
    return tree.stream.submit(work, after=(node.snapshot_fence,), label=f"raw restore {src}->{dst_slot}")


class _AliasTree(HybridRadixCache):
    def restore(
        self, node: TreeNode, dst_slot: int, *, stream: Stream | None = None, dst_owner: Owner | None = None
    ) -> Fence:
        # The snapshot slot is not the tree's: the pool would (rightly) refuse to read it once the
        # donor freed it, so this tree copies raw rows, ordered after the snapshot's fence.
        return _raw_restore(self, node, dst_slot, ordered=True)

    def _take_snapshot(self, state_slot: int, owner: NodeOwner, ready: Fence | None) -> SlotWrite:
        return SlotWrite(SlotId(state_slot), COMPLETE)  # BUG: the donor's slot, not a private clone

    def _free_snapshot(self, n: TreeNode) -> None:
        # The aliased slot belongs to the donor (or its next owner): dropping it is all we can do.
        n.snapshot = None
        n.snapshot_fence = COMPLETE
        self._num_snapshots -= 1


class _NoDonateFenceTree(HybridRadixCache):
    def _take_snapshot(self, state_slot: int, owner: NodeOwner, ready: Fence | None) -> SlotWrite:
        return self.pool.clone(state_slot, owner, stream=self.stream)  # BUG: ``ready`` not waited


class _NoRestoreFenceTree(HybridRadixCache):
    def restore(
        self, node: TreeNode, dst_slot: int, *, stream: Stream | None = None, dst_owner: Owner | None = None
    ) -> Fence:
        self.pool.check_writable(dst_slot, dst_owner)
        return _raw_restore(self, node, dst_slot, ordered=False)


BUGS: dict[str, type[HybridRadixCache]] = {
    "alias": _AliasTree,
    "no-donate-fence": _NoDonateFenceTree,
    "no-restore-fence": _NoRestoreFenceTree,
}


def make_cache(
    inject: str | None,
    pool: LinearStatePool,
    *,
    page_size: int = 1,
    on_free_kv: Callable[[torch.Tensor], None] | None = None,
    stream: Stream | None = None,
) -> HybridRadixCache:
    """A correct :class:`HybridRadixCache` (``inject=None``), or one committing bug ``inject``.

    :raises ValueError: unknown bug name.
    """
    if inject is None:
        return HybridRadixCache(pool, page_size=page_size, on_free_kv=on_free_kv, stream=stream)
    if inject not in BUGS:
        raise ValueError(f"unknown inject mode {inject!r}; known: {sorted(BUGS)}")
    return BUGS[inject](pool, page_size=page_size, on_free_kv=on_free_kv, stream=stream)
