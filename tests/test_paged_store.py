"""The paged host store the vLLM connector keeps (radixcache.vllm.store), without vLLM: engine
blocks are plain tensors here, so every path (save, hit, verification, eviction, bad input) is
checked on the CPU in the main suite; tests/vllm proves it inside vLLM."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch

from linear_state import StateLayout
from radixcache import KVPageList
from radixcache.manager import EvictionReason
from radixcache.policies import make_policy
from radixcache.tiers.store import MemoryStore, RedisStore, SharedStoreError
from radixcache.vllm import VERIFYING, ConnectorOptions, Hit, PagedHostStore, PagedLayout, SavePlan, UnsupportedEngine

from .exit_check import run_exiting
from .redis_server import RedisServer

B = 4  # tokens per block
STATE = StateLayout(num_layers=2, conv_shape=(3, 8), recurrent_shape=(2, 4, 4))
LAYOUT = PagedLayout(block_tokens=B, kv_layers=2, kv_page_bytes=64, state=STATE)


def _store(budget_pages: int = 16, **kw: object) -> PagedHostStore:
    per = LAYOUT.page_bytes + 0.5 * STATE.slot_bytes
    return PagedHostStore(LAYOUT, int(budget_pages * per) + 1, **kw)  # type: ignore[arg-type]


class Engine:
    """An engine's blocks: per attention layer ``(blocks, page bytes)`` uint8, per linear layer
    a conv and a recurrent state per block; each block filled with bytes derived from the ids it
    holds, so a wrong copy is visible."""

    def __init__(self, blocks: int = 32) -> None:
        self.kv = [torch.zeros(blocks, LAYOUT.kv_page_bytes, dtype=torch.uint8) for _ in range(LAYOUT.kv_layers)]
        self.conv = torch.zeros(blocks, STATE.num_layers, *STATE.conv_shape, dtype=STATE.conv_dtype)
        self.rec = torch.zeros(blocks, STATE.num_layers, *STATE.recurrent_shape, dtype=STATE.recurrent_dtype)

    def compute(self, ids: list[int], blocks: list[int]) -> None:
        for k, b in enumerate(blocks):
            seed = hash(tuple(ids[: (k + 1) * B])) % (2**31)
            g = torch.Generator().manual_seed(seed)
            for t in self.kv:
                t[b] = torch.randint(0, 256, (LAYOUT.kv_page_bytes,), dtype=torch.uint8, generator=g)
            self.conv[b] = torch.randn(self.conv.shape[1:], generator=g)
            self.rec[b] = torch.randn(self.rec.shape[1:], generator=g)

    def layers(self, blocks: list[int]) -> list[tuple[torch.Tensor, list[int]]]:
        return [(t, blocks) for t in self.kv]


def _copy_in(store: PagedHostStore, eng: Engine, plan: SavePlan, blocks: list[int] | None = None) -> None:
    """What vLLM's worker does for ``plan``: the engine's ``blocks`` into its pages, the state
    of the last of them into its slot; by default the engine's blocks are the prefix's own
    (block ``k`` of the ids in engine block ``k``), the state the one after ``plan.end``."""
    if blocks is None:
        blocks = list(range(plan.start // B, plan.end // B))
        state = plan.end // B - 1
    else:
        state = blocks[-1]
    store.copy_in_pages(plan.pages, eng.layers(blocks))
    store.copy_in_state(plan, eng.conv[state], eng.rec[state])


def _hit_equals(store: PagedHostStore, eng: Engine, ids: list[int], blocks: list[int], rid: str) -> None:
    """A lookup of ``ids`` + one token hits all of ``ids`` with the engine's bytes."""
    hit = store.lookup(rid, ids, computed=0)
    assert hit is not None and hit.end == len(ids), hit
    out = Engine()
    store.copy_out_pages(hit.pages, out.layers(list(range(len(hit.pages)))))
    for t_out, t_in in zip(out.kv, eng.kv, strict=True):
        assert torch.equal(t_out[: len(blocks)], t_in[blocks])
    conv, rec = store.state_of(hit)
    assert torch.equal(conv, eng.conv[blocks[-1]]) and torch.equal(rec, eng.rec[blocks[-1]])
    store.release(hit)
    store.check_invariants()


