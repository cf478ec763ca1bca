"""What the SGLang engine tests share: a tiny Qwen3.5 (Gated DeltaNet) built here with seeded random
weights and a local word-level tokenizer (no download), the multi-round workload, and the oracle
(greedy answers compared request by request against a server without a prefix cache).

The servers themselves run in processes of their own (``python -m tests.sglang.serve``), with the
CPU stand-ins for ``sgl_kernel`` on ``PYTHONPATH`` (``tests/sglang/standin``): see
:func:`serve_command`."""

from __future__ import annotations

import json
import os
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..hybrid_weights import widen_and_remember

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
STANDIN = HERE / "standin"
VOCAB = 512
CODE_FIRST = 448  # ids 448..511 spell codewords only (never drawn for ordinary prompt text)
PAGE = 64  # SGLang's mamba chunk: the lengths 1 mod 64 the workload sends


def build_tiny_qwen3_5(out: Path, *, seed: int = 0) -> Path:
    """Save the tiny random-weight Qwen3.5 text model (3 GDN layers, 1 gated attention layer, fp32)
    and its tokenizer into ``out``. Seeded: every build is the same model.

    Weights are drawn wide and each GDN layer's decay slow (:func:`tests.hybrid_weights.widen_and_remember`):
    a state restored wrong, or noise, changes answers decisively."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForCausalLM"],
    )
    model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    widen_and_remember(model, seed)
    model.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["full_attention_interval"] = 4  # SGLang's Qwen3.5 reads the layer pattern from it
    (out / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.save_pretrained(out)
    return out


@dataclass
class Request:
    """One request of a round: its prompt ids, its codeword, and whether its stream is aborted
    after its first tokens."""

    prompt: list[int]
    codeword: tuple[int, ...]
    abort: bool = False


@dataclass
class Workload:
    """Rounds of concurrent requests (every request of a round in flight at once); a later round's
    prompts are built from an earlier round's answers (multi-turn), so each server builds them from
    its own. Every prompt carries its request's codeword (4 ids of :data:`CODE_FIRST` and above)
    after the shared system prompt."""

    seed: int = 0
    users: int = 10
    system_len: int = 150
    answer: int = 8

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.systems = [self._ids(self.system_len), self._ids(self.system_len + 37)]
        self._codes: set[tuple[int, ...]] = set()
        self._answers: list[list[int]] = []

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(3, CODE_FIRST) for _ in range(n)]

    def _code(self) -> tuple[int, ...]:
        while True:
            c = tuple(self.rng.randrange(CODE_FIRST, VOCAB) for _ in range(4))
            if c not in self._codes:
                self._codes.add(c)
                return c

    def _new(self, prefix: list[int], tail: int) -> Request:
        c = self._code()
        return Request([*prefix, *c, *self._ids(tail)], c)

    def plan(self) -> Iterator[list[Request]]:
        """The rounds; after each, :meth:`answered` must be told the answers in order."""
        n = self.users
        first = [self._new(self.systems[i % 2], 20 + 13 * i) for i in range(n)]
        yield first  # shared system prompts
        turns = [
            Request(r.prompt + a + self._ids(15 + 7 * i), r.codeword)
            for i, (r, a) in enumerate(zip(first, self._answers, strict=True))
        ]
        yield turns  # the next turn of each conversation
        turn_answers = self._answers
        yield [Request(list(r.prompt), r.codeword) for r in first[: n // 2] + turns[n // 2 :]]  # identical re-sends
        # prefixes cut mid-page (odd cuts, inside the system prompt) then a new tail; 1 mod 64 lengths
        cuts = [self._new(self.systems[i % 2][: 51 + 6 * i], 9 + i) for i in range(n // 2)]
        ones = []
        for i in range(n - n // 2):
            want = PAGE * (2 + i % 3) + 1
            base = self.systems[i % 2][: want - 4 - 1]
            ones.append(self._new(base, want - len(base) - 4))
        yield cuts + ones
        third = [
            Request(t.prompt + a + self._ids(11), t.codeword, abort=(i % 3 == 1))
            for i, (t, a) in enumerate(zip(turns, turn_answers, strict=True))
        ]
        yield third  # a third turn, every third stream aborted after its first tokens
        yield [Request(list(r.prompt), r.codeword) for r in third]  # the aborted ones re-sent whole

    def answered(self, answers: Sequence[Sequence[int]]) -> None:
        """The answers of the round just served, in request order."""
        self._answers = [list(a) for a in answers]


@dataclass
class Served:
    """What one server answered: per request, its prompt, codeword, greedy answer, whether its
    stream was aborted, SGLang's ``cached_tokens`` and the top-two margins of each answer token."""

    prompts: list[list[int]] = field(default_factory=list)
    codewords: list[list[int]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    aborted: list[bool] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)
    """Per request and answer position, the top choice's logprob minus the second's (nats)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The server's settings as SGLang resolved them (:data:`CONFIG_KEYS`), read back from it."""

    def to_json(self) -> dict[str, Any]:
        """The JSON the serve script prints."""
        return self.__dict__

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Served:
        """Back from :meth:`to_json`."""
        return cls(**d)


