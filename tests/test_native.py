"""The native walk and duplicate search (radixcache/core/_native.c) against their pure-Python
references in the tree (``_walk_py``, ``_duplicates_py``), on random trees: the same nodes, byte
counts, snapshot positions and duplicate indices, and the native calls' refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from linear_state import LinearStatePool, RequestOwner
from radixcache import HybridRadixCache
from radixcache.core import native
from radixcache.core.keys import TOKEN_BYTES, key_bytes
from radixcache.core.tree import TreeNode

from .tree_helpers import LAYOUT, make_cache, state_for

needs_native = pytest.mark.skipif(native.MODULE is None, reason="the C extension is not built here")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nat() -> Any:
    assert native.MODULE is not None
    return native.MODULE


def _build(page: int, inserts: list[tuple[list[int], bool]], evict: int) -> tuple[HybridRadixCache, int]:
    """A tree from ``inserts`` (tokens, donate a state), each with fresh KV indices; then ``evict``
    snapshots evicted: the first two demoted to a host tier (nodes whose state is in host memory),
    the rest dropped (tombstones, shorter paths). Returns the tree and the next free index."""
    cache, _ = make_cache(slots=96, page_size=page)
    cache.attach_host_pool(LinearStatePool(LAYOUT, 2))
    nxt = 1000
    for i, (tokens, donate) in enumerate(inserts):
        kv = torch.arange(nxt, nxt + len(tokens), dtype=torch.int64)
        nxt += len(tokens)
        if donate:
            owner = RequestOwner(("r", i))
            slot = state_for(cache, owner, tokens)
            cache.insert(tokens, kv, state_slot=slot)
            cache.pool.free(slot, owner)
        else:
            cache.insert(tokens, kv)
    if evict:
        cache.evict(snapshots=evict)
    cache.check_invariants()
    return cache, nxt


tokens_st = st.lists(st.integers(0, 2), max_size=24)


@st.composite
def scenario(draw: st.DrawFn) -> tuple[int, list[tuple[list[int], bool]], int, list[list[int]]]:
    """(page size, inserts, snapshots to evict, queries): each query an inserted key cut
    somewhere, then a random tail, so that walks go deep, leave edges part-way and end at nodes."""
    page = draw(st.sampled_from([1, 2, 4]))
    inserts: list[tuple[list[int], bool]] = []
    for _i in range(draw(st.integers(1, 12))):  # a fresh key, or an earlier one cut and extended
        if draw(st.booleans()) and inserts:
            base = draw(st.sampled_from([t for t, _d in inserts]))
            tokens = base[: draw(st.integers(0, len(base)))] + draw(tokens_st)
        else:
            tokens = draw(tokens_st)
        inserts.append((tokens, draw(st.booleans())))
    queries = []
    for _q in range(draw(st.integers(1, 6))):
        base = draw(st.sampled_from([t for t, _d in inserts]))
        cut = draw(st.integers(0, len(base)))
        queries.append(base[:cut] + draw(st.lists(st.integers(0, 2), max_size=8)))
    return page, inserts, draw(st.integers(0, 4)), queries


def _same_walk(a: tuple[list[TreeNode], int, int, TreeNode | None], b: tuple[list[TreeNode], int, int, Any]) -> None:
    assert [n.id for n in a[0]] == [n.id for n in b[0]] and all(x is y for x, y in zip(a[0], b[0], strict=True))
    assert a[1:3] == b[1:3]
    assert a[3] is b[3]


@needs_native
@given(scenario(), st.data())
def test_walk_matches_the_python_reference(case: Any, data: st.DataObject) -> None:
    page, inserts, evict, queries = case
    cache, _ = _build(page, inserts, evict)
    root = cache.match([]).node
    pb = page * TOKEN_BYTES
    for q in queries:
        kb = key_bytes(q)
        whole = len(kb) - len(kb) % pb
        # the tree's own ends (whole pages), and any token boundary below the key's length
        for end in {whole, data.draw(st.integers(0, len(q))) * TOKEN_BYTES}:
            _same_walk(cache._walk_py(kb, end, root), _nat().walk(kb, end, root, pb))
    cache.check_invariants()


def _kv_for(cache: HybridRadixCache, tokens: list[int], flips: list[bool], nxt: int) -> torch.Tensor:
    """Indices for ``tokens``: the tree's own where it holds the tokens, except where ``flips``
    says another index (a duplicate), fresh ones past it."""
    own = cache.kv_prefix(tokens).tolist()
    out = []
    for i in range(len(tokens)):
        if i < len(own) and not flips[i % len(flips)]:
            out.append(own[i])
        else:
            out.append(nxt + i)
    return torch.tensor(out, dtype=torch.int64)


@needs_native
@given(scenario(), st.lists(st.booleans(), min_size=1, max_size=7), st.data())
def test_duplicates_match_the_python_reference(case: Any, flips: list[bool], data: st.DataObject) -> None:
    page, inserts, evict, queries = case
    cache, nxt = _build(page, inserts, evict)
    root = cache.match([]).node
    pb = page * TOKEN_BYTES
    for q in queries:
        kb = key_bytes(q)
        end = len(kb) - len(kb) % pb
        path, pos, _, split = cache._walk_py(kb, end, root)
        node = path[-1] if path else root
        split_at = pos - node.depth * TOKEN_BYTES if split is not None else 0
        kv = _kv_for(cache, q, flips, nxt)
        kvn = kv.numpy()
        for known in {0, data.draw(st.integers(0, len(q))), len(q)}:
            ref = cache._duplicates_py(kv, kvn, path, split, split_at, known)
            got = _nat().duplicates(kvn, path, split, split_at // TOKEN_BYTES, known)
            if ref is None:
                assert got is None
            else:
                assert isinstance(got, bytearray)
                assert np.frombuffer(got, dtype=np.int64).tolist() == ref.tolist()
            # and through the tree's dispatch, as insert calls it
            mine = cache._duplicates(kv, kvn, path, split, split_at, known)
            if ref is None:
                assert mine is None
            else:
                assert mine is not None and torch.equal(mine, ref)
            # an engine's int32 page-table row: read as it is, the same duplicates, int64
            row = kvn.astype(np.int32)
            ref32 = cache._duplicates_py(None, row, path, split, split_at, known)
            got32 = _nat().duplicates(row, path, split, split_at // TOKEN_BYTES, known)
            if ref is None:
                assert ref32 is None and got32 is None
            else:
                assert ref32 is not None and ref32.dtype == torch.int64 and torch.equal(ref32, ref)
                assert isinstance(got32, bytearray) and np.frombuffer(got32, dtype=np.int64).tolist() == ref.tolist()


def test_a_known_split_compares_only_past_the_known_prefix() -> None:
    """A hand-made case: the key leaves an edge part-way, the first tokens known; the duplicates
    are exactly the indices past ``known`` that differ, in order."""
    cache, _ = make_cache(slots=8, page_size=1)
    owner = RequestOwner("a")
    slot = state_for(cache, owner, [1, 2, 3, 4, 5, 6])
    cache.insert([1, 2, 3, 4, 5, 6], torch.arange(10, 16), state_slot=slot)
    cache.pool.free(slot, owner)
    kb = key_bytes([1, 2, 3, 4, 9])
    root = cache.match([]).node
    path, pos, snap_at, split = cache._walk(kb, len(kb), root)
    assert path == [] and pos == 4 * TOKEN_BYTES and snap_at == 0 and split is not None
    kv = torch.tensor([10, 99, 12, 98, 97])
    got = cache._duplicates(kv, kv.numpy(), path, split, pos, 2)
    assert got is not None and got.tolist() == [98]  # 99 is inside the known prefix; 97 is new
    got = cache._duplicates(kv, kv.numpy(), path, split, pos, 0)
    assert got is not None and got.tolist() == [99, 98]


@needs_native
def test_duplicates_fall_back_for_arrays_it_does_not_read() -> None:
    """Not a contiguous int64 or int32 array (another dtype, a strided view, no numpy twin): the
    native search declines and the reference answers instead, through the tree's dispatch."""
    cache, _ = make_cache(slots=8, page_size=1)
    owner = RequestOwner("a")
    slot = state_for(cache, owner, [1, 2, 3])
    cache.insert([1, 2, 3], torch.arange(10, 13), state_slot=slot)
    cache.pool.free(slot, owner)
    root = cache.match([]).node
    path = cache._walk_py(key_bytes([1, 2, 3]), 3 * TOKEN_BYTES, root)[0]
    kv = torch.tensor([10, 50, 12])
    n = _nat()
    assert n.duplicates(kv.numpy().astype(np.int16), path, None, 0, 0) is NotImplemented
    assert n.duplicates(kv.numpy().astype(np.uint32), path, None, 0, 0) is NotImplemented
    strided = np.array([10, 0, 50, 0, 12, 0], dtype=np.int64)[::2]
    assert n.duplicates(strided, path, None, 0, 0) is NotImplemented
    saved = path[0].value_np
    assert path[0].value.tolist() == [10, 11, 12]  # its tensor (made when first read), kept
    path[0].value_np = None  # a node whose KV has no numpy twin (a GPU tree's)
    try:
        assert n.duplicates(kv.numpy(), path, None, 0, 0) is NotImplemented
        got = cache._duplicates(kv, kv.numpy(), path, None, 0, 0)
        assert got is not None and got.tolist() == [50]
        got = cache._duplicates(None, kv.numpy(), path, None, 0, 0)  # numpy indices alone (insert's fast path)
        assert got is not None and got.tolist() == [50]
    finally:
        path[0].value_np = saved
    cache.check_invariants()


