"""The shared tier: replicas publish snapshots (state, KV, fingerprint) to a store and fetch what
they miss; every fetched blob is verified before it is restored, and a store that goes away costs
hits, never answers."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from linear_state import LinearStatePool, RequestOwner, SlotMisuse, StateLayout
from radixcache import Admission, CacheManager, HybridRadixCache, ProtocolError
from radixcache.forensics import SnapshotCorruption, analyze, format_forensics
from radixcache.testing.engine import EngineRequest, ReferenceEngine, generate_cold
from radixcache.testing.model import HybridConfig, HybridModel
from radixcache.tiers.blob import BLOB_MAGIC, encode_blob
from radixcache.tiers.host import HOST_TIER_FACTOR, auto_host_pool
from radixcache.tiers.shared import SharedTier
from radixcache.tiers.store import MemoryStore, RedisStore, SharedStore, SharedStoreError, deepest_of

from .exit_check import run_exiting
from .redis_server import RedisServer
from .tree_helpers import scribble

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(HybridConfig())


def _prompts(n: int, seed: int = 0, shared: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(500) for _ in range(shared)]
    return [system + [rng.randrange(500) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def _serve(engine: ReferenceEngine, prompts: list[list[int]], tag: str, new: int = 4) -> list[EngineRequest]:
    for i, p in enumerate(prompts):
        engine.submit(EngineRequest(f"{tag}{i}", p, new))
    return engine.run()


def _assert_exact(model: HybridModel, finished: list[EngineRequest]) -> None:
    for r in finished:
        gt, first = generate_cold(model, r.prompt, len(r.output))
        assert r.output == gt, f"{r.rid}: wrong answer after a hit of {r.cached_length} tokens"
        assert r.first_logits is not None
        assert float((r.first_logits - first).abs().max()) < 1e-6, r.rid


def _publisher_and_fetcher(
    model: HybridModel, store: SharedStore, **kw: object
) -> tuple[ReferenceEngine, ReferenceEngine]:
    a = ReferenceEngine(model, shared_store=store, publisher="A", **kw)  # type: ignore[arg-type]
    b = ReferenceEngine(model, shared_store=store, publisher="B", **kw)  # type: ignore[arg-type]
    return a, b


def _publish(a: ReferenceEngine, prompts: list[list[int]]) -> None:
    _serve(a, prompts, "a")
    assert a.manager.publish_pending(wait=True) >= 0
    assert a.manager.metrics().shared_published > 0


# ----------------------------------------------------------------- in process
def test_a_replica_serves_exact_answers_from_another_replicas_snapshots(model: HybridModel) -> None:
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(4)
    _publish(a, prompts[:2])
    finished = _serve(b, prompts, "b")
    m = b.manager.metrics()
    assert m.shared_hits >= 2 and m.shared_foreign_hits == m.shared_hits
    assert m.shared_rejected == 0
    # the first two prompts were computed whole by A: B's hit covers far beyond the system prompt
    deep = [r.cached_length for r in finished if r.rid in ("b0", "b1")]
    assert min(deep) > 300, deep
    _assert_exact(model, finished)
    b.manager.check_invariants()


def test_the_hit_is_inserted_into_the_local_tree_and_not_fetched_twice(model: HybridModel) -> None:
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(1)
    _publish(a, prompts)
    _serve(b, prompts, "b")
    first = b.manager.metrics().shared_hits
    _serve(b, prompts, "again")
    assert first == 1 and b.manager.metrics().shared_hits == 1  # the second hit is local
    assert b.manager.metrics().hits == 2


def _corrupt(store: MemoryStore, how: Callable[[bytes], bytes]) -> int:
    n = 0
    for k, blob in list(store.blobs.items()):
        store.blobs[k] = how(blob)
        n += 1
    return n


def _flip_state_byte(blob: bytes) -> bytes:
    hl = int.from_bytes(blob[len(BLOB_MAGIC) : len(BLOB_MAGIC) + 4], "little")
    at = len(BLOB_MAGIC) + 4 + hl + 37  # inside the conv state
    return blob[:at] + bytes([blob[at] ^ 0x10]) + blob[at + 1 :]


def _with_header(blob: bytes, **changes: object) -> bytes:
    n = len(BLOB_MAGIC)
    hl = int.from_bytes(blob[n : n + 4], "little")
    header = json.loads(blob[n + 4 : n + 4 + hl])
    header.update(changes)
    h = json.dumps(header, sort_keys=True).encode()
    return BLOB_MAGIC + len(h).to_bytes(4, "little") + h + blob[n + 4 + hl :]


def _regions(blob: bytes) -> tuple[int, int, int]:
    """Where a blob's state starts, its KV starts and its KV ends (read from its header)."""
    n = len(BLOB_MAGIC)
    hl = int.from_bytes(blob[n : n + 4], "little")
    header = json.loads(blob[n + 4 : n + 4 + hl])
    state = n + 4 + hl
    return state, state + int(header["state_bytes"]), state + int(header["state_bytes"]) + int(header["kv_bytes"])


def _flip_kv_byte(blob: bytes) -> bytes:
    _, kv, end = _regions(blob)
    at = (kv + end) // 2
    return blob[:at] + bytes([blob[at] ^ 0x10]) + blob[at + 1 :]


def _words_cancelling(blob: bytes) -> bytes:
    """+2**40 in the state's first 8-byte word, -2**40 in its second: one block's sum unchanged."""
    at, _, _ = _regions(blob)
    w0, w1 = (int.from_bytes(blob[at + 8 * i : at + 8 * i + 8], "little") for i in (0, 1))
    words = ((w0 + 2**40) % 2**64).to_bytes(8, "little") + ((w1 - 2**40) % 2**64).to_bytes(8, "little")
    return blob[:at] + words + blob[at + 16 :]


def _words_swapped(blob: bytes) -> bytes:
    """The state's first two 8-byte words swapped (inside one fingerprint block)."""
    at, _, _ = _regions(blob)
    return blob[:at] + blob[at + 8 : at + 16] + blob[at : at + 8] + blob[at + 16 :]


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        (_flip_state_byte, "digest"),
        (_flip_kv_byte, "digest"),  # the KV region: covered by no check before the digest
        (_words_cancelling, "digest"),  # passes the fingerprint's block sums
        (_words_swapped, "digest"),  # likewise
        (lambda b: b[: len(b) // 2], "length"),  # truncated inside the state
        (lambda b: b[:10], "format"),  # truncated inside the header
        (lambda b: _with_header(b, identity="model=other|layout=StateLayout(...)|kv=x"), "layout"),
        (lambda b: _with_header(b, kv_bytes=7), "length"),
    ],
    ids=[
        "flipped-state-byte",
        "flipped-kv-byte",
        "cancelling-words",
        "swapped-words",
        "truncated-body",
        "truncated-header",
        "another-layout",
        "lying-header",
    ],
)
def test_a_bad_blob_is_a_miss_and_a_forensics_finding_never_a_restore(
    model: HybridModel, tmp_path: Path, how: Callable[[bytes], bytes], reason: str
) -> None:
    store = MemoryStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    b = ReferenceEngine(model, shared_store=store, publisher="B", forensics_ledger=str(tmp_path / "b.jsonl"))
    prompts = _prompts(2)
    _publish(a, prompts)
    n = _corrupt(store, how)
    assert n > 0
    finished = _serve(b, prompts, "b")
    _assert_exact(model, finished)  # served from B's own computation
    m = b.manager.metrics()
    assert m.shared_hits == 0 and m.shared_rejected >= 1
    assert b.shared is not None and set(b.shared.stats.rejected) == {reason}
    fx = b.forensics
    assert fx is not None
    kinds = {f.kind for f in fx.findings}
    assert kinds == {f"shared-{reason}"}
    assert len(fx.findings) == m.shared_rejected  # every refusal is a finding
    assert all(f.donor == ("A" if reason != "format" else "?") for f in fx.findings)
    ledger = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == f"shared-{reason}" for e in ledger)
    text = format_forensics(analyze(tmp_path / "b.jsonl"))  # the report reads a refusal as a finding
    assert f"snapshot shared-{reason}" in text
    assert ("found unknown" in text) is (reason != "fingerprint"), "a blob refused unread has no fingerprint"
    # the refused blobs were deleted from the store, so a healthy replica can publish them again
    assert b.manager.publish_pending(wait=True) >= 0
    b.manager.check_invariants()
    b.close()  # its ledger's file


def _watched_publisher(model: HybridModel, store: MemoryStore, tmp_path: Path, background: bool) -> ReferenceEngine:
    """A reference engine publishing to ``store``, forensics watching every donation."""
    return ReferenceEngine(
        model,
        shared_store=store,
        publisher="A",
        shared_background=background,
        forensics_ledger=str(tmp_path / "a.jsonl"),
    )


def _change_every_snapshot(mgr: CacheManager) -> int:
    """Write into every snapshot the tree holds, behind its back; how many were changed."""
    changed = 0
    for node in mgr.cache.iter_nodes():
        if node.snapshot is not None:
            mgr.pool.recurrent[:, node.snapshot] += 1.0
            changed += 1
    return changed


@pytest.mark.parametrize("background", [False, True])
def test_a_snapshot_changed_after_its_donation_is_never_published(
    model: HybridModel, tmp_path: Path, background: bool
) -> None:
    """A watched snapshot written behind the tree's back after its donation fingerprint was
    taken: until 2026-12-07 it was published with a fingerprint of the changed bytes, which every
    replica's checks then passed (found by tests/test_corruption_stateful.py). The manager now
    hands the tier each watched snapshot's donation fingerprint: the tier compares the fingerprint
    it takes of its copy (on the writer thread with a background tier), stores nothing that
    differs, and forensics records a finding."""
    store = MemoryStore()
    a = _watched_publisher(model, store, tmp_path, background)
    prompts = _prompts(1)
    _serve(a, prompts, "a")  # one request: its donations wait in the queue for the next admission
    fx, mgr = a.forensics, a.manager
    assert fx is not None and fx.settle() == 0 and mgr.metrics().shared_published == 0
    changed = _change_every_snapshot(mgr)
    # refused on the writer thread (background) or at once (inline): none stored either way,
    # and none counted (a background tier's were counted as handed to the writer until 2026-12-08)
    assert changed and mgr.publish_pending(wait=True) == 0
    assert mgr.metrics().shared_published == 0 and a.shared is not None
    assert a.shared.stats.publish_changed == changed and a.shared.stats.publish_skipped == 0
    assert [f.kind for f in fx.findings] == ["changed"] * changed
    assert all(fx.flagged(node.id) for node in mgr.cache.iter_nodes() if node.snapshot is not None)
    b = ReferenceEngine(model, shared_store=store, publisher="B")
    finished = _serve(b, prompts, "b")
    _assert_exact(model, finished)
    assert b.manager.metrics().shared_hits == 0
    a.close()


@pytest.mark.parametrize("background", [False, True])
def test_in_raise_mode_a_refused_publication_raises_once_and_serving_goes_on(
    model: HybridModel, tmp_path: Path, background: bool
) -> None:
    """Forensics in ``"raise"`` mode (its default): the checks of publications the tier refused
    for their fingerprint raise :class:`SnapshotCorruption` at the manager call that hears of them
    (here ``publish_pending(wait=True)``; else the next admission, before it changes anything),
    every one recorded first; the next call does not raise again, and the changed snapshots are
    neither published nor served."""
    store = MemoryStore()
    a = _watched_publisher(model, store, tmp_path, background)
    prompts = _prompts(1)
    _serve(a, prompts, "a")
    fx, mgr = a.forensics, a.manager
    assert fx is not None and fx.settle() == 0 and a.shared is not None
    fx.mode = "raise"
    changed = _change_every_snapshot(mgr)
    with pytest.raises(SnapshotCorruption):
        mgr.publish_pending(wait=True)
    assert changed and [f.kind for f in fx.findings] == ["changed"] * changed  # all recorded, one raised
    assert mgr.publish_pending(wait=True) == 0 and not a.shared.has_checks  # heard once
    assert mgr.metrics().shared_published == 0 and a.shared.stats.publish_changed == changed
    mgr.check_invariants()
    finished = _serve(a, prompts, "again")  # no admission raises: the findings were heard
    _assert_exact(model, finished)
    assert mgr.metrics().refused_hits >= 1 and len(fx.findings) == changed
    a.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_watched_publication_is_verified_without_a_second_read_on_the_scheduler_thread(
    model: HybridModel, tmp_path: Path, background: bool
) -> None:
    """The check above costs the publishing thread no read of its own: the tier fingerprints what
    it publishes anyway (the writer thread, with a background tier; inline, the slot, once per
    blob), so the manager hands it the donation's fingerprint instead of fingerprinting the slot
    itself first (it did until 2026-12-07: two reads inline, one with a background tier)."""
    store = MemoryStore()
    a = _watched_publisher(model, store, tmp_path, background)
    _serve(a, _prompts(1), "a")
    fx, mgr = a.forensics, a.manager
    assert fx is not None and fx.settle() == 0 and a.shared is not None
    caller, reads = threading.get_ident(), []
    fingerprint = mgr.pool.fingerprint

    def counted(slot: int) -> int:
        if threading.get_ident() == caller:
            reads.append(slot)
        return fingerprint(slot)

    mgr.pool.fingerprint = counted  # type: ignore[method-assign]
    published = mgr.publish_pending(wait=True)
    assert published == mgr.metrics().shared_published >= 1
    assert len(reads) == (0 if background else published) and len(set(reads)) == len(reads)
    assert not fx.findings and a.shared.stats.publish_changed == 0
    mgr.check_invariants()
    a.close()


