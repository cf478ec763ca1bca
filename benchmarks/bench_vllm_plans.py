"""What planning a save costs vLLM's scheduler thread while other saves are pending, and what the
plans of one burst reserve: ``PagedHostStore.plan_save`` with ``N`` plans already made and not
yet committed (vLLM plans every save a step schedules before the worker's report lets it commit
any), for two bursts, side by side with the same call with none pending:

- ``unrelated``: every prompt its own (no plan can rely on another's blocks);
- ``one_system_prompt``: every prompt a system prompt of 2.5 blocks and a tail of its own (the
  later plans rely on the first's copies of the two shared blocks, ``SavePlan.after``).

``plan_us``: the median ``plan_save`` with ``N`` pending and, alternating with it, with none
(``plan_alone_us``: the same ids on the same store once the burst's plans were abandoned);
``ratio``: the first over the second.
``pages_reserved``: the pages the burst's plans reserved, against ``pages_needed``, the pages of
the blocks its prompts do not share (the floor: a block copied twice costs one more).
Plans are abandoned, never committed: this times the scheduler's side of planning only. Prints
one JSON object.

    python benchmarks/bench_vllm_plans.py [--pending 16 256] [--block 256] [--blocks 16] [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from linear_state import StateLayout
from radixcache.vllm import PagedHostStore, PagedLayout, SavePlan

STATE = StateLayout(num_layers=2, conv_shape=(3, 8), recurrent_shape=(2, 4, 4))  # the state's size is not timed here
SHARED_BLOCKS = 2  # the system prompt's whole blocks (it ends half a block further)


def _prompts(n: int, block: int, blocks: int, shared: bool, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 150_000, SHARED_BLOCKS * block + block // 2)
    out = []
    for _ in range(n):
        own = rng.integers(3, 150_000, blocks * block)
        out.append((np.concatenate([system, own]) if shared else own)[: blocks * block])
    return out


def _store(layout: PagedLayout, plans: int, blocks: int) -> PagedHostStore:
    room = (plans + 2) * blocks
    return PagedHostStore(layout, room * (layout.page_bytes + STATE.slot_bytes), verify=False, copy_thread=False)


def _burst(layout: PagedLayout, n: int, blocks: int, shared: bool, reps: int) -> dict[str, object]:
    block = layout.block_tokens
    prompts = _prompts(n + 1, block, blocks, shared, seed=n)
    with_pending: list[float] = []
    alone: list[float] = []
    reserved = 0
    st = _store(layout, n + 1, blocks)
    for _ in range(reps):
        plans = [st.plan_save(f"r{i}", ids) for i, ids in enumerate(prompts[:n])]
        reserved = sum(len(plan.pages) for plan in plans if isinstance(plan, SavePlan))
        t0 = time.perf_counter()
        last = st.plan_save("last", prompts[n])
        with_pending.append(time.perf_counter() - t0)
        for plan in (last, *plans):
            assert isinstance(plan, SavePlan)
            st.abandon(plan)
        t0 = time.perf_counter()  # the same call on the same store, none pending now
        last = st.plan_save("last", prompts[n])
        alone.append(time.perf_counter() - t0)
        assert isinstance(last, SavePlan)
        st.abandon(last)
        st.check_invariants()
    st.close()
    needed = n * blocks - (n - 1) * SHARED_BLOCKS if shared else n * blocks  # the shared blocks once
    p, a = statistics.median(with_pending) * 1e6, statistics.median(alone) * 1e6
    return {
        "plan_us": round(p, 1),
        "plan_alone_us": round(a, 1),
        "ratio": round(p / a, 2),
        "pages_reserved": reserved,
        "pages_needed": needed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pending", type=int, nargs="+", default=[16, 256], help="plans pending (N)")
    ap.add_argument("--block", type=int, default=256, help="tokens per block")
    ap.add_argument("--blocks", type=int, default=16, help="blocks per prompt (a 4,096-token prompt by default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="N = 4, 1 rep (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.pending, args.reps = [4], 1
    layout = PagedLayout(block_tokens=args.block, kv_layers=2, kv_page_bytes=64, state=STATE)
    out: dict[str, object] = {"block": args.block, "prompt_tokens": args.block * args.blocks, "reps": args.reps}
    for n in args.pending:
        out[f"pending_{n}"] = {
            "unrelated": _burst(layout, n, args.blocks, False, args.reps),
            "one_system_prompt": _burst(layout, n, args.blocks, True, args.reps),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
