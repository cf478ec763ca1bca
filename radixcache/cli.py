"""The ``radixcache`` command line: one function per command, each taking its parsed arguments
and returning the process exit status.

A bad flag or input (a number out of range, a missing or unreadable file, an unknown device or
model) is one line on stderr naming it, and exit status 2; never a traceback, and never a result
that reads as a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NoReturn

from .policies import DEFAULT_POLICY, POLICIES
from .simulator.traces import SHAPES
from .testing.inject import FUZZ_BUGS, HAMMER_BUGS, MISUSE_BUGS

__all__ = ["main"]

_PRESETS = ["qwen3-next-80b", "nemotron-h-8b"]
_SHAPES = list(SHAPES)


class _BadInput(Exception):
    """A command's input is unusable: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _at_least(kind: Callable[[str], float], lo: float, what: str) -> Callable[[str], Any]:
    """An argparse type: a finite ``kind`` (int or float) of at least ``lo``."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not lo <= v < float("inf"):
            raise argparse.ArgumentTypeError(f"must be {what} >= {lo} (finite), got {text}")
        return v

    return parse


def _int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``lo``."""
    return _at_least(int, lo, "an integer")


def _float_at_least(lo: float) -> Callable[[str], float]:
    """An argparse type: a finite number of at least ``lo``."""
    return _at_least(float, lo, "a number")


def _fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    v = _float_at_least(0.0)(text)
    if v > 1.0:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1], got {text}")
    return v


def _replica(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N`` with ``0 <= I < N``."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"I/N needs 0 <= I < N, got {text!r}")
    return i, n


def _default_logit_tol(model: str) -> float:
    """The reference model computes in float64 (a correct hit is off by about 1e-13): 1e-6. A
    transformers model in fp32: the measured per-gap bound at its realistic logit scale."""
    if model == "reference":
        return 1e-6
    try:
        from .hf.families import hit_tolerance
    except ImportError:  # no transformers: check_config refuses the model with its own message
        return 1e-5
    return hit_tolerance()


def _after(close: Callable[[], None]) -> Callable[[int, str], tuple[Callable[[int], None], Callable[[], None]]]:
    """A bar factory for a run's later phases that first closes the serving bar ``close`` (once):
    each phase then shows on a line of its own."""
    closed = [False]

    def bars(total: int, desc: str) -> tuple[Callable[[int], None], Callable[[], None]]:
        from .progress import progress_callback

        if not closed[0]:
            closed[0] = True
            close()
        return progress_callback(total, desc)

    return bars


def _print_failures(exc: BaseException) -> None:
    """Print each failure hypothesis found with its shrunk program (attached as notes); with more
    than one distinct failure they come inside an exception group, each with its own program."""
    subs = getattr(exc, "exceptions", None)
    if subs:
        for i, sub in enumerate(subs, 1):
            print(f"--- failure {i} of {len(subs)}: {type(sub).__name__}: {sub}")
            _print_failures(sub)
        return
    for note in getattr(exc, "__notes__", []):
        print(note)


def cmd_demo(args: argparse.Namespace) -> int:
    """Walk through the slot pool's ownership rule and fences."""
    from .demo import run_demo

    return 0 if run_demo() else 1


def cmd_stress(args: argparse.Namespace) -> int:
    """Seeded random tree actions, invariants after each; prints a JSON report."""
    from .progress import progress_callback
    from .stress import tree_stress

    update, close = progress_callback(args.count, "stress")
    try:
        report = tree_stress(args.count, args.seed, page_size=args.page_size, slots=args.slots, progress=update)
    finally:
        close()
    print(json.dumps(asdict(report)))
    return 0


def cmd_hammer(args: argparse.Namespace) -> int:
    """Serve the hammer's mix and compare every answer with the cold run."""
    from .progress import progress_callback
    from .testing.hammer import HammerConfig, check_config, format_report, run_hammer

    replica, replicas = args.replica
    import torch

    # NOTE: one thread by default. The reference model's kernels are small, so a second thread
    # buys nothing on a quiet machine (8.6 s against 9.2 s of serving), and when another job
    # holds a core torch's threads wait on each other: serving took 152 s instead of 9.8 s.
    torch.set_num_threads(args.threads)
    cfg = HammerConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        inject=args.inject,
        chunk=args.chunk,
        forensics=args.forensics,
        policy=args.policy,
        page_size=args.page_size,
        device=args.device,
        forward_delay_us=args.forward_delay_us,
        snapshot_slots=args.snapshot_slots,
        host_slots=args.host_slots,
        shared_redis=args.shared_redis,
        replica=replica,
        replicas=replicas,
        warm=not args.no_warm,
        model=args.model,
        workers=args.workers,
        logit_tol=args.logit_tol if args.logit_tol is not None else _default_logit_tol(args.model),
        shared_corrupt=args.shared_corrupt,
        hit_guard=not args.no_hit_guard,
        clock=args.clock,
    )
    try:
        check_config(cfg)
    except ValueError as e:
        raise _BadInput(str(e)) from None
    if args.record_hit_rate is not None and (cfg.inject is not None or not args.record_hit_rate.strip()):
        raise _BadInput("--record-hit-rate records a clean run (no --inject) and needs a reason")
    update, close = progress_callback(cfg.requests, "hammer", "request")
    try:
        hammered = run_hammer(cfg, progress=update, bars=_after(close))
    finally:
        close()
    print(json.dumps(hammered.as_dict(), indent=2) if args.json else format_report(hammered))
    if args.record_hit_rate is not None:
        return _record_hammer(cfg, hammered, args.record_hit_rate)
    return 0 if hammered.ok else 1


