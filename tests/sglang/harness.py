"""The CPU differential harness: SGLang's real pools, SGLang's built-in hybrid cache or ours, driven
through SGLang's own scheduler-side helpers over a seeded request stream.

The model is simulated: the state after tokens ``t[0:n]`` is a function of ``(n, H(t[0:n]))`` (a
rolling hash), written into the request's mamba slot by each forward. With SGLang's extra buffer
(``make_env(extra_buffer=True)``), a forward also leaves the state at a tracking boundary it
crossed in the request's next ping-pong track slot and records it as SGLang's runner and batch
result processing do (``mamba_last_track_idx`` / ``_seqlen``, ``mamba_prev_track_seqlen``): a
prefill chunk at ``start + k * grid`` (its deepest whole grid step from where it started), a
decode step when its new length is on the grid. Before a forward over
``[start, end)`` the slot must hold the state of exactly ``t[0:start]``: a restored hit of the
wrong depth or content, a slot overwritten by someone else, a snapshot filed at the wrong depth,
all show up as a *state mismatch*. Nothing else is checked by the forward; the caller checks
SGLang's accounting when idle.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, release_req
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.mem_cache.allocation import ensure_mamba_capacity
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

LAYERS = 2
MOD = (1 << 24) - 3  # hashes stay exact in float32


def _h(h: int, tok: int) -> int:
    return (h * 31 + tok + 1) % MOD


def setup_sglang(page_size: int = 1) -> None:
    """The process-wide settings SGLang's pools read, without a model config (nothing is
    downloaded): server args, and the mamba chunk size its unified cache would read from a config."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    from sglang.srt.mem_cache.rust_tree_core import adapter as rust_adapter
    from sglang.srt.mem_cache.unified_cache.components import mamba as mamba_component

    mamba_component.mamba_cache_chunk_size = lambda: 64
    mamba_component.mamba_checkpoint_grid = lambda page: 64
    rust_adapter.mamba_cache_chunk_size = lambda: 64


