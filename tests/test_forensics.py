import json
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from linear_state import COMPLETE, LinearStatePool, NodeOwner, RequestOwner, StateLayout, ThreadStream
from radixcache import CacheManager, Forensics, Ledger, SnapshotCorruption, SnapshotRefused, TreeNode, read_ledger
from radixcache.cli import main
from radixcache.forensics import HOLDERS_KEPT, SAMPLED, key_digest
from radixcache.testing.hammer import HammerConfig, run_hammer
from radixcache.testing.model import HybridConfig, HybridModel

from .host_sim import Host, cold_state

_OPENED: list[Forensics] = []


@pytest.fixture(autouse=True)
def _close_ledgers() -> Iterator[None]:
    """Close the ledger files this module's tests opened (an open file collected later is a
    ``ResourceWarning`` blamed on whichever test runs then)."""
    yield
    while _OPENED:
        _OPENED.pop().close()


def forensic_host(tmp_path: Path, mode: str = "raise", **kw: object) -> Host:
    h = Host(**kw)  # type: ignore[arg-type]
    fx = Forensics(h.pool, ledger=Ledger(tmp_path / "ledger.jsonl"), mode=mode)  # type: ignore[arg-type]
    _OPENED.append(fx)
    h.mgr.forensics = fx  # the manager hands the tree's events to whatever forensics it has now
    return h


def run(h: Host, rid: object, ids: list[int]) -> int:
    r = h.admit(rid, ids)
    assert r is not None
    h.prefill(rid)
    h.finish(rid)
    h.forward.synchronize()
    h.copies.synchronize()
    return r.adm.cached_length


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(seed))]


def test_clean_traffic_has_no_findings_and_a_ledger(tmp_path: Path) -> None:
    h = forensic_host(tmp_path)
    p = tokens(300)
    run(h, "a", p)
    assert run(h, "b", p) == 299
    assert run(h, "c", p[:200] + tokens(50, 1)) >= 192
    assert h.mgr.verify_all() > 0
    assert h.mgr.forensics is not None and not h.mgr.forensics.findings
    h.mgr.forensics.close()
    kinds = {e["ev"] for e in read_ledger(tmp_path / "ledger.jsonl")}
    assert {"alloc", "free", "donate", "restore", "verify"} <= kinds
    assert main(["forensics", str(tmp_path / "ledger.jsonl")]) == 0


def test_a_write_into_a_tree_slot_is_found_and_attributed(tmp_path: Path) -> None:
    h = forensic_host(tmp_path, mode="record")
    p = tokens(200)
    run(h, "donor", p)
    node = h.cache.match(p).node
    assert node.snapshot is not None
    h.pool.recurrent[0, node.snapshot, 0, 0] += 1.0  # a stray kernel writes a frozen snapshot
    assert h.mgr.verify_all() > 0
    fx = h.mgr.forensics
    assert fx is not None and len(fx.findings) == 1
    f = fx.findings[0]
    assert (f.kind, f.node, f.depth, f.slot, f.donor) == ("changed", node.id, node.depth, node.snapshot, "donor")
    assert f.expected != f.found and len(f.key) == 16
    assert "changed" in str(f) and "depth 200" in str(f)


def test_restore_of_a_poisoned_snapshot_raises(tmp_path: Path) -> None:
    h = forensic_host(tmp_path)
    p = tokens(100)
    run(h, "donor", p)
    node = h.cache.match(p[:-1]).node  # what an identical prompt will hit
    assert node.snapshot is not None
    h.pool.conv[0, node.snapshot].zero_()
    free = h.pool.num_free
    with pytest.raises(SnapshotCorruption) as exc:
        h.admit("victim", p)
    assert exc.value.kind == "changed" and exc.value.node == node.id
    assert "victim" not in h.mgr and h.pool.num_free == free  # the admission took nothing with it
    h.mgr.check_invariants()
    h.mgr.forensics.close()  # type: ignore[union-attr]
    assert main(["forensics", str(tmp_path / "ledger.jsonl")]) == 1