def _record_hammer(cfg: Any, rep: Any, reason: str) -> int:
    """Record a clean, checked hammer run's cached tokens (the hit-rate guard's figure)."""
    from .testing import guard
    from .testing.hammer import guard_fields

    clean = rep.checked and rep.error is None and rep.wrong_answers == 0 and rep.stuck == 0
    if not clean:
        print("not recorded: the run was not clean", file=sys.stderr)
        return 1
    guard.record(guard.hammer_key(guard_fields(cfg)), rep.cached_tokens, reason)
    print(f"recorded {rep.cached_tokens} cached tokens in {guard.RECORDS}", file=sys.stderr)
    return 0


def cmd_forensics(args: argparse.Namespace) -> int:
    """Read a forensics ledger; exit 1 when it records a corruption."""
    from .forensics import analyze, format_forensics

    try:
        rep = analyze(args.ledger)
    except (OSError, ValueError) as e:  # a mistyped path is an error, never an all-clear
        raise _BadInput(str(e)) from None
    print(json.dumps(rep.as_dict(), indent=2, default=str) if args.json else format_forensics(rep))
    return 1 if rep.corrupted else 0


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Run the host state machine; print the shrunk program on a failure."""
    from .testing.fuzz import fuzz_hosts, run_fuzz

    bridge = None if args.bridge == "none" else args.bridge
    return _run_machine(
        "fuzz",
        args,
        lambda update: run_fuzz(
            args.examples,
            args.seed,
            inject=args.inject,
            page_size=args.page_size,
            progress=update,
            stateful_step_count=args.steps,
            host_slots=args.host_slots,
            shared=not args.no_shared,
            shared_redis=args.shared_redis,
            kv_budget=args.kv_budget or None,
            shrink=not args.no_shrink,
            bridge=bridge,
        ),
        hosts=fuzz_hosts(bridge),
    )


def cmd_misuse(args: argparse.Namespace) -> int:
    """Run the misuse machine: wrong calls between valid steps; each must raise a typed error and
    change nothing."""
    from .testing.misuse import run_misuse

    return _run_machine(
        "misuse",
        args,
        lambda update: run_misuse(
            args.examples, args.seed, inject=args.inject, progress=update, stateful_step_count=args.steps
        ),
    )


def _run_machine(
    name: str, args: argparse.Namespace, run: Callable[[Callable[[int], None]], None], hosts: int = 1
) -> int:
    """Run a state machine (``hosts`` of them, one after the other, ``args.examples`` each) with a
    progress bar; print PASS, or each failure's shrunk program."""
    from .progress import progress_callback

    update, close = progress_callback(args.examples * hosts, name, "example")
    t0 = time.perf_counter()
    try:
        run(update)
    except Exception as exc:
        close()
        _print_failures(exc)
        print(f"FAIL after {time.perf_counter() - t0:.1f} s: {type(exc).__name__}: {exc}")
        return 1
    close()
    each = f" on each of {hosts} hosts" if hosts > 1 else ""
    print(f"PASS: {args.examples} examples{each}, seed {args.seed}, {time.perf_counter() - t0:.1f} s, nothing found")
    return 0