#: The resolved server settings a run records: which strategy and scheduling SGLang actually ran.
CONFIG_KEYS = (
    "mamba_radix_cache_strategy",
    "disable_overlap_schedule",
    "page_size",
    "radix_cache_backend",
    "disable_radix_cache",
)

#: Two greedy runs may part where the ground truth's two best tokens are this close (nats): a prefix
#: served from cache is computed in other chunks than a cold prefill (a decode step's recurrence,
#: not the chunked prefill's), and float32 rounding differs by about 1e-5. A state restored wrong,
#: or noise, parts decisively.
TIE_NATS = 1e-3


def compare(truth: Served, got: Served) -> tuple[list[int], list[int]]:
    """Requests of ``got`` (not aborted in either) served wrong against ``truth`` (the first differing
    token is one the truth chose by more than :data:`TIE_NATS`), and those that parted at a near
    tie, or whose prompt was built from an answer that did (not wrong)."""
    wrong: list[int] = []
    ties: list[int] = []
    for i, (p, a) in enumerate(zip(got.prompts, got.answers, strict=True)):
        b = truth.answers[i]
        if got.aborted[i] or truth.aborted[i] or a == b:
            continue
        if p != truth.prompts[i]:  # built from an answer that parted at a near tie before
            ties.append(i)
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        (ties if k is not None and truth.margins[i][k] < TIE_NATS else wrong).append(i)
    return wrong, ties


def foreign_codewords(served: Served) -> list[tuple[int, int]]:
    """``(request, other)`` pairs where request's answer contains other's codeword."""
    out = []
    codes = [tuple(c) for c in served.codewords]
    for i, a in enumerate(served.answers):
        grams = {tuple(a[j : j + 4]) for j in range(len(a) - 3)}
        out += [(i, j) for j, c in enumerate(codes) if j != i and c != codes[i] and c in grams]
    return out


def serve_command(
    model: Path,
    out: Path,
    *,
    cache: str,
    mode: str = "engine",
    strategy: str = "no_buffer",
    page_size: int = 1,
    seed: int = 0,
    chunk: int | None = None,
) -> list[str]:
    """The command line that serves the workload on one SGLang server in processes of its own and
    writes :class:`Served` as JSON to ``out`` (``chunk``: SGLang's ``--chunked-prefill-size``)."""
    more = [] if chunk is None else ["--chunked-prefill-size", str(chunk)]
    return [
        sys.executable,
        "-m",
        "tests.sglang.serve",
        "--model",
        str(model),
        "--out",
        str(out),
        "--cache",
        cache,
        "--mode",
        mode,
        "--strategy",
        strategy,
        "--page-size",
        str(page_size),
        "--seed",
        str(seed),
        *more,
    ]


def serve_env(
    *,
    noise_seed: int | None = 0,
    noise_log: Path | None = None,
    inject: str | None = None,
    shared_url: str | None = None,
    stray: bool = False,
    forensics: str | None = None,
) -> dict[str, str]:
    """The environment of a serve process: SGLang's CPU engine, the stand-ins first on the path,
    the tests' noise, stray writes and injected bug switched on as asked (see
    ``standin/radixcache_test_hooks.py``), with ``shared_url`` the backend's shared tier on that
    Redis server, and ``forensics`` as the backend's ``RADIXCACHE_FORENSICS`` (default: its own)."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # SGLang keeps conv windows in bf16 by default: a prefix served from cache then reads its
    # window rounded at every step, a cold prefill does not, and answers part at near ties
    # (about 1e-3 nats here, built-in and radixcache alike). float32 windows make the three
    # servers' arithmetic the same up to float32 rounding.
    env["SGLANG_MAMBA_CONV_DTYPE"] = "float32"
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for key in (
        "RADIXCACHE_SGLANG_NOISE",
        "RADIXCACHE_SGLANG_NOISE_LOG",
        "RADIXCACHE_SGLANG_INJECT",
        "RADIXCACHE_SGLANG_STRAY",
        "RADIXCACHE_FORENSICS",
    ):
        env.pop(key, None)
    for key in [k for k in env if k.startswith(("RADIXCACHE_SHARED_", "RADIXCACHE_MODEL_IDENTITY"))]:
        env.pop(key)
    if shared_url is not None:
        env["RADIXCACHE_SHARED_URL"] = shared_url
    if noise_seed is not None:
        env["RADIXCACHE_SGLANG_NOISE"] = str(noise_seed)
    if noise_log is not None:
        env["RADIXCACHE_SGLANG_NOISE_LOG"] = str(noise_log)
    if inject is not None:
        env["RADIXCACHE_SGLANG_INJECT"] = inject
    if stray:
        env["RADIXCACHE_SGLANG_STRAY"] = "1"
    if forensics is not None:
        env["RADIXCACHE_FORENSICS"] = forensics
    return env
