"""What the vLLM tests share: a tiny Qwen3-Next built here with seeded random weights (no
download), an engine in this process, a multi-round workload of the shapes a prefix cache must
serve, and the oracle's tools: greedy token ids per request, vLLM's own count of cached tokens,
and noise in every free block of vLLM's KV and state pages between rounds (so a state nobody
restored is garbage, never a lucky reuse of the block that still held it).

The model: 3 Gated DeltaNet layers and 1 attention layer, bf16 (the CPU GDN kernel's dtype),
linear head dims 128 (the CPU kernel's), attention head dim 64. vLLM's hybrid block comes out at
640 tokens on it."""

from __future__ import annotations

import gc
import itertools
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
BLOCK = 640  # vLLM's hybrid block on this model (attention and state pages aligned)


def build_tiny_qwen3_next(out: Path, *, seed: int = 0) -> Path:
    """Save the tiny random-weight Qwen3-Next into ``out`` (config and safetensors). Seeded:
    every build is the same model."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Qwen3NextForCausalLM"],
    )
    model: Any = Qwen3NextForCausalLM(cfg)
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)  # wide enough that greedy answers depend on the whole prompt
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # Long memory: transformers draws A in (0, 16), and a GDN layer with decay
                # exp(-A * dt) forgets its state within a few tokens, so a state restored wrong
                # (even zeros) would barely change an answer. With A in (0.002, 0.02) a state
                # carries over a few hundred tokens: a wrong one changes answers decisively.
                p.copy_(torch.empty(p.shape).uniform_(0.002, 0.02, generator=gen).log())
    model.save_pretrained(out)
    return out


def build_tiny_qwen3_dense(out: Path, *, seed: int = 0) -> Path:
    """A tiny dense Qwen3 (attention layers only, seeded random weights): a model the connector
    must refuse (vLLM's own prefix cache serves it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        architectures=["Qwen3ForCausalLM"],
    )
    model: Any = Qwen3ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def block_pool_leaks(llm: Any) -> int:
    """Blocks vLLM's pool does not hold free once the engine is idle and its prefix cache reset
    (0: nothing leaked; the null block is never free)."""
    assert llm.reset_prefix_cache()
    pool = _core(llm).scheduler.kv_cache_manager.block_pool
    return int(pool.num_gpu_blocks) - 1 - int(pool.get_num_free_blocks())


def make_llm(model: Path, *, prefix_caching: bool, multiprocess: bool = False, **options: Any) -> Any:
    """An engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), token ids in and out (no
    tokenizer), eager, with a small KV space (256 MiB) so that two engines fit on a CI machine.
    ``multiprocess``: vLLM's default instead, the engine core in a process of its own (where
    vLLM's CPU build runs the worker in one more, its multiprocess executor)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM

    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enable_prefix_caching=prefix_caching,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=8,
        seed=0,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 28,
        **options,
    )


def keep_async_scheduling(monkeypatch: Any) -> None:
    """Let an engine asked for ``async_scheduling=True`` keep it on the CPU. vLLM's CPU platform
    turns asynchronous scheduling off ("not required on CPU"); its engine core and executor run
    it all the same (the batch queue schedules a step before the previous step's tokens are
    known), which is the order the connector meets on a GPU, where it is vLLM's default."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def keep(cls: Any, vllm_config: Any) -> None:
        asked = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        if asked:
            vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep))


