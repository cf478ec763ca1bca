"""radixcache inside SGLang's real engine on the CPU: real tokens of a tiny Qwen3.5 (3 Gated DeltaNet
layers, 1 attention layer), through SGLang's ``Engine`` and through its HTTP server's
OpenAI-compatible endpoint, three servers each: the radix cache disabled (the ground truth),
SGLang's built-in cache, and ``--radix-cache-backend radixcache``; for both of SGLang's
strategies: ``no_buffer`` (overlap scheduling off, page 1) and SGLang's default (no strategy flag:
overlap scheduling on, which resolves to the extra buffer; page 4 through the Engine, page 1
through HTTP). SGLang 0.5.23 allows the extra buffer on GPU platforms only; the CPU test support
lifts that gate and supplies what its tracking needs there (``standin/radixcache_test_hooks.py``),
so SGLang's own tracking code runs.

The workload (``engine_harness.Workload``): 60 requests in 6 rounds of 10 in flight at once,
shared system prompts, multi-turn, identical re-sends, prefixes cut mid-page, prompt lengths of
1 mod 64, aborted streams (then re-sent whole), each prompt carrying its request's codeword.
Between rounds every free state slot and KV row is filled with noise inside the scheduler
(``standin/radixcache_test_hooks.py``), so a state nobody restored is garbage.

Each server runs in processes of its own (``python -m tests.sglang.serve``) with the CPU stand-ins
for ``sgl_kernel`` (``standin/``). Negative controls commit a bug in the backend inside the server
(``RADIXCACHE_SGLANG_INJECT``): the same oracle must catch it."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from .engine_harness import (
    ROOT,
    Served,
    Workload,
    build_tiny_qwen3_5,
    compare,
    foreign_codewords,
    serve_command,
    serve_env,
)
from .serve import left_behind_file, remove_left_behind

SERVE_TIMEOUT_S = 900
MIN_REQUESTS = 60
MIN_IN_FLIGHT = 8


@dataclass
class Run:
    """One server's run: its exit status, what it answered, its noise fills (state slots, KV
    rows, largest batch so far, one per idle period) and its log's tail."""

    rc: int
    served: Served | None
    noise: list[tuple[int, int, int]]
    log: str
    shared: dict[str, Any] | None = None
    """With the shared tier: its counters at the last idle fill (``SharedStats`` as a dict)."""
    stray: dict[str, Any] | None = None
    """With stray writes: the snapshots written, forensics' findings and the manager's refused hits
    at the last idle fill."""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 with its tokenizer, built once per module."""
    return build_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5-tiny"))


_RUNS: dict[tuple[str, ...], Run] = {}


#: The strategies served, as (strategy flag, page size) per mode; ``auto``: SGLang's default.
STRATEGIES = {"no_buffer": ("no_buffer", 1), "default": ("auto", 4)}
HTTP_DEFAULT_PAGE = 1


def _setting(strategy: str, mode: str) -> tuple[str, int]:
    flag, page = STRATEGIES[strategy]
    return flag, HTTP_DEFAULT_PAGE if (mode == "http" and strategy == "default") else page


def serve(
    model: Path,
    tmp: Path,
    *,
    cache: str,
    mode: str = "engine",
    strategy: str = "no_buffer",
    inject: str | None = None,
    shared: tuple[str, str] | None = None,
    chunk: int | None = None,
    stray_forensics: str | None = None,
) -> Run:
    """Run the workload on one server (cached per module: the ground truth serves several tests;
    with the radix cache disabled the strategy does not matter, so one truth serves both).
    ``shared``: the backend's shared tier on a Redis server, as ``(url, name of this run)``.
    ``stray_forensics``: stray writes into the tree's snapshots at each idle fill, with
    ``RADIXCACHE_FORENSICS`` set to this."""
    if cache == "none":
        strategy = "no_buffer"
    key = _run_key(
        cache,
        mode,
        strategy,
        inject=inject,
        shared="" if shared is None else shared[1],
        chunk=chunk,
        stray="" if stray_forensics is None else f"stray-{stray_forensics}",
    )
    if key in _RUNS:
        return _RUNS[key]
    name = "-".join(k for k in key if k)
    out, log = tmp / f"{name}.json", tmp / f"{name}.noise"
    flag, page = _setting(strategy, mode)
    try:
        p = subprocess.run(
            serve_command(model, out, cache=cache, mode=mode, strategy=flag, page_size=page, chunk=chunk),
            env=serve_env(
                noise_seed=0,
                noise_log=log,
                inject=inject,
                shared_url=None if shared is None else shared[0],
                stray=stray_forensics is not None,
                forensics=stray_forensics,
            ),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=SERVE_TIMEOUT_S,
        )
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = -1, str(e.stderr or "")
    remove_left_behind(left_behind_file(out))
    served = Served.from_json(json.loads(out.read_text())) if rc == 0 and out.exists() else None
    noise = [tuple(int(x) for x in line.split()) for line in log.read_text().splitlines()] if log.exists() else []
    counters = log.with_name(log.name + ".shared")
    last = counters.read_text().splitlines()[-1] if counters.exists() else None
    strayed = log.with_name(log.name + ".stray")
    last_stray = strayed.read_text().splitlines()[-1] if strayed.exists() else None
    _RUNS[key] = Run(
        rc,
        served,
        noise,  # type: ignore[arg-type]
        err[-4000:],
        None if last is None else json.loads(last),
        None if last_stray is None else json.loads(last_stray),
    )
    return _RUNS[key]


def _run_key(
    cache: str,
    mode: str,
    strategy: str,
    *,
    inject: str | None = None,
    shared: str = "",
    chunk: int | None = None,
    stray: str = "",
) -> tuple[str, ...]:
    """The :data:`_RUNS` key of one server's run (:func:`serve`'s arguments)."""
    return (cache, mode, strategy, inject or "", shared, str(chunk or ""), stray)


def _key(name: str, strategy: str, chunk: int | None) -> tuple[str, ...]:
    """The :data:`_RUNS` key of a radixcache engine run with the shared tier named ``name``."""
    return _run_key("radixcache", "engine", strategy, shared=name, chunk=chunk)


def _ok(run: Run) -> Served:
    assert run.rc == 0 and run.served is not None, run.log
    return run.served


def _ran_as_asked(served: Served, strategy: str, mode: str) -> None:
    """The server ran the strategy, scheduling and page size the test asked for (as SGLang
    resolved them): SGLang's default is the extra buffer with overlap scheduling."""
    flag, page = _setting(strategy, mode)
    c = served.config
    assert c["page_size"] == page, c
    if flag == "no_buffer":
        assert c["mamba_radix_cache_strategy"] == "no_buffer" and c["disable_overlap_schedule"] is True, c
    else:
        assert c["mamba_radix_cache_strategy"] == "extra_buffer" and c["disable_overlap_schedule"] is False, c


