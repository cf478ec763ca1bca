"""Seeded request traces for measuring snapshot placement and eviction (no downloads).

Each record: ``session_id``, ``turn_id``, ``ts`` (seconds), ``input_tokens`` (the full history
plus the new message) and ``output_tokens``. Shapes:

- ``chat``: sessions of >= 10 turns, user messages and answers of a few hundred tokens, sessions
  starting at a configurable rate, typing-speed gaps between turns;
- ``agentic``: sessions of up to 50 turns whose context grows by tool outputs of 1-4k tokens,
  Poisson gaps, contexts up to 32k;
- ``fanout``: groups of prompts sharing a 2,048-token system prompt, 128-token questions;
- ``edge``: identical re-sends; a 1,500-token shared prefix followed by 700 unique tokens;
  prompts shorter than one block;
- ``rag``: retrieval-augmented questions: a shared system prompt, then 3-5 documents drawn from a
  Zipf-popular corpus in the order the retriever ranked them (the same documents often come in
  another order), then the question; one in four sessions asks a follow-up;
- ``tools``: tool-calling agents that branch and backtrack: from the same context an agent tries
  two or three calls in parallel, keeps one, and now and then returns to a context two or three
  steps back and tries another path;
- ``mixed``: four tenants on one cache, told apart by the session id's prefix: ``chat`` sessions,
  ``agent`` sessions, ``rag`` questions and ``short`` prompts (classification-style: a shared
  20-40-token instruction and a short input, popular inputs repeated), all interleaved in time.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

__all__ = ["SHAPES", "TraceRecord", "generate", "read_trace", "write_trace"]

VOCAB = 150_000


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace."""

    session_id: str
    turn_id: int
    ts: float
    input_tokens: list[int]
    output_tokens: list[int]


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _chat(rng: random.Random, sessions: int = 100, turns: int = 10, rate: float = 0.5) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    system = _toks(rng, 400)
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(rate)
        t, history = start, list(system)
        for k in range(turns + rng.randint(0, 4)):
            history = history + _toks(rng, rng.randint(80, 400))
            answer = _toks(rng, rng.randint(80, 300))
            out.append(TraceRecord(f"chat-{s}", k, t, list(history), answer))
            history = history + answer
            t += rng.uniform(5, 60)  # reading and typing
    return sorted(out, key=lambda r: r.ts)


