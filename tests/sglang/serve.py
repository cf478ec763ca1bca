"""Serve the engine tests' workload on one real SGLang server on the CPU and write what it answered
as JSON: ``python -m tests.sglang.serve --model DIR --out FILE --cache {none,builtin,radixcache}
--mode {engine,http}`` (run from the repository root, in the environment of
:func:`tests.sglang.engine_harness.serve_env`).

- ``engine``: SGLang's ``Engine`` in this process (its scheduler and detokenizer in processes of
  their own); each round's requests go in through ``async_generate`` at once.
- ``http``: ``python -m sglang.launch_server`` with :func:`server_flags` (the command
  docs/sglang.md gives), each round's requests at once through the OpenAI-compatible
  ``/v1/completions`` endpoint, an aborted stream by closing its connection.

Greedy decoding, ``ignore_eos``, a fixed answer length."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .engine_harness import CONFIG_KEYS, Request, Served, Workload

MAX_RUNNING = 16
STATE_SLOTS = 128
ROUND_TIMEOUT_S = 180


def server_flags(model: Path, *, cache: str, strategy: str, page_size: int, chunk: int | None = None) -> list[str]:
    """``launch_server``'s flags for one of the three servers (``cache``: ``none`` disables SGLang's
    prefix cache, ``builtin`` keeps SGLang's own, ``radixcache`` selects ours). ``strategy``
    ``auto`` passes no strategy flag: SGLang's default, which with overlap scheduling on (its
    default too) resolves to ``extra_buffer``; ``no_buffer`` needs overlap scheduling off.
    ``chunk``: SGLang's ``--chunked-prefill-size`` (default: SGLang's)."""
    flags = [
        "--model-path", str(model), "--device", "cpu", "--attention-backend", "torch_native",
        "--dtype", "float32", "--disable-cuda-graph", "--max-total-tokens", "16384",
        "--max-running-requests", str(MAX_RUNNING), "--max-mamba-cache-size", str(STATE_SLOTS),
        "--mem-fraction-static", "0.3", "--random-seed", "0", "--skip-server-warmup",
        "--enable-cache-report", "--page-size", str(page_size),
    ]  # fmt: skip
    if chunk is not None:
        flags += ["--chunked-prefill-size", str(chunk)]
    if strategy != "auto":
        flags += ["--mamba-radix-cache-strategy", strategy]
    if strategy == "no_buffer":
        flags.append("--disable-overlap-schedule")
    if cache == "none":
        flags.append("--disable-radix-cache")
    elif cache == "radixcache":
        flags += ["--radix-cache-backend", "radixcache"]
    return flags


def _engine_kwargs(flags: list[str]) -> dict[str, Any]:
    """The same settings as ``Engine`` keyword arguments."""
    kw: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        key = flags[i][2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            val: Any = flags[i + 1]
            kw[key] = int(val) if val.isdigit() else float(val) if val.replace(".", "", 1).isdigit() else val
            i += 2
        else:
            kw[key] = True
            i += 1
    kw.pop("enable_cache_report", None)
    return kw


def _params(answer: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": answer, "ignore_eos": True}


def _margin(top: list[float]) -> float:
    """Top logprob minus the second (infinite when only one is known)."""
    top = sorted(top, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


Answer = tuple[list[int], int, list[float]]  # answer ids, cached tokens, per-token margins


def serve_engine(flags: list[str], wl: Workload, left: Path | None = None) -> Served:
    """Every round of ``wl`` through SGLang's ``Engine``; the files it leaves in ``/dev/shm``
    named in ``left`` as soon as they are known (see :func:`remove_left_behind`)."""
    import sglang as sgl

    engine = sgl.Engine(**_engine_kwargs(flags), log_level="warning")
    _name_left_behind(left, _load_snapshot_path(engine))
    resolved = engine.tokenizer_manager.server_args.resolved_dict()  # what `auto` resolved to
    out = Served(config={k: resolved.get(k) for k in CONFIG_KEYS})
    n = 0

    async def one(req: Request, rid: str) -> Answer:
        if not req.abort:
            r = await engine.async_generate(
                input_ids=req.prompt,
                sampling_params=_params(wl.answer),
                rid=rid,
                return_logprob=True,
                top_logprobs_num=2,
            )
            tops = r["meta_info"]["output_top_logprobs"]  # per position: [(logprob, id, text), ...]
            margins = [_margin([t[0] for t in pos]) for pos in tops]
            return list(r["output_ids"]), int(r["meta_info"].get("cached_tokens", 0)), margins
        gen = await engine.async_generate(
            input_ids=req.prompt, sampling_params=_params(wl.answer), rid=rid, stream=True
        )
        last = await gen.__anext__()
        engine.tokenizer_manager.abort_request(rid)  # after its first tokens
        async for chunk in gen:
            last = chunk
        return list(last.get("output_ids", [])), int(last["meta_info"].get("cached_tokens", 0)), []

    async def round_(batch: list[Request], base: int) -> list[Answer]:
        return list(await asyncio.gather(*(one(r, f"req-{base + i}") for i, r in enumerate(batch))))

    children = engine.get_all_child_pids()

    async def watched(batch: list[Request], base: int) -> list[Answer]:
        """The round, failed as soon as one of the engine's processes dies (a scheduler that died
        leaves the engine waiting forever) and at the latest after ROUND_TIMEOUT_S."""
        import psutil  # type: ignore[import-untyped]

        task = asyncio.ensure_future(round_(batch, base))
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not task.done():
            await asyncio.wait([task], timeout=1.0)
            dead = [p for p in children if not psutil.pid_exists(p) or psutil.Process(p).status() == "zombie"]
            if dead or time.monotonic() > deadline:
                task.cancel()
                raise RuntimeError(f"round abandoned: engine processes {dead} died" if dead else "round timed out")
        return task.result()

    for batch in wl.plan():
        # On an error the caller kills the engine's processes (shutdown() would wait on a dead one).
        got = engine.loop.run_until_complete(watched(batch, n))
        n += len(batch)
        _record(out, batch, got)
        wl.answered([a for a, _, _ in got])
        _wait_idle()
    engine.shutdown()
    return out


def _load_snapshot_files(pid: int) -> set[Path]:
    """The load-snapshot files the server ``pid`` and its children hold open (its scheduler's, in
    ``/dev/shm``): the HTTP server's shutdown kills the scheduler (SIGKILL) and leaves them, and
    this process does not know the server's instance id that names them."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return set()
    out: set[Path] = set()
    for p in procs:
        try:
            out.update(Path(f.path) for f in p.open_files() if Path(f.path).name.startswith("sglang_loads_"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _load_snapshot_path(engine: Any) -> list[Path]:
    """The load-snapshot file SGLang's scheduler keeps in ``/dev/shm``: its shutdown kills the
    scheduler (SIGKILL), so nothing removes it, and each engine left one behind."""
    try:
        from sglang.srt.managers.load_snapshot import shm_path_for
    except ImportError:  # an SGLang without one
        return []
    return [Path(shm_path_for(engine.port_args.instance_id))]


def _name_left_behind(left: Path | None, files: Iterable[Path]) -> None:
    if left is not None:
        with left.open("a") as f:
            f.writelines(f"{p}\n" for p in files)


def left_behind_file(out: Path) -> Path:
    """Where a serve process writing ``out`` names the files it leaves in ``/dev/shm``."""
    return out.with_suffix(".shm-files")


def remove_left_behind(left: Path) -> None:
    """Remove the files a serve process named in ``left`` (its servers' load-snapshot files) once
    its servers are down: the serve process does at its end, and the test after it, however it
    ended (SGLang kills the process that holds its engine when a scheduler dies)."""
    if left.exists():
        for line in left.read_text().splitlines():
            if Path(line).name.startswith("sglang_loads_"):
                Path(line).unlink(missing_ok=True)
        left.unlink()


def _record(out: Served, batch: list[Request], got: list[Answer]) -> None:
    for r, (answer, cached, margins) in zip(batch, got, strict=True):
        out.margins.append(margins)
        out.prompts.append(r.prompt)
        out.codewords.append(list(r.codeword))
        out.answers.append(answer)
        out.aborted.append(r.abort)
        out.cached.append(cached)


def _wait_idle() -> None:
    """Give the scheduler a moment to go idle between rounds (its noise fill runs then)."""
    time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ids(text: str) -> list[int]:
    """Token ids back from the word-level tokenizer's text (``w17 w5`` is ``[17, 5]``)."""
    return [int(w[1:]) for w in text.split() if w.startswith("w") and w[1:].isdigit()]


def serve_http(flags: list[str], wl: Workload, left_file: Path | None = None) -> Served:
    """Every round of ``wl`` through the OpenAI-compatible endpoint of ``launch_server``
    (``left_file`` as for :func:`serve_engine`)."""
    import requests  # type: ignore[import-untyped]

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", *flags, "--host", "127.0.0.1", "--port", str(port)],
        stdout=sys.stderr,
        stderr=sys.stderr,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"launch_server exited with {proc.returncode}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("launch_server did not come up in 300 s")
            time.sleep(1)
        # the server's own: its processes hold them open
        _name_left_behind(left_file, _load_snapshot_files(proc.pid))

        def one(req: Request) -> Answer:
            body = {
                "model": "default", "prompt": req.prompt, "max_tokens": wl.answer,
                "temperature": 0.0, "ignore_eos": True, "stream": req.abort, "logprobs": 2,
            }  # fmt: skip
            if not req.abort:
                r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
                r.raise_for_status()
                js = r.json()
                details = js["usage"].get("prompt_tokens_details") or {}
                tops = js["choices"][0]["logprobs"]["top_logprobs"]  # per position: {token: logprob}
                margins = [_margin(list(pos.values())) for pos in tops]
                return _ids(js["choices"][0]["text"]), int(details.get("cached_tokens") or 0), margins
            with requests.post(f"{url}/v1/completions", json=body, timeout=300, stream=True) as r:
                text = ""
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
                        break  # close the stream after its first tokens: SGLang aborts the request
            return _ids(text), 0, []

        info = requests.get(f"{url}/server_info", timeout=30).json()
        out = Served(config={k: info.get(k) for k in CONFIG_KEYS})
        with ThreadPoolExecutor(max_workers=MAX_RUNNING) as pool:
            for batch in wl.plan():
                got = list(pool.map(one, batch))
                _record(out, batch, got)
                wl.answered([a for a, _, _ in got])
                _wait_idle()
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, serve, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache", choices=("none", "builtin", "radixcache"), required=True)
    ap.add_argument("--mode", choices=("engine", "http"), default="engine")
    ap.add_argument("--strategy", choices=("no_buffer", "extra_buffer", "auto"), default="no_buffer")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    a = ap.parse_args(argv)
    chunk = a.chunked_prefill_size
    flags = server_flags(a.model, cache=a.cache, strategy=a.strategy, page_size=a.page_size, chunk=chunk)
    wl = Workload(seed=a.seed)
    left = left_behind_file(a.out)
    try:
        served = serve_engine(flags, wl, left) if a.mode == "engine" else serve_http(flags, wl, left)
    except BaseException:
        import os
        import traceback

        from sglang.srt.utils import kill_process_tree

        traceback.print_exc()
        sys.stderr.flush()
        kill_process_tree(os.getpid(), include_parent=False)  # a dead scheduler leaves its siblings
        remove_left_behind(left)
        os._exit(3)
    remove_left_behind(left)
    a.out.write_text(json.dumps(served.to_json()))


if __name__ == "__main__":
    main()