@pytest.mark.parametrize("strategy", ["no_buffer", "default"])
@pytest.mark.parametrize("mode", ["engine", "http"])
def test_three_servers_answer_alike_with_noise_in_every_free_slot(
    model: Path, tmp_path_factory: pytest.TempPathFactory, mode: str, strategy: str
) -> None:
    tmp = tmp_path_factory.mktemp(f"serve-{mode}-{strategy}")
    truth = _ok(serve(model, tmp, cache="none", mode=mode))
    builtin = _ok(serve(model, tmp, cache="builtin", mode=mode, strategy=strategy))
    ours = _ok(serve(model, tmp, cache="radixcache", mode=mode, strategy=strategy))
    for got in (builtin, ours):
        _ran_as_asked(got, strategy, mode)
    assert ours.config["radix_cache_backend"] == "radixcache" and builtin.config["radix_cache_backend"] is None
    assert len(truth.answers) >= MIN_REQUESTS and sum(truth.aborted) >= 3
    ties: dict[str, list[int]] = {}
    for name, got in (("builtin", builtin), ("radixcache", ours)):
        wrong, ties[name] = compare(truth, got)
        assert wrong == [], f"{name} answered differently from the cold server (not at a near tie)"
        assert foreign_codewords(got) == [], f"{name}: an answer holds another request's codeword"
        assert sum(got.cached) > 0, f"{name} served no cached tokens"
    assert sum(truth.cached) == 0
    assert sum(ours.cached) >= sum(builtin.cached)
    assert ties["radixcache"] == ties["builtin"] and len(ties["radixcache"]) <= 3, ties  # float32 near ties only
    print(
        f"\n{mode}, {strategy}: near ties {ties}; cached tokens built-in {sum(builtin.cached)}, ours {sum(ours.cached)}"
    )
    for cache in ("none", "builtin", "radixcache"):
        noise = _RUNS[_run_key(cache, mode, "no_buffer" if cache == "none" else strategy)].noise
        assert len(noise) >= 6 and all(s > 0 and r > 0 for s, r, _ in noise[1:]), noise  # every round
        assert max(b for _, _, b in noise) >= MIN_IN_FLIGHT, noise