def test_fetch_shared_asks_the_store_past_a_local_snapshot_a_finding_names(model: HybridModel, tmp_path: Path) -> None:
    """Until 2026-12-07 ``fetch_shared`` took the tree's match as it was: a local snapshot a
    finding named was the match (so the store was asked only past it) and was returned. It now
    goes past it as ``lookup`` does, and the store's clean copy of that prefix replaces it."""
    store = MemoryStore()
    a = _watched_publisher(model, store, tmp_path, background=False)
    b = ReferenceEngine(model, shared_store=store, publisher="B", forensics_ledger=str(tmp_path / "b.jsonl"))
    prompts = _prompts(1)
    _publish(a, prompts)
    _serve(b, prompts, "b")  # b's hit comes from the store: its deepest snapshot is a's state
    mgr, fx = b.manager, b.forensics
    assert fx is not None
    ids = prompts[0]
    deep = mgr.lookup(ids, touch=False, kv=False).node
    assert deep.snapshot is not None and deep.depth > 0
    mgr.pool.recurrent[:, deep.snapshot] += 1.0
    assert mgr.verify_all() > 0 and fx.flagged(deep.id)
    fetched = mgr.metrics().shared_hits
    m = mgr.fetch_shared(ids)
    assert m.cached_length == deep.depth and not fx.flagged(m.node.id) and m.node.snapshot is not None
    assert mgr.metrics().shared_hits == fetched + 1 and mgr.metrics().refused_hits == 1
    theirs = a.manager.lookup(ids[: deep.depth], touch=False, kv=False).node
    assert theirs.depth == deep.depth and theirs.snapshot is not None
    assert mgr.pool.fingerprint(m.node.snapshot) == a.manager.pool.fingerprint(theirs.snapshot)
    mgr.check_invariants()
    a.close()
    b.close()


def _publish_under(store: MemoryStore, tier: SharedTier, blob: bytes, ids: Sequence[int], namespace: object) -> str:
    key = tier.key(np.asarray(ids, dtype=np.int64), namespace)
    store.blobs[key] = blob
    return key


@pytest.mark.parametrize("where", ["another-prompt", "another-namespace"])
def test_a_blob_moved_to_another_address_is_refused_by_its_digest(model: HybridModel, where: str) -> None:
    """An honest blob stored under another key (another prompt's, or the same ids in another
    namespace) has intact bytes and a matching fingerprint: only the address in its digest tells."""
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(1, seed=5)
    if where == "another-prompt":
        _publish(a, prompts)
        victim, ns = _prompts(1, seed=6)[0], None  # no prefix in common with the published one
    else:
        for i, p in enumerate(prompts[:1]):
            a.submit(EngineRequest(f"t{i}", p, 4, namespace="tenant"))
        a.run()
        a.manager.publish_pending(wait=True)
        victim, ns = prompts[0], None
    tier = _tier(b)
    moved = 0
    for blob in list(store.blobs.values()):
        depth = json.loads(blob[len(BLOB_MAGIC) + 4 : _regions(blob)[0]])["depth"]
        if depth < len(victim):
            _publish_under(store, tier, blob, victim[:depth], ns)
            store.indexes.setdefault(tier.index(ns), set()).add(depth)
            moved += 1
    assert moved > 0
    r = EngineRequest("victim", victim, 4, namespace=ns)
    b.submit(r)
    finished = b.run()
    _assert_exact(model, finished)
    assert b.manager.metrics().shared_hits == 0
    assert tier.stats.rejected.get("digest", 0) >= 1, tier.stats.rejected
    b.manager.check_invariants()


def _written_slot(layout: StateLayout) -> tuple[LinearStatePool, int]:
    """A pool of ``layout`` with one slot holding a random state."""
    pool = LinearStatePool(layout, 2)
    owner = RequestOwner("r")
    slot = pool.alloc(owner)
    conv = torch.randn(layout.num_layers, *layout.conv_shape).to(layout.conv_dtype)
    rec = torch.randn(layout.num_layers, *layout.recurrent_shape).to(layout.recurrent_dtype)
    pool.write(slot, conv, rec, owner=owner).wait()
    return pool, slot


def test_a_blob_re_signed_with_a_wrong_fingerprint_is_refused_by_the_fingerprint() -> None:
    """The digest proves the bytes are the publisher's; the fingerprint that the state is the one
    the publisher meant (an aliased slot serialises another state than it fingerprinted)."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = MemoryStore()
    tier = SharedTier(store, model="m", kv=_NoKV(), publisher="P")
    tier.bind(layout)
    pool, slot = _written_slot(layout)
    ids = np.arange(8, dtype=np.int64)
    assert tier.publish(ids, None, pool, slot, torch.zeros(8, dtype=torch.int64), None)
    (key,) = store.blobs
    blob = store.blobs[key]
    at, kv, end = _regions(blob)
    n = len(BLOB_MAGIC)
    hl = int.from_bytes(blob[n : n + 4], "little")
    header = json.loads(blob[n + 4 : n + 4 + hl])
    header["fingerprint"] ^= 1
    store.blobs[key] = bytes(encode_blob(header, blob[at:kv], blob[kv:end], key=key))  # a valid digest
    rejected: list[str] = []
    tier.on_reject = lambda rej: rejected.append(rej.reason.value)
    assert tier.fetch(np.arange(9, dtype=np.int64), None, 0) is None
    assert rejected == ["fingerprint"]


def test_a_keyed_digest_refuses_blobs_of_writers_without_the_secret() -> None:
    """A writer without the secret that plants a blob under the keyed replicas' address (key names
    are readable in the store; the header's identity is plain text, copied) fails the keyed
    digest, and the planted blob is deleted. Replicas that share the secret share blobs."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = MemoryStore()
    pool, slot = _written_slot(layout)
    ids, longer = np.arange(8, dtype=np.int64), np.arange(9, dtype=np.int64)
    tiers = {}
    for name, secret in (("keyed", b"deployment secret"), ("other", b"another secret"), ("plain", None)):
        tiers[name] = SharedTier(store, model="m", kv=_NoKV(), publisher=name, secret=secret)
        tiers[name].bind(layout)
    keyed = tiers["keyed"]
    for n, planter in enumerate(("other", "plain"), 1):
        store.blobs.clear()
        assert tiers[planter].publish(ids, None, pool, slot, torch.zeros(8, dtype=torch.int64), None)
        (blob,) = store.blobs.values()
        store.blobs[keyed.key(ids, None)] = _with_header(blob, identity=keyed.identity)
        store.add_depth(keyed.index(None), 8)
        assert keyed.fetch(longer, None, 0) is None
        assert keyed.stats.rejected.get("digest") == n
        assert keyed.key(ids, None) not in store.blobs  # deleted: a keyed replica may publish it
    store.blobs.clear()
    assert keyed.publish(ids, None, pool, slot, torch.zeros(8, dtype=torch.int64), None)
    fresh = SharedTier(store, model="m", kv=_NoKV(), publisher="keyed-2", secret=b"deployment secret")
    fresh.bind(layout)
    got = fresh.fetch(longer, None, 0)
    assert got is not None and got.depth == 8  # replicas that share the secret share blobs
    assert "deployment secret" not in fresh.identity and fresh.identity == keyed.identity
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        SharedTier(store, model="m", kv=_NoKV(), secret=b"")
    with pytest.raises(TypeError, match="secret must be bytes"):
        SharedTier(store, model="m", kv=_NoKV(), secret="text")  # type: ignore[arg-type]