def test_a_capture_never_written_is_reported_against_its_donor(tmp_path: Path) -> None:
    h = forensic_host(tmp_path, mode="record", chunk=64)
    h.mgr.write_checks = False  # forensics' own detection, alone (the write checks find it too)
    ids = tokens(300)
    r = h.admit("lazy", ids)
    assert r is not None
    h.extend("lazy")  # captures into the track slots and commits them: fine
    h.forward.synchronize()
    h.copies.synchronize()
    # next chunk: the host "forgets" to write its captures, yet commits the window
    plan = h.mgr.plan_prefill("lazy", 128)
    points = [c.depth for c in plan.captures]
    assert points
    h.commit(r, plan)
    h.copies.synchronize()
    h.mgr.verify_all()  # takes the fingerprints of completed donations
    fx = h.mgr.forensics
    assert fx is not None
    never = [f for f in fx.findings if f.kind == "never-written"]
    assert never and never[0].suspects[0] == "lazy" and never[0].donor == "lazy"
    assert never[0].depth in points


def test_fresh_zero_slot_donated_is_never_written(tmp_path: Path) -> None:
    h = forensic_host(tmp_path, mode="record")
    h.mgr.write_checks = False  # forensics' own detection, alone (the write checks find it too)
    r = h.admit("z", tokens(100))
    assert r is not None
    plan = h.mgr.plan_prefill("z", 64)
    assert [(c.depth, c.slot) for c in plan.captures] == [(64, r.adm.track_slots[0])]
    h.pool.recurrent[:, r.adm.track_slots[0]].zero_()
    h.pool.conv[:, r.adm.track_slots[0]].zero_()
    h.commit(r, plan)  # no forward ran: the capture slot holds zeros
    h.copies.synchronize()
    h.mgr.verify_all()
    fx = h.mgr.forensics
    assert fx is not None and [f.kind for f in fx.findings] == ["never-written"]
    assert cold_state([]).abs().sum() == 0


def test_ledger_rotates_within_its_bound(tmp_path: Path) -> None:
    path = tmp_path / "l.jsonl"
    led = Ledger(path, max_bytes=2000, backups=2, flush_every=7)
    for i in range(300):
        led.write({"ev": "alloc", "slot": i, "step": i})
    led.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["l.jsonl", "l.jsonl.1", "l.jsonl.2"]
    assert all(p.stat().st_size <= 2000 for p in tmp_path.iterdir())
    events = read_ledger(path)
    steps = [e["step"] for e in events]
    assert steps == sorted(steps) and steps[-1] == 299, "oldest first, newest kept"
    with pytest.raises(ValueError, match="bad ledger sizes"):
        Ledger(tmp_path / "x", max_bytes=0)


def test_bad_mode() -> None:
    h = Host()
    with pytest.raises(ValueError, match="mode"):
        Forensics(h.pool, mode="loud")  # type: ignore[arg-type]


def test_forensics_of_something_that_is_not_a_pool_or_a_ledger_is_refused() -> None:
    with pytest.raises(TypeError, match="Forensics watches a LinearStatePool, got str"):
        Forensics("pool")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ledger must be a Ledger or None, got str"):
        Forensics(LinearStatePool(StateLayout(1, (2, 2), (2,)), 2), ledger="ledger.jsonl")  # type: ignore[arg-type]


MODEL = HybridModel(HybridConfig())