@pytest.mark.parametrize(
    ("inject", "strategy"),
    [("skip-restore", "no_buffer"), ("alias", "no_buffer"), ("skip-restore", "default"), ("working-slot", "default")],
)
def test_a_backend_bug_is_caught_by_the_same_oracle(
    model: Path, tmp_path_factory: pytest.TempPathFactory, inject: str, strategy: str
) -> None:
    """``skip-restore``: a hit's state never reaches the request's slot (noise is served). ``alias``:
    the tree keeps the donor's slot instead of a clone (SGLang's own idle leak check stops the
    scheduler, or answers go wrong). ``working-slot`` (the extra buffer): a checkpoint clones the
    request's working slot, which the runner carried past the tracked depth, not its track slot."""
    tmp = tmp_path_factory.mktemp(f"inject-{inject}-{strategy}")
    truth = _ok(serve(model, tmp, cache="none"))
    run = serve(model, tmp, cache="radixcache", strategy=strategy, inject=inject)
    if run.rc == 0:
        assert run.served is not None
        assert compare(truth, run.served)[0] != [], f"{inject}: every answer matched the cold server"
    else:
        assert "Traceback" in run.log, run.log  # the server failed loudly, it did not serve


@pytest.mark.parametrize("forensics", ["all", "off"])
def test_stray_writes_into_the_trees_snapshots_are_never_served_with_forensics_watching(
    model: Path, tmp_path_factory: pytest.TempPathFactory, forensics: str
) -> None:
    """Between rounds every snapshot of the tree is written behind its back (noise added inside
    the scheduler), the bug class forensics exists for. With ``RADIXCACHE_FORENSICS=all`` every
    hit is verified and a snapshot found changed is refused (a miss, the request's slot cleared
    by SGLang): every answer is the cold server's. ``off``, the negative control: the writes
    reach the answers."""
    tmp = tmp_path_factory.mktemp(f"stray-{forensics}")
    truth = _ok(serve(model, tmp, cache="none"))
    run = serve(model, tmp, cache="radixcache", stray_forensics=forensics)
    served = _ok(run)
    assert run.stray is not None and run.stray["stray"] > 0, run.stray
    wrong = compare(truth, served)[0]
    if forensics == "all":
        assert wrong == [], wrong[:3]
        assert run.stray["findings"] > 0 and run.stray["refused_hits"] > 0, run.stray
    else:
        assert wrong != [], "the stray writes never reached an answer: the test would not see a refusal missing"
        assert run.stray["findings"] is None


