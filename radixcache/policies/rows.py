"""The row table of the policies that rank snapshots by numbers kept between evictions
(:class:`~radixcache.policies.HitDensity`, :class:`~radixcache.policies.FlopEfficiency`): one
row of floats per tracked snapshot node, for vectorised scoring, and what the tree did to those
nodes, heard as events (:meth:`RowTable.hear`), so that a snapshot the tree let go without the
policy choosing it (its own LRU after the policy answered ``None``, a manager's direct eviction,
``reset``) leaves the table at once and the rows whose costs it changed are refreshed, without a
sweep of every row.
"""

from __future__ import annotations

import numpy as np

from ..core.events import TreeEvent, TreeEventKind
from ..core.tree import TreeNode

__all__ = ["RowTable"]

_DUE_SLACK = 64  # nodes heard beyond twice the tracked ones before the removed ones are let go


class RowTable:
    """Tracked snapshot nodes, row ``i`` of :attr:`rows` for :attr:`nodes` ``[i]``. Adding and
    removing are O(1) (the last row moves into a removed one's place); rows past the tracked ones
    are zero.

    :ivar nodes: the tracked nodes, in row order.
    :ivar pos: row of each tracked node id.
    :ivar rows: the table, ``(capacity, columns)`` float64; grows by doubling (re-read it after
        :meth:`add`).
    """

    __slots__ = ("_due", "nodes", "pos", "rows")

    def __init__(self, columns: int) -> None:
        if columns <= 0:
            raise ValueError(f"a row table needs at least one column, got {columns}")
        self.nodes: list[TreeNode] = []
        self.pos: dict[int, int] = {}
        self.rows = np.zeros((64, columns))
        self._due: list[TreeNode] = []  # nodes whose costs the tree changed unseen: refresh at settle

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, nid: object) -> bool:
        return nid in self.pos

    def add(self, node: TreeNode) -> int:
        """Row of ``node``, a new (zero) one at the end when it is not tracked yet. O(1) amortised."""
        pos = self.pos.get(node.id)
        if pos is None:
            pos = self.pos[node.id] = len(self.nodes)
            self.nodes.append(node)
            if pos == len(self.rows):
                self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
        else:
            self.nodes[pos] = node
        return pos

    def remove(self, nid: int) -> bool:
        """Stop tracking node id ``nid`` (the last row takes its place). False: not tracked. O(1)."""
        pos = self.pos.pop(nid, None)
        if pos is None:
            return False
        moved = self.nodes.pop()
        last = len(self.nodes)
        if pos < last:
            self.nodes[pos] = moved
            self.pos[moved.id] = pos
            self.rows[pos] = self.rows[last]
        self.rows[last] = 0.0
        return True

    def hear(self, event: TreeEvent) -> int | None:
        """Take in what the tree did (a policy's :meth:`~radixcache.core.policy.Policy.tree_event`
        calls it). A tracked node that lost its device snapshot or left the tree is untracked
        (its id returned, for the policy's own bookkeeping), and the nodes whose eviction costs
        that changed are remembered for :meth:`due`: the node itself when it stays as a tombstone,
        the node a removed one hung from (an eviction cascade's stop). Reads nothing of the tree
        (a listener runs while the tree acts). Returns ``None`` when no tracked node went."""
        kind = event.kind
        if kind is TreeEventKind.NODE_REMOVED:
            if event.parent is not None and event.parent.depth > 0:
                self._due.append(event.parent)
        elif not (kind is TreeEventKind.DEMOTED or (kind is TreeEventKind.SNAPSHOT_FREED and event.tier == "device")):
            return None
        else:
            self._due.append(event.node)
        self._bound_due()
        nid = event.node.id
        return nid if self.remove(nid) else None

    def mark(self, nodes: list[TreeNode]) -> None:
        """Remember ``nodes`` for :meth:`due` as well: nodes whose dependent costs the policy's own
        bookkeeping changed (a new snapshot below them), refreshed at the next choice instead of
        at every change (a refresh reads the tree: several changes before a choice cost one)."""
        self._due.extend(nodes)
        self._bound_due()

    def _bound_due(self) -> None:
        if len(self._due) > 2 * len(self.nodes) + _DUE_SLACK:
            # No choice for a while (resets, direct evictions, donations between evictions): what
            # left the tree needs no refresh, a node marked twice one.
            self._due = list(dict.fromkeys(n for n in self._due if n.parent is not None))

    def due(self, first: TreeNode | None = None) -> list[TreeNode]:
        """``first`` (the policy's own last victim, or where its cascade stopped), then the nodes
        :meth:`hear` found changed and :meth:`mark` was given since the last call, in that order,
        each once: the policy refreshes the costs that depend on them (``cost_dependent``) now that
        the tree is still."""
        heard, self._due = self._due, []
        return list(dict.fromkeys(heard if first is None else [first, *heard]))

    def check_invariants(self) -> None:
        """Raise AssertionError unless positions, nodes and the zero rows past them agree."""
        n = len(self.nodes)
        assert len(self.pos) == n, f"{len(self.pos)} positions for {n} tracked nodes"
        for i, node in enumerate(self.nodes):
            assert self.pos.get(node.id) == i, f"node {node.id} at row {i}, its position says {self.pos.get(node.id)}"
        assert len(self.rows) >= n, f"{len(self.rows)} rows for {n} tracked nodes"
        assert not self.rows[n:].any(), "a non-zero row past the tracked ones"
