"""Seeded request traces for measuring snapshot placement and eviction (no downloads).

Each record: ``session_id``, ``turn_id``, ``ts`` (seconds), ``input_tokens`` (the full history
plus the new message) and ``output_tokens``. Shapes:

- ``chat``: sessions of >= 10 turns, user messages and answers of a few hundred tokens, sessions
  starting at a configurable rate, typing-speed gaps between turns;
- ``agentic``: sessions of up to 50 turns whose context grows by tool outputs of 1-4k tokens,
  Poisson gaps, contexts up to 32k;
- ``fanout``: groups of prompts sharing a 2,048-token system prompt, 128-token questions;
- ``edge``: identical re-sends; a 1,500-token shared prefix followed by 700 unique tokens;
  prompts shorter than one block.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

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


SHAPES: dict[str, Callable[[random.Random], list[TraceRecord]]] = {
    "chat": _chat,
    "agentic": _agentic,
    "fanout": _fanout,
    "edge": _edge,
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
