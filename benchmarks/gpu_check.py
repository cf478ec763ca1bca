"""The checks that need a GPU, as one script printing JSON: run it where a CUDA device is lent
(never needed by CI).

- ``fences``: :func:`linear_state.cuda_fence_check`: a warmed producer (a chain of matrix products
  before its write) that a clone NOT ordered after its event reads stale, while the clone ordered
  after it reads the new state (``ordered_ok`` must be true; ``unordered_stale`` true shows the
  check can tell);
- ``clone``: a Qwen3-Next-80B-like slot (36 GDN layers, 77 MB) cloned through the pool against a
  raw device copy of the same bytes: medians of host wall time (queue, copy, wait) and of device
  time (CUDA events around the call), and the ratios (target >= 0.8x the raw bandwidth);
- ``fingerprint``: the slot's fingerprint against its clone (target <= 1.0x), and against one plain
  read pass over the slot (``torch.sum`` of its words: the floor of any fingerprint); ``kernel``
  says which path the pool took (``triton``: the fused kernel, when Triton imports), beside the
  torch path's time and whether both give the same value (``equal_to_torch_path``);
- ``fingerprint_warm_up``: a hasher over fresh CUDA tensors whose slots alternate between two
  alignments (so the fused kernel has two variants per tensor): ``SlotHasher.warm_up`` (what
  forensics runs at start-up) must build every variant the hasher's slots launch: fingerprinting
  each slot afterwards compiles nothing more (``variants_after_warm_up == variants_after_all_slots``)
  and no slot's first fingerprint takes a compile's time (``slowest_first_fingerprint_ms``);
- ``hosted_stream``: an engine's own state tensors and slot list wrapped by a
  :class:`~linear_state.HostedStatePool` whose stream is the engine's forward stream
  (``CudaStream(stream=...)``, what the SGLang backend does): a long producer writes a request's
  slot on that stream, the tree clones it with no fence passed (stream order alone), restores it
  into another slot, and both must read the producer's write (``ok``);
- ``shared_tier``: two reference engines on ``cuda`` sharing one in-process store, the publisher's
  tier inline and then with its writer thread (``background=True``): publications read CUDA slots
  back to the host, the other engine fetches them into its CUDA slots after verifying their
  fingerprints; every answer must equal the cold run's (``ok``);
- ``device``: what the numbers were measured on;
- ``hammer``: the ground-truth hammer with the reference engine on ``cuda`` (two CUDA streams:
  forwards and copies run concurrently, ordered by fences alone), clean and with forensics; then
  with every forward delayed on the GPU (``--delay-us``: the tiny model's forwards otherwise finish
  before the host queues the next copy), clean, and with each fence bug injected
  (``no-donate-fence``, ``no-restore-fence``), which must then serve wrong answers.

    python benchmarks/gpu_check.py [--reps 20] [--hammer-requests 200] [--delay-us 20000] [--out FILE]

A section that raises is reported as ``{"ok": false, "error": ...}`` and the others still run;
``--out`` rewrites the JSON after each section, so a run cut short by a time limit keeps what it
measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from linear_state import (
    CudaStream,
    HostedStatePool,
    LinearStatePool,
    NodeOwner,
    RequestOwner,
    StateLayout,
    cuda_fence_check,
)
from linear_state.fingerprint import SlotHasher
from linear_state.fingerprint_triton import compiled_variants
from radixcache import HybridRadixCache
from radixcache.testing.engine import EngineRequest, ReferenceEngine, generate_cold
from radixcache.testing.hammer import HammerConfig, run_hammer
from radixcache.testing.model import HybridConfig, HybridModel
from radixcache.tiers.store import MemoryStore


def device_info() -> dict[str, Any]:
    """The device, the driver's view of it, and the software versions."""
    p = torch.cuda.get_device_properties(0)
    return {
        "name": p.name,
        "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / 2**30, 1),
        "multiprocessors": p.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def fences() -> dict[str, Any]:
    """Ordered clone correct, unordered clone stale, with a long producer."""
    c = cuda_fence_check()
    return {
        "ordered_ok": c.ordered_ok,
        "unordered_stale": c.unordered_stale,
        "matmuls": c.matmuls,
        "attempts": c.attempts,
        "producer_ms": c.producer_ms,
    }


def hosted_stream(matmuls: int = 48, size: int = 4096) -> dict[str, Any]:
    """Clone and restore ordered by the engine's stream alone, over a HostedStatePool."""
    dev = torch.device("cuda", torch.cuda.current_device())
    layout = StateLayout(2, (64, 3), (8, 64, 64))
    n_slots = 8
    conv = torch.zeros((2, n_slots, 64, 3), dtype=layout.conv_dtype, device=dev)
    rec = torch.zeros((2, n_slots, 8, 64, 64), dtype=layout.recurrent_dtype, device=dev)

    class Lender:
        def __init__(self) -> None:
            self.free = list(range(1, n_slots))

        def take(self, n: int) -> list[int] | None:
            if n > len(self.free):
                return None
            out, self.free = self.free[:n], self.free[n:]
            return out

        def give(self, slots: Any) -> None:
            self.free.extend(int(x) for x in slots)

        def available(self) -> int:
            return len(self.free)

    lender = Lender()
    fwd = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
    pool = HostedStatePool(layout, conv, rec, lender, reserved=(0,), stream=CudaStream(stream=fwd))
    tree = HybridRadixCache(pool)
    big = torch.randn(size, size, device=dev) / size**0.5
    src_slot, dst_slot = lender.take(2) or [1, 2]
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with torch.cuda.stream(fwd):  # the engine's forward: long, then the request's state
        x = big
        for _ in range(matmuls):
            x = torch.tanh(x @ big)
        rec[:, src_slot].copy_(torch.full_like(rec[:, src_slot], 7.0) + 0.0 * x.mean())
    queued_ms = (time.perf_counter() - t0) * 1e3
    a, b = RequestOwner("a"), RequestOwner("b")
    s = pool.lend(src_slot, a)
    res = tree.insert([1, 2, 3], torch.arange(3), state_slot=s)  # no ready fence: stream order
    pool.reclaim(s, a)
    d = pool.lend(dst_slot, b)
    tree.restore(tree.match([1, 2, 3, 4]).node, d, dst_owner=b)
    pool.reclaim(d, b)
    torch.cuda.synchronize(dev)
    snap = res.node.snapshot
    ok = bool((rec[:, snap] == 7.0).all()) and bool((rec[:, dst_slot] == 7.0).all())
    return {"ok": ok, "host_queue_ms": round(queued_ms, 3), "matmuls": matmuls}


def _host_ms(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn`` from an idle device to an idle device: queueing, the work, the wait."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def _device_ms(fn: Callable[[], Any]) -> float:
    """Device time between two events recorded around ``fn`` on the current stream."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def clone_and_fingerprint(reps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Clone against a raw copy of the same bytes; fingerprint against clone and one read pass.
    Alternating rounds; medians."""
    layout = StateLayout.for_gdn(36, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
    pool = LinearStatePool(layout, 3, "cuda")
    req = RequestOwner("r")
    src = pool.alloc(req)
    pool.recurrent[:, src].normal_()
    pool.conv[:, src].normal_()
    nbytes = layout.slot_bytes
    raw_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    raw_dst = torch.empty_like(raw_src)
    rec_words = pool.recurrent[:, src]

    def clone() -> None:
        w = pool.clone(src, NodeOwner(9))
        w.fence.wait()
        pool.free(w.slot, NodeOwner(9))

    def raw() -> None:
        raw_dst.copy_(raw_src)

    def fingerprint() -> None:
        pool.fingerprint(src)

    # The pool's hasher takes the fused Triton kernel on CUDA when Triton imports ("auto"); the
    # torch path is the reference it must equal.
    auto = SlotHasher([pool.conv, pool.recurrent])
    reference = SlotHasher([pool.conv, pool.recurrent], kernel="torch")

    def fingerprint_torch() -> None:
        reference.fingerprint(src)

    def read_pass() -> None:  # the recurrent rows' words summed: one read of ~all the slot's bytes
        torch.sum(rec_words.reshape(rec_words.shape[0], -1).view(torch.int64))

    fns = {
        "clone": clone,
        "raw": raw,
        "fingerprint": fingerprint,
        "fingerprint_torch": fingerprint_torch,
        "read_pass": read_pass,
    }
    host: dict[str, list[float]] = {k: [] for k in fns}
    dev: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: kernels loaded, allocator blocks cached
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            host[k].append(_host_ms(fn))
            dev[k].append(_device_ms(fn))
    h = {k: statistics.median(v) for k, v in host.items()}
    d = {k: statistics.median(v) for k, v in dev.items()}
    gib = nbytes / 2**30
    clone_row = {
        "slot_bytes": nbytes,
        "clone_ms": round(h["clone"], 4),
        "raw_copy_ms": round(h["raw"], 4),
        "clone_over_raw_throughput": round(h["raw"] / h["clone"], 3),
        "device_clone_ms": round(d["clone"], 4),
        "device_raw_copy_ms": round(d["raw"], 4),
        "device_clone_gib_s": round(gib / (d["clone"] / 1e3), 1),
        "device_raw_gib_s": round(gib / (d["raw"] / 1e3), 1),
        "device_clone_over_raw_throughput": round(d["raw"] / d["clone"], 3),
    }
    fingerprint_row: dict[str, Any] = {
        "fingerprint_ms": round(h["fingerprint"], 4),
        "clone_ms": round(h["clone"], 4),
        "fingerprint_over_clone": round(h["fingerprint"] / h["clone"], 3),
        "device_fingerprint_ms": round(d["fingerprint"], 4),
        "device_read_pass_ms": round(d["read_pass"], 4),
        "device_fingerprint_over_clone": round(d["fingerprint"] / d["clone"], 3),
        "device_fingerprint_over_read_pass": round(d["fingerprint"] / d["read_pass"], 3),
        "kernel": auto.kernel,
        "equal_to_torch_path": auto.fingerprint(src) == reference.fingerprint(src) == pool.fingerprint(src),
        "device_fingerprint_torch_ms": round(d["fingerprint_torch"], 4),
        "device_fingerprint_torch_over_clone": round(d["fingerprint_torch"] / d["clone"], 3),
    }
    return clone_row, fingerprint_row


def fingerprint_warm_up(slots: int = 32) -> dict[str, Any]:
    """The hasher's warm-up against the fingerprints that follow it (see the module docstring)."""
    # conv: 24-byte rows, slot addresses alternate between multiples of 16 bytes and not; shapes no
    # other section uses, so that Triton has compiled none of their variants yet.
    conv = torch.randn(3, slots, 3, 2, device="cuda")
    rec = torch.randn(5, slots, 6, device="cuda").to(torch.bfloat16)  # 12-byte rows: int32 words
    hasher = SlotHasher([conv, rec])
    before = compiled_variants()
    t0 = time.perf_counter()
    warmed = hasher.warm_up()
    torch.cuda.synchronize()
    warm_ms = (time.perf_counter() - t0) * 1e3
    after_warm = compiled_variants()
    firsts = []
    for s in range(slots):
        t0 = time.perf_counter()
        hasher.fingerprint(s)
        firsts.append((time.perf_counter() - t0) * 1e3)
    after_all = compiled_variants()
    known = None not in (after_warm, after_all)
    return {
        "kernel": hasher.kernel,
        "slots_warmed": list(warmed),
        "warm_up_ms": round(warm_ms, 3),
        "variants_before": before,
        "variants_after_warm_up": after_warm,
        "variants_after_all_slots": after_all,
        "slowest_first_fingerprint_ms": round(max(firsts), 4),
        "median_first_fingerprint_ms": round(statistics.median(firsts), 4),
        "ok": hasher.kernel == "triton" and (after_warm == after_all if known else max(firsts) < 5.0),
    }


def shared_tier() -> dict[str, Any]:
    """Publish from one CUDA engine, fetch into another (inline, then background); exact answers."""
    model = HybridModel(HybridConfig(), device="cuda")
    system = [(7 * i) % 500 for i in range(300)]
    prompts = [system + [(11 * i + j) % 500 for j in range(40)] for i in range(4)]
    out: dict[str, Any] = {}
    for mode in ("inline", "background"):
        store = MemoryStore()
        a = ReferenceEngine(model, shared_store=store, publisher="A", shared_background=mode == "background")
        b = ReferenceEngine(model, shared_store=store, publisher="B")
        for i, p in enumerate(prompts[:2]):
            a.submit(EngineRequest(f"a{i}", p, 4))
        a.run()
        a.manager.publish_pending(wait=True)
        for i, p in enumerate(prompts):
            b.submit(EngineRequest(f"b{i}", p, 4))
        finished = b.run()
        wrong = sum(r.output != generate_cold(model, r.prompt, len(r.output))[0] for r in finished)
        m_a, m_b = a.manager.metrics(), b.manager.metrics()
        a.manager.check_invariants()
        b.manager.check_invariants()
        out[mode] = {
            "published": m_a.shared_published,
            "foreign_hits": m_b.shared_foreign_hits,
            "rejected": m_b.shared_rejected,
            "wrong_answers": int(wrong),
        }
        assert a.shared is not None
        a.shared.close()
    out["ok"] = all(
        r["published"] > 0 and r["foreign_hits"] > 0 and r["rejected"] == 0 and r["wrong_answers"] == 0
        for r in out.values()
    )
    return out


def hammer(requests: int, delay_us: float) -> dict[str, Any]:
    """The hammer on cuda: clean, with forensics, clean with each forward delayed by ``delay_us``,
    and each fence bug injected under the same delay (which should make it serve wrong answers)."""
    out: dict[str, Any] = {}
    runs: list[tuple[str, str | None, float]] = [
        ("clean", None, 0.0),
        ("forensics", None, 0.0),
        ("clean-delayed", None, delay_us),
        ("no-donate-fence-delayed", "no-donate-fence", delay_us),
        ("no-restore-fence-delayed", "no-restore-fence", delay_us),
    ]
    keep = (
        "device", "requests", "hits", "cached_fraction", "wrong_answers", "cross_talk", "logit_mismatches",
        "slots_leaked", "kv_leaked", "snapshot_corruptions", "stuck", "error", "wall_s", "ground_truth_s",
        "probe_ttft_ratio", "ok",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, bug, delay in runs:
            cfg = HammerConfig(
                requests=requests if bug is None else max(1, requests // 2),
                device="cuda",
                inject=bug,
                forward_delay_us=delay,
                forensics=os.path.join(tmp, "ledger.jsonl") if name == "forensics" else None,
            )
            rep = run_hammer(cfg)
            d = rep.as_dict()
            out[name] = {k: d[k] for k in keep}
            out[name]["forward_delay_us"] = delay
            examples = rep.wrong_examples
            out[name]["example"] = examples[0] if examples else None
    return out


def _guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``fn()``, or ``{"ok": False, "error": ...}`` when it raises: one section's failure must not
    lose the others' figures (a lent GPU's minutes are few)."""
    try:
        return fn()
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _verdict(out: dict[str, Any], hammer_runs: bool) -> bool:
    """Whether every check that ran passed (and the hammer ran, when asked for)."""
    ham = out.get("hammer", {})
    fences_ok = out["fences"].get("ordered_ok") is True and out["fences"].get("unordered_stale") is True
    ok = fences_ok and out["hosted_stream"].get("ok") is True and out["shared_tier"].get("ok") is True
    ok = ok and out["fingerprint_warm_up"].get("ok") is True
    ok = ok and "error" not in out["clone"] and "error" not in out["fingerprint"]
    if hammer_runs:
        if "error" in ham:
            return False
        clean = [ham[k]["ok"] for k in ("clean", "forensics", "clean-delayed")]
        caught = [not ham[k]["ok"] for k in ("no-donate-fence-delayed", "no-restore-fence-delayed")]
        ok = ok and all(clean) and all(caught)
    return bool(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hammer-requests", type=int, default=200, help="requests of each clean hammer run; 0: none")
    ap.add_argument("--delay-us", type=float, default=20000.0, help="forward delay of the delayed hammer runs")
    ap.add_argument(
        "--out", help="also write the JSON here after each section (a run stopped by a time limit leaves its figures)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: this script is for a machine with a GPU"}))
        raise SystemExit(2)
    out: dict[str, Any] = {"bench": "gpu_check", "device": device_info()}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    def run(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        out[name] = _guarded(fn)
        save()

    run("fences", fences)
    run("hosted_stream", hosted_stream)
    run("shared_tier", shared_tier)
    run("fingerprint_warm_up", fingerprint_warm_up)
    pair = _guarded(lambda: dict(zip(("clone", "fingerprint"), clone_and_fingerprint(args.reps), strict=True)))
    out["clone"], out["fingerprint"] = (pair, pair) if "error" in pair else (pair["clone"], pair["fingerprint"])
    save()
    if args.hammer_requests:
        run("hammer", lambda: hammer(args.hammer_requests, args.delay_us))
    out["ok"] = _verdict(out, bool(args.hammer_requests))
    save()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
