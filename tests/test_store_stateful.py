"""The vLLM host store with its copy thread, driven by hypothesis: saves (some of a state never
written, some planned a step ahead so that plans of one prefix overlap, some planned before their
last ids are known, as vLLM's asynchronous scheduling does, some abandoned), lookups (some hits held
over later steps) and evictions in a small budget, while the copy thread is held back now and
then so that clones, fingerprints and page fingerprints are still queued when the next call
comes. Every hit must serve exactly the bytes of its prefix, no state never written is ever
served, and the store's invariants (pages, slots, plans, held hits) hold after every step."""

from __future__ import annotations

import threading

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixcache.vllm import VERIFYING, Hit, PagedHostStore, SavePlan

from .test_paged_store import B, Engine, _store

# three prompts of 3 blocks sharing prefixes: 0 and 1 share a block, 0 and 2 two blocks
_BASE = list(range(1000, 1000 + 3 * B))
DOCS = [_BASE, _BASE[:B] + list(range(2000, 2000 + 2 * B)), _BASE[: 2 * B] + list(range(3000, 3000 + B))]


def _expected(ids: list[int]) -> Engine:
    """The engine's blocks for ``ids`` (a whole number of blocks), in blocks 0, 1, ..."""
    eng = Engine(len(ids) // B)
    eng.compute(ids, list(range(len(ids) // B)))
    return eng


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # 6 pages and 3 slots: saves evict each other, and plans wait for slots freed behind clones
        self.store: PagedHostStore = _store(budget_pages=6)
        assert self.store.copies is not None
        self.gate: threading.Event | None = None
        self.never_written: set[tuple[int, ...]] = set()
        self.served = 0
        self.n = 0
        self.pending: list[tuple[SavePlan, tuple[int, ...], bool]] = []  # plans not yet committed
        self.held: list[tuple[int, Hit]] = []  # hits not yet let go, with their prompt

    def _release_copies_soon(self) -> None:
        """Before a call into the store: the held copy thread runs again 10 ms from now (a
        call that waits a queued copy blocks until then)."""
        if self.gate is not None:
            threading.Timer(0.01, self.gate.set).start()
            self.gate = None

    @rule()
    def hold_copies(self) -> None:
        if self.gate is None and self.store.copies is not None:
            self.gate = threading.Event()
            gate = self.gate
            self.store.copies.submit(lambda: gate.wait(10), label="held")

    def _plan(
        self, doc: int, blocks: int, never_written: bool, unknown: int = 0
    ) -> tuple[SavePlan, tuple[int, ...], bool] | None:
        """A plan for the first ``blocks`` of ``doc`` with the engine's bytes copied in; its last
        ``unknown`` ids not known when it is planned (given at the commit)."""
        ids = DOCS[doc][: blocks * B]
        eng = _expected(ids)
        self._release_copies_soon()
        self.n += 1
        plan = self.store.plan_save(f"s{self.n}", ids[: len(ids) - unknown], end=len(ids))
        if plan is None:
            return None
        first = plan.start // B
        self.store.copy_in_pages(plan.pages, eng.layers(list(range(first, blocks))))
        if never_written:
            conv, rec = torch.zeros_like(eng.conv[0]), torch.zeros_like(eng.rec[0])
        else:
            conv, rec = eng.conv[blocks - 1], eng.rec[blocks - 1]
        # as vLLM's worker does: straight into the slot's bytes, no fence (the plan's slot was
        # handed out only once every queued copy that read it had run)
        self.store.bytes.write_state(plan.slot, conv, rec)
        return plan, tuple(ids), never_written

    def _commit(self, planned: tuple[SavePlan, tuple[int, ...], bool]) -> None:
        plan, ids, never_written = planned
        self._release_copies_soon()
        if self.store.commit(plan, list(ids)):
            if never_written:
                self.never_written.add(ids)
            else:
                self.never_written.discard(ids)

    @rule(doc=st.integers(0, len(DOCS) - 1), blocks=st.integers(1, 3), never_written=st.booleans())
    def save(self, doc: int, blocks: int, never_written: bool) -> None:
        planned = self._plan(doc, blocks, never_written)
        if planned is not None:
            self._commit(planned)

    @rule(
        doc=st.integers(0, len(DOCS) - 1),
        blocks=st.integers(1, 3),
        never_written=st.booleans(),
        unknown=st.sampled_from([0, 1, B // 2, B]),
    )
    def plan_ahead(self, doc: int, blocks: int, never_written: bool, unknown: int) -> None:
        """A save planned now and committed by a later step (vLLM plans every request a step
        schedules before it commits any): plans of one prefix overlap. With ``unknown`` its
        last ids are not known yet (asynchronous scheduling: the step's sampled token comes
        later), so the pages it reserves are counted from fewer ids than it files."""
        if len(self.pending) < 2:
            planned = self._plan(doc, blocks, never_written, unknown)
            if planned is not None:
                self.pending.append(planned)

    @rule()
    def commit_planned(self) -> None:
        if self.pending:
            self._commit(self.pending.pop(0))

    @rule()
    def abandon_planned(self) -> None:
        """A planned save the engine never files (its request aborted before the step ran): its
        pages and slot go back, whatever the copy thread and the other plans did meanwhile."""
        if self.pending:
            self._release_copies_soon()
            plan, _, _ = self.pending.pop()
            self.store.abandon(plan, why="aborted")

    @rule(doc=st.integers(0, len(DOCS) - 1))
    def lookup(self, doc: int) -> None:
        self._release_copies_soon()
        self.n += 1
        self._check_hit(doc, self.store.lookup(f"r{self.n}", [*DOCS[doc], 7], computed=0))

    @rule(doc=st.integers(0, len(DOCS) - 1), computed=st.sampled_from([0, B]))
    def lookup_in_background(self, doc: int, computed: int) -> None:
        """One request per prompt asking again and again, as vLLM's scheduler does each step:
        verifying, then its hit (or nothing); asked with another ``computed`` it starts over."""
        self._release_copies_soon()
        got = self.store.lookup_in_background(f"bg{doc}", [*DOCS[doc], 7], computed=computed)
        if got is VERIFYING:
            return
        self._check_hit(doc, got)
        self.store.finished(f"bg{doc}")  # the next ask is a new request

    @rule(doc=st.integers(0, len(DOCS) - 1))
    def background_request_ends(self, doc: int) -> None:
        self.store.finished(f"bg{doc}")

    @rule(doc=st.integers(0, len(DOCS) - 1))
    def lookup_and_hold(self, doc: int) -> None:
        """A hit the engine reads over later steps (vLLM loads it while other requests save and
        evict): its lock must keep its snapshot and pages as they were until it is let go."""
        if len(self.held) < 2:
            self._release_copies_soon()
            self.n += 1
            hit = self.store.lookup(f"h{self.n}", [*DOCS[doc], 7], computed=0)
            if hit is not None:
                self._check_bytes(doc, hit)
                self.held.append((doc, hit))

    @rule(loaded=st.booleans())
    def release_held(self, loaded: bool) -> None:
        if self.held:
            doc, hit = self.held.pop(0)
            self._check_bytes(doc, hit)  # unchanged while it was held
            self.store.release(hit, loaded=loaded)

    def _check_hit(self, doc: int, hit: Hit | None) -> None:
        if hit is None:
            return
        self._check_bytes(doc, hit)
        self.store.release(hit, loaded=True)
        self.served += 1

    def _check_bytes(self, doc: int, hit: Hit) -> None:
        """``hit`` serves exactly the bytes of its prefix, and not a state never written."""
        ids = DOCS[doc][: hit.end]
        assert tuple(ids) not in self.never_written, f"a state never written was served at depth {hit.end}"
        want = _expected(ids)
        if hit.start:  # vLLM held the first blocks: the hit's pages are the rest
            want.kv = [t[hit.start // B :] for t in want.kv]
        conv, rec = self.store.state_of(hit)
        assert torch.equal(conv, want.conv[-1]) and torch.equal(rec, want.rec[-1]), f"wrong state at {hit.end}"
        out = Engine(len(hit.pages))
        self.store.copy_out_pages(hit.pages, out.layers(list(range(len(hit.pages)))))
        for got, exp in zip(out.kv, want.kv, strict=True):
            assert torch.equal(got, exp), f"wrong KV pages for the hit at {hit.end}"

    @rule()
    def synchronize(self) -> None:
        self._release_copies_soon()
        self.store.synchronize()
        self.never_written = {k for k in self.never_written if self._holds(k)}

    def _holds(self, ids: tuple[int, ...]) -> bool:
        m = self.store.manager.lookup(list(ids), touch=False, kv=False)
        return m.cached_length == len(ids)

    @invariant()
    def consistent(self) -> None:
        self.store.check_invariants()  # pages and slots conserved, plans and held hits accounted

    def teardown(self) -> None:
        self._release_copies_soon()
        for plan, _, _ in self.pending:
            self.store.abandon(plan)
        for _, hit in self.held:
            self.store.release(hit)
        for doc in range(len(DOCS)):
            self.store.finished(f"bg{doc}")
        self.store.synchronize()
        self.store.check_invariants()
        assert self.store.pool.num_free == self.store.num_slots - self.store.manager.cache.num_snapshots
        assert self.store.close()


TestStoreMachine = StoreMachine.TestCase