@pytest.mark.parametrize("strategy", ["no_buffer", "default"])
def test_two_servers_share_prefixes_through_one_redis_server(
    model: Path, tmp_path_factory: pytest.TempPathFactory, redis_server: Any, strategy: str
) -> None:
    """Server A (``RADIXCACHE_SHARED_URL``) serves the workload and publishes every snapshot it
    files, with its prefix's KV rows, to a real redis-server; server B, started after A is gone,
    with empty pools and the same setting, serves the same workload, its first round's prefixes
    fetched from Redis. Both answer as the cold server does (noise in every free slot and KV row
    between rounds), and B's first round is served more cached tokens than A's, which found Redis
    empty. A first round's prompts are shared system prompts with tails of their own: only a
    snapshot inside the system prompt serves them, which the extra buffer tracks on its grid of
    64 tokens and ``no_buffer`` takes at chunk ends only, so ``no_buffer`` runs with 64-token
    prefill chunks (SGLang's default chunk holds a whole prompt)."""
    import redis

    tmp = tmp_path_factory.mktemp(f"shared-{strategy}")
    truth = _ok(serve(model, tmp, cache="none"))
    url = redis_server.url
    chunk = 64 if strategy == "no_buffer" else None
    a = _ok(serve(model, tmp, cache="radixcache", strategy=strategy, shared=(url, "shared-a"), chunk=chunk))
    blobs = len(redis.Redis.from_url(url).keys("radixcache:*"))
    assert blobs >= 10, f"server A left {blobs} keys in Redis"
    b = _ok(serve(model, tmp, cache="radixcache", strategy=strategy, shared=(url, "shared-b"), chunk=chunk))
    for name, got in (("A", a), ("B", b)):
        _ran_as_asked(got, strategy, "engine")
        wrong, ties = compare(truth, got)
        assert wrong == [], f"server {name} answered differently from the cold server (not at a near tie)"
        assert foreign_codewords(got) == [], f"server {name}: an answer holds another request's codeword"
        assert len(ties) <= 3, ties
    first = Workload().users  # the first round: one request per user, all in flight at once
    cached_a, cached_b = sum(a.cached[:first]), sum(b.cached[:first])
    print(f"\n{strategy}: first round's cached tokens A {cached_a}, B {cached_b}; {blobs} keys in Redis")
    assert cached_b > cached_a, (cached_a, cached_b)
    # inside B's scheduler: each arrival prefetched (the plugin's hook), hits verified and served
    sa, sb = _RUNS[_key("shared-a", strategy, chunk)].shared, _RUNS[_key("shared-b", strategy, chunk)].shared
    print(f"A's tier {sa}\nB's tier {sb}")
    assert sa is not None and sb is not None and sa["published"] > 0
    assert sb["prefetches"] >= Workload().users and sb["hits"] > 0 and sb["rejected"] == {}, sb
    if strategy == "default":
        # Negative control: server C fetches the same blobs but writes their KV bytes rotated
        # (``shared-kv``): the same oracle must catch it.
        c = serve(model, tmp, cache="radixcache", strategy=strategy, shared=(url, "shared-c"), inject="shared-kv")
        assert c.rc == 0 and c.served is not None, c.log
        assert compare(truth, c.served)[0] != [], "shared-kv: every answer matched the cold server"


def _doc_commands() -> list[list[str]]:
    """The ``launch_server`` commands of docs/sglang.md, as argument lists (line continuations
    joined, environment assignments dropped)."""
    text = (ROOT / "docs" / "sglang.md").read_text()
    out = []
    for block in text.split("```bash")[1:]:
        body = block.split("```")[0].replace("\\\n", " ")
        for line in body.splitlines():
            words = line.split("#")[0].split()
            if "sglang.launch_server" in words:
                out.append([w for w in words[words.index("sglang.launch_server") + 1 :]])
    return out


def test_the_documented_commands_are_the_tested_ones() -> None:
    from .serve import server_flags

    cmds = _doc_commands()
    for strategy in STRATEGIES:
        flag, page = _setting(strategy, "http")
        tested = server_flags(Path("MODEL"), cache="radixcache", strategy=flag, page_size=page)
        assert tested in cmds, f"docs/sglang.md lacks the tested command {' '.join(tested)}"
    for cmd in cmds:  # every documented command selects the backend with a strategy it serves
        assert cmd[cmd.index("--radix-cache-backend") + 1] == "radixcache"
        if "--mamba-radix-cache-strategy" in cmd:
            assert cmd[cmd.index("--mamba-radix-cache-strategy") + 1] == "no_buffer"
            assert "--disable-overlap-schedule" in cmd  # no_buffer asserts it in SGLang
        else:  # SGLang's default: the extra buffer, which needs overlap scheduling left on
            assert "--disable-overlap-schedule" not in cmd