def _save(store: PagedHostStore, eng: Engine, rid: str, ids: list[int], blocks: list[int]) -> bool:
    plan = store.plan_save(rid, ids)
    if plan is None:
        return False
    _copy_in(store, eng, plan, blocks[plan.start // B : len(ids) // B])
    return store.commit(plan)


def test_a_saved_prefix_is_served_back_byte_for_byte() -> None:
    store, eng = _store(), Engine()
    ids = list(range(100, 100 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    assert _save(store, eng, "a", ids, [0, 1, 2])
    store.check_invariants()
    hit = store.lookup("b", [*ids, 7], computed=0)
    assert hit is not None and (hit.start, hit.end) == (0, 3 * B) and len(hit.pages) == 3
    out = Engine()
    store.copy_out_pages(hit.pages, out.layers([5, 6, 7]))
    conv, rec = store.state_of(hit)
    for t_out, t_in in zip(out.kv, eng.kv, strict=True):
        assert torch.equal(t_out[5:8], t_in[0:3])
    assert torch.equal(conv, eng.conv[2]) and torch.equal(rec, eng.rec[2])
    store.release(hit)
    store.check_invariants()
    assert store.lookup("c", ids, computed=3 * B) is None, "nothing deeper than what the engine has"


def test_a_hit_is_read_out_of_its_snapshots_own_slot_which_its_hold_keeps() -> None:
    """No private copy of the state on the scheduler's thread: the hit names the snapshot's
    slot, takes no slot of the store, and its lock keeps the snapshot from every eviction until
    it is released, even when the store needs the room."""
    store, eng = _store(budget_pages=6), Engine()
    ids = list(range(100, 100 + 2 * B))
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "a", ids, [0, 1])
    free = store.pool.num_free
    hit = store.lookup("b", [*ids, 7])
    assert hit is not None and hit.slot == hit.node.snapshot and store.pool.num_free == free
    store.check_invariants()
    for i in range(4):  # more saves than the store holds: they evict what is not held
        other = list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * B))
        eng.compute(other, [2, 3])
        _save(store, eng, f"o{i}", other, [2, 3])
    assert sum(store.manager.metrics().evictions.values()) > 0
    assert hit.node.snapshot == hit.slot
    conv, rec = store.state_of(hit)
    assert torch.equal(conv, eng.conv[1]) and torch.equal(rec, eng.rec[1])
    second = store.lookup("c", [*ids, 7])  # a second hold of the same snapshot
    assert second is not None and second.slot == hit.slot
    store.release(hit, loaded=True)
    with pytest.raises(ValueError, match="released already"):
        store.release(hit)  # would take the second hit's lock away
    assert hit.node.snap_lock == 1
    with pytest.raises(ValueError, match="not this store's"):
        _store().release(second)
    store.manager.unlock(second.node)  # the hold taken away behind the store's back
    with pytest.raises(AssertionError):
        store.check_invariants()
    store.manager.lock(second.node)
    store.release(second)
    store.check_invariants()


def test_only_a_hit_the_engine_loaded_counts_as_a_hit() -> None:
    """A lookup's hit is an offer; released unloaded (the engine took none of it, or asks again
    at a later step) it must not count, or the store's hit tokens overstate the engine's."""
    store, eng = _store(), Engine()
    ids = list(range(100, 100 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    assert _save(store, eng, "a", ids, [0, 1, 2])
    for _ in range(2):  # offered twice, not taken
        hit = store.lookup("b", [*ids, 7], computed=B)
        assert hit is not None
        store.release(hit)
    hit = store.lookup("b", [*ids, 7], computed=B)
    assert hit is not None
    with pytest.raises(ValueError, match="either loaded or declined"):
        store.release(hit, loaded=True, declined=True)
    store.release(hit, declined=True)  # withdrawn: the engine had no room for it
    hit = store.lookup("b", [*ids, 7], computed=B)
    assert hit is not None
    store.release(hit, loaded=True)
    st = store.describe()["stats"]
    assert (st["offers"], st["offered_tokens"], st["declined"]) == (4, 4 * 2 * B, 1)
    assert (st["hits"], st["hit_tokens"]) == (1, 2 * B)
    store.check_invariants()
    held = store.manager.cache.num_snapshots
    assert held == 1 and store.pool.num_free == store.num_slots - held, "a released hit kept its slot"


def test_a_later_save_copies_only_the_blocks_the_tree_lacks() -> None:
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 4 * B))
    eng.compute(ids, [0, 1, 2, 3])
    assert _save(store, eng, "a", ids[: 2 * B], [0, 1])
    plan = store.plan_save("a", ids)
    assert plan is not None and plan.start == 2 * B and len(plan.pages) == 2
    store.abandon(plan)
    assert store.plan_save("a", ids[: 2 * B]) is None and store.stats.saves_skipped["held"] == 1
    store.check_invariants()


def test_a_changed_snapshot_is_a_finding_and_never_served() -> None:
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 2 * B))
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "a", ids, [0, 1])
    node = store.manager.lookup(ids).node
    store.synchronize()  # the change lands after the tree's copy (a write racing it is overwritten)
    store.pool.recurrent[0, node.snapshot, 0, 0, 0] += 1.0  # one element changed
    assert store.lookup("b", [*ids, 9]) is None
    assert store.stats.corrupt_snapshots == 1 and len(store.forensics.findings) == 1  # type: ignore[union-attr]
    assert store.manager.metrics().evictions[EvictionReason.CORRUPT.value] == 1
    assert store.manager.cache.num_snapshots == 0
    store.check_invariants()


def test_a_changed_kv_page_is_a_finding_and_the_hit_falls_back() -> None:
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    assert _save(store, eng, "a", ids[:B], [0])
    assert _save(store, eng, "a", ids, [0, 1, 2])
    deep = store.manager.lookup(ids).kv_indices
    page = int(deep[2 * B]) // B  # the third block's page: only the deeper snapshot reads it
    store.synchronize()  # the change lands after the page's fingerprint (one before it is recorded in it)
    store.kv[1, page, 3] ^= 0xFF
    hit = store.lookup("b", [*ids, 9])
    assert hit is not None and hit.end == B, "the shallower verified snapshot serves"
    assert store.stats.corrupt_pages == 1 and store.page_findings[0].page == page
    store.release(hit)
    store.check_invariants()


def test_a_hit_that_does_not_fit_is_declined_before_it_is_verified_or_copied() -> None:
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    assert _save(store, eng, "a", ids, [0, 1, 2])
    st = store.stats
    asked: list[int] = []

    def no_room(tokens: int) -> bool:
        asked.append(tokens)
        return False

    with pytest.raises(TypeError, match="fits must be a callable"):
        store.lookup("b", [*ids, 9], computed=B, fits=True)  # type: ignore[arg-type]
    assert st.lookups == 0 and st.declined == 0, "refused before anything was counted"
    assert store.lookup("b", [*ids, 9], computed=B, fits=no_room) is None
    assert asked == [2 * B], "asked with the tokens beyond the engine's own"
    assert st.declined == 1 and st.verified_pages == 0 and st.offers == 0
    store.check_invariants()
    hit = store.lookup("b", [*ids, 9], computed=B, fits=lambda tokens: tokens == 2 * B)
    assert hit is not None and hit.end == 3 * B
    assert st.declined == 1 and st.verified_pages == 2 and st.offers == 1
    store.release(hit)
    store.check_invariants()


def test_without_verification_a_changed_snapshot_is_served() -> None:
    """The negative control of the check above: ``verify=False`` serves the changed bytes."""
    store, eng = _store(verify=False), Engine()
    ids = list(range(1, 1 + 2 * B))
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "a", ids, [0, 1])
    node = store.manager.lookup(ids).node
    store.synchronize()  # the change lands after the tree's copy (a write racing it is overwritten)
    store.pool.recurrent[0, node.snapshot, 0, 0, 0] += 1.0
    hit = store.lookup("b", [*ids, 9])
    assert hit is not None and not torch.equal(store.state_of(hit)[1], eng.rec[1])
    store.release(hit)


@pytest.mark.parametrize("copy_thread", [False, True])
def test_a_state_never_written_is_dropped_when_filed(copy_thread: bool) -> None:
    """On the caller's thread the commit finds it and files nothing; on the copy thread the
    finding comes once the clone and its fingerprint ran, and the next call (here
    ``synchronize``) drops it: no lookup serves it either way."""
    store, eng = _store(copy_thread=copy_thread), Engine()
    ids = list(range(1, 1 + 2 * B))
    plan = store.plan_save("a", ids)
    assert plan is not None
    store.copy_in_pages(plan.pages, eng.layers([0, 1]))
    store.pool.write(plan.slot, torch.zeros(2, 3, 8), torch.zeros(2, 2, 4, 4), owner=plan.owner)
    filed = store.commit(plan)
    if not copy_thread:
        assert not filed and store.manager.cache.num_snapshots == 0
    store.synchronize()
    assert store.stats.saves_skipped["corrupt"] == 1 and store.stats.corrupt_snapshots == 1
    assert store.manager.cache.num_snapshots == 0 and store.lookup("b", [*ids, 9]) is None
    store.check_invariants()