class StepClock:
    """The policy's clock in the harness: a millisecond per scheduler step (:func:`run_stream`
    ticks it), so runs are deterministic (the backend's default, ``time.monotonic``, makes eviction
    choices depend on the machine) and do not depend on how often the cache reads the clock."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def tick(self) -> None:
        """One scheduler step: a millisecond."""
        self.t += 1e-3


@dataclass
class Env:
    """One cache over its own SGLang pools."""

    cache: Any
    cache_params: CacheInitParams
    rtp: HybridReqToTokenPool
    alloc: TokenToKVPoolAllocator
    kv_size: int
    mamba_size: int
    track_grid: int = 0  # the extra buffer's tracking grid (0: no extra buffer)
    keys: torch.Tensor | None = None  # with a KV pool: its one layer's K rows ([rows, 1, 2], float32)
    mismatches: list[str] = field(default_factory=list)
    hit_tokens: int = 0
    requests: int = 0  # admissions, resumed requests included
    retractions: int = 0

    @property
    def conv(self) -> torch.Tensor:
        t: torch.Tensor = self.rtp.mamba_pool.mamba_cache.conv[0]
        return t

    @property
    def temporal(self) -> torch.Tensor:
        t: torch.Tensor = self.rtp.mamba_pool.mamba_cache.temporal
        return t

    # ---------------------------------------------------------------- simulated model
    def write_state(self, slot: int, n: int, h: int) -> None:
        t = self.temporal[:, slot]
        t.fill_(float(h % 1000))
        flat = t.view(t.shape[0], -1)
        flat[:, 0] = float(n)
        flat[:, 1] = float(h)
        self.conv[:, slot].fill_(float(n % 128))

    def read_state(self, slot: int) -> tuple[int, int, bool]:
        """(depth, hash, whether the rest of the slot agrees with them)."""
        t = self.temporal[:, slot]
        flat = t.reshape(t.shape[0], -1)
        n, h = int(flat[0, 0].item()), int(flat[0, 1].item())
        ok = bool((flat[:, 0] == n).all()) and bool((flat[:, 1] == h).all())
        ok = ok and bool((flat[:, 2:] == float(h % 1000)).all()) and bool((self.conv[:, slot] == float(n % 128)).all())
        return n, h, ok

    def forward(self, req: Req, tokens: array[int], start: int, end: int, hashes: list[int]) -> None:
        slot = int(req.kv.mamba_pool_idx)
        n, h, ok = self.read_state(slot)
        if (n, h) != (start, hashes[start]) or not ok:
            self.mismatches.append(
                f"{req.rid}: slot {slot} holds depth {n} hash {h} (consistent={ok}), "
                f"forward from {start} needs hash {hashes[start]}"
            )
        self.write_state(slot, end, hashes[end])
        if self.keys is not None:
            self._check_kv(req, start, end, hashes)
        grid = self.track_grid
        if grid:
            # a prefill chunk: its deepest whole grid step from its start; a decode step: its new length on the grid
            depth = start + (end - start) // grid * grid if end - start > 1 else end - end % grid
            if depth > start:
                self.track(req, depth, hashes[depth])

    def _check_kv(self, req: Req, start: int, end: int, hashes: list[int]) -> None:
        """With a KV pool: the row of token ``i`` holds ``(i, hash of t[0:i+1])``. The forward
        checks the rows of ``[0, start)`` (a hit's KV: the tree's, or imported from the shared
        tier) and writes those of ``[start, end)``."""
        keys = self.keys
        assert keys is not None
        idx = self.rtp.req_to_token[req.kv.req_pool_idx, :end].to(torch.int64)
        want = torch.tensor([[float(i), float(hashes[i + 1])] for i in range(end)], dtype=torch.float32)
        got = keys[idx[:start], 0]
        bad = (got != want[:start]).any(dim=1).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            self.mismatches.append(
                f"{req.rid}: KV row {int(idx[i])} of token {i} holds {got[i].tolist()}, wants {want[i].tolist()}"
            )
        keys[idx[start:end], 0] = want[start:end]

    def track(self, req: Req, depth: int, h: int) -> None:
        """SGLang's extra-buffer tracking of the state after ``depth`` tokens (hash ``h``): written
        into the request's next track slot, which becomes the latest; the previous latest is kept
        as the earlier one."""
        kv = req.kv
        nxt = int(kv.mamba_next_track_idx)
        self.write_state(int(kv.mamba_ping_pong_track_buffer[nxt]), depth, h)
        kv.mamba_prev_track_seqlen = kv.mamba_last_track_seqlen
        kv.mamba_last_track_seqlen = depth
        kv.mamba_last_track_idx = nxt
        kv.mamba_next_track_idx = self.rtp.get_mamba_ping_pong_other_idx(nxt)

    # ---------------------------------------------------------------- accounting
    def idle_check(self) -> None:
        """SGLang's own idle invariants (its scheduler's checker, the formula and the census it
        runs when idle): available + evictable + protected == total for the KV pool and for the
        mamba pool, and no KV index or mamba slot that is neither free nor the tree's. Then the
        cache's own ``sanity_check``."""
        c = self.cache
        check = SchedulerInvariantChecker._check_pool_invariant
        leak, msg = check(
            "full", self.alloc.available_size(), c.full_evictable_size(), c.full_protected_size(), 0, self.alloc.size
        )
        assert not leak, msg
        leak, msg = check(
            "mamba",
            self.rtp.mamba_allocator.available_size(),
            c.mamba_evictable_size(),
            c.mamba_protected_size(),
            0,
            self.rtp.mamba_pool.size,
        )
        assert not leak, msg
        free_kv = set(self.alloc.get_all_free_pages().tolist())
        cached_kv = set(c.all_values_flatten().tolist())
        assert not free_kv & cached_kv, f"KV both free and cached: {sorted(free_kv & cached_kv)[:5]}"
        lost = set(range(1, self.alloc.size + 1)) - free_kv - cached_kv
        assert not lost, f"KV indices neither free nor cached: {sorted(lost)[:10]}"
        free_m = set(self.rtp.mamba_allocator.free_slots.tolist())
        cached_m = set(c.all_mamba_values_flatten().tolist())
        assert not free_m & cached_m, f"mamba slots both free and cached: {sorted(free_m & cached_m)}"
        lost = set(range(1, self.rtp.mamba_allocator.size + 1)) - free_m - cached_m
        assert not lost, f"mamba slots neither free nor cached: {sorted(lost)}"
        c.sanity_check()