@pytest.mark.parametrize("other", ["another secret", "no secret", "another blob format"])
def test_a_replica_of_another_identity_never_reads_nor_deletes_the_deployments_blobs(
    other: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica given another secret (or none), or one mid-upgrade to another blob format, reads
    and writes addresses of its own: it refuses nothing of the deployment's, so it deletes
    nothing, and the deployment's replicas go on sharing their blobs."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = MemoryStore()
    pool, slot = _written_slot(layout)
    ids, longer = np.arange(8, dtype=np.int64), np.arange(9, dtype=np.int64)
    a = SharedTier(store, model="m", kv=_NoKV(), publisher="A", secret=b"deployment secret")
    a.bind(layout)
    assert a.publish(ids, None, pool, slot, torch.zeros(8, dtype=torch.int64), None)
    published = dict(store.blobs)
    if other == "another blob format":
        import radixcache.tiers.shared as shared_mod

        monkeypatch.setattr(shared_mod, "BLOB_MAGIC", b"RCSHARE9")
    secret = {"another secret": b"rotated secret", "no secret": None}.get(other, b"deployment secret")
    b = SharedTier(store, model="m", kv=_NoKV(), publisher="B", secret=secret)
    b.bind(layout)
    assert b.fetch(longer, None, 0) is None
    assert b.stats.rejected == {} and store.blobs == published  # nothing refused, nothing deleted
    assert b.identity != a.identity
    monkeypatch.undo()
    c = SharedTier(store, model="m", kv=_NoKV(), publisher="C", secret=b"deployment secret")
    c.bind(layout)
    got = c.fetch(longer, None, 0)
    assert got is not None and got.depth == 8


def test_without_the_digest_check_a_corrupted_kv_region_would_serve_a_wrong_answer(
    model: HybridModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks above can fail: with the digest comparison skipped, a blob whose KV bytes were
    changed (the fingerprint covers the state only) is restored and the answer moves."""
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(1)
    _publish(a, prompts)
    _corrupt(store, lambda blob: _flip_kv_range(blob))
    import radixcache.tiers.shared as shared_mod

    class _Blind:
        @staticmethod
        def compare_digest(x: bytes, y: bytes) -> bool:
            return True

    monkeypatch.setattr(shared_mod, "hmac", _Blind)
    finished = _serve(b, prompts, "b")
    assert b.manager.metrics().shared_hits == 1
    _, first = generate_cold(model, prompts[0], len(finished[0].output))
    assert finished[0].first_logits is not None
    assert float((finished[0].first_logits - first).abs().max()) > 1e-6


def _flip_kv_range(blob: bytes) -> bytes:
    """Every KV byte of the blob inverted: the attention rows the hit serves are another's."""
    _, kv, end = _regions(blob)
    return blob[:kv] + bytes(x ^ 0x5A for x in blob[kv:end]) + blob[end:]


def test_no_room_for_the_kv_is_a_miss_that_changes_nothing(model: HybridModel) -> None:
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(1)
    _publish(a, prompts)
    b.kv_codec.import_kv = lambda data, num_tokens: None  # type: ignore[method-assign]
    finished = _serve(b, prompts, "b")
    _assert_exact(model, finished)
    assert b.shared is not None and b.shared.stats.no_room == 1 and b.manager.metrics().shared_hits == 0
    b.manager.check_invariants()


class _DownStore(MemoryStore):
    """A store whose every call fails while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.is_down = False
        self.calls = 0

    def _gate(self) -> None:
        self.calls += 1
        if self.is_down:
            raise SharedStoreError("store down (test)")

    def get(self, key: str) -> bytes | None:
        self._gate()
        return super().get(key)

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        self._gate()
        return super().put(key, blob)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._gate()
        return super().exists(keys)

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        self._gate()
        return super().depths(index, lo, hi)


def test_a_store_that_fails_is_left_alone_for_retry_s_then_asked_again() -> None:
    t = [0.0]
    store = _DownStore()
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    tier = SharedTier(store, model="m", kv=_NoKV(), retry_s=5.0, clock=lambda: t[0])
    tier.bind(layout)
    ids = np.arange(100, dtype=np.int64)
    store.is_down = True
    assert tier.fetch(ids, None, 0) is None and tier.stats.errors == 1 and tier.down
    calls = store.calls
    assert tier.fetch(ids, None, 0) is None and store.calls == calls  # not asked while down
    assert tier.stats.skipped_down == 1
    store.is_down = False
    t[0] = 5.1
    assert not tier.down
    assert tier.fetch(ids, None, 0) is None and store.calls == calls + 1  # asked again: nothing there


class _NoKV:
    identity = "none"

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> bytes:
        return b""

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        return torch.arange(num_tokens)


class _FreeKV(_NoKV):
    def __init__(self, answer: Callable[[], Any]) -> None:
        self.answer = answer

    def free_tokens(self) -> Any:
        return self.answer()


def _raise() -> int:
    raise RuntimeError("allocator gone")


@pytest.mark.parametrize(
    ("answer", "want", "errors"),
    [(lambda: 7, 7, 0), (lambda: np.int32(0), 0, 0), (_raise, None, 1), (lambda: -1, None, 1),
     (lambda: True, None, 1), (lambda: "3", None, 1)],
)  # fmt: skip
def test_what_the_codec_says_the_host_has_free_is_read_checked(
    answer: Callable[[], Any], want: int | None, errors: int
) -> None:
    """``kv_free_tokens``: the codec's ``free_tokens()`` when it answers an int >= 0; None (and a
    codec error counted, warned about) when it raises or answers anything else; None without it."""
    store = MemoryStore()
    assert SharedTier(store, model="m", kv=_NoKV()).kv_free_tokens() is None
    tier = SharedTier(store, model="m", kv=_FreeKV(answer))
    if errors:
        with pytest.warns(RuntimeWarning, match="free_tokens"):
            assert tier.kv_free_tokens() is want
    else:
        assert tier.kv_free_tokens() == want
    assert tier.stats.codec_errors == errors


def test_the_tiers_invariants_include_its_codecs() -> None:
    """A codec with ``check_invariants`` (the engines': their kept export buffers) is checked with
    the tier (so through the manager's); one without is not asked."""

    class Checked(_NoKV):
        broken = False

        def check_invariants(self) -> None:
            assert not self.broken, "the codec's rule"

    codec = Checked()
    tier = SharedTier(MemoryStore(), model="m", kv=codec)
    tier.check_invariants()
    codec.broken = True
    with pytest.raises(AssertionError, match="the codec's rule"):
        tier.check_invariants()
    SharedTier(MemoryStore(), model="m", kv=_NoKV()).check_invariants()


def test_bad_tier_arguments_raise_typed_errors() -> None:
    store = MemoryStore()
    with pytest.raises(TypeError, match="SharedStore"):
        SharedTier(object(), model="m", kv=_NoKV())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model"):
        SharedTier(store, model="", kv=_NoKV())
    with pytest.raises(ValueError, match="namespace"):
        SharedTier(store, model="m", kv=_NoKV(), namespace="a:b")
    with pytest.raises(ValueError, match="max_probes"):
        SharedTier(store, model="m", kv=_NoKV(), max_probes=0)
    with pytest.raises(TypeError, match="KVCodec"):
        SharedTier(store, model="m", kv=object())  # type: ignore[arg-type]
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 4)
    with pytest.raises(TypeError, match="SharedTier"):
        CacheManager(HybridRadixCache(pool), shared=store)  # type: ignore[arg-type]
    tier = SharedTier(store, model="m", kv=_NoKV())
    CacheManager(HybridRadixCache(pool), shared=tier)
    other = LinearStatePool(StateLayout(3, (4, 3), (2, 4, 4)), 4)
    with pytest.raises(ProtocolError, match="another manager"):
        CacheManager(HybridRadixCache(other), shared=tier)
    with pytest.raises(ProtocolError, match="another manager"):
        tier.bind(layout, client=object())
    with pytest.raises(ProtocolError, match="another layout"):
        tier.bind(other.layout)
    assert tier.layout == layout


def test_bad_background_arguments_raise_typed_errors() -> None:
    store = MemoryStore()
    with pytest.raises(TypeError, match="background"):
        SharedTier(store, model="m", kv=_NoKV(), background=1)  # type: ignore[arg-type]
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match=f"max_queued_bytes must be an int >= 1, got {bad!r}"):
            SharedTier(store, model="m", kv=_NoKV(), background=True, max_queued_bytes=bad)  # type: ignore[arg-type]


class _GatedStore(MemoryStore):
    """A store whose uploads wait for ``gate`` and then take ``delay_s`` (a slow remote store);
    the thread each upload ran on is recorded."""

    def __init__(self, delay_s: float = 0.05) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.delay_s = delay_s
        self.put_threads: list[str] = []

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        assert self.gate.wait(10), "test store: gate never opened"
        time.sleep(self.delay_s)
        self.put_threads.append(threading.current_thread().name)
        return super().put(key, blob)


class _ArrivingStore(_GatedStore):
    """A gated store that says when the first upload reached it (encoded, waiting at the gate)."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.0)
        self.arrived = threading.Event()

    def put(self, key: str, blob: bytes | memoryview) -> bool:
        self.arrived.set()
        return super().put(key, blob)


class _RecordingPool(LinearStatePool):
    """A pool that records, per :meth:`read`, the tensors it was given to copy into (None: new)."""

    def __init__(self, layout: StateLayout, capacity: int) -> None:
        super().__init__(layout, capacity)
        self.outs: list[tuple[int, int] | None] = []

    def read(
        self, slot: int, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.outs.append(None if out is None else (out[0].data_ptr(), out[1].data_ptr()))
        return super().read(slot, out=out)


@pytest.mark.parametrize("background", [False, True])
def test_publications_reuse_host_copies_only_once_encoded_and_each_blob_holds_its_own_state(
    background: bool,
) -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = _ArrivingStore()  # with background: uploads wait at the gate, the writer holds its job
    if not background:
        store.gate.set()
    tier = SharedTier(store, model="m", kv=_NoKV(), background=background)
    tier.bind(layout)
    pool = _RecordingPool(layout, 2)
    owner = RequestOwner("r")
    slot = pool.alloc(owner)
    published: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []

    def publish(i: int) -> None:
        conv = torch.randn(2, 4, 3).to(layout.conv_dtype)
        rec = torch.randn(2, 2, 4, 4).to(layout.recurrent_dtype)
        pool.write(slot, conv, rec, owner=owner).wait()
        ids = np.arange(100 * i, 100 * i + 20, dtype=np.int64)
        assert tier.publish(ids, None, pool, slot, torch.zeros(20, dtype=torch.int64), None)
        published.append((ids, conv, rec))

    publish(0)
    if background:
        assert store.arrived.wait(10), "the writer never reached the store"
    publish(1)
    publish(2)
    if background:
        # The writer encoded the first and waits at the gate with it: its copies are done with
        # and the second publication copies into them; the second's copies are queued, so the
        # third gets new ones.
        assert pool.outs[0] is None and pool.outs[1] is not None and pool.outs[2] is None, pool.outs
        store.gate.set()
        assert tier.flush(timeout_s=10)
    else:
        assert pool.outs[0] is None and pool.outs[1] is not None and pool.outs[2] == pool.outs[1]
    tier.check_invariants()
    publish(3)
    assert pool.outs[3] is not None, "a publication after the others were encoded copies into their tensors"
    assert tier.flush(timeout_s=10)
    reader = SharedTier(store, model="m", kv=_NoKV())
    reader.bind(layout)
    stage, stage_slot, _ = reader.staging
    for ids, conv, rec in published:
        got = reader.fetch(np.append(ids, 7), None, 0)
        assert got is not None and got.depth == 20, reader.stats.as_dict()
        staged = stage.read(stage_slot)
        assert torch.equal(staged[0], conv) and torch.equal(staged[1], rec)
    tier.close()
    tier.check_invariants()


def test_a_publication_that_raises_leaves_the_spare_copies_to_the_next() -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    tier = SharedTier(MemoryStore(), model="m", kv=_NoKV())
    tier.bind(layout)
    pool = _RecordingPool(layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    kv = torch.zeros(20, dtype=torch.int64)
    assert tier.publish(np.arange(20), None, pool, slot, kv, None)
    with pytest.raises(SlotMisuse):
        tier.publish(np.arange(100, 120), None, pool, 1 - slot, kv, None)  # a free slot
    assert pool.outs[1] is not None, "the spare was offered to the failing read"
    tier.check_invariants()
    assert tier.publish(np.arange(200, 220), None, pool, slot, kv, None)
    assert pool.outs[2] == pool.outs[1], "and is still there for the next publication"


def test_the_tier_invariants_name_spare_copies_that_break_their_rules() -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    tier = SharedTier(MemoryStore(), model="m", kv=_NoKV())
    tier.bind(layout)
    pool, slot = _written_slot(layout)
    assert tier.publish(np.arange(20), None, pool, slot, torch.zeros(20, dtype=torch.int64), None)
    tier.check_invariants()
    spares = tier._spares  # the structure under test: broken by hand, one rule at a time
    assert len(spares) == 1
    kept = spares[0]
    other = (torch.zeros(2, 4, 2, dtype=layout.conv_dtype), kept[1].clone())
    fresh = (kept[0].clone(), kept[1].clone())
    for broken, word in (
        ([kept, kept], "kept twice"),
        ([other], "another layout"),
        ([kept, fresh, (fresh[0].clone(), fresh[1].clone())], "cap 2"),
    ):
        spares[:] = broken
        with pytest.raises(AssertionError, match=word):
            tier.check_invariants()
    spares[:] = [kept]
    tier.check_invariants()


def test_a_background_tier_uploads_on_its_own_thread_and_flush_waits_for_it(model: HybridModel) -> None:
    store = _GatedStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A", shared_background=True)
    b = ReferenceEngine(model, shared_store=store, publisher="B")
    prompts = _prompts(3, seed=4)
    _serve(a, prompts[:2], "a")  # serving never waits for the store: its uploads are held at the gate
    assert a.shared is not None
    a.manager.publish_pending()
    assert not store.blobs and a.shared.pending_writes > 0 and a.shared.stats.published == 0
    a.manager.check_invariants()
    store.gate.set()
    a.manager.publish_pending(wait=True)  # returns once the writer stored every blob
    assert a.shared.pending_writes == 0
    assert len(store.blobs) == a.shared.stats.published > 0
    assert set(store.put_threads) == {"radixcache-shared-writer"}
    finished = _serve(b, prompts, "b")
    assert b.manager.metrics().shared_foreign_hits >= 2
    _assert_exact(model, finished)
    assert a.shared.close() and a.shared.pending_writes == 0
    a.manager.check_invariants()


def test_a_background_writer_drops_what_passes_its_byte_cap_and_what_comes_after_close() -> None:
    store = _GatedStore(delay_s=0.0)
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 4)
    slot = pool.alloc(RequestOwner("r"))
    tier = SharedTier(store, model="m", kv=_NoKV(), background=True, max_queued_bytes=1)
    tier.bind(layout)
    one = tier.publish(np.arange(10), None, pool, slot, torch.arange(10), None)
    assert not one and tier.stats.publish_skipped == 1 and tier.pending_writes == 0  # a blob > 1 byte
    tier = SharedTier(store, model="m", kv=_NoKV(), background=True)
    tier.bind(layout)
    assert tier.publish(np.arange(10), None, pool, slot, torch.arange(10), None)
    assert tier.pending_writes == 1
    store.gate.set()
    assert tier.close(timeout_s=10) and len(store.blobs) == 1 and tier.stats.published == 1
    assert not tier.publish(np.arange(11), None, pool, slot, torch.arange(11), None)
    assert tier.stats.publish_skipped == 1 and len(store.blobs) == 1
    tier.check_invariants()


def test_a_background_upload_that_fails_marks_the_store_down_and_serving_goes_on(model: HybridModel) -> None:
    store = _DownStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A", shared_background=True)
    store.is_down = True
    prompts = _prompts(3, seed=5)
    finished = _serve(a, prompts, "a")
    a.manager.publish_pending(wait=True)
    assert a.shared is not None and a.shared.stats.errors >= 1 and a.shared.stats.published == 0
    _assert_exact(model, finished)
    a.manager.check_invariants()


def _tier_state(tier: SharedTier, store: MemoryStore, pool: LinearStatePool) -> tuple[object, ...]:
    return (
        json.dumps(tier.stats.as_dict(), sort_keys=True),
        sorted(store.blobs),
        sorted((k, sorted(v)) for k, v in store.indexes.items()),
        tier.down,
        tier.pending_writes,
        [pool.owner_of(i) for i in range(pool.capacity)],
        pool.fingerprint(0),
    )


@pytest.mark.parametrize("background", [False, True])
def test_bad_publish_fetch_and_flush_arguments_raise_typed_errors_and_change_nothing(background: bool) -> None:
    store = MemoryStore()
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    tier = SharedTier(store, model="m", kv=_NoKV(), background=background)
    with pytest.raises(ProtocolError, match=r"SharedTier\.publish before bind"):
        tier.publish(np.arange(3), None, pool, slot, torch.arange(3), None)
    unbound: list[tuple[str, Callable[[], object]]] = [
        ("fetch", lambda: tier.fetch(np.arange(3), None, 0)),
        ("take", lambda: tier.take("r", np.arange(3), None, 0)),
        ("prefetch", lambda: tier.prefetch("r", np.arange(3), None, 0)),
    ]
    for name, early in unbound:
        with pytest.raises(ProtocolError, match=rf"SharedTier\.{name} before bind"):
            early()
    assert not tier.prefetching and tier.layout is None
    tier.bind(layout)
    ids, kv = np.arange(6), torch.arange(6)
    assert tier.publish(ids, None, pool, slot, kv, None)
    tier.flush()

    def w(v: object) -> Any:
        """A deliberately wrong argument (typed Any so the call type-checks)."""
        return v

    def pub(ids: Any, ns: Any = None, p: Any = pool, k: Any = None, after: Any = None) -> object:
        return tier.publish(ids, ns, p, slot, torch.arange(len(ids)) if k is None else k, after)

    bad: list[tuple[type[BaseException], str, Callable[[], object]]] = [
        (TypeError, "ids must be an integer numpy array, got str", lambda: pub("abc")),
        (TypeError, "ids must be an integer numpy array, got list", lambda: tier.fetch(w([1, 2]), None, 0)),
        (TypeError, "array of float64", lambda: pub(np.arange(6.0) + 0.5)),
        (ValueError, r"ids must be 1-D, got shape \(2, 3\)", lambda: tier.fetch(np.zeros((2, 3), dtype=int), None, 0)),
        (TypeError, "pool must be a LinearStatePool, got object", lambda: pub(np.arange(7), p=object())),
        (TypeError, "integer tensor, got Tensor of torch.float32", lambda: pub(np.arange(7), k=torch.zeros(7))),
        (ValueError, r"one index per id: shape \(3,\) for 7 ids", lambda: pub(np.arange(7), k=torch.arange(3))),
        (TypeError, "kv_after must be a Fence or None, got str", lambda: pub(np.arange(7), after="x")),
        (
            TypeError,
            "expect must be an int fingerprint or None, got str",
            lambda: tier.publish(np.arange(7), None, pool, slot, torch.arange(7), None, expect=w("1")),
        ),
        (
            TypeError,
            "expect must be an int fingerprint or None, got bool",
            lambda: tier.publish(np.arange(7), None, pool, slot, torch.arange(7), None, expect=w(True)),
        ),
        (
            TypeError,
            "token must be hashable, got list",
            lambda: tier.publish(np.arange(7), None, pool, slot, torch.arange(7), None, expect=1, token=w([1])),
        ),
        (TypeError, "namespaces that are None, str, int or bytes", lambda: pub(np.arange(7), ns=[1])),
        (TypeError, "namespaces that are None, str, int or bytes", lambda: tier.fetch(np.arange(9), w([1]), 0)),
        (ValueError, "local must be >= 0, got -1", lambda: tier.fetch(np.arange(9), None, -1)),
        (ValueError, "local match 10 is longer than the request's 9 ids", lambda: tier.fetch(np.arange(9), None, 10)),
        (TypeError, "local must be an int, got 1.5", lambda: tier.fetch(np.arange(9), None, w(1.5))),
        (ValueError, "page must be >= 1, got 0", lambda: tier.fetch(np.arange(9), None, 0, page=0)),
        (ValueError, "timeout_s must be None or a number >= 0, got -1", lambda: tier.flush(-1)),
        (ValueError, "timeout_s must be None or a number >= 0, got nan", lambda: tier.close(float("nan"))),
    ]
    for err, msg, call in bad:
        before = _tier_state(tier, store, pool)
        with pytest.raises(err, match=msg):
            call()
        tier.flush()
        assert _tier_state(tier, store, pool) == before, msg
        tier.check_invariants()
        pool.check_invariants()
    got = tier.fetch(np.arange(9), None, 0)  # still serves: the good blob at depth 6
    assert got is not None and got.depth == 6
    assert tier.close()


@pytest.mark.parametrize("background", [False, True])
def test_a_copy_without_the_expected_fingerprint_is_not_stored_and_its_check_says_so(background: bool) -> None:
    """``publish(expect=)``: the tier compares the fingerprint it takes of its copy (on the writer
    thread with ``background``) with the one the publisher expected; a copy that differs is not
    stored, and each comparison comes back once from ``checks()`` with its token."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = MemoryStore()
    pool, slot = _written_slot(layout)
    tier = SharedTier(store, model="m", kv=_NoKV(), background=background)
    tier.bind(layout)
    fp = pool.fingerprint(slot)
    assert not tier.has_checks and tier.checks() == []
    assert tier.publish(np.arange(5), None, pool, slot, torch.arange(5), None)  # no expect: no check
    assert tier.publish(np.arange(6), None, pool, slot, torch.arange(6), None, expect=fp, token="good")
    bad = tier.publish(np.arange(7), None, pool, slot, torch.arange(7), None, expect=fp ^ 1, token=("bad", 7))
    assert bad is background  # inline: known at once (nothing stored); background: the writer knows
    tier.flush()
    assert tier.has_checks
    got = tier.checks()
    assert [(c.token, c.depth, c.expected, c.found, c.ok) for c in got] == [
        ("good", 6, fp, fp, True),
        (("bad", 7), 7, fp ^ 1, fp, False),
    ]
    assert not tier.has_checks and tier.checks() == []  # each comes back once
    assert tier.stats.publish_changed == 1 and tier.stats.published == 2 and len(store.blobs) == 2
    got_back = tier.fetch(np.arange(9), None, 0)
    assert got_back is not None and got_back.depth == 6  # never the refused 7
    # the refused prefix is not remembered as published: a clean copy of it is stored later
    assert tier.publish(np.arange(7), None, pool, slot, torch.arange(7), None, expect=fp, token="again")
    assert not tier.publish(np.arange(6), None, pool, slot, torch.arange(6), None, expect=fp)  # stored once
    tier.flush()
    assert [(c.token, c.ok) for c in tier.checks()] == [("again", True)]
    assert tier.stats.published == 3 and len(store.blobs) == 3
    got_back = tier.fetch(np.arange(9), None, 0)
    assert got_back is not None and got_back.depth == 7
    tier.check_invariants()
    assert tier.close()


_EXIT_SCRIPT = """
import sys, time
import numpy as np, torch
from linear_state import LinearStatePool, RequestOwner, StateLayout
from radixcache.tiers.shared import SharedTier
from radixcache.tiers.store import MemoryStore

class Slow(MemoryStore):
    def put(self, key, blob):
        time.sleep(0.1)
        stored = super().put(key, blob)
        print("stored", flush=True)
        return stored

class NoKV:
    identity = "none"
    def export_kv(self, kv_indices, after):
        return b""
    def import_kv(self, data, num_tokens):
        return None

layout = StateLayout(2, (4, 3), (2, 4, 4))
tier = SharedTier(Slow(), model="m", kv=NoKV(), background=True, exit_flush_s=float(sys.argv[1]))
tier.bind(layout)
pool = LinearStatePool(layout, 1)
slot = pool.alloc(RequestOwner("r"))
for i in range(8):
    assert tier.publish(np.arange(4 * i, 4 * i + 4), None, pool, slot, torch.arange(4), None)
print("queued", tier.pending_writes, flush=True)
"""


@pytest.mark.parametrize("exit_flush_s", [5.0, 0.0])
def test_a_process_that_exits_without_close_stores_its_queued_uploads_first(exit_flush_s: float) -> None:
    """Until 2026-12-07 the writer's queue was dropped at exit: a replica that exited without
    ``close()`` took its last publications with it. It now stores them for up to
    ``exit_flush_s`` (0: dropped at once, the one in flight finishing)."""
    done = run_exiting(_EXIT_SCRIPT, str(exit_flush_s))  # the writer ended by the tier's own exit hook
    lines = done.stdout.split()
    queued = int(lines[lines.index("queued") + 1])
    assert queued >= 6, done.stdout  # the script published faster than the store takes them
    stored = lines.count("stored")
    assert stored == 8 if exit_flush_s else stored < 8, done.stdout


def test_exit_flush_s_must_be_finite_seconds() -> None:
    for bad in (-1.0, math.inf, math.nan, "5", True):
        with pytest.raises(ValueError, match="exit_flush_s must be a finite number of seconds >= 0"):
            SharedTier(MemoryStore(), model="m", kv=_NoKV(), background=True, exit_flush_s=bad)  # type: ignore[arg-type]


def _probe_tier(store: SharedStore) -> tuple[SharedTier, LinearStatePool, int]:
    """A tier over ``store`` bound to a small layout, and a pool with one request slot to publish."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    tier = SharedTier(store, model="m", kv=_NoKV())
    tier.bind(layout)
    return tier, pool, slot


def test_a_published_prefix_is_found_behind_many_deeper_depths_of_other_prompts() -> None:
    store = MemoryStore()
    tier, pool, slot = _probe_tier(store)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 1000, 100)
    assert tier.publish(prefix, None, pool, slot, torch.arange(100), None)
    for d in range(101, 1101):  # other prompts published deeper in the same namespace
        assert tier.publish(rng.integers(1000, 2000, d), None, pool, slot, torch.arange(d), None)
    request = np.concatenate([prefix, rng.integers(0, 1000, 1050)])
    got = tier.fetch(request, None, 0)
    assert got is not None and got.depth == 100
    assert tier.fetch(request, None, 100) is None  # nothing deeper than the local match
    # the keys a probe computes in one pass are the keys publish used
    depths = [1, 50, 100, 1150]
    assert tier._keys(request, None, depths) == [tier.key(request[:d], None) for d in depths]


class _IndexKV:
    """A KV codec whose bytes are the indices themselves (int64): what a fetch hands back is
    checkable."""

    identity = "index-kv"

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> bytes:
        return kv_indices.to(torch.int64).numpy().tobytes()

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        return torch.frombuffer(bytearray(data), dtype=torch.int64)


class _ReusingKV(_IndexKV):
    """An index codec that records what the tier hands back through ``reuse_kv``."""

    def __init__(self, fail: bool = False) -> None:
        self.exported: list[bytes | memoryview] = []
        self.reused: list[bytes | memoryview] = []
        self.fail = fail

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> bytes:
        got = super().export_kv(kv_indices, after)
        self.exported.append(got)
        return got

    def reuse_kv(self, kv: bytes | memoryview) -> None:
        if self.fail:
            raise RuntimeError("reuse_kv raised on purpose")
        self.reused.append(kv)


@pytest.mark.parametrize("background", [False, True])
def test_the_tier_hands_each_exported_kv_back_once_encoded_or_dropped(background: bool) -> None:
    store = MemoryStore()
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    codec = _ReusingKV()
    tier = SharedTier(store, model="m", kv=codec, background=background)
    tier.bind(layout)
    for n in (10, 20):
        assert tier.publish(np.arange(n), None, pool, slot, torch.arange(n), None)
    assert tier.flush(10.0)
    assert len(codec.exported) == 2 and [id(k) for k in codec.reused] == [id(k) for k in codec.exported]
    assert tier.fetch(np.arange(30), None, 0) is not None  # what was encoded before the hand-back is served
    if background:  # a publication the writer cannot take: its KV handed back at once
        tier.max_queued_bytes = 0
        assert not tier.publish(np.arange(5), None, pool, slot, torch.arange(5), None)
        assert codec.reused[-1] is codec.exported[-1] and len(codec.reused) == 3
    tier.close()
    # a codec whose reuse_kv raises: counted as a codec error, the blob still stored
    failing = _ReusingKV(fail=True)
    other = SharedTier(MemoryStore(), model="m", kv=failing, background=background)
    other.bind(layout)
    with pytest.warns(RuntimeWarning, match="reuse_kv"):
        assert other.publish(np.arange(10), None, pool, slot, torch.arange(10), None)
        assert other.flush(10.0)
    assert other.stats.codec_errors == 1 and other.stats.published == 1
    other.close()
    tier.check_invariants()
    other.check_invariants()


def test_a_fetched_blobs_kv_is_a_view_of_the_stores_reply_not_a_copy() -> None:
    store = MemoryStore()
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    tier = SharedTier(store, model="m", kv=_IndexKV())
    tier.bind(layout)
    ids, kv = np.arange(40), torch.arange(100, 140)
    assert tier.publish(ids, None, pool, slot, kv, None)
    request = np.arange(50)
    got = tier.fetch(request, None, 0)
    assert got is not None and got.depth == 40
    assert isinstance(got.kv, memoryview) and got.kv.readonly
    assert got.kv.obj is store.blobs[tier.key(ids, None)], "a view of the blob the store answered"
    assert bytes(got.kv) == kv.numpy().tobytes()
    back = tier.kv.import_kv(got.kv, 40)  # the codec reads it as it read bytes
    assert back is not None and torch.equal(back, kv)
    assert tier.prefetch("r", request, None, 0)
    deadline = time.monotonic() + 10
    while tier.prefetch_pending("r") and time.monotonic() < deadline:
        time.sleep(0.001)
    taken, pre = tier.take("r", request, None, 0)
    assert taken and pre is not None and isinstance(pre.kv, memoryview) and bytes(pre.kv) == bytes(got.kv)
    tier.close()
    tier.check_invariants()


def test_a_blob_encoded_from_tensors_is_the_blob_of_their_bytes_and_stays_as_encoded() -> None:
    from radixcache.tiers.blob import bytes_tensor, parse_blob

    conv = torch.randn(2, 4, 3).to(torch.bfloat16)
    rec = torch.randn(2, 6, 4).transpose(1, 2)  # not contiguous
    kv = np.arange(10, dtype=np.float32)  # a codec's buffer of another item size
    header: dict[str, object] = {"state_bytes": conv.nbytes + rec.nbytes, "kv_bytes": kv.nbytes}
    state = (
        conv.reshape(-1).view(torch.uint8).numpy().tobytes()
        + rec.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    )
    blob = encode_blob(header, (conv, rec), kv.data, key="k")
    assert isinstance(blob, memoryview) and blob.readonly
    assert bytes(blob) == bytes(encode_blob(header, state, kv.tobytes(), key="k"))
    assert len(blob) == len(bytes(blob)) > conv.nbytes + rec.nbytes + kv.nbytes
    with pytest.raises(TypeError):
        blob[0] = 0
    conv.zero_()  # the blob holds its own bytes: the tensors it came from may change
    parsed = parse_blob(blob)
    assert parsed is not None
    got, body = parsed
    assert got == header
    conv_n = 2 * 4 * 3 * 2
    back = bytes_tensor(body[:conv_n], torch.bfloat16, (2, 4, 3))
    assert back.reshape(-1).view(torch.uint8).numpy().tobytes() == state[:conv_n]
    rec_back = bytes_tensor(body[conv_n : conv_n + rec.nbytes], rec.dtype, (2, 4, 6))
    assert torch.equal(rec_back, rec)
    rec_back.add_(1)  # a copy of its own: writable, and the blob unchanged
    assert torch.equal(bytes_tensor(body[conv_n : conv_n + rec.nbytes], rec.dtype, (2, 4, 6)), rec)
    assert bytes_tensor(b"", torch.float32, (0, 3)).shape == (0, 3)
    with pytest.raises(TypeError, match="on the CPU"):
        encode_blob(header, (conv, torch.empty(3, device="meta")), b"", key="k")


class _FloatKV:
    """A KV codec exporting a float32 view (``len`` counts items, not bytes)."""

    identity = "float-kv"

    def export_kv(self, kv_indices: torch.Tensor, after: object) -> memoryview:
        return kv_indices.to(torch.float32).numpy().data

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        return torch.from_numpy(np.frombuffer(bytes(data), dtype=np.float32).astype(np.int64))


@pytest.mark.parametrize("background", [False, True])
def test_a_kv_export_of_wider_items_is_published_and_fetched_whole(background: bool) -> None:
    store = MemoryStore()
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool, slot = _written_slot(layout)
    tier = SharedTier(store, model="m", kv=_FloatKV(), background=background)
    tier.bind(layout)
    ids, kv = np.arange(40), torch.arange(100, 140)
    assert tier.publish(ids, None, pool, slot, kv, None)
    assert tier.flush(timeout_s=10)
    got = tier.fetch(np.arange(50), None, 0)
    assert got is not None and got.depth == 40, tier.stats.as_dict()
    assert memoryview(got.kv).nbytes == 160
    back = tier.kv.import_kv(got.kv, 40)
    assert back is not None and torch.equal(back, kv)
    assert got.state is None
    stage, stage_slot, _ = tier.staging
    conv, rec = pool.read(slot)
    assert tuple(x.tolist() for x in stage.read(stage_slot)) == (conv.tolist(), rec.tolist())
    tier.close()
    tier.check_invariants()


class _CountingStore(MemoryStore):
    """A memory store that records how many keys each existence check asked about (and, having no
    ``deepest``, answers a probe's batches from one ``depths`` call: counted too)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []
        self.ranges = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.asked.append(len(keys))
        return super().exists(keys)

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        self.ranges += 1
        return super().depths(index, lo, hi)


class _CountingRedisStore(RedisStore):
    """A Redis store that records the keys asked per existence check and the depths each
    ``deepest`` call answered with."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.asked: list[int] = []
        self.answered: list[int] = []

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.asked.append(len(keys))
        return super().exists(keys)

    def deepest(self, index: str, lo: int, hi: int, count: int) -> list[int]:
        out = super().deepest(index, lo, hi, count)
        self.answered.append(len(out))
        return out


_BATCHES = [
    (30, True, [31]),  # every candidate in the first round trip
    (100, True, [64, 37]),  # the prefix in the second batch, the rest never hashed
    (1100, False, [64, 128, 256, 512, 64]),  # a miss: max_probes (1,024) in 5 round trips
]


def _probe_batches(store: _CountingStore | _CountingRedisStore, deeper: int, real: bool) -> None:
    """Publish a 100-token prefix (``real``) behind ``deeper`` depths of other prompts, then fetch a
    request that extends it: the prefix found (or not)."""
    tier, pool, slot = _probe_tier(store)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 1000, 100)
    if real:
        assert tier.publish(prefix, None, pool, slot, torch.arange(100), None)
    for d in range(101, 101 + deeper):  # other prompts published deeper in the same namespace
        store.add_depth(tier.index(None), d)
    request = np.concatenate([prefix, rng.integers(0, 1000, deeper + 10)])
    store.asked.clear()
    got = tier.fetch(request, None, 0)
    assert (got is not None and got.depth == 100) if real else got is None


@pytest.mark.parametrize(("deeper", "real", "asked"), _BATCHES)
def test_a_probe_checks_the_deepest_candidates_first_in_doubling_batches(
    deeper: int, real: bool, asked: list[int]
) -> None:
    store = _CountingStore()
    _probe_batches(store, deeper, real)
    assert store.asked == asked
    assert store.ranges == 1, "a store without deepest(): its depth range read once per probe"


@pytest.mark.parametrize(("deeper", "real", "asked"), _BATCHES)
def test_a_probe_on_redis_reads_only_the_batches_it_checks(
    deeper: int, real: bool, asked: list[int], redis_server: RedisServer
) -> None:
    store = _CountingRedisStore(redis_server.url)
    _probe_batches(store, deeper, real)
    assert store.asked == asked
    assert store.answered == asked  # what the server sent: each batch checked, never the whole range
    store.close()


def test_redis_reads_a_large_blob_in_ranges_whole_and_a_blob_removed_meanwhile_as_absent(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    store = RedisStore(redis_server.url, read_chunk=4096)
    rng = np.random.default_rng(0)
    for size in (1, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 17):
        blob = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert store.put(f"b{size}", blob)
        got = store.get(f"b{size}")
        assert got is not None and bytes(got) == blob, size
        assert isinstance(got, bytes) if size <= 4096 else isinstance(got, memoryview) and got.readonly
    assert store.get("absent") is None
    other = redis.Redis.from_url(redis_server.url)
    execute = redis.client.Pipeline.execute
    removed: list[str] = []

    def remove_then_execute(pipe: redis.client.Pipeline, *a: object, **kw: object) -> list[object]:
        if not removed:  # after its first range and its size, before the other ranges
            removed.append("b12305")
            other.delete("b12305")
        out: list[object] = execute(pipe, *a, **kw)  # type: ignore[arg-type]
        return out

    monkeypatch.setattr(redis.client.Pipeline, "execute", remove_then_execute)
    assert store.get("b12305") is None, "a blob removed while it was read is absent, not cut"
    assert removed
    monkeypatch.undo()
    assert store.get("b12305") is None and store.get("b12288") is not None
    with pytest.raises(ValueError, match="read_chunk"):
        RedisStore(redis_server.url, read_chunk=4095)
    with pytest.raises(TypeError, match="read_chunk"):
        RedisStore(redis_server.url, read_chunk=4096.0)  # type: ignore[arg-type]
    store.close()
    other.close()


def test_redis_reads_a_blob_replaced_meanwhile_as_one_version_or_absent_never_a_mix(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blob deleted and published again (expired, evicted, refused by another replica) by a
    blob of the same size between two of the ranges that read it: a mix of the two would fail the
    tier's digest, count as a corrupted blob and have the new, valid one deleted."""
    import redis

    store = RedisStore(redis_server.url, read_chunk=4096)
    other = redis.Redis.from_url(redis_server.url)
    rng = np.random.default_rng(1)
    old, new = (rng.integers(0, 256, 3 * 4096 + 5, dtype=np.uint8).tobytes() for _ in range(2))
    execute, watch = redis.client.Pipeline.execute, redis.client.Pipeline.watch
    replaced: list[str] = []

    def replace(key: str) -> None:
        if not replaced:
            replaced.append(key)
            other.delete(key)
            other.set(key, new)

    def replace_then_execute(pipe: redis.client.Pipeline, *a: object, **kw: object) -> list[object]:
        if not pipe.watching:  # the ranges, after the first one was read
            replace("k")
        out: list[object] = execute(pipe, *a, **kw)  # type: ignore[arg-type]
        return out

    assert store.put("k", old)
    monkeypatch.setattr(redis.client.Pipeline, "execute", replace_then_execute)
    assert store.get("k") is None, "a blob replaced while its ranges were read is absent, not a mix"
    assert replaced == ["k"]
    monkeypatch.undo()
    got = store.get("k")
    assert got is not None and bytes(got) == new  # nothing deleted: the next read has the new blob whole

    def replace_then_watch(pipe: redis.client.Pipeline, *names: str) -> object:
        replace(names[0])  # after the first range, before the watch: the ranges all read the new one
        return watch(pipe, *names)  # type: ignore[no-untyped-call]

    replaced.clear()
    other.delete("k")
    assert store.put("k", old)
    monkeypatch.setattr(redis.client.Pipeline, "watch", replace_then_watch)
    got = store.get("k")
    assert replaced == ["k"] and got is not None and bytes(got) == new
    monkeypatch.undo()
    store.close()
    other.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_delete_version_removes_a_blob_only_while_it_ends_in_the_version_read(
    kind: str, request: pytest.FixtureRequest
) -> None:
    store: Any = MemoryStore() if kind == "memory" else RedisStore(request.getfixturevalue("redis_server").url)
    store.put("k", b"header" + b"A" * 32)
    assert not store.delete_version("k", b"B" * 32)  # another version there: kept
    assert not store.delete_version("k", b"")  # no version named: nothing removed
    assert not store.delete_version("absent", b"A" * 32)
    for bad in ("A" * 32, None, 7):  # a str tail: a TypeError on both stores, not a silent miss
        with pytest.raises(TypeError, match=f"tail must be bytes .*got {type(bad).__name__}"):
            store.delete_version("k", bad)
    assert store.get("k") is not None
    assert store.delete_version("k", b"A" * 32)
    assert store.get("k") is None
    store.put("short", b"xyz")  # shorter than a digest: the whole blob is its version
    assert store.delete_version("short", b"xyz") and store.get("short") is None


class _RepublishedMeanwhile(MemoryStore):
    """Hands out the stored (corrupted) blob once, then, before the tier can remove it, another
    replica's valid blob replaces it (as after another replica removed it and published again)."""

    def __init__(self, valid: dict[str, bytes]) -> None:
        super().__init__()
        self.valid = valid

    def get(self, key: str) -> bytes | None:
        got = super().get(key)
        if key in self.valid:
            self.blobs[key] = self.valid.pop(key)
        return got


@pytest.mark.parametrize("versioned", [True, False])
def test_a_refused_blob_is_removed_but_not_a_valid_one_stored_meanwhile(versioned: bool) -> None:
    """The tier removes a blob it refused only while it is the version it read: a valid blob
    another replica stored under the key in between stays (a store without ``delete_version``
    removes by key, and loses it: the race the optional method closes)."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool, slot = _written_slot(layout)
    ids, longer = np.arange(8, dtype=np.int64), np.arange(9, dtype=np.int64)
    plain = MemoryStore()
    a = SharedTier(plain, model="m", kv=_NoKV(), publisher="A")
    a.bind(layout)
    assert a.publish(ids, None, pool, slot, torch.zeros(8, dtype=torch.int64), None)
    ((key, valid),) = plain.blobs.items()
    store = _RepublishedMeanwhile({key: valid})
    if not versioned:
        store.delete_version = None  # type: ignore[assignment,method-assign]  # a store without it
    store.blobs[key] = _flip_kv_byte(valid)
    store.indexes = {k: set(v) for k, v in plain.indexes.items()}
    b = SharedTier(store, model="m", kv=_NoKV(), publisher="B")
    b.bind(layout)
    assert b.fetch(longer, None, 0) is None and b.stats.rejected == {"digest": 1}
    assert (store.blobs.get(key) == valid) is versioned
    if versioned:
        got = b.fetch(longer, None, 0)
        assert got is not None and got.depth == 8


def test_redis_deepest_answers_as_the_depths_it_cuts_from(redis_server: RedisServer) -> None:
    import redis

    store, mem = RedisStore(redis_server.url), MemoryStore()
    rng = np.random.default_rng(3)
    for d in rng.choice(np.arange(1, 400), 150, replace=False):
        store.add_depth("ix", int(d))
        mem.add_depth("ix", int(d))
    fallback = deepest_of(mem)
    assert deepest_of(store) == store.deepest  # the store's own, one round trip
    for lo, hi, count in [(0, 400, 64), (0, 400, 1000), (10, 200, 7), (200, 100, 5), (0, 400, 0), (399, 400, 3)]:
        want = sorted((d for d in mem.depths("ix", 0, 10**6) if lo < d <= hi), reverse=True)[:count]
        assert store.deepest("ix", lo, hi, count) == want == deepest_of(mem)("ix", lo, hi, count)
    # one fallback, batches of ever shallower ranges of one probe: the same answers
    assert fallback("ix", 0, 400, 10) + fallback("ix", 0, fallback("ix", 0, 400, 10)[-1] - 1, 10) == (
        store.deepest("ix", 0, 400, 20)
    )
    assert store.deepest("absent", 0, 10, 5) == []
    with pytest.raises(TypeError, match="must be a SharedStore, got int"):
        deepest_of(5)  # type: ignore[arg-type]
    r = redis.Redis.from_url(redis_server.url)
    r.zadd("bad", {"not-a-depth": 5, "7": 7})
    with pytest.raises(SharedStoreError, match="non-integer member"):
        store.deepest("bad", 0, 10, 5)
    r.close()
    store.close()


def _two_model_tiers() -> list[SharedTier]:
    """Tiers of two models ("m1", "m2") bound to one layout."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    tiers = []
    for model_id in ("m1", "m2"):
        t = SharedTier(MemoryStore(), model=model_id, kv=_NoKV())
        t.bind(layout)
        tiers.append(t)
    return tiers


def test_keys_separate_models_namespaces_and_prefixes() -> None:
    tiers = _two_model_tiers()
    ids = np.arange(64, dtype=np.int64)
    keys = {
        tiers[0].key(ids, None),
        tiers[1].key(ids, None),
        tiers[0].key(ids, "tenant"),
        tiers[0].key(ids[:63], None),
    }
    assert len(keys) == 4
    assert tiers[0].key(ids, None) == tiers[0].key(ids.copy(), None)  # content addressed


def test_depth_indexes_separate_models_and_namespaces_equal_values_of_other_types_included() -> None:
    a, b = _two_model_tiers()
    # True == 1 and hash alike in Python, but they are other names: other indexes (as their keys)
    names = [a.index(ns) for ns in (None, 1, True, "1", b"1")] + [b.index(None)]
    assert len(set(names)) == len(names), names
    assert a.index(True) == a.index(True) and a.index(1) == a.index(1)  # remembered, the same name
    with pytest.raises(TypeError, match="namespaces that are None, str, int or bytes"):
        a.index([1])  # type: ignore[arg-type]  # unhashable: the tier's own error, not the memo's


# -------------------------------------------------------------- default host tier
def test_the_host_tier_is_on_by_default_with_a_byte_budget() -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))

    def tree() -> HybridRadixCache:
        return HybridRadixCache(LinearStatePool(layout, 10))

    assert tree().host_pool is None  # the tree alone: what it is given
    mgr = CacheManager(tree())  # the manager: a host tier of 4x the device pool's bytes
    assert mgr.cache.host_pool is not None and mgr.cache.host_pool.device.type == "cpu"
    assert mgr.cache.host_pool.capacity == HOST_TIER_FACTOR * 10
    assert CacheManager(tree(), host_tier=None).cache.host_pool is None
    sized = CacheManager(tree(), host_budget_bytes=3 * layout.slot_bytes + 1).cache.host_pool
    assert sized is not None and sized.capacity == 3
    assert CacheManager(tree(), host_budget_bytes=layout.slot_bytes - 1).cache.host_pool is None
    own = LinearStatePool(layout, 2)
    assert CacheManager(HybridRadixCache(LinearStatePool(layout, 10), host_pool=own)).cache.host_pool is own
    one = auto_host_pool(LinearStatePool(layout, 10), layout.slot_bytes)
    assert one is not None and one.capacity == 1 and HybridRadixCache(LinearStatePool(layout, 10), host_pool=one)
    assert auto_host_pool(LinearStatePool(layout, 10), 0) is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="host_budget_bytes"):
            CacheManager(tree(), host_budget_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_tier"):
        CacheManager(tree(), host_tier="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host budget must be >= 0"):
        auto_host_pool(LinearStatePool(layout, 10), -1)
    with pytest.raises(TypeError, match="host_pool must be a LinearStatePool or None"):
        HybridRadixCache(LinearStatePool(layout, 10), host_pool="auto")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="already"):
        mgr.cache.attach_host_pool(LinearStatePool(layout, 2))
    mgr.check_invariants()