def test_a_state_never_written_is_not_served_while_its_fingerprint_is_pending() -> None:
    """The lookup comes before anything swept the finding: it waits the donation's fingerprint
    itself, finds the state never written, and serves nothing."""
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 2 * B))
    plan = store.plan_save("a", ids)
    assert plan is not None and store.copies is not None
    store.copy_in_pages(plan.pages, eng.layers([0, 1]))
    store.pool.write(plan.slot, torch.zeros(2, 3, 8), torch.zeros(2, 2, 4, 4), owner=plan.owner)
    gate = threading.Event()
    store.copies.submit(lambda: gate.wait(10), label="busy")  # the clone waits behind this
    assert store.commit(plan), "filed: its fingerprint is not taken yet"
    assert store.manager.cache.num_snapshots == 1
    threading.Timer(0.05, gate.set).start()
    assert store.lookup("b", [*ids, 9]) is None
    assert store.stats.corrupt_snapshots == 1 and store.manager.cache.num_snapshots == 0
    store.synchronize()
    assert store.stats.corrupt_snapshots == 1  # counted once
    store.check_invariants()


def test_a_commit_returns_before_the_copy_and_a_lookup_waits_for_it() -> None:
    """The clone of a saved state runs on the store's copy thread: the commit files it at once;
    the plan's slot is free again (its next owner waits the clone); a lookup offers the snapshot
    only once it was copied and verified, with the saved bytes."""
    store, eng = _store(budget_pages=4), Engine()
    assert store.num_slots == 2 and store.copies is not None
    ids = list(range(1, 1 + 2 * B))
    eng.compute(ids, [0, 1])
    plan = store.plan_save("a", ids)
    assert plan is not None
    _copy_in(store, eng, plan, [0, 1])
    gate = threading.Event()
    store.copies.submit(lambda: gate.wait(10), label="busy")  # the clone waits behind this
    assert store.commit(plan)
    node = store.manager.lookup(ids).node
    assert node.snapshot is not None and not node.snapshot_fence.is_complete()
    assert store.pool.num_free == 1  # the plan's slot: free, its clone still to read it
    store.check_invariants()
    threading.Timer(0.05, gate.set).start()
    hit = store.lookup("b", [*ids, 9])
    assert hit is not None and node.snapshot_fence.is_complete()
    assert torch.equal(store.state_of(hit)[1], eng.rec[1]) and torch.equal(store.state_of(hit)[0], eng.conv[1])
    store.release(hit, loaded=True)
    store.check_invariants()
    assert store.close()
    assert not store.copies.running


def test_the_budget_is_held_by_the_policy() -> None:
    store, eng = _store(budget_pages=6), Engine(64)
    for r in range(8):
        ids = [1000 * r + i for i in range(2 * B)]
        eng.compute(ids, [2 * r, 2 * r + 1])
        _save(store, eng, f"r{r}", ids, [2 * r, 2 * r + 1])
        store.check_invariants()
    assert store.manager.cache.total_kv_tokens <= store.num_pages * B
    assert sum(store.manager.metrics().evictions.values()) > 0


