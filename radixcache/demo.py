"""A short, real walk-through of the slot pool: the one rule, step by step, printed.

Runs on a :class:`~linear_state.DeferredStream` so the output shows what a fence is for: a clone
taken before the producer's fence holds the stale state, one taken after holds the new state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from linear_state import (
    DeferredStream,
    LinearStatePool,
    NodeOwner,
    RequestOwner,
    SlotMisuse,
    StateLayout,
)

__all__ = ["run_demo"]


def run_demo(echo: Callable[[str], None] = print) -> bool:
    """Walk through alloc, write, donate (clone), restore and free; print each step and the
    conservation check. Returns True when every check held."""
    layout = StateLayout.for_gdn(num_layers=2, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    pool = LinearStatePool(layout, num_slots=4)
    forward = DeferredStream(name="forward")
    a, b, tree = RequestOwner("A"), RequestOwner("B"), NodeOwner(1)
    ok = True

    def status(step: str) -> None:
        nonlocal ok
        pool.check_invariants()
        req = pool.num_owned_by(RequestOwner)
        node = pool.num_owned_by(NodeOwner)
        held = pool.num_free + req + node == pool.capacity
        ok &= held
        echo(f"  {step:<60} free={pool.num_free} request={req} tree={node} conserved={held}")

    echo(f"pool: {pool.capacity} slots of {layout.slot_bytes:,} bytes ({layout})")
    live = pool.alloc(a)
    status(f"alloc: request A takes slot {live}")

    def forward_pass() -> None:  # request A's prefill: writes its live slot on the device stream
        pool.conv[:, live].fill_(1.0)
        pool.recurrent[:, live].fill_(1.0)

    produced = forward.submit(forward_pass, label="A prefill")
    status(f"A's prefill queued on the forward stream ({forward.pending} pending)")

    produced_sum = float(layout.num_layers * torch.Size(layout.recurrent_shape).numel())  # all ones
    stale = pool.clone(live, NodeOwner(0))
    stale_sum = float(pool.read(stale.slot)[1].sum())
    # The label says what the clone actually read: the state before the producer (zeros), after
    # it (all ones: the hazard did not show), or neither.
    label = {0.0: "stale: the producer had not run", produced_sum: "fresh: the hazard did not show"}
    echo(f"  hazard: a clone NOT ordered after the fence reads sum={stale_sum} ({label.get(stale_sum, 'garbage')})")
    ok &= stale_sum == 0.0  # on a deferred stream the producer cannot have run: the hazard must show
    pool.free(stale.slot, NodeOwner(0))

    snap = pool.clone(live, tree, after=[produced])
    donated_fp = pool.fingerprint(snap.slot)
    snap_sum = float(pool.read(snap.slot)[1].sum())
    echo(f"  the clone ordered after the fence reads sum={snap_sum} (expected {produced_sum})")
    ok &= snap_sum == produced_sum
    status(f"donate: clone of slot {live} after the fence -> slot {snap.slot} (sum={snap_sum})")

    try:
        pool.zero(snap.slot, owner=tree)
        ok = False
    except SlotMisuse as e:
        echo(f"  a write into the frozen snapshot raises: {e}")

    pool.free(live, a, after=[produced])
    status("finish: A frees its live slot after its last fence")

    b_live = pool.alloc(b)
    restored = pool.copy(snap.slot, b_live, dst_owner=b)
    restored.wait()
    same = pool.fingerprint(b_live) == donated_fp
    ok &= same
    status(f"hit: restore snapshot {snap.slot} -> B's slot {b_live} (fingerprint equal={same})")

    try:
        pool.free(b_live, a)
        ok = False
    except SlotMisuse as e:
        echo(f"  a free by a non-owner raises: {e}")

    pool.free(b_live, b)
    pool.free(snap.slot, tree)
    status("B finishes; the snapshot is evicted")
    echo("all checks held" if ok else "A CHECK FAILED")
    return ok