def close(llm: Any) -> None:
    """Let an engine go before the next one starts (its KV space is most of its memory)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def kv_pages(llm: Any) -> torch.Tensor:
    """vLLM's KV and state pages as one byte tensor, ``(blocks, page bytes)``: every group's
    layers view the same blocks (a block id belongs to one group at a time)."""
    runner = _core(llm).model_executor.driver_worker.worker.model_runner
    first = runner.kv_caches[0]
    storage = first.untyped_storage()
    blocks = first.shape[0]
    page = first.stride(0) * first.element_size()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat[: blocks * page].view(blocks, page)


def noise_every_block(worker: Any, seed: int) -> int:
    """Write random bytes into every block but the null one (block 0) of ``worker``'s KV and
    state pages: for an engine whose worker is in another process (``llm.collective_rpc(
    noise_every_block, args=(seed,))``, with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), idle
    after ``reset_prefix_cache()``, where every such block is free. Returns how many."""
    first = worker.model_runner.kv_caches[0]
    blocks = first.shape[0]
    page = first.stride(0) * first.element_size()
    pages = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())[: blocks * page].view(blocks, page)
    gen = torch.Generator().manual_seed(seed)
    pages[1:] = torch.randint(0, 256, (blocks - 1, page), dtype=torch.uint8, generator=gen)
    return int(blocks - 1)


def fill_free_blocks_with_noise(llm: Any, seed: int) -> int:
    """Write random bytes into every block vLLM's pool holds free (the engine must be idle: after
    ``reset_prefix_cache()`` that is every block but the null one). Returns how many."""
    pool = _core(llm).scheduler.kv_cache_manager.block_pool
    free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks() if not b.is_null]
    pages = kv_pages(llm)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(free, dtype=torch.int64)
    pages[idx] = torch.randint(0, 256, (len(free), pages.shape[1]), dtype=torch.uint8, generator=gen)
    return len(free)


@dataclass
class Workload:
    """Rounds of requests (each one ``generate`` batch); a later round's prompts may be built
    from an earlier round's answers (multi-turn), so each engine builds them from its own."""

    seed: int = 0
    system_len: int = 1400  # more than two hybrid blocks
    answer: int = 8
    #: Two more rounds: prompts 1 to 7 tokens short of a block (and one 8 short), so a decode
    #: step ends on the block boundary (the save of a state after a sampled token), then each
    #: conversation's next turn, which only that save can serve. Short of the first block: a
    #: prompt in one chunk is computed as the ground truth computes it (at a near tie two chunks
    #: part from one, with or without a cache).
    decode_boundary: bool = False
    block: int = BLOCK  # the engine's block, for the decode-boundary rounds (vLLM picks it per CPU)

    def __post_init__(self) -> None:
        self._answers: list[list[int]] = []
        self.rng = random.Random(self.seed)
        self.systems = [self._ids(self.system_len) for _ in range(2)]

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(n)]

    def plan(self) -> Iterator[list[list[int]]]:
        """The rounds, each a batch of prompts; after each, :meth:`answered` must be told."""
        users = [self.systems[i % 2] + self._ids(40 + 37 * i) for i in range(8)]
        yield users  # shared system prompts
        turns = [p + a + self._ids(25 + 11 * i) for i, (p, a) in enumerate(zip(users, self._answers, strict=True))]
        yield turns  # the next turn of each conversation
        yield [list(p) for p in users[:4]] + [list(p) for p in turns[4:]]  # identical re-sends
        cut = BLOCK + 260  # inside the second block: the prefixes diverge mid-block
        yield [users[i][:cut] + self._ids(90 + 13 * i) for i in range(8)]
        more = [t + a + self._ids(30) for t, a in zip(turns, self._answers, strict=True)]
        yield more  # a third turn
        yield [self.systems[i % 2][: BLOCK * 2] + self._ids(200 + 9 * i) for i in range(8)]  # block-aligned
        if self.decode_boundary:
            assert self.answer >= 8, "a decode step must reach the boundary from 7 tokens short"
            short = [self._ids(self.block - 1 - i) for i in range(8)]  # the last one: 8 short, no decode boundary
            yield short
            yield [p + a + self._ids(20) for p, a in zip(short, self._answers, strict=True)]

    def answered(self, outs: Sequence[Sequence[int]]) -> None:
        self._answers = [list(o) for o in outs]

    def system_hit_floor(self, requests: int, block: int) -> int:
        """Hit tokens ``requests`` requests over a shared system prompt at least get from a cache
        that filed it: its whole ``block``-token blocks each (the floor the tests assert is this,
        not a figure of one CPU's block: 1,280 a request on 640-token blocks, 1,152 on 384)."""
        return requests * (self.system_len // block * block)


#: Two greedy runs may part at a near tie: a prefix served from cache is computed in other chunks
#: than a cold prefill, and bf16 rounding differs. A token is wrong only where the ground truth's
#: top choice beat its second by more than this many nats (a state nobody restored, or the wrong
#: one, gives garbage that parts decisively).
TIE_NATS = 0.15

#: At most one request in this many may part at a near tie: more says the model's margins are too
#: thin for the oracle to see anything, or a restored state is off by more than rounding (pages
#: written where the worker does not read them parted 26 requests of 64, all at near ties). How
#: many part depends on the CPU's bf16 numbers (vLLM's CPU build picks its kernels and its block
#: per CPU). Measured 2026-12-07 on an AMD EPYC without AVX-512 (384-token blocks), the 64-request
#: decode-boundary workload in vLLM's own process layout: vLLM's own prefix cache parted at 9
#: requests, the connector at the same 9 and at 4 of the decode-boundary turns vLLM's cache does
#: not serve (13), every one where the truth's top two were within 0.15 nats; a cold engine with
#: no cache at all, its prefills cut into 384-token chunks, parted at 27 (at two of them the
#: truth's top two were 0.16 and 0.69 nats apart: chunking alone can part decisively). One in four
#: is the 12 of 48 the workload without the decode-boundary rounds always allowed.
TIE_SHARE = 4


@dataclass
class Served:
    """What one engine served: each request's prompt, greedy answer and vLLM's cached tokens, and
    at each answer position the margin of the top choice over the second (nats)."""

    prompts: list[list[int]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)


def compare(truth: Served, got: Served) -> tuple[list[int], list[int]]:
    """Requests of ``got`` served wrong against ``truth`` (the first differing token is one the
    truth chose decisively, see :data:`TIE_NATS`), and those that parted at a near tie. A request
    whose prompt differs (built from an answer that parted earlier) is left out of both."""
    wrong: list[int] = []
    ties: list[int] = []
    for i, (p, a, b) in enumerate(zip(got.prompts, got.answers, truth.answers, strict=True)):
        if p != truth.prompts[i] or a == b:
            continue
        k = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        (ties if truth.margins[i][k] < TIE_NATS else wrong).append(i)
    return wrong, ties


def tie_bound(served: Served) -> int:
    """How many of ``served``'s requests may part from the ground truth at a near tie (one in
    :data:`TIE_SHARE`)."""
    return len(served.answers) // TIE_SHARE


def generate(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    answer: int,
    out: Served | None = None,
    *,
    cache_salt: str | None = None,
    together: bool = False,
) -> Served:
    """One batch of greedy answers of ``answer`` tokens, with vLLM's cached tokens and the
    margins, added to ``out`` (a new :class:`Served` by default); every prompt under
    ``cache_salt`` when given.

    ``together``: every prompt reaches the scheduler before its first step (vLLM's scheduler
    paused while they are added), for an engine core in a process of its own, where requests
    otherwise arrive one by one while it steps: the batches, and with them the bf16 numbers of
    every answer, then vary from run to run (measured: a request parted from the ground truth
    at a 0.5-nat margin in some runs and not in others)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True, detokenize=False, logprobs=2)
    out = Served() if out is None else out
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    inputs = [TokensPrompt(prompt_token_ids=list(p), **salt) for p in prompts]
    res = _generate_together(llm, inputs, params) if together else llm.generate(inputs, params, use_tqdm=False)
    out.prompts += [list(p) for p in prompts]
    out.answers += [list(r.outputs[0].token_ids) for r in res]
    out.cached += [int(r.num_cached_tokens or 0) for r in res]
    for r in res:
        tops = [sorted((lp.logprob for lp in pos.values()), reverse=True) for pos in r.outputs[0].logprobs]
        out.margins.append([t[0] - t[1] if len(t) > 1 else float("inf") for t in tops])
    return out


def _generate_together(llm: Any, inputs: Sequence[Any], params: Any) -> list[Any]:
    engine = llm.llm_engine
    core = engine.engine_core
    core.call_utility("pause_scheduler", "keep", False)  # adds wait in the scheduler's queue
    ids = [f"together-{next(_TOGETHER)}" for _ in inputs]
    try:
        for rid, prompt in zip(ids, inputs, strict=True):
            engine.add_request(rid, prompt, params)
    finally:
        core.call_utility("resume_scheduler")
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[rid] for rid in ids]


_TOGETHER = itertools.count()


def serve(llm: Any, workload: Workload, *, between: Any = None, together: bool = False) -> Served:
    """Run every round of ``workload`` on ``llm`` (greedy), calling ``between(llm, round)`` before
    each round after the first; ``together`` as in :func:`generate`."""
    out = Served()
    for i, batch in enumerate(workload.plan()):
        if i and between is not None:
            between(llm, i)
        n = len(out.answers)
        generate(llm, batch, workload.answer, out, together=together)
        workload.answered(out.answers[n:])
    return out


def serve_aborting(
    llm: Any, prompts: Sequence[Sequence[int]], answer: int, abort_at: dict[int, int]
) -> list[list[int]]:
    """Serve ``prompts`` (greedy, ``answer`` tokens) through the engine's own step loop, aborting
    request ``i`` at engine step ``abort_at[i]`` (as a client that drops its stream). Returns each
    request's tokens: the whole answer, or what it had when aborted."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=list(p)), params)
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        drop = [f"abort-{i}" for i, at in abort_at.items() if at == step]
        if drop:
            engine.abort_request(drop)
        for out in engine.step():
            got[int(out.request_id.split("-")[1])] = list(out.outputs[0].token_ids)
    return [got[i] for i in range(len(prompts))]