def _agentic(
    rng: random.Random, sessions: int = 12, max_turns: int = 50, max_context: int = 32_000
) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    system = _toks(rng, 1500)
    for s in range(sessions):
        t = rng.uniform(0, 60)
        history = system + _toks(rng, rng.randint(100, 400))
        for k in range(rng.randint(max_turns // 2, max_turns)):
            if len(history) > max_context:
                break
            call = _toks(rng, rng.randint(30, 120))
            out.append(TraceRecord(f"agent-{s}", k, t, list(history), call))
            history = history + call + _toks(rng, rng.randint(1000, 4000))  # the tool's output
            t += rng.expovariate(0.5)
    return sorted(out, key=lambda r: r.ts)


def _fanout(rng: random.Random, groups: int = 64, per_group: int = 16) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    t = 0.0
    systems = [_toks(rng, 2048) for _ in range(groups)]
    for i in range(groups * per_group):
        g = rng.randrange(groups) if i >= groups else i
        t += rng.expovariate(4.0)
        out.append(TraceRecord(f"fan-{g}-{i}", 0, t, systems[g] + _toks(rng, 128), _toks(rng, rng.randint(20, 80))))
    return out


def _edge(rng: random.Random) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    t = 0.0
    for i in range(20):  # identical re-sends
        p = _toks(rng, rng.randint(200, 1200))
        for k in range(3):
            t += 1
            out.append(TraceRecord(f"resend-{i}", k, t, list(p), _toks(rng, 30)))
    for i in range(20):  # a 1,500-token shared prefix, then 700 unique tokens
        shared = _toks(rng, 1500)
        for k in range(3):
            t += 1
            out.append(TraceRecord(f"midblock-{i}-{k}", 0, t, shared + _toks(rng, 700), _toks(rng, 30)))
    for i in range(20):  # prompts shorter than one block, re-sent
        p = _toks(rng, rng.randint(8, 60))
        for k in range(3):
            t += 1
            out.append(TraceRecord(f"short-{i}", k, t, list(p), _toks(rng, 10)))
    return out


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> Callable[[], int]:
    """A sampler of ranks ``[0, n)`` with Zipf weights ``1 / (rank + 1) ** s``."""
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    ranks = list(range(n))
    return lambda: rng.choices(ranks, weights)[0]


def _rag(
    rng: random.Random, questions: int = 600, corpus: int = 300, rate: float = 2.0, prefix: str = "rag"
) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    system = _toks(rng, 300)
    docs = [_toks(rng, rng.randint(300, 800)) for _ in range(corpus)]
    popular = _zipf(rng, corpus)
    t = 0.0
    for q in range(questions):
        t += rng.expovariate(rate)
        picked: list[int] = []
        while len(picked) < rng.randint(3, 5):
            d = popular()
            if d not in picked:
                picked.append(d)
        if rng.random() < 0.5:  # the retriever's scores moved: the same documents, another order
            rng.shuffle(picked)
        history = system + [tok for d in picked for tok in docs[d]] + _toks(rng, rng.randint(20, 80))
        answer = _toks(rng, rng.randint(50, 200))
        out.append(TraceRecord(f"{prefix}-{q}", 0, t, list(history), answer))
        if rng.random() < 0.25:  # a follow-up on the same documents
            follow = history + answer + _toks(rng, rng.randint(10, 60))
            later = t + rng.uniform(10, 60)
            out.append(TraceRecord(f"{prefix}-{q}", 1, later, follow, _toks(rng, rng.randint(50, 200))))
    return sorted(out, key=lambda r: r.ts)


def _tools(rng: random.Random, sessions: int = 16, steps: int = 30, max_context: int = 24_000) -> list[TraceRecord]:
    out: list[TraceRecord] = []
    system = _toks(rng, 2000)  # the agent's instructions and tool schemas
    for s in range(sessions):
        t = rng.uniform(0, 60)
        path = [system + _toks(rng, rng.randint(100, 400))]  # contexts along the path kept so far
        turn = 0
        for _ in range(steps):
            context = path[-1]
            if len(context) > max_context:
                break
            tries = []
            for _ in range(rng.choice((1, 1, 2, 3))):  # parallel calls from the same context
                call = _toks(rng, rng.randint(30, 120))
                out.append(TraceRecord(f"tools-{s}", turn, t, list(context), call))
                turn += 1
                tries.append(context + call + _toks(rng, rng.randint(500, 3000)))  # the tool's output
                t += rng.uniform(0.2, 2.0)
            path.append(rng.choice(tries))
            if len(path) > 3 and rng.random() < 0.15:  # a dead end: back two or three steps
                del path[-rng.randint(2, 3) :]
            t += rng.expovariate(0.5)
    return sorted(out, key=lambda r: r.ts)


def _short(rng: random.Random, n: int, rate: float, prefix: str = "short") -> list[TraceRecord]:
    """Classification-style prompts shorter than one block: one of 30 instructions (20-40 tokens),
    then an input of 5-30 tokens; popular inputs come back."""
    instructions = [_toks(rng, rng.randint(20, 40)) for _ in range(30)]
    inputs = [_toks(rng, rng.randint(5, 30)) for _ in range(400)]
    which, what = _zipf(rng, len(instructions)), _zipf(rng, len(inputs), 0.9)
    out: list[TraceRecord] = []
    t = 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = instructions[which()] + inputs[what()]
        out.append(TraceRecord(f"{prefix}-{i}", 0, t, prompt, _toks(rng, rng.randint(2, 10))))
    return out


def _mixed(rng: random.Random) -> list[TraceRecord]:
    chat = _chat(rng, sessions=40, rate=0.2)
    # the agents' sessions spread over the chat's span rather than crowding its start
    agents = [replace(r, ts=r.ts * 4) for r in _agentic(rng, sessions=6, max_context=24_000)]
    rag = _rag(rng, questions=250, rate=0.5)
    short = _short(rng, 800, rate=2.0)
    return sorted(chat + agents + rag + short, key=lambda r: r.ts)


SHAPES: dict[str, Callable[[random.Random], list[TraceRecord]]] = {
    "chat": _chat,
    "agentic": _agentic,
    "fanout": _fanout,
    "edge": _edge,
    "rag": _rag,
    "tools": _tools,
    "mixed": _mixed,
}


def generate(shape: str, seed: int = 0) -> list[TraceRecord]:
    """A trace of ``shape`` (one of :data:`SHAPES`), deterministic for ``seed``.

    :raises ValueError: unknown shape.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown trace shape {shape!r}; known: {sorted(SHAPES)}")
    return SHAPES[shape](random.Random(seed))


def write_trace(records: list[TraceRecord], path: str | os.PathLike[str]) -> None:
    """Write records as JSONL."""
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")


def read_trace(path: str | os.PathLike[str]) -> list[TraceRecord]:
    """Read a JSONL trace. :raises ValueError: a line missing a field (naming the line)."""
    out: list[TraceRecord] = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    out.append(TraceRecord(**json.loads(line)))
                except TypeError as e:
                    raise ValueError(f"{path}:{i}: not a trace record ({e})") from None
    return out
