"""The ``radixcache`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

from .testing.inject import BUGS, FUZZ_BUGS

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radixcache`` console script. Returns the process exit status."""
    parser = argparse.ArgumentParser(prog="radixcache", description="radix prefix cache for hybrid LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="walk through the slot pool's ownership rule and fences")
    stress = sub.add_parser("stress", help="seeded random actions on the tree, invariants checked after each")
    stress.add_argument("--count", type=int, default=10_000, help="number of actions")
    stress.add_argument("--seed", type=int, default=0)
    stress.add_argument("--page-size", type=int, default=1)
    stress.add_argument("--slots", type=int, default=64, help="pool capacity")
    hammer = sub.add_parser("hammer", help="serve a request mix concurrently and check every answer against cold")
    hammer.add_argument("--requests", type=int, default=500)
    hammer.add_argument("--concurrency", type=int, default=8)
    hammer.add_argument("--seed", type=int, default=0)
    hammer.add_argument("--chunk", type=int, default=256, help="prefill chunk size")
    hammer.add_argument(
        "--inject",
        choices=sorted(BUGS),
        default=None,
        help="commit a historical bug on purpose; the hammer must catch it",
    )
    hammer.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    hammer.add_argument("--forensics", metavar="LEDGER", default=None, help="fingerprint snapshots, log to LEDGER")
    fx = sub.add_parser("forensics", help="read a forensics ledger: findings, suspects, branch timelines")
    fx.add_argument("ledger")
    fx.add_argument("--json", action="store_true")
    fuzz = sub.add_parser("fuzz", help="run the host state machine: random interleavings, invariants after each step")
    fuzz.add_argument("--examples", type=int, default=1000)
    fuzz.add_argument("--seed", type=int, default=0)
    fuzz.add_argument("--page-size", type=int, default=1)
    fuzz.add_argument("--steps", type=int, default=50, help="rules per example")
    fuzz.add_argument(
        "--inject",
        choices=list(FUZZ_BUGS),
        default=None,
        help="commit a bug on purpose; the machine must find it",
    )
    bt = sub.add_parser("bench-trace", help="replay a trace under policies and budgets, side by side (JSON)")
    bt.add_argument("trace", help="a JSONL trace, or a shape: chat, agentic, fanout, edge")
    bt.add_argument("--policy", nargs="+", default=None, help="default: every policy")
    bt.add_argument("--budget", nargs="+", type=float, default=None, help="cache budgets in GiB")
    bt.add_argument("--preset", default="qwen3-next-80b", choices=["qwen3-next-80b", "nemotron-h-8b"])
    bt.add_argument("--seed", type=int, default=0)
    bt.add_argument("--plot", default=None, help="save a PNG (needs the plot extra)")
    mt = sub.add_parser("make-trace", help="write a seeded trace as JSONL")
    mt.add_argument("shape", choices=["chat", "agentic", "fanout", "edge"])
    mt.add_argument("out")
    mt.add_argument("--seed", type=int, default=0)
    pr = sub.add_parser("policies-report", help="every trace shape x 3 budgets x every policy -> docs/policies.md")
    pr.add_argument("--doc", default="docs/policies.md")
    pr.add_argument("--png", default="docs/policies.png")
    pr.add_argument("--preset", default="qwen3-next-80b", choices=["qwen3-next-80b", "nemotron-h-8b"])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return 0 if run_demo() else 1
    if args.command == "stress":
        from .progress import progress_callback
        from .stress import tree_stress

        update, close = progress_callback(args.count, "stress")
        try:
            report = tree_stress(args.count, args.seed, page_size=args.page_size, slots=args.slots, progress=update)
        finally:
            close()
        print(json.dumps(asdict(report)))
        return 0
    if args.command == "hammer":
        from .progress import progress_callback
        from .testing.hammer import HammerConfig, format_report, run_hammer

        cfg = HammerConfig(
            requests=args.requests,
            concurrency=args.concurrency,
            seed=args.seed,
            inject=args.inject,
            chunk=args.chunk,
            forensics=args.forensics,
        )
        update, close = progress_callback(cfg.requests, "hammer")
        try:
            hammered = run_hammer(cfg, progress=update)
        finally:
            close()
        print(json.dumps(hammered.as_dict(), indent=2) if args.json else format_report(hammered))
        return 0 if hammered.ok else 1
    if args.command in ("bench-trace", "policies-report"):
        from .bench_trace import DEFAULT_BUDGETS_GIB, load_trace, plot, run_grid, write_report
        from .policies import POLICIES
        from .progress import progress_callback

        if args.command == "bench-trace":
            traces = [load_trace(args.trace, args.seed)]
            policies = args.policy or list(POLICIES)
            budgets = args.budget or DEFAULT_BUDGETS_GIB.get(traces[0][0], (2.0, 4.0, 8.0))
            update, close = progress_callback(len(policies) * len(budgets), "bench-trace")
            try:
                rows = run_grid(traces, policies, lambda _: budgets, preset=args.preset, progress=update)
            finally:
                close()
            if args.plot:
                plot(rows, args.plot)
            print(json.dumps(rows, indent=1, default=str))
            return 0
        traces = [load_trace(shape) for shape in DEFAULT_BUDGETS_GIB]
        total = sum(len(b) for b in DEFAULT_BUDGETS_GIB.values()) * len(POLICIES)
        update, close = progress_callback(total, "policies-report")
        try:
            rows = run_grid(
                traces, list(POLICIES), lambda t: DEFAULT_BUDGETS_GIB[t], preset=args.preset, progress=update
            )
        finally:
            close()
        write_report(rows, args.doc, args.png)
        print(f"wrote the results table into {args.doc} and the plot to {args.png}")
        return 0
    if args.command == "make-trace":
        from .traces import generate, write_trace

        write_trace(generate(args.shape, args.seed), args.out)
        return 0
    if args.command == "forensics":
        from .forensics_report import analyze, format_forensics

        rep = analyze(args.ledger)
        print(json.dumps(rep.as_dict(), indent=2, default=str) if args.json else format_forensics(rep))
        return 1 if rep.corrupted else 0
    if args.command == "fuzz":
        import time

        from .progress import progress_callback
        from .testing.fuzz import run_fuzz

        update, close = progress_callback(args.examples, "fuzz")
        t0 = time.perf_counter()
        try:
            run_fuzz(
                args.examples,
                args.seed,
                inject=args.inject,
                page_size=args.page_size,
                progress=update,
                stateful_step_count=args.steps,
            )
        except Exception as exc:
            close()
            # hypothesis attaches the shrunk failing program (each rule call, in order) as notes
            for note in getattr(exc, "__notes__", []):
                print(note)
            print(f"FAIL after {time.perf_counter() - t0:.1f} s: {type(exc).__name__}: {exc}")
            return 1
        close()
        print(f"PASS: {args.examples} examples, seed {args.seed}, {time.perf_counter() - t0:.1f} s, nothing found")
        return 0
    parser.error(f"unknown command {args.command!r}")  # pragma: no cover - argparse rejects first
    return 2


if __name__ == "__main__":
    sys.exit(main())