def test_alias_report_names_the_branch_and_ranks_the_writer_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hammer with --inject alias: the first finding's top suspect is the request whose
    forward actually wrote the snapshot's slot after its donation."""
    from radixcache.testing.engine import ReferenceEngine

    ledger = tmp_path / "alias.jsonl"
    engine_box: list[ReferenceEngine] = []
    real_init = ReferenceEngine.__init__

    def init(self: ReferenceEngine, *a: object, **kw: object) -> None:
        kw["record_writes"] = True
        real_init(self, *a, **kw)  # type: ignore[arg-type]
        engine_box.append(self)

    ReferenceEngine.__init__ = init  # type: ignore[method-assign]
    try:
        rep = run_hammer(HammerConfig(requests=40, seed=0, inject="alias", forensics=str(ledger)), model=MODEL)
    finally:
        ReferenceEngine.__init__ = real_init  # type: ignore[method-assign]
    assert rep.snapshot_corruptions > 0 and not rep.ok
    fx = engine_box[0].forensics
    writes = engine_box[0].slot_writes
    assert fx is not None and writes is not None
    first = fx.findings[0]
    donated_at = min(e["step"] for e in read_ledger(ledger) if e["ev"] == "donate" and e["node"] == first.node)
    writer = next(rid for step, rid, slot in writes if slot == first.slot and step >= donated_at)
    assert first.suspects[0] == writer
    assert main(["forensics", str(ledger), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_bad"]["key"] == first.key and out["first_bad"]["depth"] == first.depth
    assert out["first_bad"]["suspects"][0] == writer


def test_no_false_positive_over_a_clean_hammer_of_500(tmp_path: Path) -> None:
    rep = run_hammer(HammerConfig(requests=500, seed=1, forensics=str(tmp_path / "clean.jsonl")), model=MODEL)
    assert rep.requests >= 500 and rep.snapshot_corruptions == 0 and rep.ok
    events = read_ledger(tmp_path / "clean.jsonl")
    assert sum(e["ev"] == "restore" for e in events) > 100
    assert not [e for e in events if e["ev"] == "corruption"]


def test_manager_invariants_cover_the_forensics_bookkeeping(tmp_path: Path) -> None:
    h = forensic_host(tmp_path)
    run(h, "a", tokens(200))
    h.mgr.verify_all()
    h.mgr.check_invariants()
    fx = h.mgr.forensics
    assert fx is not None and fx._snaps
    node = next(iter(fx._snaps))
    fx._by_slot[fx._snaps[node].slot].discard(node)  # the slot index forgets a snapshot
    with pytest.raises(AssertionError, match="missing from slot"):
        h.mgr.check_invariants()
    fx._by_slot[fx._snaps[node].slot].add(node)
    fx._snaps[node].slot += 1000  # tracked at a slot the tree does not hold
    with pytest.raises(AssertionError):
        h.mgr.check_invariants()


# ------------------------------------------------------------ sampled forensics
def test_the_manager_watches_a_sample_of_donations_by_default_and_warns_once_per_kind() -> None:
    h = Host(slots=64)  # a manager built without saying: forensics="sampled"
    fx = h.mgr.forensics
    assert isinstance(fx, Forensics) and (fx.sample, fx.mode, fx.warn) == (SAMPLED, "record", True)
    for i in range(120):
        run(h, f"r{i}", tokens(70, seed=i))
    assert fx.donations_seen >= 120
    assert 0.03 * fx.donations_seen < fx.donations_watched < 0.25 * fx.donations_seen, (
        fx.donations_watched,
        fx.donations_seen,
    )
    live = [n for n in h.cache.iter_nodes() if n.snapshot is not None]
    for n in live:
        h.pool.recurrent[0, n.snapshot, 0, 0] += 1.0  # a stray kernel writes every snapshot
    with pytest.warns(RuntimeWarning, match="snapshot changed") as caught:
        checked = h.mgr.verify_all()
    assert checked > 0 and {f.kind for f in fx.findings} == {"changed"}
    # the watched device snapshots are found (the host tier's copies were not written); the others
    # were never fingerprinted, so nothing is said of them
    assert 0 < len(fx.findings) < len(live), (len(fx.findings), len(live))
    assert {f.node for f in fx.findings} <= {n.id for n in live}
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1, "one warning per kind"
    h.mgr.check_invariants()


def test_a_sample_of_one_watches_every_donation_and_none_turns_forensics_off() -> None:
    assert Forensics(Host().pool).sample == 1.0
    h = Host()
    h.mgr.forensics = Forensics(h.pool, mode="record")
    for i in range(10):
        run(h, f"r{i}", tokens(70, seed=i))
    assert h.mgr.forensics.donations_watched == h.mgr.forensics.donations_seen > 0
    off = Host()
    off_mgr = CacheManager(off.cache.__class__(off.pool), forensics=None)
    assert off_mgr.forensics is None


def test_the_sample_is_drawn_per_donation_not_by_stride() -> None:
    # Two donations per request (a capture and a final state, say): a stride of two at sample=0.5
    # would watch only one kind. The draw watches both, about half of each.
    pool = LinearStatePool(StateLayout(1, (2, 2), (2,)), 4)
    slot = pool.alloc(RequestOwner("x"))
    pool.recurrent[:, slot] = 1.0
    fx = Forensics(pool, sample=0.5, seed=3)
    watched = []
    for i in range(400):
        before = fx.donations_watched
        fx.donated(i, 10 + i, b"k%d" % i, slot, "d", COMPLETE, None, 0)
        watched.append(fx.donations_watched > before)
        fx.snapshot_freed(i, slot)
    even, odd = sum(watched[0::2]), sum(watched[1::2])
    assert 60 < even < 140 and 60 < odd < 140, (even, odd)
    again = Forensics(pool, sample=0.5, seed=3)
    for i in range(400):
        again.donated(i, 10 + i, b"k%d" % i, slot, "d", COMPLETE, None, 0)
        again.snapshot_freed(i, slot)
    assert again.donations_watched == fx.donations_watched, "seeded: the same draw"


@pytest.mark.parametrize("sample", [0, 0.0, -0.1, 1.5, True, "0.5", float("nan")])
def test_a_bad_sample_is_refused(sample: object) -> None:
    with pytest.raises(ValueError, match="sample must be a fraction in"):
        Forensics(Host().pool, sample=sample)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "error"), [("all", ValueError), (3, TypeError)])