def cmd_bench_trace(args: argparse.Namespace) -> int:
    """Replay one trace under policies and budgets through the manager; rows as JSON."""
    from .progress import progress_callback
    from .simulator import DEFAULT_BUDGETS_GIB, load_trace, run_grid

    if args.trace not in SHAPES and not os.path.isfile(args.trace):
        raise _BadInput(f"trace {args.trace!r} is neither a JSONL file nor a shape ({', '.join(_SHAPES)})")
    try:
        traces = [load_trace(args.trace, args.seed)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _BadInput(f"trace {args.trace!r} cannot be read: {type(e).__name__}: {e}") from None
    policies = args.policy or list(POLICIES)
    budgets = args.budget or DEFAULT_BUDGETS_GIB.get(traces[0][0], (2.0, 4.0, 8.0))
    update, close = progress_callback(len(policies) * len(budgets), "bench-trace")
    try:
        rows = run_grid(traces, policies, lambda _: budgets, preset=args.preset, progress=update)
    finally:
        close()
    return _guard_replay(args, rows)


def _guard_replay(args: argparse.Namespace, rows: list[dict[str, Any]]) -> int:
    """The hit-rate guard on replay rows of a built-in trace shape (a file has no record): each
    row gets ``hit_guard``; exit 1 when one fails. ``--record-hit-rate`` writes them instead."""
    from .testing import guard

    shape = args.trace in SHAPES and not os.path.isfile(args.trace)
    failed = []
    for row in rows:
        if not shape or args.no_hit_guard:
            continue
        key = guard.replay_key(args.trace, args.seed, args.preset, str(row["policy"]), int(row["budget_bytes"]))
        if args.record_hit_rate is not None:
            guard.record(key, int(row["hit_tokens"]), args.record_hit_rate)
        res = guard.check(key, int(row["hit_tokens"]))
        row["hit_guard"] = res.as_dict()
        if res.status == "fail":
            failed.append(f"{row['policy']} at {row['budget_bytes']} bytes: {res.describe()}")
    print(json.dumps(rows, indent=1, default=str))
    for line in failed:
        print(f"hit-rate guard: {line}", file=sys.stderr)
    return 1 if failed else 0


def cmd_policies_report(args: argparse.Namespace) -> int:
    """Every trace shape x 3 budgets x every policy, for each seed and preset, through the manager;
    the markdown tables (or the rows as JSON). benchmarks/policies_report.py writes them into
    docs/policies.md."""
    from .progress import progress_callback
    from .simulator import DEFAULT_BUDGETS_GIB, report_markdown, run_report

    policies = args.policy or list(POLICIES)
    shapes = args.shape or list(DEFAULT_BUDGETS_GIB)
    per = sum(len(DEFAULT_BUDGETS_GIB[t]) for t in shapes) * (len(policies) + 1)
    update, close = progress_callback(per * len(args.seed) * len(args.preset), "policies-report")
    try:
        rows = run_report(
            args.seed, args.preset, policies, shapes=shapes, progress=update, host_factor=args.host_factor
        )
    finally:
        close()
    print(json.dumps(rows, indent=1, default=str) if args.json else report_markdown(rows))
    return 0


def cmd_make_trace(args: argparse.Namespace) -> int:
    """Write a seeded trace as JSONL."""
    from .simulator import generate, write_trace

    try:
        write_trace(generate(args.shape, args.seed), args.out)
    except OSError as e:
        raise _BadInput(f"cannot write {args.out!r}: {e.strerror or e}") from None
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="radixcache", description="radix prefix cache for hybrid LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.set_defaults(run=fn)
        return p

    add("demo", cmd_demo, "walk through the slot pool's ownership rule and fences")
    stress = add("stress", cmd_stress, "seeded random actions on the tree, invariants checked after each")
    stress.add_argument("--count", type=_int_at_least(1), default=10_000, help="number of actions")
    stress.add_argument("--seed", type=int, default=0)
    stress.add_argument("--page-size", type=_int_at_least(1), default=1)
    stress.add_argument("--slots", type=_int_at_least(1), default=64, help="pool capacity")
    hammer = add("hammer", cmd_hammer, "serve a request mix concurrently and check every answer against cold")
    hammer.add_argument("--requests", type=_int_at_least(0), default=500)
    hammer.add_argument("--concurrency", type=_int_at_least(1), default=8)
    hammer.add_argument("--seed", type=int, default=0)
    hammer.add_argument("--chunk", type=_int_at_least(1), default=256, help="prefill chunk size")
    hammer.add_argument("--page-size", type=_int_at_least(1), default=1, help="tokens per KV page of the tree")
    hammer.add_argument(
        "--policy", choices=sorted(POLICIES), default=DEFAULT_POLICY, help="the manager's snapshot policy"
    )
    hammer.add_argument(
        "--inject",
        choices=list(HAMMER_BUGS),
        default=None,
        help="commit a bug on purpose; the hammer must catch it",
    )
    hammer.add_argument(
        "--shared-corrupt",
        type=_fraction,
        default=0.05,
        help="with --shared-redis: the fraction of blobs handed out corrupted on purpose (each must be refused)",
    )
    hammer.add_argument(
        "--clock",
        choices=["steps", "wall"],
        default="steps",
        help="the policy's clock: a scheduler step counts 10 ms (default: the same figures on every machine), "
        "or the machine's monotonic clock",
    )
    hammer.add_argument(
        "--no-hit-guard", action="store_true", help="do not compare cached tokens with the recorded figure"
    )
    hammer.add_argument(
        "--record-hit-rate",
        metavar="REASON",
        default=None,
        help="write this run's cached tokens as the recorded figure of its configuration, with REASON "
        "(a clean run only; the file is radixcache/testing/hit_rates.json)",
    )
    hammer.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    hammer.add_argument("--forensics", metavar="LEDGER", default=None, help="fingerprint snapshots, log to LEDGER")
    hammer.add_argument(
        "--device", default="cpu", help="where the reference model runs: cpu, or cuda (two CUDA streams, real races)"
    )
    hammer.add_argument(
        "--snapshot-slots", type=_int_at_least(1), default=512, help="device pool slots for the tree's snapshots"
    )
    hammer.add_argument(
        "--host-slots",
        type=_int_at_least(0),
        default=None,
        help="the tree's host tier, in snapshots (0: evicted snapshots are dropped; default: the tree's "
        "own budget, 4x the device pool)",
    )
    hammer.add_argument(
        "--shared-redis",
        metavar="URL",
        default=None,
        help="a shared tier on this Redis server (redis://127.0.0.1:6379/0): publish every snapshot, fetch misses",
    )
    hammer.add_argument(
        "--replica",
        type=_replica,
        default=(0, 1),
        metavar="I/N",
        help="serve replica I's round-robin share of the mix (every N-th request drawn), e.g. 0/2 and 1/2",
    )
    hammer.add_argument("--no-warm", action="store_true", help="do not pre-cache the system prompts")
    hammer.add_argument(
        "--threads",
        type=_int_at_least(1),
        default=1,
        help="torch threads for serving and the in-process ground truth (default 1: stays fast beside other jobs)",
    )
    hammer.add_argument(
        "--workers",
        type=_int_at_least(1),
        default=None,
        help="processes computing the ground truth (default: one per core)",
    )
    hammer.add_argument(
        "--model",
        default="reference",
        metavar="reference|hf:FAMILY",
        help="the reference hybrid model, or a tiny seeded transformers model of FAMILY (qwen3_next, nemotron_h, "
        "...: radixcache.hf.TINY_CONFIGS; needs the hf extra)",
    )
    hammer.add_argument(
        "--logit-tol",
        type=_float_at_least(0.0),
        default=None,
        help="first-token logits must match the cold run within this (default 1e-6; for hf models the "
        "bound radixcache.hf.families.hit_tolerance gives at their realistic logit scale, 1e-5)",
    )
    hammer.add_argument(
        "--forward-delay-us",
        type=_float_at_least(0.0),
        default=0.0,
        help="cuda only: every forward first keeps the GPU busy this long, so an unfenced copy races it",
    )
    fx = add("forensics", cmd_forensics, "read a forensics ledger: findings, suspects, branch timelines")
    fx.add_argument("ledger")
    fx.add_argument("--json", action="store_true")
    fuzz = add("fuzz", cmd_fuzz, "run the host state machine: random interleavings, invariants after each step")
    fuzz.add_argument("--examples", type=_int_at_least(1), default=1000)
    fuzz.add_argument("--seed", type=int, default=0)
    fuzz.add_argument("--page-size", type=_int_at_least(1), default=1)
    fuzz.add_argument("--steps", type=_int_at_least(1), default=50, help="rules per example")
    fuzz.add_argument(
        "--host-slots", type=_int_at_least(0), default=2, help="the tree's host tier, in snapshots (0: none)"
    )
    fuzz.add_argument(
        "--kv-budget",
        type=_int_at_least(0),
        default=96,
        help="KV tokens the host holds by asking the manager to evict (0: unbounded)",
    )
    fuzz.add_argument("--no-shared", action="store_true", help="no shared tier (default: one over a faulty store)")
    fuzz.add_argument("--no-shrink", action="store_true", help="report the failing program as found, unshrunk")
    fuzz.add_argument(
        "--bridge",
        default="auto",
        metavar="FAMILY|auto|none",
        help="keep each request's state in a transformers cache of FAMILY's tiny model between windows, "
        "loaded through the bridge (auto: qwen3_next when transformers is installed)",
    )
    fuzz.add_argument(
        "--shared-redis",
        metavar="URL",
        default=None,
        help="put the faulty shared store over this Redis server instead of memory (redis://127.0.0.1:6379/0)",
    )
    fuzz.add_argument(
        "--inject", choices=list(FUZZ_BUGS), default=None, help="commit a bug on purpose; the machine must find it"
    )
    mu = add("misuse", cmd_misuse, "interleave wrong calls with valid steps: typed errors, nothing changed")
    mu.add_argument("--examples", type=_int_at_least(1), default=1000)
    mu.add_argument("--seed", type=int, default=0)
    mu.add_argument("--steps", type=_int_at_least(1), default=30, help="rules per example")
    mu.add_argument(
        "--inject",
        choices=list(MISUSE_BUGS),
        default=None,
        help="commit an edge bug on purpose; the machine must find it",
    )
    bt = add("bench-trace", cmd_bench_trace, "replay a trace under policies and budgets, side by side (JSON)")
    bt.add_argument("trace", help="a JSONL trace, or a shape: " + ", ".join(_SHAPES))
    bt.add_argument("--policy", nargs="+", choices=sorted(POLICIES), default=None, help="default: every policy")
    bt.add_argument("--budget", nargs="+", type=_float_at_least(0.0), default=None, help="cache budgets in GiB")
    bt.add_argument("--preset", default=_PRESETS[0], choices=_PRESETS)
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--no-hit-guard", action="store_true", help="do not compare hit tokens with the recorded figures")
    bt.add_argument(
        "--record-hit-rate",
        metavar="REASON",
        default=None,
        help="write each row's hit tokens as the recorded figure (a trace shape only), with REASON",
    )
    pr = add("policies-report", cmd_policies_report, "every trace shape x 3 budgets x every policy: the table")
    pr.add_argument("--preset", nargs="+", default=[_PRESETS[0]], choices=_PRESETS)
    pr.add_argument("--seed", nargs="+", type=int, default=[0])
    pr.add_argument("--shape", nargs="+", choices=_SHAPES, default=None, help="default: every shape")
    pr.add_argument("--policy", nargs="+", choices=sorted(POLICIES), default=None, help="default: every policy")
    pr.add_argument(
        "--host-factor",
        type=_float_at_least(0.0),
        default=8.0,
        help="each policy also with a host tier of this many times the device budget (0: none)",
    )
    pr.add_argument("--json", action="store_true", help="the rows as JSON instead of the markdown table")
    mt = add("make-trace", cmd_make_trace, "write a seeded trace as JSONL")
    mt.add_argument("shape", choices=_SHAPES)
    mt.add_argument("out")
    mt.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixcache`` console script. Returns the process exit status."""
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except _BadInput as e:
        print(f"radixcache {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
