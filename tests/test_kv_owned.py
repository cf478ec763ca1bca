"""A manager that owns the KV (``CacheManager(kv=...)``): admission reserves, plans say where to
write and what to read, commit takes no indices, and every index returns by ``kv.free`` once."""

from __future__ import annotations

import copy
import random
from collections import deque

import pytest
import torch

from linear_state import COMPLETE, Fence, ImmediateStream, LinearStatePool
from radixcache import Admission, CacheManager, Forensics, HybridRadixCache, Refusal, RefusalCause, free_kv_to
from radixcache.core.kv import KVAllocator, KVExhausted, KVFreeList
from radixcache.manager.cache_manager import WindowPlan
from radixcache.policies import FixedPoints
from radixcache.testing.adapter import FUZZ_LAYOUT, advance


def make(kv_tokens: int = 256, slots: int = 16, page: int = 1) -> tuple[CacheManager, KVFreeList]:
    kv = KVFreeList(kv_tokens)
    pool = LinearStatePool(FUZZ_LAYOUT, slots)
    cache = HybridRadixCache(pool, page_size=page, stream=ImmediateStream())
    mgr = CacheManager(cache, FixedPoints(align=8), track_slots=2, kv=kv, host_tier=None)
    return mgr, kv


def conserved(mgr: CacheManager, kv: KVFreeList) -> None:
    """free + the tree's + every request's own == capacity, and the structures agree."""
    mgr.check_invariants()
    kv.check_invariants()
    owned = 0
    for rid in list(mgr._requests):
        rec = mgr._requests[rid]
        assert rec.kv_full is not None
        owned += int(rec.kv_full.numel()) - rec.kv_held
    assert kv.num_free + mgr.cache.total_kv_tokens + owned == kv.capacity


def forward(mgr: CacheManager, plan: WindowPlan, ids: list[int]) -> None:
    """The host's forward over ``ids[plan.start:plan.end]`` (the fuzz kit's exact recurrence):
    writes the live slot, copies each capture's state into its slot."""
    pool, live = mgr.pool, plan.live_slot
    at = {c.depth: c.slot for c in plan.captures}
    for pos in range(plan.start, plan.end):
        advance(pool.conv[:, live], pool.recurrent[:, live], ids[pos])
        if pos + 1 in at:
            pool.conv[:, at[pos + 1]].copy_(pool.conv[:, live])
            pool.recurrent[:, at[pos + 1]].copy_(pool.recurrent[:, live])


def serve(mgr: CacheManager, rid: str, ids: list[int], out: list[int], *, chunk: int = 16) -> Admission:
    adm = mgr.admit(rid, ids, max_new_tokens=len(out))
    assert isinstance(adm, Admission), adm
    done = adm.cached_length
    while done < len(ids):
        plan = mgr.plan_prefill(rid, min(len(ids), done + chunk))
        assert plan.kv_table is not None and plan.kv_indices is not None
        assert torch.equal(plan.kv_table[plan.start :], plan.kv_indices)
        assert len(plan.kv_table) == plan.end
        forward(mgr, plan, ids)
        res = mgr.commit(plan, None)
        assert res.free_kv.numel() == 0 and res.kv_table is not None and len(res.kv_table) == plan.end
        assert torch.equal(res.kv_table, mgr.kv_indices(rid))
        done = plan.end
    for i, tok in enumerate(out):
        plan = mgr.plan_decode(rid, [tok])
        assert plan.kv_indices is not None and len(plan.kv_indices) == 1
        forward(mgr, plan, ids + out[: i + 1])
        mgr.commit(plan, None)
    return adm


def test_admission_reserves_prompt_and_decode_and_finish_gives_all_back() -> None:
    mgr, kv = make()
    prompt = list(range(1, 41))
    adm = mgr.admit("a", prompt, max_new_tokens=5)
    assert isinstance(adm, Admission) and adm.cached_length == 0
    assert kv.num_free == 256 - 45, "prompt + max_new_tokens reserved at admission"
    conserved(mgr, kv)
    mgr.abort("a")
    assert kv.num_free == 256
    conserved(mgr, kv)
    serve(mgr, "b", prompt, [7, 8, 9])
    fin = mgr.finish("b")
    assert fin.free_kv.numel() == 0, "the manager gave them to the allocator itself"
    assert mgr.cache.total_kv_tokens > 0
    conserved(mgr, kv)
    assert mgr.num_requests == 0