def test_a_bad_forensics_argument_is_refused(value: object, error: type[Exception]) -> None:
    h = Host()
    with pytest.raises(error, match="forensics must be a Forensics, 'sampled' or None"):
        CacheManager(h.cache.__class__(h.pool), forensics=value)  # type: ignore[arg-type]


def test_the_holders_of_a_slot_are_bounded() -> None:
    pool = LinearStatePool(StateLayout(1, (2, 2), (2,)), 4)
    fx = Forensics(pool)
    for i in range(3 * HOLDERS_KEPT):
        fx.request_slots(f"r{i}", [1])
        fx.request_freed(f"r{i}", [1])
    spans = fx._holds[1].spans
    assert len(spans) == HOLDERS_KEPT and spans[-1][2] == f"r{3 * HOLDERS_KEPT - 1}", "the latest are kept"


def test_an_unwatched_donation_into_a_watched_snapshots_slot_is_still_a_finding() -> None:
    # Aliasing: the tree hands a slot a watched snapshot still holds to a new donation. Whether
    # that donation is drawn into the sample or not, the watched one was overwritten.
    seed = next(s for s in range(1000) if _first_two_draws_below(s, 0.5) == [True, False])
    pool = LinearStatePool(StateLayout(1, (2, 2), (2,)), 4)
    slot = pool.alloc(RequestOwner("x"))
    pool.recurrent[:, slot] = 1.0
    fx = Forensics(pool, mode="record", sample=0.5, seed=seed)
    fx.donated(1, 10, b"a", slot, "first", COMPLETE, None, 0)  # watched
    assert fx.donations_watched == 1 and not fx.findings
    pool.recurrent[:, slot] = 2.0  # the second donation's clone lands in the same slot
    fx.donated(2, 20, b"b", slot, "second", COMPLETE, None, 0)  # not watched
    assert fx.donations_watched == 1
    assert [(f.kind, f.node) for f in fx.findings] == [("changed", 1)]


def _first_two_draws_below(seed: int, sample: float) -> list[bool]:
    """Whether Forensics(sample=, seed=seed) watches its first two donations."""
    rng = random.Random(seed)
    return [rng.random() < sample for _ in range(2)]


def test_the_ancestor_is_asked_only_for_a_watched_donation() -> None:
    # A checkpoint hands the nearest snapshot ancestor as a function and a view of its key: the
    # walk and the digest are paid only for the donations drawn into the sample, and a watched
    # one still compares itself with that ancestor (never-written).
    seed = next(s for s in range(1000) if _first_two_draws_below(s, 0.5) == [True, False])
    pool = LinearStatePool(StateLayout(1, (2, 2), (2,)), 4)
    first, second = pool.alloc(RequestOwner("x")), pool.alloc(RequestOwner("y"))
    pool.recurrent[:, first] = 1.0
    pool.recurrent[:, second] = 1.0  # the same state as the first: nothing written in between
    fx = Forensics(pool, mode="record", sample=0.5, seed=seed)
    asked: list[int] = []

    def ancestor(nid: int | None, depth: int) -> Callable[[], tuple[int | None, int]]:
        def find() -> tuple[int | None, int]:
            asked.append(0 if nid is None else nid)
            return nid, depth

        return find

    key = memoryview(b"k" * 32)
    fx.donated(1, 10, key[:16], first, "a", COMPLETE, ancestor(None, 0))  # watched
    fx.donated(2, 20, key, second, "b", COMPLETE, ancestor(1, 10))  # not watched: not asked
    assert asked == [0] and fx.donations_watched == 1 and not fx.findings
    watch_all = Forensics(pool, mode="record")
    watch_all.donated(1, 10, key[:16], first, "a", COMPLETE, ancestor(None, 0))
    watch_all.donated(2, 20, key, second, "b", COMPLETE, ancestor(1, 10))
    assert asked == [0, 0, 1]
    assert [(f.kind, f.node) for f in watch_all.findings] == [("never-written", 2)]
    assert watch_all.findings[0].key == key_digest(bytes(key))