def make_env(
    kind: str,
    *,
    kv_size: int = 2048,
    mamba_size: int = 10,
    max_reqs: int = 8,
    page_size: int = 1,
    tree_core: str = "python",
    extra_buffer: bool = False,
    cache_kwargs: dict[str, Any] | None = None,
    kv_pool: bool = False,
) -> Env:
    """``kind``: ``"builtin"`` (SGLang's UnifiedRadixCache, FULL + MAMBA, over its ``tree_core``:
    ``"python"`` or SGLang's default ``"rust"``) or ``"radixcache"``. ``extra_buffer``: SGLang's
    extra-buffer strategy with overlap scheduling (two track slots per request, tracked on a grid
    of ``lcm(64, page_size)`` tokens). ``cache_kwargs``: more keyword arguments for radixcache's
    backend (``policy``, ``forensics``, ``shared``). ``kv_pool``: the allocator gets SGLang's KV
    pool (a hybrid pool over one attention layer, one head of two floats), and each forward
    checks the KV rows of what it resumes from (:meth:`Env._check_kv`)."""
    setup_sglang(page_size)
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8, state_size=4, conv_kernel=4
    )
    params = Mamba2CacheParams(shape=shape, layers=list(range(LAYERS)))
    rtp = HybridReqToTokenPool(
        size=max_reqs,
        mamba_size=mamba_size,
        mamba_spec_state_size=max_reqs,
        max_context_len=1024,
        device="cpu",
        enable_memory_saver=False,
        cache_params=params,
        mamba_layer_ids=list(range(LAYERS)),
        enable_mamba_extra_buffer=extra_buffer,
        enable_overlap_schedule=extra_buffer,
    )
    kvcache = None
    if kv_pool:
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MHATokenToKVPool

        full = MHATokenToKVPool(
            size=kv_size, page_size=page_size, dtype=torch.float32, head_num=1, head_dim=2, layer_num=1,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        kvcache = HybridLinearKVPool(
            size=kv_size, dtype=torch.float32, page_size=page_size, head_num=1, head_dim=2,
            full_attention_layer_ids=[LAYERS], device="cpu", mamba_pool=rtp.mamba_pool, full_kv_pool=full,
        )  # fmt: skip
    alloc = TokenToKVPoolAllocator(size=kv_size, dtype=torch.bfloat16, device="cpu", kvcache=kvcache, need_sort=False)
    init = CacheInitParams(
        req_to_token_pool=rtp,
        token_to_kv_pool_allocator=alloc,
        page_size=page_size,
        disable=False,
        enable_mamba_extra_buffer=extra_buffer,
    )
    if kind == "builtin":
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        init.tree_components = (ComponentType.FULL, ComponentType.MAMBA)
        init.tree_core_backend = tree_core
        cache: Any = UnifiedRadixCache(init)
    else:
        from radixcache.sglang.backend import RadixcacheHybridCache

        cache = RadixcacheHybridCache(init, clock=StepClock(), **(cache_kwargs or {}))
    grid = math.lcm(64, page_size) if extra_buffer else 0
    keys = kvcache.full_kv_pool.k_buffer[0] if kvcache is not None else None
    return Env(cache, init, rtp, alloc, kv_size, mamba_size, grid, keys)


def build_context(params: Any, **server_args: Any) -> SimpleNamespace:
    """SGLang's ``TreeCacheBuildContext`` for a hybrid model without hierarchical cache, its
    ``server_args`` SGLang's defaults for what the factory reads, overridden by ``server_args``."""
    sa = {"speculative_algorithm": None, "radix_eviction_policy": "lru", **server_args}
    return SimpleNamespace(
        params=params,
        is_hybrid_ssm=True,
        is_hybrid_swa=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        server_args=SimpleNamespace(**sa),
    )


# -------------------------------------------------------------------- the request stream
def stream(seed: int, n: int) -> list[tuple[list[int], int, bool]]:
    """``n`` requests: (prompt ids, output tokens, aborted). Shared system prompts, re-sent
    identical prompts, follow-up turns that extend an earlier prompt, prompt lengths 1 mod 64 and
    prefixes that leave a page mid-way (with pages above 1 token)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(rng.choice((31, 64, 65, 100)))] for _ in range(4)]
    sent: list[list[int]] = []
    out = []
    for _ in range(n):
        r = rng.random()
        if sent and r < 0.15:
            prompt = list(rng.choice(sent))  # an identical re-send
        elif sent and r < 0.35:
            base = rng.choice(sent)  # a follow-up turn, or a prefix cut anywhere
            cut = rng.randrange(1, len(base) + 1)
            prompt = base[:cut] + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 40))]
        else:
            sys_p = rng.choice(systems)
            prompt = sys_p + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 90))]
        if rng.random() < 0.2:  # a length of 1 mod 64
            target = 64 * rng.randrange(1, 4) + 1
            prompt = (prompt + [rng.randrange(1, 30000) for _ in range(target)])[:target]
        sent.append(prompt)
        out.append((prompt, rng.randrange(1, 12), rng.random() < 0.1))
    return out


@dataclass
class Running:
    req: Req
    tokens: array[int]  # prompt + outputs to be
    hashes: list[int]
    prompt_len: int
    outputs: int
    abort: bool
    done: int = 0  # tokens whose state the slot holds
    fill_len: int = 0  # this round's prefill length: the prompt, or prompt + outputs after a retraction
    first_kv: torch.Tensor | None = None  # the first chunk's KV, allocated at admission


def _chunk_end(done: int, fill_len: int, chunk: int) -> int:
    return min(fill_len, (done // chunk + 1) * chunk) if done < fill_len else done + 1


def new_request(rid: str, prompt: list[int], outputs: int, abort: bool, rng: random.Random) -> Running:
    """A request and the tokens it will have produced (drawn now, so a retracted request resumes
    with the same ones)."""
    tokens = array("q", prompt + [rng.randrange(1, 30000) for _ in range(outputs)])
    hashes = [0]
    for t in tokens:
        hashes.append(_h(hashes[-1], t))
    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", prompt),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=outputs),
    )
    return Running(req, tokens, hashes, len(prompt), outputs, abort)


def admit(env: Env, run: Running, chunk: int = 48) -> bool:
    """Match (copy-on-write of the hit state), lock, allocate the row, the state slot and the first
    chunk's KV: what the scheduler does when it takes a request (new, or retracted and resumed with
    its outputs as prompt) into a prefill batch. False: no room (the request is left waiting, as a
    scheduler leaves it)."""
    req = run.req
    req.init_next_round_input(env.cache)
    if req.kv.mamba_cow_src_index is not None:  # SGLang's batch preparation: the deferred copy
        env.rtp.mamba_pool.copy_from(req.kv.mamba_cow_src_index.reshape(1), req.kv.mamba_pool_idx.reshape(1))
        req.kv.mamba_cow_src_index = None
    req.lock = env.cache.lock(req.last_node)
    p = req.prefix_len
    fill_len = len(req.origin_input_ids) + len(req.output_ids)
    first = _alloc_kv(env, _chunk_end(p, fill_len, chunk) - p)
    if first is None or not ensure_mamba_capacity(env.rtp, [req], env.cache) or env.rtp.alloc([req]) is None:
        # what the scheduler does with a request it cannot add: unlock, free the slot match gave it
        if first is not None:
            env.alloc.free(first)
        _drop(env, req)
        return False
    if req.kv.mamba_needs_clear:
        env.write_state(int(req.kv.mamba_pool_idx), 0, 0)
        req.kv.mamba_needs_clear = False
    if p:
        env.rtp.req_to_token[req.kv.req_pool_idx, :p] = env.cache.prefix_device_indices(req).to(torch.int32)
    req.kv.kv_committed_len = req.kv.kv_allocated_len = p
    env.requests += 1
    env.hit_tokens += p
    run.done, run.fill_len, run.first_kv = p, fill_len, first
    return True


def retract(env: Env, run: Running) -> None:
    """SGLang's retraction of a decoding request under memory pressure (its ``release_req``: the
    KV row released without a checkpoint, the state slot freed, the request reset to wait)."""
    release_req(
        req=run.req,
        remaing_req_count=0,
        req_to_token_pool=env.rtp,
        token_to_kv_pool_allocator=env.alloc,
        tree_cache=env.cache,
        hisparse_coordinator=None,
    )
    env.retractions += 1


def _drop(env: Env, req: Req) -> None:
    env.cache.unlock(req.lock)
    req.lock = None
    req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False
    if req.kv.holds_mamba:
        env.rtp.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1))
        req.kv.mamba_pool_idx = None


def _alloc_kv(env: Env, n: int) -> torch.Tensor | None:
    got: torch.Tensor | None = env.alloc.alloc(n)
    if got is None:
        env.cache.evict(EvictParams(num_tokens=n - env.alloc.available_size()))
        got = env.alloc.alloc(n)
    return got


def step(env: Env, run: Running, chunk: int) -> bool:
    """One scheduled step: a prefill chunk (checkpointed, as chunked prefill does) or one decode
    token. Returns False once the request finished, was aborted or found no KV (released)."""
    req = run.req
    total = run.prompt_len + run.outputs
    end = _chunk_end(run.done, run.fill_len, chunk)
    kv, run.first_kv = run.first_kv, None
    if kv is None and not (run.abort and run.done >= run.prompt_len // 2):
        kv = _alloc_kv(env, end - run.done)
    elif kv is not None and run.abort and run.done >= run.prompt_len // 2:
        env.alloc.free(kv)
        kv = None
    if kv is None:
        req.finished_reason = FINISH_ABORT()
        release_kv_cache(req, env.cache, checkpoint=False)
        return False
    env.rtp.req_to_token[req.kv.req_pool_idx, run.done : end] = kv.to(torch.int32)
    req.kv.kv_allocated_len = end
    env.forward(req, run.tokens, run.done, end, run.hashes)
    run.done = end
    req.kv.kv_committed_len = end
    if end > len(req.origin_input_ids) + len(req.output_ids):
        req.output_ids.append(run.tokens[end - 1])
    if end < run.fill_len:
        req.extend_end = end
        checkpoint_kv_cache(req, env.cache)
        return True
    if end >= total:
        req.finished_reason = FINISH_LENGTH(length=run.outputs)
        release_kv_cache(req, env.cache, checkpoint=True)
        return False
    return True


def run_stream(
    env: Env,
    seed: int,
    n: int,
    *,
    concurrency: int = 3,
    chunk: int = 48,
    retract_p: float = 0.0,
    between: Callable[[Env, random.Random], None] | None = None,
    queued: int = 0,
    arrived: Callable[[Env, Running], None] | None = None,
) -> None:
    """The seeded stream through ``env``, ``concurrency`` requests in flight, idle checks whenever
    none runs. With ``retract_p``, each decode step first retracts its request with that
    probability (it waits, then resumes with its outputs as prompt). ``between`` runs after every
    scheduler step (the misuse test's wrong calls). ``queued``: that many requests arrive ahead of
    their admission and wait in a queue (``arrived`` runs for each as it arrives, as SGLang's
    scheduler calls ``_prefetch_kvcache``); 0: each arrives when admitted. Mismatches are
    collected in ``env.mismatches``."""
    rng = random.Random(seed * 7919 + 1)
    reqs = stream(seed, n)
    i = 0
    running: list[Running] = []
    waiting: list[Running] = []
    queue: list[Running] = []
    clock = getattr(env.cache, "clock", None)
    while i < len(reqs) or running or waiting or queue:
        if isinstance(clock, StepClock):
            clock.tick()
        while len(queue) < queued and i < len(reqs):
            prompt, outputs, abort = reqs[i]
            queue.append(new_request(f"r{i}", prompt, outputs, abort, rng))
            i += 1
            if arrived is not None:
                arrived(env, queue[-1])
        while (waiting or queue or i < len(reqs)) and len(running) < concurrency:
            if waiting:
                r = waiting.pop(0)
            elif queue:
                r = queue.pop(0)
            else:
                prompt, outputs, abort = reqs[i]
                r = new_request(f"r{i}", prompt, outputs, abort, rng)
                i += 1
            if admit(env, r, chunk):
                running.append(r)
            elif r.req.is_retracted:
                waiting.append(r)  # a retracted request is never dropped: it waits its turn
                break
        if not running:
            if waiting:
                env.cache.evict(EvictParams(num_tokens=env.kv_size, mamba_num=env.mamba_size))
            continue
        r = rng.choice(running)
        if retract_p and r.fill_len <= r.done < r.prompt_len + r.outputs - 1 and rng.random() < retract_p:
            retract(env, r)
            running.remove(r)
            waiting.append(r)
        elif not step(env, r, chunk):
            running.remove(r)
        if between is not None:
            between(env, rng)
        if not running:
            env.idle_check()
    env.idle_check()