def test_a_hit_reads_the_trees_pages_and_writes_only_its_own() -> None:
    mgr, kv = make()
    prompt = list(range(1, 65))
    serve(mgr, "a", prompt, [])
    mgr.finish("a")
    tree_kv = mgr.cache.kv_prefix(prompt[:40])
    adm = mgr.admit("b", prompt[:40] + [99] * 8)
    assert isinstance(adm, Admission) and adm.cached_length == 40
    plan = mgr.plan_prefill("b", 48)
    forward(mgr, plan, prompt[:40] + [99] * 8)
    assert plan.kv_table is not None and plan.kv_indices is not None
    assert torch.equal(plan.kv_table[:40], tree_kv), "attention reads the tree's pages for the hit"
    assert not set(plan.kv_indices.tolist()) & set(mgr.cache.kv_prefix(prompt).tolist())
    mgr.commit(plan, None)
    conserved(mgr, kv)
    mgr.finish("b")
    conserved(mgr, kv)


def test_donation_splices_and_frees_the_duplicates_to_the_allocator() -> None:
    mgr, kv = make()
    prompt = list(range(1, 33))
    serve(mgr, "a", prompt, [])  # captures at 8, 16, ...: the tree takes its pages
    mgr.finish("a")
    freed: list[int] = []
    real_free = kv.free

    def spy(idx: torch.Tensor, after: Fence = COMPLETE) -> None:
        freed.extend(idx.tolist())
        real_free(idx)

    kv.free = spy  # type: ignore[method-assign,assignment]
    # Two requests computing the same fresh prompt: the second one's donation meets the first's pages.
    p2 = list(range(100, 132))
    for rid in ("x", "y"):
        assert isinstance(mgr.admit(rid, p2), Admission)
    px = mgr.plan_prefill("x", 32)
    py = mgr.plan_prefill("y", 32)
    forward(mgr, px, p2)
    forward(mgr, py, p2)
    assert py.kv_indices is not None and px.kv_indices is not None
    mgr.commit(px, None)
    res = mgr.commit(py, None)
    assert res.spliced and res.kv_table is not None
    assert torch.equal(res.kv_table[: res.kv_held], mgr.cache.kv_prefix(p2[: res.kv_held]))
    dup = set(py.kv_indices[: res.kv_held].tolist())
    assert dup and dup <= set(freed), "y's own copies of the tree's tokens went back to the allocator"
    conserved(mgr, kv)
    mgr.finish("x")
    mgr.finish("y")
    conserved(mgr, kv)


def test_kv_pressure_at_admission_evicts_through_the_policy_keeping_the_hit() -> None:
    mgr, kv = make(kv_tokens=96)
    a = list(range(1, 49))
    serve(mgr, "a", a, [])
    mgr.finish("a")
    serve(mgr, "b", list(range(200, 232)), [])
    mgr.finish("b")
    assert kv.num_free < 40
    adm = mgr.admit("c", a[:32] + list(range(500, 540)))
    assert isinstance(adm, Admission) and adm.cached_length == 32, "the hit survived the eviction"
    assert mgr.metrics().evictions["kv-pressure"] >= 1 or mgr.metrics().evicted_kv_tokens > 0
    conserved(mgr, kv)
    mgr.abort("c")
    conserved(mgr, kv)


def test_kv_refusal_when_locked_kv_cannot_make_room() -> None:
    mgr, kv = make(kv_tokens=64)
    assert isinstance(mgr.admit("a", list(range(1, 50))), Admission)
    before = (kv.num_free, mgr.cache.total_kv_tokens, mgr.pool.num_free)
    ref = mgr.admit("b", list(range(300, 330)))
    assert isinstance(ref, Refusal) and ref.cause is RefusalCause.KV
    assert "KV indices needed" in ref.reason and "30" in ref.reason
    assert (kv.num_free, mgr.cache.total_kv_tokens, mgr.pool.num_free) == before
    assert "b" not in mgr
    conserved(mgr, kv)


def test_decode_beyond_the_reservation_allocates_then_raises_kv_exhausted() -> None:
    mgr, kv = make(kv_tokens=20)
    serve(mgr, "a", list(range(1, 17)), [])
    assert kv.num_free == 4
    for t in range(4):
        plan = mgr.plan_decode("a", [t])
        forward(mgr, plan, list(range(1, 17)) + list(range(t + 1)))
        mgr.commit(plan, None)
    assert kv.num_free == 0
    done = mgr._requests["a"].computed
    with pytest.raises(KVExhausted, match="1 KV indices needed") as e:
        mgr.plan_decode("a", [5])
    assert e.value.needed == 1 and e.value.free == 0
    assert mgr._requests["a"].computed == done and mgr._requests["a"].plan is None, "nothing changed"
    conserved(mgr, kv)
    mgr.finish("a")
    conserved(mgr, kv)