def test_a_watched_donations_key_is_digested_only_when_named_from_the_bytes_it_was_given() -> None:
    # The branch's name is the digest of the key at donation, made when a finding (or the ledger)
    # first names it: bytes and views of bytes are kept as they are, any other buffer copied at
    # donation (the caller may rewrite it), and something that is no buffer is refused there.
    pool = LinearStatePool(StateLayout(1, (2, 2), (2,)), 4)
    slots = [pool.alloc(RequestOwner(i)) for i in range(3)]
    for s in slots:
        pool.recurrent[:, s] = float(s + 1)
    fx = Forensics(pool, mode="record")
    mutable = bytearray(b"m" * 16)
    view = memoryview(b"v" * 32)[:16]
    fx.donated(1, 10, mutable, slots[0], "a", COMPLETE, None)
    fx.donated(2, 10, view, slots[1], "b", COMPLETE, None)
    mutable[:] = b"x" * 16  # rewritten after the donation
    assert all(s._key is None for s in fx._snaps.values())  # not digested yet
    for s in slots[:2]:
        pool.recurrent[:, s] = 9.0  # both snapshots overwritten: two findings name their branches
    assert fx.verify_all() == 2
    assert [f.key for f in fx.findings] == [key_digest(b"m" * 16), key_digest(b"v" * 16)]
    with pytest.raises(TypeError):
        fx.donated(3, 10, 12345, slots[2], "c", COMPLETE, None)  # type: ignore[arg-type]


def test_forensics_warms_the_pools_fingerprint_when_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the first fingerprint compiles Triton's kernel: at start-up, not in a donation.
    warmed: list[LinearStatePool] = []

    def warm(self: LinearStatePool) -> tuple[int, ...]:
        warmed.append(self)
        return ()

    monkeypatch.setattr(LinearStatePool, "warm_fingerprint", warm)
    h = Host()  # its manager's default forensics warmed the pool
    assert warmed == [h.pool]
    warmed.clear()
    Forensics(h.pool, sample=0.5)
    assert warmed == [h.pool]
    mgr = CacheManager(h.cache.__class__(h.pool))  # the default sampled forensics too
    assert mgr.forensics is not None and warmed == [h.pool, h.pool]
    assert CacheManager(h.cache.__class__(h.pool), forensics=None).forensics is None and len(warmed) == 2


def test_on_a_thread_stream_the_donation_fingerprint_runs_on_the_pools_thread() -> None:
    """A donation on a pool whose stream is a ThreadStream: its fingerprint is taken on that
    thread behind the clone (the donor's thread never fingerprints), pending until then; a
    never-written one is reported once it ran, and ``flagged`` names it."""
    stream = ThreadStream("copies")
    pool = LinearStatePool(StateLayout(2, (4, 3), (2, 4, 4)), 4, "cpu", stream=stream)
    fx = Forensics(pool, mode="record")
    owner = RequestOwner("r")
    live = pool.alloc(owner)
    pool.recurrent[:, live].normal_()
    zero = pool.alloc(owner)
    pool.recurrent[:, zero].zero_()
    pool.conv[:, zero].zero_()

    def not_here(slot: int) -> int:
        raise AssertionError("the donation's fingerprint was taken on the donor's thread")

    gate = threading.Event()
    stream.submit(lambda: gate.wait(10), label="busy")
    snaps = [pool.clone(s, NodeOwner(n)) for n, s in ((1, live), (2, zero))]
    real = pool.fingerprint
    pool.fingerprint = not_here  # type: ignore[method-assign]
    for n, w in ((1, snaps[0]), (2, snaps[1])):
        fx.donated(n, 8 * n, b"k%d" % n, w.slot, "d", w.fence, None, 0)
    assert fx.pending(1) and fx.pending(2) and fx.settle() == 2 and not fx.findings
    gate.set()
    stream.synchronize()
    assert fx.settle() == 0 and not fx.pending(1) and not fx.pending(2)
    assert [f.kind for f in fx.findings] == ["never-written"] and fx.flagged(2) and not fx.flagged(1)
    pool.fingerprint = real  # type: ignore[method-assign]
    fx.before_restore(1, "r2", None)  # verified against the fingerprint the thread took
    assert len(fx.findings) == 1
    fx.check_invariants()
    stream.close()