# -------------------------------------------------------------------- Redis
def test_replicas_share_through_a_real_redis_server(model: HybridModel, redis_server: RedisServer) -> None:
    a, b = _publisher_and_fetcher(model, RedisStore(redis_server.url))
    prompts = _prompts(3, seed=1)
    _publish(a, prompts[:2])
    finished = _serve(b, prompts, "b")
    assert b.manager.metrics().shared_foreign_hits >= 2
    _assert_exact(model, finished)


def test_background_replicas_share_through_a_real_redis_server(model: HybridModel, redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    a, b = _publisher_and_fetcher(model, store, shared_background=True)
    prompts = _prompts(3, seed=6)
    _publish(a, prompts[:2])
    finished = _serve(b, prompts, "b")
    assert b.manager.metrics().shared_foreign_hits >= 2
    _assert_exact(model, finished)
    for e in (a, b):
        assert e.shared is not None and e.shared.close(timeout_s=30)
        e.manager.check_invariants()


def test_redis_existence_checks_answer_per_key_with_and_without_server_scripts(redis_server: RedisServer) -> None:
    import redis

    store = RedisStore(redis_server.url)
    keys = [f"t:{i}" for i in range(300)]
    for k in keys[::7]:
        assert store.put(k, b"blob")
    want = [i % 7 == 0 for i in range(300)]
    assert store.exists(keys) == want  # one server-side script
    assert store._exists_script is not None

    def refuse(**kw: object) -> object:
        raise redis.ResponseError("NOSCRIPT scripting is disabled on this server (test)")

    store._exists_script = refuse  # a server that refuses scripts
    assert store.exists(keys) == want  # the per-key pipeline
    assert store._exists_script is None  # and it stays on it
    assert store.exists(keys[:3]) == want[:3] and store.exists([]) == []


def test_redis_removes_a_refused_version_on_a_server_that_refuses_scripts(redis_server: RedisServer) -> None:
    """Without scripts, ``delete_version`` removes by key (the race it closes open again) and stays
    so; before, the server's refusal came out as a SharedStoreError and the blob stayed."""
    import redis

    store = RedisStore(redis_server.url)

    def refuse(**kw: object) -> object:
        raise redis.ResponseError("NOSCRIPT scripting is disabled on this server (test)")

    store._delete_script = refuse
    store.put("k", b"header" + b"A" * 32)
    assert store.delete_version("k", b"A" * 32) and store.get("k") is None
    assert store._delete_script is None  # and it stays on delete
    store.put("k", b"header" + b"B" * 32)
    assert store.delete_version("k", b"A" * 32) and store.get("k") is None  # by key: any version
    store.close()


def test_a_replica_keeps_serving_while_redis_is_down_and_uses_it_again_when_it_returns(
    model: HybridModel, redis_server: RedisServer
) -> None:
    store = RedisStore(redis_server.url, timeout_s=0.2)
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    assert a.shared is not None
    a.shared.retry_s = 0.0  # ask again at once after a failure
    prompts = _prompts(6, seed=2)
    _serve(a, prompts[:1], "up")
    redis_server.kill()  # mid-run: the server crashes
    down = _serve(a, prompts[1:3], "down")
    _assert_exact(model, down)  # misses only, no wrong answer
    a.manager.publish_pending(wait=True)
    errors = a.manager.metrics().shared_errors
    assert errors >= 1
    a.manager.check_invariants()
    redis_server.start()  # the server returns (empty: it persisted nothing)
    _serve(a, prompts[3:4], "back")
    published = a.manager.publish_pending(wait=True)
    assert published >= 1  # reconnected by itself
    b = ReferenceEngine(model, shared_store=RedisStore(redis_server.url), publisher="B")
    finished = _serve(b, prompts[3:4], "b")
    assert b.manager.metrics().shared_foreign_hits == 1
    _assert_exact(model, finished)


def _hammer(url: str, replica: str, requests: int, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, RADIXCACHE_NO_PROGRESS="1", PYTHONWARNINGS="always::ResourceWarning")
    args = [sys.executable, "-m", "radixcache.cli", "hammer", "--json", "--no-warm", "--shared-redis", url]
    args += ["--replica", replica, "--requests", str(requests), "--concurrency", "4", "--seed", "3", *extra]
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report(p: subprocess.Popen[str]) -> dict[str, object]:
    out, err = p.communicate(timeout=900)
    assert out.strip(), err[-2000:]
    assert "ResourceWarning" not in err, err[-2000:]  # every file and connection it opened was closed
    rep = json.loads(out)
    assert isinstance(rep, dict)
    return rep


def test_two_replica_processes_share_prefixes_through_redis(redis_server: RedisServer) -> None:
    procs = [_hammer(redis_server.url, f"{i}/2", 24) for i in range(2)]
    reps = [_report(p) for p in procs]
    for rep in reps:
        assert rep["wrong_answers"] == 0 and rep["slots_leaked"] == 0 and rep["kv_leaked"] == 0, rep
        assert rep["ok"], rep
    foreign = [rep["metrics"]["shared_foreign_hits"] for rep in reps]  # type: ignore[index]
    assert sum(foreign) > 0, foreign  # hits on prefixes only the other replica computed


def test_corrupted_and_swapped_blobs_between_replicas_are_refused_and_no_answer_is_wrong(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Replica 0 publishes; then, in Redis, a quarter of its blobs get a state byte flipped, a
    quarter a KV byte flipped, and the rest are swapped pairwise between keys (another prompt's or
    another namespace's blob under each key). Replica 1 serves the other half of the same mix: no
    wrong answer, every blob it fetched refused (a counted rejection and a forensics finding, never
    a corruption of its own), nothing leaked."""
    first = _report(_hammer(redis_server.url, "0/2", 16))
    assert first["ok"], first
    import redis

    r = redis.Redis.from_url(redis_server.url)
    blobs = sorted(k for k in r.scan_iter() if b":depths:" not in k)
    assert len(blobs) >= 8, len(blobs)
    values = {k: r.get(k) for k in blobs}
    q = len(blobs) // 4
    for k in blobs[:q]:
        r.set(k, _flip_state_byte(values[k]))  # type: ignore[arg-type]
    for k in blobs[q : 2 * q]:
        r.set(k, _flip_kv_byte(values[k]))  # type: ignore[arg-type]
    rest = blobs[2 * q :]
    for a, b in zip(rest, rest[1:] + rest[:1], strict=True):  # a cycle: every key gets another's blob
        r.set(a, values[b])  # type: ignore[arg-type]
    r.close()
    ledger = tmp_path / "replica1.jsonl"
    second = _report(_hammer(redis_server.url, "1/2", 16, "--forensics", str(ledger)))
    assert second["wrong_answers"] == 0 and second["slots_leaked"] == 0 and second["kv_leaked"] == 0, second
    m = second["metrics"]
    assert isinstance(m, dict)
    assert m["shared_hits"] == 0 and m["shared_rejected"] >= 1, m
    assert second["snapshot_corruptions"] == 0 and second["ok"], second  # refusals are not this replica's fault
    assert second["shared_rejections"] == m["shared_rejected"]  # every refusal a finding
    kinds = {json.loads(line).get("kind") for line in ledger.read_text().splitlines()} - {None}
    # a swapped blob of another depth fails its header's depth first (length), the rest the digest
    assert "shared-digest" in kinds and kinds <= {"shared-digest", "shared-length"}, kinds


# -------------------------------------------------------------------- replay
def test_replay_models_the_shared_store_and_its_fetch_time() -> None:
    from radixcache.policies import make_policy
    from radixcache.simulator.replay import PRESETS, replay
    from radixcache.simulator.traces import generate

    trace = sorted(generate("chat", 0), key=lambda r: r.ts)[:300]
    preset = PRESETS["qwen3-next-80b"]
    budget = 2 * 2**30
    base = replay(trace, make_policy("hit-density"), preset, budget)
    shared = replay(trace, make_policy("hit-density"), preset, budget, shared_gbps=10.0)
    assert base.shared_hits == 0 and shared.shared_hits > 0
    assert shared.token_hit_rate > base.token_hit_rate
    assert shared.shared_hit_tokens <= shared.hit_tokens
    # each fetch moves the snapshot and the KV of its prefix at 10 GB/s
    lower = shared.shared_hits * preset.snapshot_bytes / 10e9
    upper = (shared.shared_hits * preset.snapshot_bytes + shared.shared_hit_tokens * preset.kv_bytes_per_token) / 10e9
    assert lower < shared.shared_restore_s <= upper * (1 + 1e-9)
    assert shared.shared_prefill_s_saved > 0
    with pytest.raises(ValueError, match="shared_gbps"):
        replay(trace, make_policy("hit-density"), preset, budget, shared_gbps=-1.0)


def test_a_fetched_state_is_in_the_live_slot_exactly_when_the_admissions_fence_completed() -> None:
    """The fetch's copy into the request's slot runs on the manager's stream; ``admission.ready``
    is its fence. Read raw (no pool wait): before the fence the slot is not written, after it is."""
    from linear_state import DeferredStream

    layout = StateLayout(2, (4, 3), (2, 4, 4), conv_dtype=torch.float32)
    store = MemoryStore()
    src = LinearStatePool(layout, 2)
    publisher = SharedTier(store, model="m", kv=_NoKV(), publisher="A")
    publisher.bind(layout)
    from linear_state import RequestOwner

    owner = RequestOwner("a")
    slot = src.alloc(owner)
    gen = torch.Generator().manual_seed(1)
    conv = torch.randn(2, 4, 3, generator=gen)
    rec = torch.randn(2, 2, 4, 4, generator=gen)
    src.write(slot, conv, rec, owner=owner).wait()
    ids = np.arange(100, dtype=np.int64)
    assert publisher.publish(ids[:64], None, src, slot, torch.arange(64), None)

    copies = DeferredStream("copies")
    pool = LinearStatePool(layout, 8)
    mgr = CacheManager(
        HybridRadixCache(pool, stream=copies, host_pool=None),
        shared=SharedTier(store, model="m", kv=_NoKV(), publisher="B"),
    )
    adm = mgr.admit("r", ids)
    assert isinstance(adm, Admission) and adm.cached_length == 64
    assert mgr.metrics().shared_foreign_hits == 1
    assert not adm.ready.is_complete()
    assert not torch.equal(pool.conv[:, adm.live_slot], conv)  # not written yet
    adm.ready.wait()
    assert torch.equal(pool.conv[:, adm.live_slot], conv) and torch.equal(pool.recurrent[:, adm.live_slot], rec)
    node = mgr.cache.match(ids[:64], touch=False)
    assert node.cached_length == 64 and node.snapshot_slot is not None  # the tree holds its own clone
    copies.synchronize()
    assert torch.equal(pool.conv[:, node.snapshot_slot], conv)
    mgr.abort("r")
    copies.synchronize()
    mgr.check_invariants()


def test_replicas_of_another_model_never_read_each_others_blobs(model: HybridModel) -> None:
    """A replica serving another model (here: other weights) addresses other keys: no hit, and no
    blob of the other model is even fetched (nothing refused either)."""
    store = MemoryStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    other = HybridModel(HybridConfig(seed=1))
    b = ReferenceEngine(other, shared_store=store, publisher="B")
    prompts = _prompts(2)
    _publish(a, prompts)
    finished = _serve(b, prompts, "b")
    m = b.manager.metrics()
    assert m.shared_hits == 0 and m.shared_rejected == 0
    assert b.shared is not None and a.shared is not None and b.shared.identity != a.shared.identity
    _assert_exact(other, finished)


def test_a_kv_codec_that_raises_costs_a_hit_or_a_publication_never_the_admission(model: HybridModel) -> None:
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(2)

    def boom(*args: object) -> bytes:
        raise RuntimeError("codec bug")

    a.kv_codec.export_kv = boom  # type: ignore[method-assign,assignment]
    with pytest.warns(RuntimeWarning, match="export_kv"):
        _serve(a, prompts[:1], "a")
        a.manager.publish_pending(wait=True)
    assert a.shared is not None and a.shared.stats.codec_errors >= 1 and not store.blobs
    a.kv_codec.export_kv = type(a.kv_codec).export_kv.__get__(a.kv_codec)  # type: ignore[method-assign]
    _publish(a, prompts)
    b.kv_codec.import_kv = boom  # type: ignore[method-assign,assignment]
    with pytest.warns(RuntimeWarning, match="import_kv"):
        finished = _serve(b, prompts, "b")
    _assert_exact(model, finished)
    assert b.manager.metrics().shared_hits == 0
    b.manager.check_invariants()


def test_namespaces_a_store_cannot_address_are_served_locally_only() -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = MemoryStore()
    tier = SharedTier(store, model="m", kv=_NoKV())
    mgr = CacheManager(HybridRadixCache(LinearStatePool(layout, 16)), shared=tier, track_slots=1)
    ids = list(range(1, 200))
    for ns, rid in ((("tenant", 1), "tuple"), ("tenant-1", "str")):  # hashable; only the str is addressable
        adm = mgr.admit(rid, ids, namespace=ns)
        assert isinstance(adm, Admission)
        plan = mgr.plan_prefill(rid, len(ids))
        scribble(mgr.pool, plan)
        mgr.commit(plan, None, kv_indices=torch.arange(len(ids)) + (0 if rid == "tuple" else 1000))
        mgr.finish(rid)
    mgr.publish_pending(wait=True)
    assert not tier.addressable(("tenant", 1)) and tier.addressable("tenant-1")
    assert tier.stats.published >= 1
    indexed = [k for k in store.indexes]
    assert len(indexed) == 1  # the str namespace's index only
    mgr.check_invariants()


def test_only_depths_the_tree_can_hold_are_fetched() -> None:
    """A replica with page size 1 publishes depth 70; a tree with 16-token pages cannot hold a node
    there (its insert would cut the key to 64 while the live slot holds the state after 70 tokens):
    it fetches only whole-page depths."""
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = MemoryStore()
    src = LinearStatePool(layout, 2)
    pub = SharedTier(store, model="m", kv=_NoKV(), publisher="A")
    pub.bind(layout)
    from linear_state import RequestOwner

    slot = src.alloc(RequestOwner("a"))
    ids = np.arange(1, 200, dtype=np.int64)
    for d in (70, 48):
        assert pub.publish(ids[:d], None, src, slot, torch.arange(d), None)
    mgr = CacheManager(
        HybridRadixCache(LinearStatePool(layout, 16), page_size=16),
        shared=SharedTier(store, model="m", kv=_NoKV(), publisher="B"),
        track_slots=1,
    )
    adm = mgr.admit("r", ids)
    assert isinstance(adm, Admission) and adm.cached_length == 48
    mgr.abort("r")
    mgr.check_invariants()


_OTHER: list[ReferenceEngine] = []  # the publishing replica of the last _replica_with_a_hit


def _replica_with_a_hit(model: HybridModel) -> ReferenceEngine:
    """A replica that served a hit from another replica's blob (probes, hits, a bound staging
    pool), whose check_invariants passes."""
    store = MemoryStore()
    a, b = _publisher_and_fetcher(model, store)
    prompts = _prompts(2)
    _publish(a, prompts[:1])
    _serve(b, prompts, "b")
    assert b.manager.metrics().shared_hits >= 1
    _OTHER[:] = [a]
    return b


def _queued_item(e: ReferenceEngine) -> Any:
    """A well-formed publication of one of ``e``'s snapshot nodes."""
    node = next(n for n in e.cache.iter_nodes() if n.snapshot is not None)
    return (node, np.zeros(node.depth, dtype=np.int64), None, None)


def _tier(e: ReferenceEngine) -> SharedTier:
    assert e.manager.shared is not None
    return e.manager.shared


def _free_staging(e: ReferenceEngine) -> None:
    pool, slot, owner = _tier(e).staging
    pool.free(slot, owner)


SHARED_CORRUPTIONS: dict[str, Callable[[ReferenceEngine], object]] = {
    "staging slot": _free_staging,
    "shared hits from": lambda e: setattr(_tier(e).stats, "probes", 0),
    "foreign hits of": lambda e: setattr(_tier(e).stats, "foreign_hits", 10**6),
    "stats.errors": lambda e: setattr(_tier(e).stats, "errors", -1),
    "answered prefetches hold": lambda e: setattr(_tier(e), "_prefetch_bytes", 5),
    "publications queued": lambda e: e.manager._to_publish.extend([_queued_item(e)] * (_tier(e).max_pending + 1)),
    "with a key of": lambda e: e.manager._to_publish.append(
        (_queued_item(e)[0], np.zeros(3, dtype=np.int64), None, None)
    ),
    "a node of another tree": lambda e: e.manager._to_publish.append(_queued_item(_OTHER[0])),
}


@pytest.mark.parametrize("kind", sorted(SHARED_CORRUPTIONS))
def test_check_invariants_covers_the_shared_tier(model: HybridModel, kind: str) -> None:
    e = _replica_with_a_hit(model)
    e.manager._to_publish.append(_queued_item(e))  # a well-formed queued publication passes
    e.manager.check_invariants()
    SHARED_CORRUPTIONS[kind](e)
    with pytest.raises(AssertionError, match=kind):
        e.manager.check_invariants()


def test_blob_digest_refuses_arguments_of_the_wrong_type() -> None:
    from radixcache.tiers.blob import blob_digest

    assert blob_digest("k", b"x") != blob_digest("k", b"x", b"secret") != blob_digest("k2", b"x", b"secret")
    with pytest.raises(TypeError, match="store key"):
        blob_digest(b"k", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        blob_digest("k", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="64 bytes"):
        blob_digest("k", b"x", b"s" * 65)


def test_a_fetched_prefix_is_cloned_into_the_tree_before_the_request_writes_its_slot() -> None:
    """The misuse machine's find (deferred streams, a shared tier): a prefix fetched from the store
    is copied into the request's live slot and the tree clones that slot as its snapshot; the
    admission's fence must cover the clone too, or the request's first forward (ordered after the
    admission only) lands in the slot before the clone reads it and the tree keeps a state
    several tokens too deep. The next request that hits it restores a wrong state."""
    from radixcache.testing.adapter import ManagerAdapter, prefix_state

    host = ManagerAdapter.build(shared=MemoryStore(), host_slots=0, kv_budget=None)
    ids = [1, 2, 9, 9, 9, 9, 1]

    def finish(rid: int) -> None:
        while host.extend(rid):
            pass
        host.finish(rid)

    for rid in range(2):
        assert host.admit(rid, ids) is not None
    finish(0)
    finish(1)
    assert host.manager.publish_pending(wait=True) >= 0
    host.manager.evict(snapshots=10**6)  # the tree forgets; the store remembers
    assert host.admit(2, ids) == 6 and host.manager.metrics().shared_hits == 1  # from the store
    finish(2)
    assert host.admit(3, ids) == 6 and host.manager.metrics().shared_hits == 1  # from the tree now
    conv, rec, fed = host.state(3)
    want_conv, want_rec = prefix_state(fed)
    assert torch.equal(conv, want_conv) and torch.equal(rec, want_rec), "the tree's clone of a fetched prefix"
    host.manager.check_invariants()


def test_the_hammer_on_redis_corrupts_blobs_on_purpose_and_every_one_is_refused(redis_server: RedisServer) -> None:
    """Two replicas on one real redis-server, the second reading through a link that corrupts half
    the blobs: every corrupted blob refused, every answer exact; a tier that skips verification
    when the sizes match keeps them and fails the run."""
    import redis

    from radixcache.testing.hammer import HammerConfig, HammerReport, format_report, run_hammer

    def replica(i: int, inject: str | None = None) -> HammerReport:
        cfg = HammerConfig(
            requests=60,
            seed=4,
            shared_redis=redis_server.url,
            replica=i,
            replicas=2,
            warm=False,
            shared_corrupt=0.5,
            inject=inject,
        )
        return run_hammer(cfg)

    first, second = replica(0), replica(1)
    assert first.ok and second.ok, format_report(second)
    assert second.shared_corrupted > 0 and second.shared_accepted_bad == 0, format_report(second)
    assert "corrupted on purpose" in format_report(second)
    redis.Redis.from_url(redis_server.url).flushdb()
    replica(0)
    bad = replica(1, inject="shared-trusts-sizes")
    assert not bad.ok and bad.shared_accepted_bad > 0, format_report(bad)


def test_the_fuzzing_kit_runs_its_faulty_shared_tier_over_a_real_redis_server(redis_server: RedisServer) -> None:
    """`radixcache fuzz --shared-redis URL`: the same faults over a real server, each example under
    a key prefix of its own; clean it passes, and a tier that skips verification is caught."""
    import redis

    from radixcache.testing.fuzz import run_fuzz

    run_fuzz(40, 0, shared_redis=redis_server.url)
    assert redis.Redis.from_url(redis_server.url).dbsize() > 0, "the examples published to the server"
    with pytest.raises(AssertionError, match="differs from the ground truth"):
        run_fuzz(300, 0, shared_redis=redis_server.url, inject="shared-key-no-ns", shrink=False)


# ----------------------------------------------------------------- prefetch (off the scheduler's thread)
class _SlowStore(MemoryStore):
    """A store whose probes wait for ``gate`` (a slow server); the threads that probed are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.probe_threads: set[str] = set()

    def depths(self, index: str, lo: int, hi: int) -> list[int]:
        self.probe_threads.add(threading.current_thread().name)
        assert self.gate.wait(10), "test store: gate never opened"
        return super().depths(index, lo, hi)


def test_a_prefetching_replica_serves_the_hits_of_a_fetching_one_off_the_schedulers_thread(
    model: HybridModel,
) -> None:
    store = _SlowStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    prompts = _prompts(4, seed=11)
    _publish(a, prompts[:3])
    b = ReferenceEngine(model, shared_store=store, publisher="B")
    c = ReferenceEngine(model, shared_store=store, publisher="C", shared_prefetch=True)
    store.probe_threads.clear()
    got_b = _serve(b, prompts, "x")
    assert store.probe_threads == {threading.current_thread().name}  # fetched on the caller's thread
    store.probe_threads.clear()
    got_c = _serve(c, prompts, "x")
    assert store.probe_threads == {"radixcache-shared-fetcher"}, store.probe_threads
    assert [r.cached_length for r in got_c] == [r.cached_length for r in got_b]
    mb, mc = b.manager.metrics(), c.manager.metrics()
    assert mc.shared_hits == mb.shared_hits >= 3
    assert c.shared is not None and c.shared.stats.prefetches >= 3 and c.shared.stats.prefetch_late == 0
    _assert_exact(model, got_c)
    c.manager.check_invariants()
    c.close()
    assert not c.manager.prefetch("late", prompts[0]), "no prefetch after close"


def test_an_admission_before_its_prefetch_is_answered_is_served_from_the_tree(model: HybridModel) -> None:
    store = _SlowStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    prompts = _prompts(1, seed=12)
    _publish(a, prompts)
    b = ReferenceEngine(model, shared_store=store, publisher="B", shared_prefetch=True, prefetch_wait_s=0.0)
    store.gate.clear()  # the server does not answer yet
    got = _serve(b, prompts, "b")
    assert got[0].cached_length == 0 and b.manager.shared_pending("b0") is False  # consumed at admission
    assert b.shared is not None and b.shared.stats.prefetch_late == 1 and b.shared.stats.hits == 0
    store.gate.set()
    _assert_exact(model, got)
    b.manager.check_invariants()


def test_a_prefetched_bad_blob_is_reported_on_the_schedulers_thread(model: HybridModel, tmp_path: Path) -> None:
    store = MemoryStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    prompts = _prompts(2, seed=13)
    _publish(a, prompts)
    assert _corrupt(store, _flip_state_byte) > 0
    ledger = str(tmp_path / "b.jsonl")
    b = ReferenceEngine(model, shared_store=store, publisher="B", forensics_ledger=ledger, shared_prefetch=True)
    finished = _serve(b, prompts, "b")
    _assert_exact(model, finished)
    assert b.shared is not None and b.shared.stats.hits == 0 and sum(b.shared.stats.rejected.values()) >= 1
    assert b.forensics is not None and len(b.forensics.findings) == sum(b.shared.stats.rejected.values())
    b.manager.check_invariants()
    b.close()  # its ledger's file and the fetcher thread


def test_prefetches_are_bounded_cancelled_and_validated() -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    store = _SlowStore()
    tier = SharedTier(store, model="m", kv=_NoKV(), max_prefetches=2)
    tier.bind(layout)
    ids = np.arange(50, dtype=np.int64)
    store.gate.clear()
    assert tier.prefetch("r1", ids, None, 0) and tier.prefetch("r2", ids, None, 0)
    assert not tier.prefetch("r2", ids, None, 0), "one per request"
    assert tier.prefetch("r3", ids, None, 0) and tier.stats.prefetch_dropped == 1  # r1, the oldest, went
    assert tier.take("r1", ids, None, 0) == (False, None)
    tier.cancel("r2")
    assert not tier.prefetch_pending("r2") and tier.stats.prefetch_dropped == 2
    assert not tier.prefetch("r4", ids, None, 49, limit=49), "nothing deeper than the local match to ask for"
    with pytest.raises(ValueError, match="limit 51 is longer"):
        tier.prefetch("r5", ids, None, 0, limit=51)
    with pytest.raises(TypeError, match="unhashable"):
        tier.prefetch(["r"], ids, None, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ids must be an integer numpy array"):
        tier.prefetch("r6", [1, 2, 3], None, 0)  # type: ignore[arg-type]
    tier.check_invariants()
    store.gate.set()
    assert tier.take("r3", ids, None, 0) in ((True, None),)  # a miss (or late): nothing published
    assert tier.close(timeout_s=5)
    tier.check_invariants()


def _answer_all(tier: SharedTier, rids: list[str]) -> None:
    deadline = time.monotonic() + 10
    while any(tier.prefetch_pending(r) for r in rids):
        assert time.monotonic() < deadline, "prefetches never answered"
        time.sleep(0.001)


def test_answered_prefetches_hold_at_most_max_prefetch_bytes_the_oldest_dropped(model: HybridModel) -> None:
    """A host that prefetches at arrival keeps an answer per waiting request: beyond
    ``max_prefetch_bytes`` the oldest answers go (their admissions ask the store themselves), and
    an answer larger than the cap alone is not kept."""
    store = MemoryStore()
    a = ReferenceEngine(model, shared_store=store, publisher="A")
    prompts = _prompts(1, seed=14)
    _publish(a, prompts)
    b = ReferenceEngine(model, shared_store=store, publisher="B")
    tier = _tier(b)
    ids = np.asarray(prompts[0], dtype=np.int64)
    assert b.manager.prefetch("r0", ids)
    _answer_all(tier, ["r0"])
    one = tier.prefetch_bytes
    assert one > 0
    assert tier.take("r0", ids, None, 0)[1] is not None and tier.prefetch_bytes == 0
    tier.max_prefetch_bytes = 2 * one + one // 2  # two answers of this blob fit, not three
    for r in ("r1", "r2", "r3"):
        assert b.manager.prefetch(r, ids)
    _answer_all(tier, ["r1", "r2", "r3"])
    assert tier.prefetch_bytes == 2 * one and tier.stats.prefetch_dropped == 1
    b.manager.check_invariants()
    assert tier.take("r1", ids, None, 0) == (False, None), "the oldest answer was dropped"
    assert tier.take("r2", ids, None, 0)[1] is not None and tier.take("r3", ids, None, 0)[1] is not None
    tier.max_prefetch_bytes = one - 1  # one answer alone is too large: not kept
    assert b.manager.prefetch("r4", ids)
    _answer_all(tier, ["r4"])
    assert tier.prefetch_bytes == 0 and tier.stats.prefetch_dropped == 2
    assert tier.take("r4", ids, None, 0) == (False, None)
    b.manager.check_invariants()
    with pytest.raises(ValueError, match="max_prefetch_bytes must be an int >= 1, got 0"):
        SharedTier(store, model="m", kv=_NoKV(), max_prefetch_bytes=0)
    b.close()


def _fetcher_threads() -> int:
    return sum(t.name == "radixcache-shared-fetcher" for t in threading.enumerate())


def test_a_host_starts_the_fetcher_at_set_up_not_at_the_first_arrival(model: HybridModel) -> None:
    store = _SlowStore()
    tier = SharedTier(store, model="m", kv=_NoKV())
    with pytest.raises(ProtocolError, match="before bind"):
        tier.start_prefetching()
    assert not tier.prefetching
    tier.bind(StateLayout(2, (4, 3), (2, 4, 4)))
    before = _fetcher_threads()
    tier.start_prefetching()
    tier.start_prefetching()  # idempotent: one thread
    assert tier.prefetching and _fetcher_threads() == before + 1
    store.gate.clear()  # the fetcher's first probe waits: r1 in the store, r2 queued behind it
    ids = np.arange(50, dtype=np.int64)
    assert tier.prefetch("r1", ids, None, 0) and tier.prefetch("r2", ids, None, 0)
    assert _fetcher_threads() == before + 1, "the first prefetch used the thread started at set-up"
    tier.check_invariants()
    assert tier.close(timeout_s=0.2)  # the fetcher is still in the store: closed anyway
    assert not tier.prefetching and tier.stats.prefetch_dropped == 2, "the two out, never answered"
    assert tier.take("r2", ids, None, 0) == (False, None)
    tier.check_invariants()  # NOTE: before 2026-12-04 a closed tier kept them listed, cancelled
    store.gate.set()
    with pytest.raises(ProtocolError, match="after close"):
        tier.start_prefetching()
    tier.check_invariants()
    # the hosts that prefetch start it when they are built
    eng = ReferenceEngine(model, shared_store=MemoryStore(), publisher="A", shared_prefetch=True)
    assert eng.shared is not None and eng.shared.prefetching
    eng.close()
    plain = ReferenceEngine(model, shared_store=MemoryStore(), publisher="B")
    assert plain.shared is not None and not plain.shared.prefetching
    plain.close()


def test_the_depth_index_forgets_depths_whose_blobs_expired(redis_server: RedisServer) -> None:
    layout = StateLayout(2, (4, 3), (2, 4, 4))
    pool = LinearStatePool(layout, 2)
    slot = pool.alloc(RequestOwner("r"))
    pool.write(slot, torch.randn(2, 4, 3), torch.randn(2, 2, 4, 4), owner=RequestOwner("r")).wait()
    store = RedisStore(redis_server.url, ttl_s=0.2)
    tier = SharedTier(store, model="m", kv=_NoKV(), retry_s=0.0)
    tier.bind(layout)
    for d in (8, 16, 24):
        assert tier.publish(np.arange(d, dtype=np.int64), None, pool, slot, torch.arange(d), None)
    index = tier.index(None)
    assert store.depths(index, 0, 100) == [8, 16, 24]
    assert store.trim_depths(index) == 0, "nothing expired yet"
    time.sleep(0.5)
    assert tier.fetch(np.arange(30, dtype=np.int64), None, 0) is None  # the blobs expired: a miss
    assert tier.stats.trimmed == 3 and store.depths(index, 0, 100) == []
    assert tier.publish(np.arange(30, dtype=np.int64)[:8].copy(), "other", pool, slot, torch.arange(8), None)
    assert RedisStore(redis_server.url).trim_depths(index) == 0, "a store without ttl_s trims nothing"