def test_bad_input_is_refused_and_changes_nothing() -> None:
    store = _store()
    with pytest.raises(ValueError, match="multiple of 4"):
        store.plan_save("a", [1, 2, 3])
    with pytest.raises(ValueError, match="computed must be a multiple of 4"):
        store.lookup("a", [1, 2, 3, 4, 5], computed=3)
    with pytest.raises(ValueError, match="holds 0 KV pages"):
        PagedHostStore(LAYOUT, 100)
    with pytest.raises(TypeError, match="PagedLayout"):
        PagedHostStore(STATE, 10**6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="copy_thread must be a bool, got 1"):
        PagedHostStore(LAYOUT, 10**6, copy_thread=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_layers must be an int >= 1"):
        PagedLayout(4, 0, 64, STATE)
    plan = store.plan_save("a", list(range(B)))
    assert plan is not None
    with pytest.raises(ValueError, match="3 attention layers given"):
        store.copy_in_pages(plan.pages, [(torch.zeros(4, 64, dtype=torch.uint8), [0])] * 3)
    store.abandon(plan)
    for again in (store.abandon, store.commit):
        with pytest.raises(ValueError, match="committed or abandoned already"):
            again(plan)
    store.check_invariants()
    assert store.pages.free_pages == store.num_pages and store.pool.num_free == store.num_slots


def test_a_plan_made_before_its_last_ids_were_known_is_filed_under_the_whole_prefix() -> None:
    """vLLM's asynchronous scheduling plans a decode step's save before the token the step reads
    is sampled: the plan holds the ids known then, the commit takes the whole prefix, and the
    snapshot is keyed on it (a prefix that differs in that last token does not hit it)."""
    store, eng = _store(), Engine()
    ids = list(range(200, 200 + 2 * B))
    eng.compute(ids, [0, 1])
    plan = store.plan_save("a", ids[:-1], end=2 * B)
    assert plan is not None and plan.ids.size == 2 * B - 1 and (plan.start, plan.end) == (0, 2 * B)
    _copy_in(store, eng, plan, [0, 1])
    with pytest.raises(ValueError, match="knows 7 of its ids: commit needs all of them"):
        store.commit(plan)
    with pytest.raises(ValueError, match="got 7 ids"):
        store.commit(plan, ids[:-1])
    with pytest.raises(ValueError, match="that differ from them"):
        store.commit(plan, [0, *ids[1:]])
    store.check_invariants()  # each refusal left the plan planned and the store as it was
    assert store.manager.cache.num_snapshots == 0
    assert store.commit(plan, ids)
    store.check_invariants()
    other = store.lookup("b", [*ids[:-1], ids[-1] + 1, 9], computed=0)
    assert other is None, "a prefix that differs in the token unknown at planning hit the snapshot"
    hit = store.lookup("c", [*ids, 9], computed=0)
    assert hit is not None and hit.end == 2 * B
    conv, rec = store.state_of(hit)
    assert torch.equal(conv, eng.conv[1]) and torch.equal(rec, eng.rec[1])
    store.release(hit)


def test_a_plan_whose_last_ids_never_came_is_given_back_and_counted() -> None:
    store = _store()
    with pytest.raises(ValueError, match="end must be an int >= len\\(ids\\) = 5, got 4"):
        store.plan_save("a", list(range(5)), end=B)
    with pytest.raises(ValueError, match="multiple of 4 tokens, got 6"):
        store.plan_save("a", list(range(5)), end=6)
    plan = store.plan_save("a", list(range(5)), end=2 * B)
    assert plan is not None
    store.abandon(plan, why="ids-unknown")
    assert store.describe()["stats"]["saves_skipped"] == {"ids-unknown": 1}
    store.check_invariants()
    assert store.pages.free_pages == store.num_pages and store.pool.num_free == store.num_slots


def test_options_refuse_unknown_keys_and_bad_values() -> None:
    assert ConnectorOptions.from_extra(None) == ConnectorOptions()
    assert ConnectorOptions.from_extra({"policy": "vllm-like", "verify": False}).verify is False
    assert ConnectorOptions.from_extra({"copy_thread": False}).copy_thread is False
    assert ConnectorOptions.from_extra({"redis_url": "redis://127.0.0.1:1/0"}).redis_url == "redis://127.0.0.1:1/0"
    cases: list[tuple[dict[str, object], str]] = [
        ({"budget": 1}, r"unknown kv_connector_extra_config keys \['budget'\]"),
        ({"policy": "lru"}, "unknown policy 'lru'"),
        ({"verify": 1}, "verify must be a bool"),
        ({"host_budget_bytes": -5}, "host_budget_bytes must be an int >= 1"),
        ({"snapshots_per_block": 0}, "snapshots_per_block"),
        ({"redis_url": "http://x"}, "redis_url must be a redis://"),
        ({"shared_namespace": "a:b"}, "shared_namespace must be a non-empty string without ':'"),
        ({"model_identity": ""}, "model_identity must be a non-empty string"),
        ({"copy_thread": "yes"}, "copy_thread must be a bool"),
    ]
    for extra, match in cases:
        with pytest.raises(UnsupportedEngine, match=match):
            ConnectorOptions.from_extra(extra)


def test_page_list_hands_out_and_takes_back_whole_pages() -> None:
    pl = KVPageList(3, 4)
    a = pl.alloc(8)
    assert a is not None and a.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and pl.num_free == 4
    assert pl.alloc(8) is None and pl.num_free == 4
    with pytest.raises(ValueError, match="whole number of 4-token pages"):
        pl.alloc(3)
    with pytest.raises(ValueError, match="not whole pages in order"):
        pl.free(torch.tensor([1, 0, 2, 3]))
    pl.free(a[:4])
    with pytest.raises(RuntimeError, match="KV page 0 freed twice"):
        pl.free(a[:4])
    pl.check_invariants()
    assert pl.free_pages == 2 and np.array_equal(pl.pages(a[4:]).numpy(), [1])


def test_a_plan_whose_prefix_was_evicted_meanwhile_is_not_filed() -> None:
    """A plan copies only the blocks the tree lacked; if the tree lost the rest before the commit,
    filing it would pair the new pages with KV nobody holds: it is given back instead."""
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    assert _save(store, eng, "a", ids[: 2 * B], [0, 1])
    plan = store.plan_save("a", ids)
    assert plan is not None and plan.start == 2 * B
    store.manager.evict(kv_tokens=2 * B)
    assert store.manager.cache.total_kv_tokens == 0
    _copy_in(store, eng, plan, [2])
    assert not store.commit(plan) and store.stats.saves_skipped["prefix-evicted"] == 1
    assert store.lookup("b", [*ids, 1]) is None
    store.check_invariants()
    assert store.pages.free_pages == store.num_pages and store.pool.num_free == store.num_slots


@pytest.mark.parametrize("order", ["shorter-first", "longer-first"])
def test_plans_of_one_prefix_pending_together_copy_its_blocks_once(order: str) -> None:
    """Requests with one prompt planned in the same step, before either committed (a system
    prompt's burst): the later plan's pages begin where the earlier plan's end, so the prompt's
    blocks are reserved and copied once; a plan for the very prefix of a pending one is not made."""
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    ends = (2 * B, 3 * B) if order == "shorter-first" else (3 * B, 2 * B)
    first = store.plan_save("a", ids[: ends[0]])
    second = store.plan_save("b", ids[: ends[1]])
    assert first is not None and second is not None
    assert (first.start, first.after) == (0, None)
    assert second.after is first and second.start == min(ends), (second.start, second.after)
    assert len(first.pages) + len(second.pages) == 3, "blocks of the pending plan were reserved again"
    assert store.plan_save("c", ids[: ends[0]]) is None  # the first plan files that snapshot
    assert store.stats.saves_skipped == {"planned": 1}
    for plan in (first, second):
        _copy_in(store, eng, plan)
    assert store.commit(first) and store.commit(second)  # a snapshot at each depth
    assert second.after is None  # not kept alive once committed
    store.synchronize()
    store.check_invariants()
    assert store.manager.cache.total_kv_tokens == 3 * B
    assert store.pages.free_pages == store.num_pages - 3 and store.stats.saved_pages == 3
    for end in (2 * B, 3 * B):
        _hit_equals(store, eng, ids[:end], list(range(end // B)), f"r{end}")


@pytest.mark.parametrize("fate", ["committed-after", "abandoned", "other-namespace"])
def test_a_plan_filed_before_the_plan_it_relies_on_files_nothing_and_gives_all_back(fate: str) -> None:
    """A plan relies on a pending plan's blocks; committed while that plan is still pending (out
    of the order they were made) or after it was abandoned, it files nothing, says why, and its
    page and slot go back. A plan of another namespace relies on nothing of it."""
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 2 * B))
    eng.compute(ids, [0, 1])
    first = store.plan_save("a", ids[:B])
    assert first is not None
    second = store.plan_save("b", ids, namespace="tenant" if fate == "other-namespace" else None)
    assert second is not None
    _copy_in(store, eng, first)
    _copy_in(store, eng, second)
    if fate == "other-namespace":
        assert (second.start, second.after) == (0, None)
        assert store.commit(second) and store.commit(first)
        store.check_invariants()
        return
    assert second.after is first and second.start == B
    free = store.pages.free_pages
    if fate == "abandoned":
        store.abandon(first, why="aborted")
        free += 1
    assert not store.commit(second), "filed without the blocks its pages follow"
    skipped = "prefix-evicted" if fate == "abandoned" else "prefix-pending"
    assert store.stats.saves_skipped.get(skipped) == 1, store.stats.saves_skipped
    assert store.pages.free_pages == free + 1 and store.manager.cache.num_snapshots == 0
    store.check_invariants()
    if fate == "committed-after":
        assert store.commit(first)
        store.synchronize()
        _hit_equals(store, eng, ids[:B], [0], "r")


@pytest.mark.parametrize("order", ["shorter-first", "longer-first"])
def test_blocks_another_plan_filed_first_go_back_to_the_free_pages(order: str) -> None:
    """Plans of one prefix still copy a block twice when the earlier one did not know its ids
    there yet (asynchronous scheduling plans a step before its sampled token is known): the
    second commit finds the first's pages in the tree and gives its own copy back (such copies
    leaked once: the tree hands duplicates back to the caller)."""
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    ends = (2 * B, 3 * B) if order == "shorter-first" else (3 * B, 2 * B)
    first = store.plan_save("a", ids[: B + 1], end=ends[0])  # its ids known into its second block
    second = store.plan_save("b", ids[: ends[1]])
    assert first is not None and second is not None
    assert second.after is first and second.start == B  # block 1: the first plan's too
    for plan in (first, second):
        _copy_in(store, eng, plan)
    assert store.commit(first, ids[: ends[0]]) and store.commit(second)  # a snapshot at each depth
    store.synchronize()
    store.check_invariants()
    assert store.manager.cache.total_kv_tokens == 3 * B
    assert store.pages.free_pages == store.num_pages - 3, "the second plan's copies of filed blocks were kept"
    for end in (2 * B, 3 * B):
        _hit_equals(store, eng, ids[:end], list(range(end // B)), f"r{end}")


def test_the_clone_slot_is_made_before_the_prefix_is_read() -> None:
    """A commit on a full pool: the slot its clone needs is evicted for before the tree's KV of the
    prefix is read, so an eviction of that very prefix cannot hand the tree indices it freed."""
    store, eng = _store(budget_pages=6, policy=make_policy("vllm-like")), Engine(64)  # 3 slots
    a = list(range(1, 1 + 2 * B))
    longer = [*a, *range(50, 50 + B)]
    eng.compute(longer, [0, 1, 2])
    assert _save(store, eng, "a", a, [0, 1])
    c = [9000 + i for i in range(B)]
    eng.compute(c, [10])
    assert _save(store, eng, "c", c, [10])
    plan = store.plan_save("a", longer)  # the third slot: the pool is full
    assert plan is not None and plan.start == 2 * B and store.pool.num_free == 0
    _copy_in(store, eng, plan, [2])
    store.check_invariants()
    store.commit(plan)
    store.check_invariants()
    hit = store.lookup("b", [*longer, 1])
    if hit is not None:  # served: byte for byte what was saved
        assert torch.equal(store.state_of(hit)[1], eng.rec[2])
        store.release(hit)
    store.check_invariants()


# ----------------------------------------------------------------------------- the shared tier
def _published(first_id: int, n_blocks: int) -> tuple[MemoryStore, PagedHostStore, PagedHostStore, Engine, list[int]]:
    """Two stores on one in-memory shared store, ``a`` having computed, saved and published the
    ``n_blocks``-block prompt starting at ``first_id`` (blocks 0, 1, ... of its engine)."""
    shared = MemoryStore()
    a, b = _store(shared=shared, model="m"), _store(shared=shared, model="m")
    eng = Engine()
    ids = list(range(first_id, first_id + n_blocks * B))
    blocks = list(range(n_blocks))
    eng.compute(ids, blocks)
    assert _save(a, eng, "a", ids, blocks) and a.flush_shared(5.0)
    return shared, a, b, eng, ids


def test_a_lookup_verifies_pages_only_once_their_fingerprints_are_taken() -> None:
    """A save's page fingerprints run on the copy thread: a lookup that came first would compare
    the pages with no fingerprint at all (unverified); it waits them."""
    store, eng = _store(), Engine()
    ids = list(range(1, 1 + 2 * B))
    eng.compute(ids, [0, 1])
    plan = store.plan_save("a", ids)
    assert plan is not None and store.copies is not None
    _copy_in(store, eng, plan, [0, 1])
    gate = threading.Event()
    store.copies.submit(lambda: gate.wait(10), label="busy")
    assert store.commit(plan)
    checker = store._kv_hasher  # the lookup's own hasher (the copy thread has another)
    assert checker is not None
    real = checker.fingerprint
    early: list[int] = []

    def checked(page: int) -> int:
        if store._kv_fp[page] is None:
            early.append(page)  # compared while the copy thread had not fingerprinted the page
        return real(page)

    checker.fingerprint = checked  # type: ignore[method-assign,assignment]
    threading.Timer(0.05, gate.set).start()
    hit = store.lookup("b", [*ids, 9])
    assert hit is not None and not early and store.stats.verified_pages == 2
    store.release(hit)
    store.check_invariants()


def test_a_state_never_written_is_never_published() -> None:
    """Filed while its clone and fingerprint wait on the copy thread: the manager publishes a
    donation only once forensics has its fingerprint, and not one a finding names."""
    shared = MemoryStore()
    store, eng = _store(shared=shared, model="m"), Engine()
    good = list(range(900, 900 + 2 * B))
    eng.compute(good, [0, 1])
    ids = list(range(1, 1 + 2 * B))
    plan = store.plan_save("a", ids)
    assert plan is not None and store.copies is not None and store.shared is not None
    store.copy_in_pages(plan.pages, eng.layers([0, 1]))
    store.pool.write(plan.slot, torch.zeros(2, 3, 8), torch.zeros(2, 2, 4, 4), owner=plan.owner)
    gate = threading.Event()
    store.copies.submit(lambda: gate.wait(10), label="busy")
    assert store.commit(plan)
    threading.Timer(0.05, gate.set).start()
    assert store.flush_shared(5.0)
    assert not shared.blobs and store.shared.stats.publish_skipped == 1
    assert _save(store, eng, "b", good, [0, 1]) and store.flush_shared(5.0)
    assert len(shared.blobs) == 1 and store.shared.stats.published == 1  # the good one only
    assert store.stats.corrupt_snapshots == 1 and store.manager.cache.num_snapshots == 1
    store.check_invariants()


def test_a_prefix_filed_by_one_store_is_fetched_verified_by_another() -> None:
    shared = MemoryStore()
    a, b = _store(shared=shared, model="m"), _store(shared=shared, model="m")
    eng = Engine()
    ids = list(range(300, 300 + 3 * B))
    eng.compute(ids, [0, 1, 2])
    assert _save(a, eng, "a", ids[: 2 * B], [0, 1]) and _save(a, eng, "a", ids, [0, 1, 2])
    assert a.flush_shared(5.0) and a.shared is not None and a.shared.stats.published == 2
    _hit_equals(b, eng, ids, [0, 1, 2], "b")  # b never computed it: pages and state came from the store
    assert b.shared is not None and (b.shared.stats.hits, b.shared.stats.hit_tokens) == (1, 3 * B)
    _hit_equals(b, eng, ids, [0, 1, 2], "b2")  # now b's own: no second fetch
    assert b.shared.stats.hits == 1 and b.manager.cache.num_snapshots == 1
    # a store of another layout (pages of other bytes) shares the server, never the blobs: a miss
    other = PagedHostStore(
        PagedLayout(B, 2, 64, STATE, kv_format="fp8"),
        a.num_pages * (LAYOUT.page_bytes + STATE.slot_bytes),
        shared=shared,
        model="m",
    )
    assert other.lookup("o", ids, computed=0) is None
    assert other.shared is not None and other.shared.stats.hits == 0
    other.check_invariants()
    assert other.pages.free_pages == other.num_pages and other.pool.num_free == other.num_slots
    a.close(5.0)
    b.close(5.0)


def test_a_fetched_prefix_leaves_the_process_warning_filters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetch writes the blob's pages on the scheduler's thread while the tier's threads run:
    ``warnings.catch_warnings`` (not thread-safe: it swaps the process's filters) must not be
    how it keeps quiet, and it warns nothing."""
    _, a, b, eng, ids = _published(700, 2)

    def forbidden(*a: object, **kw: object) -> None:
        raise AssertionError("warnings.catch_warnings used on the fetch path")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "catch_warnings", forbidden)
        _hit_equals(b, eng, ids, [0, 1], "b")
        monkeypatch.undo()
    assert b.shared is not None and b.shared.stats.hits == 1
    assert not seen, [str(w.message) for w in seen]
    a.close(5.0)
    b.close(5.0)


def test_the_kv_codec_exports_into_buffers_handed_back_and_keeps_two_within_its_cap() -> None:
    from radixcache.vllm.store import PagedKVCodec

    st = _store(budget_pages=16)
    codec = PagedKVCodec(st)
    idx = codec.import_kv(bytes(range(256)) * (2 * LAYOUT.kv_layers * LAYOUT.kv_page_bytes // 256), 2 * B)
    assert idx is not None
    want = st.kv[:, st.pages.pages(idx)].contiguous().numpy().tobytes()
    first = codec.export_kv(idx, None)
    assert bytes(first) == want
    again = codec.export_kv(idx, None)  # the first not handed back: a buffer of its own
    assert np.shares_memory(np.frombuffer(first, np.uint8), np.frombuffer(again, np.uint8)) is False
    addr = np.frombuffer(first, np.uint8).ctypes.data
    codec.reuse_kv(first)
    assert codec.spare_bytes == len(first)
    del first
    third = codec.export_kv(idx[:B], None)  # one page: into the spare, which is larger
    assert np.frombuffer(third, np.uint8).ctypes.data == addr and codec.spare_bytes == 0
    assert bytes(third) == st.kv[:, st.pages.pages(idx[:B])].contiguous().numpy().tobytes()
    # what it did not export, or handed back before, is ignored: never written by a later export
    codec.reuse_kv(third)
    codec.reuse_kv(third)
    codec.reuse_kv(b"foreign")
    codec.reuse_kv(np.zeros(len(want), np.uint8).data)
    codec.reuse_kv(memoryview(b""))
    assert codec.spare_bytes == len(want)
    # at most two kept, the largest, together within a quarter of the store's KV bytes
    views = [codec.export_kv(idx, None) for _ in range(3)]
    for v in views:
        codec.reuse_kv(v)
    cap = st.kv.numel() // 4
    assert codec.spare_bytes == 2 * len(want) == cap
    page_bytes = LAYOUT.kv_layers * LAYOUT.kv_page_bytes
    idx5 = codec.import_kv(bytes(5 * page_bytes), 5 * B)
    assert idx5 is not None
    big = codec.export_kv(idx5[: 3 * B], None)  # no spare fits: a new buffer
    codec.reuse_kv(big)
    assert codec.spare_bytes == 3 * page_bytes  # the largest kept, the others dropped to stay within the cap
    huge = codec.export_kv(idx5, None)
    assert len(huge) > cap
    codec.reuse_kv(huge)
    assert codec.spare_bytes == 3 * page_bytes  # above the cap: never kept
    st.pages.free(idx)
    st.pages.free(idx5)
    st.check_invariants()


def test_the_store_invariants_check_the_codecs_kept_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's invariants include its codec's buffers' (tests/test_export_buffers.py breaks
    each of their rules)."""
    st = _store(budget_pages=16, shared=MemoryStore(), model="m")
    codec = st.kv_codec
    assert codec is not None and st.shared is not None and st.shared.kv is codec
    idx = st.pages.alloc(B)
    assert idx is not None
    codec.reuse_kv(codec.export_kv(idx, None))
    st.pages.free(idx)  # the export is a copy
    st.check_invariants()

    def broken() -> None:
        raise AssertionError("a KV buffer kept twice")

    monkeypatch.setattr(codec.buffers, "check_invariants", broken)
    with pytest.raises(AssertionError, match="kept twice"):
        st.check_invariants()
    monkeypatch.undo()
    st.check_invariants()
    st.close(5.0)


def test_a_corrupted_shared_blob_is_a_miss_a_finding_and_deleted() -> None:
    shared, _, b, _, ids = _published(500, 2)
    (key,) = list(shared.blobs)
    blob = bytearray(shared.blobs[key])
    blob[len(blob) // 2] ^= 0x40  # one bit, in the KV pages' bytes
    shared.blobs[key] = bytes(blob)
    assert b.lookup("b", ids, computed=0) is None
    assert b.shared is not None and b.shared.stats.rejected == {"digest": 1} and b.shared.stats.hits == 0
    assert b.forensics is not None and [f.kind for f in b.forensics.findings] == ["shared-digest"]
    assert key not in shared.blobs, "deleted, so a healthy engine can publish it again"
    b.check_invariants()
    assert b.pages.free_pages == b.num_pages and b.pool.num_free == b.num_slots


def test_a_shared_store_that_fails_is_a_miss() -> None:
    class Down(MemoryStore):
        def depths(self, index: str, lo: int, hi: int) -> list[int]:
            raise SharedStoreError("down")

    store, eng = _store(shared=Down(), model="m"), Engine()
    ids = list(range(700, 700 + 2 * B))
    assert store.lookup("r", ids, computed=0) is None
    assert store.shared is not None and store.shared.stats.errors == 1
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "r", ids, [0, 1])  # served from its own tree meanwhile
    _hit_equals(store, eng, ids, [0, 1], "r2")


def test_a_shared_store_needs_the_models_identity() -> None:
    with pytest.raises(ValueError, match="model"):
        _store(shared=MemoryStore())
    tier = _store(shared=MemoryStore(), model="m").shared
    assert tier is not None
    ids = np.arange(8, dtype=np.int64)
    with pytest.raises(ValueError, match="limit 9 is longer"):
        tier.fetch(ids, None, 0, limit=9)
    with pytest.raises(TypeError, match="limit must be an int"):
        tier.fetch(ids, None, 0, limit=True)
    assert tier.fetch(ids, None, 0, limit=8) is None and tier.stats.probes == 1  # nothing published
    with pytest.raises(TypeError, match="kv_format"):
        PagedLayout(B, 2, 64, STATE, kv_format=3)  # type: ignore[arg-type]


def test_two_stores_share_prefixes_through_a_real_redis_server(redis_server: RedisServer) -> None:
    a = _store(shared=RedisStore(redis_server.url), model="m")
    b = _store(shared=RedisStore(redis_server.url), model="m")
    eng = Engine()
    ids = list(range(900, 900 + 4 * B))
    eng.compute(ids, [0, 1, 2, 3])
    assert _save(a, eng, "a", ids, [0, 1, 2, 3]) and a.flush_shared(5.0)
    _hit_equals(b, eng, ids, [0, 1, 2, 3], "b")
    assert b.shared is not None and b.shared.stats.hits == 1
    redis_server.kill()  # the server goes away: misses, never an error
    assert b.lookup("c", list(range(40, 40 + 2 * B)), computed=0) is None
    assert b.shared.stats.errors >= 1
    b.check_invariants()


def test_fetch_shared_refuses_bad_input_and_without_a_tier_is_the_local_match() -> None:
    store = _store()
    mgr = store.manager
    for bad, err in ((-1, ValueError), (3 * B + 1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(err, match="limit"):
            mgr.fetch_shared(list(range(3 * B)), limit=bad)  # type: ignore[arg-type]
        with pytest.raises(err, match="limit"):
            mgr.prefetch("r", list(range(3 * B)), limit=bad)  # type: ignore[arg-type]
    eng = Engine()
    ids = list(range(60, 60 + 2 * B))
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "a", ids, [0, 1])
    assert mgr.fetch_shared([*ids, 1, 2]).cached_length == 2 * B
    assert mgr.fetch_shared([*ids, 1, 2], limit=B).cached_length == 0  # no snapshot at one block
    store.check_invariants()


def test_a_prefetched_lookup_takes_the_answer_of_the_fetcher_thread() -> None:
    _, _, b, eng, ids = _published(1100, 3)
    assert b.prefetch("b", ids)
    deadline = time.monotonic() + 5
    while b.prefetch_pending("b") and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not b.prefetch_pending("b")
    probes = b.shared.stats.probes if b.shared is not None else -1
    _hit_equals(b, eng, ids, [0, 1, 2], "b")
    assert b.shared is not None and b.shared.stats.probes == probes == 1, "the lookup asked nobody"
    assert b.shared.stats.hits == 1 and b.shared.stats.prefetches == 1
    assert not b.prefetch("b", ids), "held here now: nothing to ask"
    assert not _store().prefetch("x", ids), "no shared store"
    b.finished("b")
    b.close(5.0)


def test_a_page_fetched_from_the_shared_store_is_fingerprinted_and_a_later_change_is_caught() -> None:
    _, _, b, eng, ids = _published(1300, 2)
    _hit_equals(b, eng, ids, [0, 1], "b")  # fetched: its pages came in through the codec
    hit = b.lookup("c", ids, computed=0)
    assert hit is not None
    b.release(hit)
    b.kv[0, hit.pages[1], 3] ^= 0xFF  # a stray write into a fetched page
    assert b.lookup("d", ids, computed=0) is None
    assert [f.page for f in b.page_findings] == [hit.pages[1]] and b.stats.corrupt_pages == 1
    b.check_invariants()


# ------------------------------------------------- lookups verified on the copy thread
def _saved_store(**kw: bool) -> tuple[PagedHostStore, Engine, list[int]]:
    store, eng = _store(16, **kw), Engine()
    ids = list(range(40, 40 + 2 * B))
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "a", ids, [0, 1])
    store.synchronize()
    return store, eng, ids


def _hold(store: PagedHostStore) -> threading.Event:
    """Hold the store's copy thread back until the event is set."""
    gate = threading.Event()
    assert store.copies is not None
    store.copies.submit(lambda: gate.wait(10), label="held")
    return gate


def test_a_lookup_in_the_background_answers_verifying_then_the_verified_hit() -> None:
    store, eng, ids = _saved_store()
    gate = _hold(store)
    node = store.manager.lookup(ids).node
    assert store.lookup_in_background("b", [*ids, 9]) is VERIFYING
    assert node.snap_lock == 1 and store.stats.verified_pages == 0  # locked, nothing read on this thread
    store.check_invariants()
    assert store.lookup_in_background("b", [*ids, 9]) is VERIFYING  # asked again before it is done
    gate.set()
    assert store.copies is not None
    store.copies.synchronize()
    real = store.pool.fingerprint

    def not_here(slot: int) -> int:
        raise AssertionError("the hit's state was fingerprinted on the scheduler's thread")

    store.pool.fingerprint = not_here  # type: ignore[method-assign]
    hit = store.lookup_in_background("b", [*ids, 9])
    store.pool.fingerprint = real  # type: ignore[method-assign]
    assert isinstance(hit, Hit) and (hit.start, hit.end) == (0, 2 * B) and hit.slot == node.snapshot
    assert torch.equal(store.state_of(hit)[1], eng.rec[1]) and store.stats.verified_pages == 2
    assert (store.stats.lookups, store.stats.offers) == (1, 1) and node.snap_lock == 1
    store.release(hit, loaded=True)
    assert node.snap_lock == 0
    store.check_invariants()


def test_a_background_lookup_asked_otherwise_or_finished_lets_its_hit_go() -> None:
    store, _, ids = _saved_store()
    node = store.manager.lookup(ids).node
    gate = _hold(store)
    assert store.lookup_in_background("b", [*ids, 9]) is VERIFYING
    # vLLM's own cache now holds the first block: the pending verification is given up, a new one begun
    assert store.lookup_in_background("b", [*ids, 9], computed=B) is VERIFYING
    assert node.snap_lock == 1  # one lock: the first one's went
    store.finished("b")
    assert node.snap_lock == 0
    store.check_invariants()
    gate.set()
    store.synchronize()


def test_a_background_lookup_finds_a_changed_snapshot_and_a_changed_page() -> None:
    store, eng, ids = _saved_store()
    node = store.manager.lookup(ids).node
    store.pool.recurrent[0, node.snapshot, 0, 0, 0] += 1.0  # after its copy: a stray write
    assert store.lookup_in_background("b", [*ids, 9]) is VERIFYING
    store.synchronize()
    # the snapshot changed: a finding, discarded; nothing else to look at
    assert store.lookup_in_background("b", [*ids, 9]) is None
    assert store.stats.corrupt_snapshots == 1 and store.manager.cache.num_snapshots == 0
    assert store.forensics is not None and [f.kind for f in store.forensics.findings] == ["changed"]
    store.check_invariants()
    # a page changed under a good snapshot
    assert _save(store, eng, "a2", ids, [0, 1])
    hit_pages = store.manager.lookup(ids).kv_indices
    page = int(store.pages.pages(hit_pages[:B])[0])
    store.synchronize()
    store.kv[0, page, 0] ^= 0xFF
    assert store.lookup_in_background("c", [*ids, 9]) is VERIFYING
    store.synchronize()
    assert store.lookup_in_background("c", [*ids, 9]) is None
    assert store.stats.corrupt_pages == 1 and [f.page for f in store.page_findings] == [page]
    store.check_invariants()


def test_a_background_hit_with_no_room_when_ready_is_declined_and_unlocked() -> None:
    store, _, ids = _saved_store()
    node = store.manager.lookup(ids).node
    assert store.lookup_in_background("b", [*ids, 9], fits=lambda tokens: True) is VERIFYING
    store.synchronize()
    assert store.lookup_in_background("b", [*ids, 9], fits=lambda tokens: False) is None
    assert store.stats.declined == 1 and node.snap_lock == 0 and store.stats.offers == 0
    store.check_invariants()


def test_without_a_copy_thread_a_background_lookup_is_a_lookup() -> None:
    store, eng, ids = _saved_store(copy_thread=False)
    hit = store.lookup_in_background("b", [*ids, 9])
    assert isinstance(hit, Hit) and torch.equal(store.state_of(hit)[1], eng.rec[1])
    store.release(hit)
    with pytest.raises(ValueError, match="computed must be a multiple"):
        store.lookup_in_background("b", ids, computed=1)
    store2, _, ids2 = _saved_store()
    with pytest.raises(TypeError, match="fits"):
        store2.lookup_in_background("b", ids2, fits=3)  # type: ignore[arg-type]
    assert store2.stats.lookups == 0
    store2.check_invariants()


@pytest.mark.parametrize("copy_thread", [False, True])
def test_a_changed_page_is_not_served_by_a_shallower_snapshot_on_its_path(copy_thread: bool) -> None:
    """Until 2026-12-07 a changed page was re-recorded when found ("reported once"): the lookup
    then tried the next shallower snapshot on the same path, whose hit read the same page, and
    served it. The page is now marked until it is written anew."""
    store, eng = _store(copy_thread=copy_thread), Engine()
    ids = list(range(60, 60 + 2 * B))
    eng.compute(ids, [0, 1])
    assert _save(store, eng, "a", ids[:B], [0]) and _save(store, eng, "a", ids, [0, 1])
    store.synchronize()
    page = int(store.pages.pages(store.manager.lookup(ids).kv_indices[:B])[0])
    store.kv[0, page, 0] ^= 0xFF
    assert store.lookup("b", [*ids, 9]) is None
    assert store.stats.corrupt_pages == 1 and store.manager.cache.num_snapshots == 0
    assert store.lookup("c", [*ids, 9]) is None and store.stats.corrupt_pages == 1  # reported once
    store.check_invariants()


def test_a_corrupt_snapshot_another_hit_holds_is_refused_then_dropped_when_let_go() -> None:
    """Found changed while a hit of another request holds it: refused (counted then; not looked
    at again, no endless search), and discarded once that hit is released."""
    store, _, ids = _saved_store()
    held = store.lookup("a", [*ids, 9])
    assert held is not None
    node = held.node
    store.pool.recurrent[0, held.slot, 0, 0, 0] += 1.0
    assert store.lookup("b", [*ids, 9]) is None
    assert store.forensics is not None and len(store.forensics.findings) == 1
    assert node.snapshot is not None and store.stats.corrupt_snapshots == 1  # held: refused, not dropped yet
    assert store.lookup("c", [*ids, 9]) is None and len(store.forensics.findings) == 1
    store.check_invariants()
    store.release(held)
    assert store.lookup("d", [*ids, 9]) is None
    assert node.snapshot is None and store.stats.corrupt_snapshots == 1
    store.check_invariants()


def test_a_changed_page_under_a_held_hit_is_refused_until_the_hit_lets_go() -> None:
    store, _, ids = _saved_store()
    held = store.lookup("a", [*ids, 9])
    assert held is not None
    store.kv[0, held.pages[0], 0] ^= 0xFF
    assert store.lookup("b", [*ids, 9]) is None and store.stats.corrupt_pages == 1
    assert store.lookup("c", [*ids, 9]) is None and store.stats.corrupt_pages == 1
    assert store.manager.cache.num_snapshots == 1
    store.release(held)
    assert store.lookup("d", [*ids, 9]) is None and store.manager.cache.num_snapshots == 0
    store.check_invariants()


def test_a_process_that_exits_with_uploads_queued_exits_cleanly() -> None:
    """The shared tier's writer encodes and fingerprints uploads with torch: a thread still inside
    a torch kernel when Python finalizes aborts the process (exit status 134; a CI smoke run of
    the SGLang shared benchmark hit it). At exit the tier's threads finish the job in flight and
    end first. Without that, about one run in three of this script aborted; the check that no
    thread of the library outlives its exit hooks fails every time."""
    script = """
import torch
from linear_state import StateLayout
from radixcache.tiers.store import MemoryStore
from radixcache.vllm import PagedHostStore, PagedLayout
B = 16
state = StateLayout(num_layers=8, conv_shape=(3, 256), recurrent_shape=(8, 128, 128))
layout = PagedLayout(block_tokens=B, kv_layers=2, kv_page_bytes=4096, state=state)
st = PagedHostStore(
    layout, 64 * layout.page_bytes + 40 * state.slot_bytes, shared=MemoryStore(), model="m", verify=False
)
conv = torch.randn(state.num_layers, *state.conv_shape).to(state.conv_dtype)
rec = torch.randn(state.num_layers, *state.recurrent_shape).to(state.recurrent_dtype)
for r in range(30):
    plan = st.plan_save("a", list(range(1000 * r, 1000 * r + B)))
    if plan is not None:
        st.copy_in_state(plan, conv, rec)
        st.commit(plan)
print("exits with uploads queued")
"""
    done = run_exiting(script, timeout=300)  # the threads ended by the library's exit hooks
    assert "exits with uploads queued" in done.stdout


def test_check_invariants_catches_a_verifying_hit_whose_lock_was_taken_away() -> None:
    store, _, ids = _saved_store()
    gate = _hold(store)
    assert store.lookup_in_background("b", [*ids, 9]) is VERIFYING
    node = store.manager.lookup(ids).node
    store.manager.unlock(node)  # behind the store's back: the snapshot could be evicted mid-verification
    with pytest.raises(AssertionError):
        store.check_invariants()
    store.manager.lock(node)
    store.check_invariants()
    gate.set()
    store.finished("b")
    store.synchronize()