def test_settle_of_one_node_waits_its_fingerprint() -> None:
    stream = ThreadStream("copies")
    pool = LinearStatePool(StateLayout(2, (4, 3), (2, 4, 4)), 2, "cpu", stream=stream)
    fx = Forensics(pool, mode="record")
    live = pool.alloc(RequestOwner("r"))
    pool.recurrent[:, live].normal_()
    gate = threading.Event()
    stream.submit(lambda: gate.wait(10), label="busy")
    w = pool.clone(live, NodeOwner(1))
    fx.donated(1, 8, b"k", w.slot, "d", w.fence, None, 0)
    threading.Timer(0.05, gate.set).start()
    assert fx.settle(1) == 0 and not fx.pending(1) and not fx.findings
    stream.close()


# ------------------------------------------- a snapshot a finding names is never served
def _poisoned(tmp_path: Path, mode: str = "record") -> tuple[Host, list[int], TreeNode]:
    """A host whose deepest snapshot of a 300-token prompt was written behind the tree's back."""
    h = forensic_host(tmp_path, mode=mode)
    p = tokens(300)
    run(h, "donor", p)
    node = h.cache.match(p[:-1]).node
    assert node.depth == 299 and node.snapshot is not None
    h.pool.recurrent[0, node.snapshot, 0, 0] += 1.0
    return h, p, node


def test_an_admission_whose_hit_is_found_changed_falls_back_up_the_path(tmp_path: Path) -> None:
    """Until 2026-12-07, in ``"record"`` mode (the manager's default, sampled) a snapshot found
    changed at its restore was recorded and restored anyway: the request computed on from a
    wrong state. The admission now takes the next snapshot up its path, verified in turn."""
    h, p, node = _poisoned(tmp_path)
    r = h.admit("victim", p)
    assert r is not None and r.adm.cached_length == 256 and r.restored_ok
    fx = h.mgr.forensics
    assert fx is not None and [f.kind for f in fx.findings] == ["changed"]
    m = h.mgr.metrics()
    assert (m.refused_hits, m.evictions["corrupt"], m.hits, m.hit_tokens) == (1, 1, 1, 256)
    assert node.snapshot is None  # dropped: nobody else held it
    h.mgr.check_invariants()
    h.prefill("victim")
    assert h.final_state_ok("victim")
    h.finish("victim")
    h.forward.synchronize()
    h.copies.synchronize()
    again = h.admit("again", p)
    assert again is not None and again.adm.cached_length == 299 and again.restored_ok  # filed anew
    h.mgr.check_invariants()


def test_a_hit_a_finding_named_before_is_skipped_without_a_fingerprint(tmp_path: Path) -> None:
    """Found by ``verify_all`` (or at any slot event) before any request asks for it: the
    admission and ``can_admit`` take the next snapshot up at once."""
    h, p, node = _poisoned(tmp_path)
    assert h.mgr.verify_all() > 0
    fx = h.mgr.forensics
    assert fx is not None and fx.flagged(node.id) and fx.finding(node.id) is fx.findings[0]
    assert h.mgr.can_admit(p).cached_length == 256 and node.snapshot is not None  # a dry run drops nothing
    verified: list[int] = []
    verify = fx.before_restore

    def counted(n: int, *a: Any, **k: Any) -> None:
        verified.append(n)
        verify(n, *a, **k)

    fx.before_restore = counted  # type: ignore[method-assign, assignment]
    r = h.admit("victim", p)
    assert r is not None and r.adm.cached_length == 256 and r.restored_ok
    assert h.mgr.metrics().refused_hits == 1 and node.snapshot is None
    assert verified == [h.cache.match(p[:256]).node.id]  # the 256-deep hit's alone: 299 not read again
    h.mgr.check_invariants()