def test_decode_batch_plans_carry_each_requests_indices_and_table() -> None:
    mgr, kv = make()
    serve(mgr, "a", list(range(1, 20)), [])
    serve(mgr, "b", list(range(50, 61)), [])
    batch = mgr.plan_decode_batch(["a", "b"], [3, 4])
    assert batch.kv_indices is not None and batch.kv_tables is not None
    assert [len(t) for t in batch.kv_tables] == [20, 12]
    assert batch.kv_indices.tolist() == [int(batch.kv_tables[0][-1]), int(batch.kv_tables[1][-1])]
    for rid, p in batch.plans.items():
        forward(mgr, p, [*range(1, 20), 3] if rid == "a" else [*range(50, 61), 4])
    res = mgr.commit_batch(batch, None)
    assert res.free_kv.numel() == 0
    assert torch.equal(mgr.kv_indices("a")[-1:], batch.kv_indices[:1])
    conserved(mgr, kv)
    for rid in ("a", "b"):
        mgr.finish(rid)
    conserved(mgr, kv)


def test_commit_refuses_indices_against_kv_and_requires_them_without() -> None:
    mgr, kv = make()
    assert isinstance(mgr.admit("a", [1, 2, 3, 4]), Admission)
    plan = mgr.plan_prefill("a", 4)
    with pytest.raises(ValueError, match="owns the KV"):
        mgr.commit(plan, None, kv_indices=[0, 1, 2, 3])
    assert mgr._requests["a"].plan is plan and mgr._requests["a"].computed == 0, "nothing changed"
    forward(mgr, plan, [1, 2, 3, 4])
    mgr.commit(plan, None)
    conserved(mgr, kv)
    pool = LinearStatePool(FUZZ_LAYOUT, 8)
    plain = CacheManager(HybridRadixCache(pool, stream=ImmediateStream()), host_tier=None)
    assert isinstance(plain.admit("p", [1, 2, 3]), Admission)
    p = plain.plan_prefill("p", 3)
    with pytest.raises(ValueError, match="needs the window's kv_indices"):
        plain.commit(p, None)
    with pytest.raises(ValueError, match="needs CacheManager"):
        plain.admit("q", [1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        mgr.admit("q", [1, 2], max_new_tokens=-1)
    plain.check_invariants()


def test_constructor_refuses_a_non_allocator_and_a_tree_freeing_elsewhere() -> None:
    pool = LinearStatePool(FUZZ_LAYOUT, 8)
    cache = HybridRadixCache(pool, on_event=free_kv_to(lambda idx: None))
    with pytest.raises(TypeError, match="kv must be a KVAllocator"):
        CacheManager(HybridRadixCache(LinearStatePool(FUZZ_LAYOUT, 8)), kv=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has a listener already"):
        CacheManager(cache, kv=KVFreeList(8), host_tier=None)
    assert cache.client is None, "nothing was bound"
    assert isinstance(KVFreeList(4), KVAllocator)


def test_invariants_catch_a_kv_index_owned_by_two_requests() -> None:
    mgr, _kv = make()
    assert isinstance(mgr.admit("a", [1, 2, 3]), Admission)
    assert isinstance(mgr.admit("b", [7, 8, 9]), Admission)
    a, b = mgr._requests["a"], mgr._requests["b"]
    assert a.kv_full is not None and b.kv_full is not None
    b.kv_full = a.kv_full.clone()
    with pytest.raises(AssertionError, match="shares KV indices"):
        mgr.check_invariants()


def test_free_list_contract() -> None:
    kv = KVFreeList(4)
    idx = kv.alloc(3)
    assert idx is not None and idx.tolist() == [0, 1, 2] and kv.alloc(2) is None and kv.num_free == 1
    with pytest.raises(ValueError, match="outside"):
        kv.free(torch.tensor([4]))
    with pytest.raises(RuntimeError, match="KV index 1 freed twice"):
        kv.free(torch.tensor([1, 1]))
    assert kv.num_free == 1, "a refused free took nothing back"
    kv.free(idx[1:])
    assert kv.alloc(3) is not None
    with pytest.raises(ValueError, match="int >= 0"):
        kv.alloc(-1)
    with pytest.raises(ValueError, match="num_tokens"):
        KVFreeList(-2)
    kv.check_invariants()


def test_free_list_hands_out_in_the_order_freed_across_the_rings_end() -> None:
    """The free list against a deque model: 400 seeded steps of allocations and frees (in shuffled
    order, across the ring's end many times) hand out the same indices, in the same order."""
    rng = random.Random(0)
    kv, model = KVFreeList(37), deque(range(37))
    held: list[int] = []
    for _ in range(400):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            back, held = held[:k], held[k:]
            kv.free(torch.tensor(back))
            model.extend(back)
        else:
            n = rng.randint(0, 12)
            got = kv.alloc(n)
            if n > len(model):
                assert got is None
                continue
            assert got is not None and got.dtype == torch.int64
            want = [model.popleft() for _ in range(n)]
            assert got.tolist() == want
            held += want
        assert kv.num_free == len(model)
        kv.check_invariants()
    twin = copy.deepcopy(kv)  # a copy is a list of its own: its numpy views are not the original's
    got = twin.alloc(twin.num_free)
    assert got is not None and got.tolist() == list(model) and kv.num_free == len(model)
    twin.free(got[:1])  # one index by the scalar path: it sees what the array path marked
    kv.check_invariants()
    twin.check_invariants()


def test_the_free_lists_invariants_catch_a_flag_or_a_ring_entry_out_of_step() -> None:
    kv = KVFreeList(8)
    held = kv.alloc(3)
    assert held is not None
    kv.check_invariants()
    kv._flags[0] = 1  # an allocated index marked free
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv._flags[0] = 0
    kv._ring[kv._head] = kv._ring[kv._head + 1]  # one free index listed twice, another lost
    with pytest.raises(AssertionError, match="twice"):
        kv.check_invariants()


def test_a_refused_free_names_the_first_bad_index_and_takes_nothing_back() -> None:
    kv = KVFreeList(8)
    idx = kv.alloc(6)
    assert idx is not None
    kv.free(idx[:1])  # 0 is free again
    for bad, error, match in (
        ([3, 9, 0], ValueError, "KV index 9 is outside"),
        ([3, 0, 9], RuntimeError, "KV index 0 freed twice"),
        ([3, 4, 3], RuntimeError, "KV index 3 freed twice"),
        ([-1, 3], ValueError, "KV index -1 is outside"),
        ([9], ValueError, "KV index 9 is outside"),
        ([0], RuntimeError, "KV index 0 freed twice"),
    ):
        with pytest.raises(error, match=match):
            kv.free(torch.tensor(bad))
        assert kv.num_free == 3
        kv.check_invariants()
    with pytest.raises(TypeError, match="integer tensor"):
        kv.free(torch.tensor([1.0]))
    kv.free(torch.tensor([5, 1]))
    assert kv.alloc(5) is not None and kv.alloc(1) is None  # 6, 7, 0, 5, 1
    kv.check_invariants()
    # the same refusals for many indices at once (numpy's checks)
    big = KVFreeList(64)
    held = big.alloc(40)
    assert held is not None
    big.free(held[:10])  # 0..9 free again
    run = list(range(20, 40))
    for bad, error, match in (
        ([*run[:-1], 64], ValueError, "KV index 64 is outside"),
        ([*run[:5], 3, *run[5:]], RuntimeError, "KV index 3 freed twice"),
        ([*run[:-1], 25], RuntimeError, "KV index 25 freed twice"),
    ):
        with pytest.raises(error, match=match):
            big.free(torch.tensor(bad))
        assert big.num_free == 34
        big.check_invariants()
    with pytest.raises(TypeError, match="integer tensor"):
        big.free(torch.tensor(run, dtype=torch.float32))
    big.free(torch.tensor(run).reshape(4, 5))  # any shape: its indices
    assert big.num_free == 54
    big.check_invariants()


def test_a_hit_refused_for_a_finding_that_leaves_too_little_kv_is_a_kv_refusal() -> None:
    """The admission counted KV for its hit; refused for a finding (the snapshot changed), the
    shallower hit needs more. With the path locked by another request nothing can be evicted:
    a KV refusal, everything given back; the changed snapshot goes once its holder ended."""
    mgr, kv = make(kv_tokens=64)
    fx = Forensics(mgr.pool, mode="record")
    mgr.forensics = fx
    a = list(range(1, 49))
    serve(mgr, "a", a, [])
    mgr.finish("a")
    holder = mgr.admit("x", [*a, 7], max_new_tokens=14)  # locks the 48-deep hit; 1 KV index left
    assert isinstance(holder, Admission) and holder.cached_length == 48 and kv.num_free == 1
    node = mgr.cache.match(a).node
    assert node.snapshot is not None
    mgr.pool.recurrent[:, node.snapshot] += 1.0
    before = (kv.num_free, mgr.pool.num_free, mgr.cache.total_kv_tokens)
    ref = mgr.admit("b", [*a, 8])
    assert isinstance(ref, Refusal) and ref.cause is RefusalCause.KV and "refused for a finding" in ref.reason
    assert [f.kind for f in fx.findings] == ["changed"] and "b" not in mgr
    assert (kv.num_free, mgr.pool.num_free, mgr.cache.total_kv_tokens) == before
    conserved(mgr, kv)
    mgr.abort("x")
    conserved(mgr, kv)
    again = mgr.admit("c", [*a, 9])  # x is gone: the changed snapshot is dropped first, c hits above it
    assert isinstance(again, Admission) and 0 < again.cached_length < 48
    assert node.snapshot is None and mgr.metrics().refused_hits == 1
    conserved(mgr, kv)