def _nodes(cache: HybridRadixCache) -> list[TreeNode]:
    """Every node of ``cache``'s default tree, the root first."""
    out, todo = [], [cache.match([]).node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(n.children.values())
    return out


@needs_native
@given(scenario(), st.data())
def test_gather_matches_the_python_reference(case: Any, data: st.DataObject) -> None:
    """For every node and a few starts: the native gather into an int64 row, into an int32 row and
    into fresh bytes writes exactly what the Python reference writes, and nothing outside
    ``[start, depth)``; ``kv_indices`` (native) equals the edges' concatenation."""
    page, inserts, evict, _queries = case
    cache, _ = _build(page, inserts, evict)
    for node in _nodes(cache):
        path = []
        n: TreeNode | None = node
        while n is not None:
            path.append(n)
            n = n.parent
        whole = torch.cat([p.value for p in reversed(path)]) if path else torch.empty(0, dtype=torch.int64)
        assert whole.numel() == node.depth
        for start in {0, node.depth, data.draw(st.integers(0, node.depth))}:
            want = whole[start:].tolist()
            assert cache.kv_indices(node, start=start).tolist() == want
            got = _nat().gather(node, start, None)
            assert isinstance(got, bytearray) and np.frombuffer(got, dtype=np.int64).tolist() == want
            for dtype in (np.int64, np.int32):
                ref = np.full(node.depth + 3, -7, dtype=dtype)
                nat = ref.copy()
                cache._gather_py(node, start, ref)
                assert _nat().gather(node, start, nat) is None
                assert nat.tolist() == ref.tolist()
                assert nat[start : node.depth].tolist() == want
                assert (nat[:start] == -7).all() and (nat[node.depth :] == -7).all()
                out = np.full(node.depth + 1, -7, dtype=dtype)
                cache.kv_into(node, out, start=start)  # the dispatch
                assert out[start : node.depth].tolist() == want and out[-1] == -7
    cache.check_invariants()


def test_kv_into_refuses_bad_arguments_and_writes_nothing() -> None:
    cache, _ = make_cache(slots=8, page_size=1)
    owner = RequestOwner("a")
    slot = state_for(cache, owner, [1, 2, 3, 4])
    cache.insert([1, 2, 3, 4], torch.arange(10, 14), state_slot=slot)
    cache.insert([1, 2, 5, 6], torch.tensor([10, 11, 20, 21]), state_slot=slot)
    cache.pool.free(slot, owner)
    node = cache.match([1, 2, 5, 6]).node
    assert node.depth == 4 and node.parent is not None and node.parent.depth == 2
    out = np.zeros(4, dtype=np.int32)
    cache.kv_into(node, out, start=1)
    assert out.tolist() == [0, 11, 20, 21]
    bad: list[Any] = [
        np.zeros(4, dtype=np.int16),
        np.zeros(4, dtype=np.float64),
        np.zeros((2, 4), dtype=np.int64),
        np.zeros(8, dtype=np.int64)[::2],
        torch.zeros(4, dtype=torch.int64),
        [0, 0, 0, 0],
    ]
    ro = np.zeros(4, dtype=np.int64)
    ro.flags.writeable = False
    bad.append(ro)
    for b in bad:
        with pytest.raises(TypeError, match="writable contiguous 1-D int32 or int64"):
            cache.kv_into(node, b)
    short = np.full(3, -1, dtype=np.int64)
    with pytest.raises(ValueError, match=r"out holds 3 indices, fewer than node \d+'s depth 4"):
        cache.kv_into(node, short)
    assert short.tolist() == [-1, -1, -1]
    with pytest.raises(ValueError, match=r"start 5 is outside \[0, 4\]"):
        cache.kv_into(node, np.zeros(4, dtype=np.int64), start=5)
    with pytest.raises(TypeError, match="start must be an int"):
        cache.kv_into(node, np.zeros(4, dtype=np.int64), start=1.0)  # type: ignore[arg-type]
    other, _ = make_cache(slots=8, page_size=1)
    with pytest.raises(Exception, match="another cache"):
        other.kv_into(node, np.zeros(4, dtype=np.int64))
    cache.check_invariants()


@needs_native
def test_gather_declines_what_it_does_not_read() -> None:
    cache, _ = make_cache(slots=8, page_size=1)
    owner = RequestOwner("a")
    slot = state_for(cache, owner, [1, 2, 3])
    cache.insert([1, 2, 3], torch.arange(10, 13), state_slot=slot)
    cache.pool.free(slot, owner)
    node = cache.match([1, 2, 3]).node
    n = _nat()
    assert n.gather(node, 0, np.zeros(3, dtype=np.int16)) is NotImplemented
    ro = np.zeros(3, dtype=np.int64)
    ro.flags.writeable = False
    assert n.gather(node, 0, ro) is NotImplemented
    with pytest.raises(ValueError, match="out holds 2 indices"):
        n.gather(node, 0, np.zeros(2, dtype=np.int64))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        n.gather(node, 0)
    saved = node.value_np
    node.value_np = None  # a GPU tree's edge: no numpy twin
    try:
        assert n.gather(node, 0, None) is NotImplemented
        out = np.zeros(3, dtype=np.int64)
        cache.kv_into(node, out)  # the reference answers
        assert out.tolist() == [10, 11, 12]
        assert cache.kv_indices(node, start=1).tolist() == [11, 12]
    finally:
        node.value_np = saved
    cache.check_invariants()


@needs_native
def test_native_calls_refuse_bad_arguments() -> None:
    cache, _ = make_cache(slots=8, page_size=1)
    root = cache.match([]).node
    n = _nat()
    with pytest.raises(TypeError, match="bytes"):
        n.walk(bytearray(8), 8, root, 4)
    with pytest.raises(ValueError, match=r"end 12 outside \[0, 8\]"):
        n.walk(bytes(8), 12, root, 4)
    with pytest.raises(ValueError, match="page_bytes 0"):
        n.walk(bytes(8), 8, root, 0)
    with pytest.raises(TypeError, match="end must be an int"):
        n.walk(bytes(8), 8.0, root, 4)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        n.walk(bytes(8), 8, root)
    with pytest.raises(AttributeError):
        n.walk(bytes(8), 8, object(), 4)  # not a node
    owner = RequestOwner("a")
    slot = state_for(cache, owner, [1, 2, 3])
    cache.insert([1, 2, 3], torch.arange(10, 13), state_slot=slot)
    cache.pool.free(slot, owner)
    path = cache._walk_py(key_bytes([1, 2, 3]), 3 * TOKEN_BYTES, cache.match([]).node)[0]
    assert len(path) == 1
    with pytest.raises(ValueError, match="outside the caller's 2 indices"):
        n.duplicates(np.arange(2, dtype=np.int64), path, None, 0, 0)
    with pytest.raises(TypeError, match="path must be a list"):
        n.duplicates(np.arange(3, dtype=np.int64), tuple(path), None, 0, 0)
    cache.check_invariants()


def _flag_run(env: dict[str, str]) -> str:
    code = "import radixcache.core.native as n; print(n.NATIVE)"
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_radixcache_native_0_runs_the_reference() -> None:
    assert _flag_run({"RADIXCACHE_NATIVE": "0", "RADIXCACHE_REQUIRE_NATIVE": ""}) == "False"


@pytest.mark.skipif(
    os.environ.get("RADIXCACHE_REQUIRE_NATIVE") != "1" or os.environ.get("RADIXCACHE_NATIVE") == "0",
    reason="CI's build check (RADIXCACHE_REQUIRE_NATIVE=1, the native path not turned off)",
)
def test_ci_runs_the_native_build() -> None:
    """CI sets RADIXCACHE_REQUIRE_NATIVE=1: the extension is built there and in use."""
    assert native.NATIVE and native.MODULE is not None
    assert _flag_run({}) == "True"


@st.composite
def ids_st(draw: st.DrawFn) -> list[int]:
    """In-range ids (text and image ids alike), and in one case of three one id out of range."""
    ids = draw(st.lists(st.one_of(st.integers(0, 2**31 - 1), st.integers(2**30, 2**31 - 1)), max_size=40))
    if ids and draw(st.integers(0, 2)) == 0:
        bad = draw(st.one_of(st.sampled_from([2**31, -1, 2**32, -(2**63)]), st.integers(2**31, 2**63 - 1)))
        ids[draw(st.integers(0, len(ids) - 1))] = bad
    return ids


@needs_native
@given(ids_st(), st.sampled_from(["array", "int64", "uint64"]))
def test_words_to_key_matches_the_python_reference(ids: list[int], kind: str) -> None:
    """8-byte ids (SGLang's array('q'), numpy int64 or uint64) to key bytes: the same bytes as the
    reference, whether an id is an image id as the reference's ``_has_images`` of them says, and
    None exactly where the reference refuses an id (it then names it)."""
    from array import array as arr

    from radixcache.core import keys

    if kind == "uint64":
        ids = [i % 2**64 for i in ids]
    buf: Any = arr("q", ids) if kind == "array" else np.array(ids, dtype=np.int64 if kind == "int64" else np.uint64)
    try:
        want: bytes | None = keys._from_words64_py(buf, buf)
    except ValueError:
        want = None
    got = _nat().words_to_key(buf)
    assert got == (None if want is None else (want, keys._has_images(want)))
    if want is not None:
        assert keys.key_bytes(buf) == want  # and through the dispatch
        key = keys.CacheKey(buf)  # an array's key knows from the conversion; numpy's asks later (-1)
        assert key._images == (int(keys._has_images(want)) if kind == "array" else -1)
        assert key.data == want and key.has_images is keys._has_images(want)
    else:
        with pytest.raises(ValueError, match=r"outside \[0, 2\*\*31\)"):
            keys.key_bytes(buf)


@needs_native
def test_words_to_key_declines_what_it_does_not_read() -> None:
    n = _nat()
    assert n.words_to_key(np.arange(4, dtype=np.int32)) is None  # 4-byte ids
    assert n.words_to_key(np.arange(8, dtype=np.int64)[::2]) is None  # strided
    assert n.words_to_key(np.arange(4, dtype=np.float64)) is None  # not integers
    assert n.words_to_key(object()) is None  # not a buffer
    assert n.words_to_key(np.arange(3, dtype=np.int64)) == (np.arange(3, dtype=np.uint32).tobytes(), False)
    img = np.array([5, 2**30], dtype=np.int64)  # IMAGE_ID_BASE itself is an image id; 2**30 - 1 is not
    assert n.words_to_key(img) == (img.astype(np.uint32).tobytes(), True)
    assert n.words_to_key(img - 1)[1] is False


def _guarded_probe(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A manager and ``_exclusive`` of a probe method, through the native guard or the reference."""
    from radixcache import CacheManager
    from radixcache.manager import cache_manager as cm
    from radixcache.policies import SglangLike

    if not native_on:
        monkeypatch.setattr(cm, "_NATIVE", None)
    pool = LinearStatePool(LAYOUT, 4)
    mgr = CacheManager(HybridRadixCache(pool), SglangLike())

    def probe(self: Any, x: object, *, y: int = 0) -> tuple[object, int]:
        """The probe's contract."""
        assert self._guard.locked(), "run under the guard"
        if x == "raise":
            raise KeyError("inside")
        return x, y

    return mgr, cm._exclusive(probe)


@pytest.mark.parametrize("native_on", [pytest.param(True, marks=needs_native), False])
def test_exclusive_runs_under_the_guard_as_the_reference(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixcache.core.errors import ConcurrentUseError

    mgr, wrapped = _guarded_probe(native_on, monkeypatch)
    assert (type(wrapped).__name__ == "Exclusive") is native_on
    names = (wrapped.__name__, wrapped.__doc__, wrapped.__wrapped__.__name__)
    assert names == ("probe", "The probe's contract.", "probe")
    bound = wrapped.__get__(mgr, type(mgr))  # as a class attribute binds it
    assert bound(1, y=2) == (1, 2) and wrapped(mgr, "a") == ("a", 0)
    assert not mgr._guard.locked()
    with pytest.raises(KeyError, match="inside"):
        bound("raise")
    assert not mgr._guard.locked(), "released when the method raises"
    busy = pytest.raises(ConcurrentUseError, match=r"CacheManager\.probe entered while another call runs")
    with mgr._guard, busy:  # another call holds it: refused, the method not run
        bound(1)
    assert not mgr._guard.locked() and bound(3) == (3, 0)
    with pytest.raises(TypeError, match=r"probe\(\) needs the object it guards as its first argument"):
        wrapped()  # no object to guard


@needs_native
def test_the_managers_guarded_methods_are_native_here() -> None:
    from radixcache import CacheManager

    for name in ("checkpoint", "restore", "admitted", "lock", "unlock", "relock", "evict"):
        assert type(CacheManager.__dict__[name]).__name__ == "Exclusive", name