def test_a_lookup_never_returns_a_snapshot_a_finding_names(tmp_path: Path) -> None:
    """Until 2026-12-07 ``lookup`` returned it (hosts that keep their own slots then met
    ``SnapshotRefused`` at the restore): it now takes the next snapshot up the path and refuses
    the named one as an admission does (dropped, or once no lock holds it)."""
    h = forensic_host(tmp_path, mode="record")
    p = tokens(300)
    run(h, "donor", p)
    holder = h.admit("holder", p)  # holds the 299-deep snapshot until it ends
    assert holder is not None and holder.adm.cached_length == 299
    q = p[:-1]  # the prompt's 299-deep snapshot (the donor also filed its 300-deep final state)
    node = h.cache.match(q).node
    h.pool.recurrent[0, node.snapshot, 0, 0] += 1.0
    assert h.mgr.verify_all() > 0
    fx = h.mgr.forensics
    assert fx is not None and fx.flagged(node.id)
    m = h.mgr.lookup(q)
    assert (m.cached_length, m.node.depth) == (256, 256) and m.kv_indices.numel() == 256
    assert node.snapshot is not None and h.mgr.metrics().refused_hits == 1  # held: condemned, not dropped
    assert h.mgr.lookup(q, kv=False, touch=False).cached_length == 256 and h.mgr.metrics().refused_hits == 1
    h.mgr.check_invariants()
    h.prefill("holder")
    h.finish("holder")
    assert node.snapshot is not None  # not while the host ends the request
    assert h.mgr.lookup(q).cached_length == 256 and node.snapshot is None  # the next lookup drops it
    assert h.mgr.metrics().evictions["corrupt"] == 1 and len(fx.findings) == 1
    h.mgr.check_invariants()


def test_in_raise_mode_a_second_admission_is_not_served_the_snapshot_that_raised(tmp_path: Path) -> None:
    """``"raise"`` mode raised at the first restore; the finding then recorded the changed
    fingerprint ("reported once"), and a second admission of the prefix was served the changed
    state before 2026-12-07 when the host had not discarded it."""
    h, p, node = _poisoned(tmp_path, mode="raise")
    with pytest.raises(SnapshotCorruption):
        h.admit("first", p)
    r = h.admit("second", p)
    assert r is not None and r.adm.cached_length == 256 and r.restored_ok and node.snapshot is None
    h.mgr.check_invariants()


def test_a_changed_snapshot_another_request_holds_is_dropped_after_it_ends(tmp_path: Path) -> None:
    h = forensic_host(tmp_path, mode="record")
    p = tokens(300)
    run(h, "donor", p)
    holder = h.admit("holder", p)  # holds the 299-deep snapshot (its hit) until it finishes
    assert holder is not None and holder.adm.cached_length == 299
    node = h.cache.match(p[:-1]).node
    h.pool.recurrent[0, node.snapshot, 0, 0] += 1.0
    r = h.admit("victim", p)
    assert r is not None and r.adm.cached_length == 256 and r.restored_ok
    assert node.snapshot is not None and h.mgr.metrics().evictions["corrupt"] == 0  # held: not yet
    h.mgr.check_invariants()
    late = h.admit("late", p)  # refused again, without a new finding
    assert late is not None and late.adm.cached_length == 256
    fx = h.mgr.forensics
    assert fx is not None and len(fx.findings) == 1 and h.mgr.metrics().refused_hits == 1
    h.abort("late")
    h.prefill("holder")
    h.finish("holder")
    h.mgr.check_invariants()
    assert node.snapshot is not None  # not while the host ends the request (its KV goes with it)
    after = h.admit("after", p)  # the next admission drops it first
    assert after is not None and after.adm.cached_length == 256 and after.restored_ok
    assert node.snapshot is None and h.mgr.metrics().evictions["corrupt"] == 1
    h.mgr.check_invariants()


