"""The vLLM connector's host-store copies on the CPU, against a memcpy of the same bytes and
against torch's indexed copies (what the store did until 2026-12-06), side by side.

- ``copy_in``: a save, the worker copying a prefix's engine blocks into host pages
  (``StoreBytes.copy_in_pages``, on the engine's step: ``wait_for_save``);
- ``copy_out``: a hit, host pages into engine blocks (``copy_out_pages``, before the forward:
  ``start_load_kv``);
- ``import_kv``: a shared-tier hit, a fetched blob's KV written into host pages
  (``PagedKVCodec.import_kv``, on vLLM's scheduler thread), with and without the fingerprints a
  verifying store records;
- ``lookup_hit``: a hit of the whole prefix looked up (``PagedHostStore.lookup`` and
  ``release``, on vLLM's scheduler thread), with verification (every page of the hit
  fingerprinted first, and the snapshot) and without, the snapshot read in place; beside them
  ``private_state_copy``, the copy of the snapshot into a slot of the store each hit made until
  2026-12-07 (``verified_with_private_copy_ms``: what a verified hit cost then);
- ``lookup_hit_background``: the same verified hit with its verification on the store's copy
  thread (``lookup_in_background``, the connector's call since 2026-12-07): the scheduler
  thread's two calls (``background_scheduler``) and the copy thread's verification between them
  (``background_verification``, the time vLLM's request waits, about a step), beside the
  verified ``lookup`` in alternation;
- ``save``: a save's calls on vLLM's scheduler thread, ``plan_save`` and ``commit`` (the
  tree's clone of the staged state: copy-on-donate; with verification the donation's
  fingerprint and the new pages'), a new prefix each time, verified and not, with the store's
  copies on its copy thread (``copy_thread=True``, the default since 2026-12-07: ``commit``
  returns before the clone and the donation's fingerprint run) and on the caller's
  (``*_on_caller``, as before); ``settled``: from the commit's start until ``synchronize()``
  returns, the copy and fingerprint done (the work moved off the thread, not removed); the
  worker's copies between plan and commit are not timed;
- ``export_kv``: a publication's KV read out of host pages (``PagedKVCodec.export_kv``, on the
  thread that files the save: vLLM's scheduler's; the encoding and upload run on the tier's
  writer thread): ``ours`` into a fresh buffer each time, ``ours_reused`` into the buffer of the
  previous export, handed back (``reuse_kv``) as the tier does once it has encoded it.

Each for pages and blocks in one run each side (``consecutive``) and scattered (every other page,
blocks in reverse). ``memcpy``: one ``copy_`` of a contiguous tensor of the same bytes, the floor.
``indexed``: ``index_select`` + ``index_copy_`` (copies), a blob copied to a ``bytearray`` then
assigned through an index tensor (import), an indexed gather then ``tobytes`` (export), run here on
the same tensors. The default layout is a
Qwen3-Next-80B-like attention side: 12 attention layers, 512-token blocks, 2 KiB of K and V per
token per layer (two KV heads of 256, bf16): 1 MiB page rows, a 2,048-token prefix in 4 pages
(48 MiB); its snapshots a Qwen3-Next-80B-like state (36 Gated DeltaNet layers, 77 MB; ``--state
tiny`` for a 2 KiB one). Medians over ``--reps``, the variants alternating. Prints one JSON object.

    python benchmarks/bench_vllm_store.py [--pages 4] [--reps 20] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linear_state import RequestOwner, StateLayout
from radixcache.vllm import VERIFYING, Hit, PagedHostStore, PagedLayout
from radixcache.vllm.store import PagedKVCodec


def _indexed_in(kv: torch.Tensor, pages: list[int], layers: list[tuple[torch.Tensor, list[int]]]) -> None:
    dst = torch.tensor(pages, dtype=torch.int64)
    for i, (t, blocks) in enumerate(layers):
        kv[i].index_copy_(0, dst, t.index_select(0, torch.tensor(blocks, dtype=torch.int64)))


def _indexed_out(kv: torch.Tensor, pages: list[int], layers: list[tuple[torch.Tensor, list[int]]]) -> None:
    src = torch.tensor(pages, dtype=torch.int64)
    for i, (t, blocks) in enumerate(layers):
        t.index_copy_(0, torch.tensor(blocks, dtype=torch.int64), kv[i].index_select(0, src))


def _median_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}


def _ratios(ms: dict[str, float]) -> dict[str, float]:
    return {
        "ours_over_memcpy": round(ms["ours"] / ms["memcpy"], 2),
        "ours_over_indexed": round(ms["ours"] / ms["indexed"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-layers", type=int, default=12)
    ap.add_argument("--block", type=int, default=512, help="tokens per block")
    ap.add_argument("--token-bytes", type=int, default=2048, help="K and V bytes per token per layer")
    ap.add_argument("--pages", type=int, default=4, help="pages of the prefix copied")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="3 reps, 2 pages (a smoke run)")
    ap.add_argument(
        "--state", choices=("qwen3-next-80b", "tiny"), default="qwen3-next-80b", help="the snapshots' state layout"
    )
    a = ap.parse_args()
    if a.quick:
        a.reps, a.pages = 3, 2
    n = a.pages
    page_row = a.block * a.token_bytes
    if a.state == "tiny":
        state = StateLayout(num_layers=1, conv_shape=(3, 8), recurrent_shape=(4, 8, 8))
    else:  # 36 Gated DeltaNet layers: 77 MB a snapshot
        state = StateLayout.for_gdn(36, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    layout = PagedLayout(block_tokens=a.block, kv_layers=a.kv_layers, kv_page_bytes=page_row, state=state)
    store_pages = 4 * n + 4  # a prefix is within a quarter of it: the KV codec keeps its buffers
    budget = store_pages * layout.page_bytes + 3 * state.slot_bytes + 1
    stores = {v: PagedHostStore(layout, budget, snapshots_per_block=3 / store_pages, verify=v) for v in (False, True)}
    store = stores[False]
    assert store.num_pages >= 2 * n, (store.num_pages, n)
    gen = torch.Generator().manual_seed(0)
    blocks_total = 2 * n + 2
    engine = [
        torch.randint(0, 256, (blocks_total, page_row), dtype=torch.uint8, generator=gen) for _ in range(a.kv_layers)
    ]
    flat_src = torch.randint(0, 256, (a.kv_layers * n * page_row,), dtype=torch.uint8, generator=gen)
    flat_dst = torch.empty_like(flat_src)
    cases = {
        "consecutive": (list(range(n)), list(range(1, n + 1))),
        "scattered": (list(range(0, 2 * n, 2)), list(range(2 * n, 0, -2))),
    }
    out: dict[str, object] = {
        "layout": {
            "kv_layers": a.kv_layers,
            "block_tokens": a.block,
            "page_row_bytes": page_row,
            "prefix_tokens": n * a.block,
            "prefix_mib": round(a.kv_layers * n * page_row / 2**20, 1),
            "state_mb": round(state.slot_bytes / 1e6, 1),
        },
        "reps": a.reps,
        "torch_threads": torch.get_num_threads(),
    }
    mem = store.bytes

    def memcpy() -> None:
        flat_dst.copy_(flat_src)

    def copies(pages: list[int], layers: list[tuple[torch.Tensor, list[int]]]) -> dict[str, dict[str, float]]:
        got = {}
        for way, ours, indexed in (
            ("in", mem.copy_in_pages, _indexed_in),
            ("out", mem.copy_out_pages, _indexed_out),
        ):
            ms = _median_ms(
                {
                    "ours": partial(ours, pages, layers),
                    "indexed": partial(indexed, mem.kv, pages, layers),
                    "memcpy": memcpy,
                },
                a.reps,
            )
            got[way] = {**ms, **_ratios(ms)}
        return got

    for case, (pages, blocks) in cases.items():
        got = copies(pages, [(t, blocks) for t in engine])
        out[f"copy_in_{case}_ms"], out[f"copy_out_{case}_ms"] = got["in"], got["out"]

    data = memoryview(flat_src.numpy().tobytes())  # a fetched blob's KV: a read-only view
    for verify, st in stores.items():
        codec = PagedKVCodec(st)

        def ours(st: PagedHostStore = st, codec: PagedKVCodec = codec) -> None:
            idx = codec.import_kv(data, n * a.block)
            assert idx is not None
            st.pages.free(idx)

        def indexed(st: PagedHostStore = st) -> None:
            idx = st.pages.alloc(n * a.block)
            assert idx is not None
            pages_t = st.pages.pages(idx)
            src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(a.kv_layers, n, page_row)
            st.kv[:, pages_t] = src
            st.record_pages(pages_t.tolist())
            st.pages.free(idx)

        ms = _median_ms({"ours": ours, "indexed": indexed, "memcpy": memcpy}, a.reps)
        out[f"import_kv_{'verify' if verify else 'no_verify'}_ms"] = {**ms, **_ratios(ms)}
        # what import wrote is the blob, page by page
        idx = codec.import_kv(data, n * a.block)
        assert idx is not None
        written = st.kv[:, st.pages.pages(idx)].contiguous().numpy().tobytes()
        assert written == bytes(data), "import_kv wrote other bytes than the blob's"
        st.pages.free(idx)
        st.check_invariants()
    # a publication's KV read out of host pages (on the thread that publishes: vLLM's scheduler's)
    codec = PagedKVCodec(store)
    idx = codec.import_kv(data, n * a.block)
    assert idx is not None
    pages_t = store.pages.pages(idx)
    reusing = PagedKVCodec(store)  # hands each export back, as the tier does once it is encoded
    ms = _median_ms(
        {
            "ours": partial(codec.export_kv, idx, None),
            "ours_reused": lambda: reusing.reuse_kv(reusing.export_kv(idx, None)),
            "indexed": lambda: store.kv[:, pages_t].contiguous().numpy().tobytes(),
            "memcpy": memcpy,
        },
        a.reps,
    )
    out["export_kv_ms"] = {**ms, **_ratios(ms), "ours_reused_over_memcpy": round(ms["ours_reused"] / ms["memcpy"], 2)}
    assert reusing.spare_bytes == n * a.kv_layers * page_row, "the export's buffer kept for the next one"
    assert bytes(codec.export_kv(idx, None)) == bytes(data), "export_kv read other bytes than were written"
    store.pages.free(idx)
    # a hit's lookup on vLLM's scheduler thread, with and without verification (the difference:
    # every page of the hit fingerprinted before it is offered)
    ids = list(range(n * a.block))
    conv = torch.randn(state.num_layers, *state.conv_shape).to(state.conv_dtype)
    rec = torch.randn(state.num_layers, *state.recurrent_shape).to(state.recurrent_dtype)
    lookups: dict[str, Callable[[], object]] = {}
    for verify, st in stores.items():
        plan = st.plan_save("saved", ids)
        assert plan is not None
        st.copy_in_pages(plan.pages, [(t, list(range(n))) for t in engine])
        st.copy_in_state(plan, conv, rec)
        assert st.commit(plan)

        def lookup(st: PagedHostStore = st) -> None:
            hit = st.lookup("hit", ids, computed=0)
            assert hit is not None and hit.end == len(ids), hit
            st.release(hit)

        lookups["verified" if verify else "unverified"] = lookup
    # what each hit also paid until 2026-12-07: the snapshot copied into a private slot of the
    # store on the scheduler's thread (the worker now copies it out of the snapshot's own slot)
    st = stores[True]
    node = st.manager.lookup(ids).node
    assert node.snapshot is not None

    def private_copy(st: PagedHostStore = st, src: int = node.snapshot) -> None:
        owner = RequestOwner("private copy")
        slot = st.pool.alloc(owner)
        st.pool.copy(src, slot, dst_owner=owner).wait()
        st.pool.free(slot, owner)

    lookups["private_state_copy"] = private_copy
    ms = _median_ms({**lookups, "memcpy": memcpy}, a.reps)
    prefix_mib = a.kv_layers * n * page_row / 2**20
    verified_mib = prefix_mib + state.slot_bytes / 2**20
    out["lookup_hit_ms"] = {
        **ms,
        "verified_over_memcpy": round(ms["verified"] / ms["memcpy"], 2),
        # per MiB read by verification: the hit's pages and its snapshot
        "verification_us_per_mib": round(1e3 * (ms["verified"] - ms["unverified"]) / verified_mib, 1),
        "verified_with_private_copy_ms": round(ms["verified"] + ms["private_state_copy"], 3),
    }
    # the same hit verified on the store's copy thread (lookup_in_background, what the connector
    # calls since 2026-12-07): the scheduler thread's two calls timed (the first answers
    # VERIFYING, the one a step later the hit), the copy thread's verification between them not;
    # alternating with the verified lookup above
    bg: dict[str, list[float]] = {"background_scheduler": [], "background_verification": [], "verified": []}
    st = stores[True]
    assert st.copies is not None
    for r in range(a.reps + 1):
        t0 = time.perf_counter()
        assert st.lookup_in_background("bg", ids, computed=0) is VERIFYING
        t1 = time.perf_counter()
        st.copies.synchronize()
        t2 = time.perf_counter()
        hit = st.lookup_in_background("bg", ids, computed=0)
        t3 = time.perf_counter()
        assert isinstance(hit, Hit) and hit.end == len(ids), hit
        st.release(hit)
        st.finished("bg")
        t4 = time.perf_counter()
        lookups["verified"]()
        t5 = time.perf_counter()
        if r:
            bg["background_scheduler"].append((t1 - t0) + (t3 - t2))
            bg["background_verification"].append(t2 - t1)
            bg["verified"].append(t5 - t4)
    bgm = {k: round(statistics.median(v) * 1e3, 3) for k, v in bg.items()}
    out["lookup_hit_background_ms"] = {
        **bgm,
        "background_scheduler_over_verified": round(bgm["background_scheduler"] / bgm["verified"], 3),
    }
    # a save's two calls on vLLM's scheduler thread (the worker's copies between them untimed):
    # plan_save (pages and a slot, evicting through the policy when the store is full) and
    # commit (the tree's clone of the staged state, copy-on-donate; with verification the
    # donation's fingerprint and the new pages' too); a new prefix each time; the stores with
    # the copies on the caller's thread beside those with a copy thread
    savers = {
        **{("verified" if v else "unverified"): st for v, st in stores.items()},
        **{
            ("verified_on_caller" if v else "unverified_on_caller"): PagedHostStore(
                layout, budget, snapshots_per_block=3 / store_pages, verify=v, copy_thread=False
            )
            for v in (False, True)
        },
    }
    times: dict[str, dict[str, list[float]]] = {k: {"plan": [], "commit": [], "settled": []} for k in savers}
    fresh = itertools.count(1)
    for r in range(a.reps + 1):
        for name, st in savers.items():
            base = 1_000_000 * next(fresh)
            new = [base + i for i in range(n * a.block)]
            t0 = time.perf_counter()
            plan = st.plan_save("save", new)
            t1 = time.perf_counter()
            assert plan is not None
            st.copy_in_pages(plan.pages, [(t, list(range(n))) for t in engine])
            st.copy_in_state(plan, conv, rec)
            t2 = time.perf_counter()
            assert st.commit(plan)
            t3 = time.perf_counter()
            st.synchronize()
            t4 = time.perf_counter()
            if r:  # the first of each is a warm-up
                row = times[name]
                row["plan"].append(t1 - t0)
                row["commit"].append(t3 - t2)
                row["settled"].append(t4 - t2)
    save = {k: {c: round(statistics.median(v) * 1e3, 3) for c, v in row.items()} for k, row in times.items()}
    for st in savers.values():
        st.check_invariants()
        assert st.stats.corrupt_snapshots == 0
    out["save_ms"] = {
        **save,
        "unverified_on_caller_commit_over_state_copy": round(
            save["unverified_on_caller"]["commit"] / ms["private_state_copy"], 2
        ),
        "commit_over_on_caller": {
            k: round(save[k]["commit"] / save[f"{k}_on_caller"]["commit"], 3) for k in ("verified", "unverified")
        },
    }
    # and the copies: a save and a hit of the same pages give the engine back its blocks
    pages, blocks = cases["scattered"]
    mem.copy_in_pages(pages, [(t, blocks) for t in engine])
    back = [torch.zeros_like(t) for t in engine]
    mem.copy_out_pages(pages, [(t, blocks) for t in back])
    assert all(torch.equal(b[blocks], t[blocks]) for b, t in zip(back, engine, strict=True))
    out["ok"] = True
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