def test_a_restore_of_a_snapshot_a_finding_names_raises_snapshot_refused(tmp_path: Path) -> None:
    h, p, node = _poisoned(tmp_path)
    owner = RequestOwner("host")
    dst = h.pool.alloc(owner)
    info = h.mgr.request_info(p, 299)
    with pytest.raises(SnapshotRefused, match="found it changed") as exc:
        h.mgr.restore(node, dst, dst_owner=owner, info=info)
    assert (exc.value.node, exc.value.depth, exc.value.kind) == (node.id, 299, "changed")
    assert node.snapshot is None and h.mgr.metrics().hits == 0
    h.pool.free(dst, owner)
    h.mgr.check_invariants()


def _one_watched_one_not() -> tuple[Forensics, LinearStatePool, int, int]:
    """Forensics sampling half the donations, and two snapshots: node 1 (slot ``a``, watched)
    and node 2 (slot ``b``, not watched)."""
    seed = next(s for s in range(1000) if _first_two_draws_below(s, 0.5) == [True, False])
    pool = LinearStatePool(StateLayout(1, (2, 2), (2,)), 4)
    a, b = pool.alloc(RequestOwner("x")), pool.alloc(RequestOwner("x"))
    pool.recurrent[:, a] = 1.0
    pool.recurrent[:, b] = 2.0
    fx = Forensics(pool, mode="record", sample=0.5, seed=seed)
    fx.donated(1, 10, b"a", a, "first", COMPLETE, None, 0)  # watched
    fx.donated(2, 10, b"b", b, "second", COMPLETE, None, 0)  # not watched
    return fx, pool, a, b


def test_a_comparison_made_elsewhere_is_a_finding_only_for_the_same_donation() -> None:
    """``expected`` names the fingerprint a watched snapshot must have (nothing for one not
    watched); ``compared`` records what another thread's fingerprint of a copy found: a finding
    when it differs and the snapshot still carries that donation fingerprint, nothing otherwise."""
    fx, pool, a, _ = _one_watched_one_not()
    fp = fx.expected(1)
    assert fp == pool.fingerprint(a) and fx.expected(2) is None and fx.expected(99) is None
    assert fx.compared(1, fp, fp) and fx.compared(2, 5, 6) and fx.compared(99, 5, 6) and not fx.findings
    assert fx.compared(1, fp ^ 1, 7) and not fx.findings  # not the fingerprint it carries: stale
    assert not fx.compared(1, fp, fp ^ 1)
    assert [(f.kind, f.node, f.expected, f.found) for f in fx.findings] == [("changed", 1, fp, fp ^ 1)]
    assert fx.flagged(1) and fx.expected(1) is None
    assert not fx.compared(1, fp, 3) and len(fx.findings) == 1  # named already: once
    step = fx.step
    for bad in ("1", 1.0, True, None):
        with pytest.raises(TypeError, match="node id"):
            fx.expected(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="node id"):
            fx.compared(bad, 1, 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected must be an int"):
        fx.compared(1, "1", 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="found must be an int"):
        fx.compared(1, 1, True)
    with pytest.raises(TypeError, match="why"):
        fx.compared(1, 1, 2, why=3)  # type: ignore[arg-type]
    assert fx.step == step and len(fx.findings) == 1  # nothing changed
    fx.check_invariants()


def test_verify_reads_a_watched_snapshot_and_says_whether_a_finding_names_it() -> None:
    fx, pool, a, b = _one_watched_one_not()
    assert fx.verify(1) and fx.verify(2) and not fx.findings
    pool.recurrent[:, a] = 3.0
    pool.recurrent[:, b] = 3.0
    assert not fx.verify(1, "publish") and [(f.kind, f.node) for f in fx.findings] == [("changed", 1)]
    assert not fx.verify(1) and len(fx.findings) == 1  # named before: not read again
    assert fx.verify(2) and fx.verify(99)  # not watched (not read), no snapshot at all
    step = fx.step
    for bad in ("1", 1.0, True, None):
        with pytest.raises(TypeError, match="node id"):
            fx.verify(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="node id"):
            fx.finding(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="why"):
        fx.verify(1, why=3)  # type: ignore[arg-type]
    assert fx.step == step and len(fx.findings) == 1  # nothing changed
