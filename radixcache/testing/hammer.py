"""The ground-truth hammer: serve a realistic mix of requests concurrently through the reference
engine and the cache, then compare every answer with the same prompt computed alone, cold.

The mix (seeded): new sessions on shared system prompts (pre-cached at start-up by the engine's
``warm``, straight into the tree through a reused KV staging buffer), multi-turn continuations (the
previous prompt + its answer + a new message), identical re-sends, prefixes cut mid-block followed
by a new suffix, streams aborted after a few tokens, one-token requests (whose final state is
the state at exactly the prompt: a re-send may only hit one token short of it), tenants (each
with its own adapter: a namespace, sharing the system prompts and ids with the base model), and
image requests (real image bytes keyed through ``image_cache_ids``: a gallery of images and of
variants differing from them in one byte anywhere, the same image after other prefixes,
placeholder runs cut by a later hit). Each request is compared with the same prompt, namespace and
images computed alone, cold. A request is wrong when its tokens differ from the cold ground truth;
cross-talk when its wrong tokens are another prompt's ground truth. Leaks are slots or KV indices
neither free nor held once everything finished. An exception out of the engine or the cache fails
the run (``error``).
"""

from __future__ import annotations

import os
import random
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from linear_state import DeviceUnavailable, check_device

from ..manager.cache_manager import UnwrittenSlotWarning
from ..policies import POLICIES, make_policy
from ..tiers.store import REDIS_URL_SCHEMES, RedisStore
from . import guard
from .engine import POLICY_CLOCKS, ColdJob, EngineRequest, ReferenceEngine, generate_cold_many
from .faults import FaultyStore
from .inject import HAMMER_BUGS, injected
from .model import HybridConfig, HybridModel

__all__ = ["HammerConfig", "HammerReport", "check_config", "format_report", "guard_fields", "run_hammer"]


@dataclass(frozen=True)
class HammerConfig:
    """What the hammer runs. Defaults are the README's main job."""

    requests: int = 500
    concurrency: int = 8
    seed: int = 0
    inject: str | None = None
    chunk: int = 256
    system_prompts: int = 6
    min_new_tokens: int = 4
    max_new_tokens: int = 12
    logit_tol: float = 1e-6
    probe_tokens: int = 2560
    forensics: str | None = None  # ledger path: fingerprint every donation, verify every restore
    ground_truth: bool = True  # False: serve only (benchmarks); nothing is checked
    policy: str = "hit-density"  # the manager's policy, by name (see radixcache.policies.POLICIES)
    page_size: int = 1  # tokens per KV page of the tree
    stall_steps: int = 2000  # engine steps without any progress before the watchdog fails the run
    tenants: int = 2  # adapters (namespaces) besides the base model; 0: base model only
    tenant_share: float = 0.25  # fraction of new sessions that run on a tenant's adapter
    images: int = 4  # images in the gallery (each with a variant differing in one byte); 0: text only
    image_share: float = 0.2  # fraction of new sessions that carry an image
    single_token_share: float = 0.08  # fraction of requests that generate one token
    warm: bool = True  # pre-cache the system prompts at start-up (engine.warm)
    device: str = "cpu"  # where the reference model, its pools and its streams live ("cuda": CudaStreams)
    forward_delay_us: float = 0.0  # cuda only: each forward first keeps the GPU busy this long (widens races)
    snapshot_slots: int = 512  # the device pool's slots for tree snapshots
    host_slots: int | None = None  # the tree's host tier, in snapshots; 0: none; None: the tree's default budget
    shared_redis: str | None = None  # a shared tier on this Redis server (redis://host:port/db)
    replica: int = 0  # with replicas > 1: serve only the drawn requests whose index % replicas == replica
    replicas: int = 1
    # "reference" (the reference hybrid model) or "hf:FAMILY": a tiny seeded transformers model of
    # that family (radixcache.hf.families) served by radixcache.testing.hf_engine.HFEngine: text only, base model
    model: str = "reference"
    # processes computing the ground truth (reference model on the CPU): None, one per core
    workers: int | None = None
    # with shared_redis: the fraction of blobs the store hands out corrupted on purpose (one bit
    # flipped); each must be refused by the tier's verification, or the run fails
    shared_corrupt: float = 0.05
    # compare the tokens served from cache with the figure recorded for this configuration
    # (radixcache.testing.guard); a drop beyond its tolerance fails the run
    hit_guard: bool = True
    # the policy's clock: "steps" (a scheduler step counts 10 ms: the same figures on every
    # machine, run after run) or "wall" (time.monotonic: figures move with the machine's pace)
    clock: str = "steps"


@dataclass
class HammerReport:
    """The hammer's findings; ``ok`` is False on any wrong answer or leak."""

    requests: int
    finished: int
    aborted: int
    hits: int
    prompt_tokens: int
    cached_tokens: int
    wrong_answers: int
    cross_talk: int
    logit_mismatches: int
    slots_leaked: int
    kv_leaked: int
    ttft_cold_ms: float
    ttft_hit_ms: float
    probe_ttft_cold_ms: float
    probe_ttft_hit_ms: float
    probe_hit_fraction: float
    snapshot_corruptions: int  # this replica's own snapshots that changed (forensics): a failure
    wall_s: float
    ground_truth_s: float
    inject: str | None
    seed: int
    forensics: str | None = None
    policy: str = "hit-density"
    page_size: int = 1
    checked: bool = True  # False: served without ground truth; no answer was compared
    stuck: int = 0  # requests the watchdog aborted: no progress in stall_steps engine steps
    error: str | None = None  # an exception out of the engine or the cache ended the run
    tenant_requests: int = 0  # served requests with a namespace
    image_requests: int = 0  # served requests with images
    metrics: dict[str, object] = field(default_factory=dict)  # the manager's counters at the end
    wrong_examples: list[str] = field(default_factory=list)
    device: str = "cpu"  # where the model, its pools and its streams ran
    # Blobs from the shared tier that failed verification (forensics' shared-* findings): the tier
    # doing its job (each was a miss, never a restore), so not a failure of this run.
    shared_rejections: int = 0
    # With shared_redis: blobs the store handed out corrupted (or misplaced) on purpose, and how
    # many of them the tier kept instead of refusing (a failure: a verification skipped).
    shared_corrupted: int = 0
    shared_accepted_bad: int = 0
    # The hit-rate guard's comparison (radixcache.testing.guard.GuardResult.as_dict()); None: off.
    hit_guard: dict[str, object] | None = None
    # Snapshots the manager's write checks found donated from slots never written (a capture the
    # forward did not write, or a clone taken before it did): a failure, each a wrong snapshot.
    unwritten_snapshots: int = 0

    @property
    def cached_fraction(self) -> float:
        """Prompt tokens served from cache / all prompt tokens."""
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def probe_ttft_ratio(self) -> float:
        """Hit TTFT / cold TTFT on the probes (the hit one >= 90% cached)."""
        return self.probe_ttft_hit_ms / max(1e-9, self.probe_ttft_cold_ms)

    @property
    def ok(self) -> bool:
        """Answers were compared with the cold run, and: no wrong answer, no cross-talk, no leak,
        no corrupted shared blob kept, no snapshot donated unwritten, no drop of cached tokens beyond
        the hit-rate guard's tolerance. False when nothing was checked (``ground_truth=False``)."""
        return (
            self.checked
            and self.error is None
            and self.stuck == 0
            and self.wrong_answers == 0
            and self.cross_talk == 0
            and self.slots_leaked == 0
            and self.kv_leaked == 0
            and self.snapshot_corruptions == 0
            and self.shared_accepted_bad == 0
            and self.unwritten_snapshots == 0
            and (self.hit_guard is None or self.hit_guard["status"] != "fail")
        )

    def as_dict(self) -> dict[str, object]:
        """Every field plus the derived ratios, for JSON."""
        d = asdict(self)
        d.update(cached_fraction=self.cached_fraction, probe_ttft_ratio=self.probe_ttft_ratio, ok=self.ok)
        return d


_Key = tuple[tuple[int, ...], object, tuple[bytes, ...]]  # prompt, namespace, images


class _Workload:
    """Seeded request mix; continuations and re-sends draw on requests that already finished."""

    QUESTIONS = 3  # fixed questions after an image: repeats of (image, question) hit deep

    def __init__(self, cfg: HammerConfig, vocab: int) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.vocab = vocab - 1  # the last id is the image placeholder: text never uses it
        self.placeholder = vocab - 1
        self.systems = [self._tokens(self.rng.randint(150, 1100)) for _ in range(cfg.system_prompts)]
        self.tenants = [f"tenant-{i}" for i in range(cfg.tenants)]
        self.questions = [self._tokens(self.rng.randint(8, 40)) for _ in range(self.QUESTIONS)]
        self.gallery: list[tuple[bytes, int]] = []  # (image bytes, its tokens)
        for i in range(cfg.images):
            image = self.rng.randbytes(self.rng.randint(6 * 1024, 12 * 1024))
            # Its variant differs in one byte: within the first 4 KiB for even i, beyond for odd.
            at = self.rng.randrange(4096) if i % 2 == 0 else self.rng.randrange(4096, len(image))
            variant = image[:at] + bytes([image[at] ^ 0x5A]) + image[at + 1 :]
            n = self.rng.randint(24, 96)
            self.gallery += [(image, n), (variant, n)]
        # finished (prompt, output, session, namespace, images)
        self.history: list[tuple[list[int], list[int], object, object, list[bytes]]] = []
        self.followers: set[object] = set()  # rids of burst followers
        self.n = 0

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _request(
        self, prompt: list[int], session: object = None, namespace: object = None, images: list[bytes] | None = None
    ) -> EngineRequest:
        rng, cfg = self.rng, self.cfg
        n_new = 1 if rng.random() < cfg.single_token_share else rng.randint(cfg.min_new_tokens, cfg.max_new_tokens)
        abort_after = rng.randint(1, max(1, n_new - 1)) if n_new > 1 and rng.random() < 0.10 else None
        self.n += 1
        prompt = prompt[:3000]
        images = list(images or [])[: self._runs(prompt)]  # a cut prompt keeps the images it still shows
        # A new conversation is its own session; a continuation carries its conversation's.
        return EngineRequest(
            self.n, prompt, n_new, abort_after, session=session or f"s{self.n}", namespace=namespace, images=images
        )

    def _runs(self, prompt: list[int]) -> int:
        ph = self.placeholder
        return sum(1 for i, t in enumerate(prompt) if t == ph and (i == 0 or prompt[i - 1] != ph))

    def _new_session(self) -> EngineRequest:
        rng, cfg = self.rng, self.cfg
        system = rng.choice(self.systems)
        ns = rng.choice(self.tenants) if self.tenants and rng.random() < cfg.tenant_share else None
        if self.gallery and rng.random() < cfg.image_share:
            image, n = rng.choice(self.gallery)
            # Mostly the vision app's own system prompt, the image right after it; else the same
            # image at another position: after another system prompt, or a few words of its own.
            system = self.systems[0] if rng.random() < 0.8 else system
            lead = [] if rng.random() < 0.7 else self._tokens(rng.randint(1, 30))
            prompt = system + lead + [self.placeholder] * n + rng.choice(self.questions)
            return self._request(prompt, namespace=ns, images=[image])
        return self._request(system + self._tokens(rng.randint(20, 250)), namespace=ns)

    def next(self) -> list[tuple[int, EngineRequest]]:
        """The next request(s), each with a delay in engine steps before it is submitted."""
        rng = self.rng
        kind = rng.random()
        if kind < 0.10:
            # A burst on a fresh shared prefix, arriving one step apart: later ones hit snapshots
            # the first donated moments ago, while its forward and the clones may still be queued.
            shared = self._tokens(rng.randint(300, 900))
            burst = [(i, self._request(shared + self._tokens(rng.randint(10, 80)))) for i in range(3)]
            self.followers.update(req.rid for _, req in burst[1:])
            return burst
        if kind < 0.35 and self.history:
            prompt, answer, session, ns, images = rng.choice(self.history)
            prompt = prompt + answer + self._tokens(rng.randint(10, 120))  # multi-turn continuation
            return [(0, self._request(prompt, session, ns, images))]
        if kind < 0.50 and self.history:
            prompt, _, _, ns, images = rng.choice(self.history)
            return [(0, self._request(list(prompt), None, ns, images))]  # identical re-send
        if kind < 0.60 and self.history:
            base, _, _, ns, images = rng.choice(self.history)
            cut = base[: rng.randint(1, len(base))] + self._tokens(rng.randint(20, 300))  # cut mid-block
            return [(0, self._request(cut, None, ns, images))]
        return [(0, self._new_session())]

    def finished(self, req: EngineRequest) -> None:
        if not req.aborted:
            self.history.append((req.prompt, req.output, req.session, req.namespace, req.images))


def _key(r: EngineRequest) -> _Key:
    return tuple(r.prompt), r.namespace, tuple(r.images)


Bars = Callable[[int, str], tuple[Callable[[int], None], Callable[[], None]]]
"""A progress bar factory, ``bars(total, desc) -> (update(step), close())``
(:func:`radixcache.progress.progress_callback`)."""


def run_hammer(
    cfg: HammerConfig,
    *,
    model: HybridModel | None = None,
    progress: Callable[[int], None] | None = None,
    bars: Bars | None = None,
) -> HammerReport:
    """Run the hammer and return its report (see the module docstring).

    ``progress(step)`` after each request served; ``bars`` makes a bar for each later phase
    that takes time (the ground truth, with its own count and estimate). The ground truth of the
    reference model on the CPU runs in ``cfg.workers`` spawned processes, so a script calling this
    needs multiprocessing's ``if __name__ == "__main__":`` guard (without it, it runs here, warned).

    :raises ValueError: ``cfg.device`` names no device torch can use here (CUDA asked for where
        ``torch.cuda.is_available()`` is False, or a name torch does not know), or a field of
        ``cfg`` out of its range (the message names it): checked before anything runs."""
    check_config(cfg)
    if cfg.model != "reference":
        with injected(cfg.inject):
            return _run(_hf_config(cfg), None, progress, bars)
    if cfg.inject == "hf-conv-shift":
        raise ValueError(
            "hammer inject 'hf-conv-shift' is a bug of the transformers bridge: run it with model='hf:FAMILY'"
        )
    with injected(cfg.inject):
        return _run(cfg, model or HybridModel(HybridConfig(), device=cfg.device), progress, bars)


def tiny_families() -> list[str]:
    """The transformers families the hammer serves as ``hf:FAMILY`` (none without the hf extra)."""
    try:
        from ..hf.families import TINY_CONFIGS
    except ImportError:
        return []
    return list(TINY_CONFIGS)


_NOT_SHAPING_HITS = ("inject", "forensics", "ground_truth", "logit_tol", "stall_steps", "workers", "hit_guard")


def guard_fields(cfg: HammerConfig) -> dict[str, object]:
    """The fields of ``cfg`` that shape its cached-token figure: the hit-rate guard's key (the
    injected bug is not one: a bug is compared with the clean figure; a Redis URL counts only as
    whether there is a shared tier)."""
    fields = {k: v for k, v in asdict(cfg).items() if k not in _NOT_SHAPING_HITS}
    fields["shared_redis"] = cfg.shared_redis is not None
    if cfg.shared_redis is None:
        fields.pop("shared_corrupt")
    return fields


def check_config(cfg: HammerConfig) -> None:
    """Refuse a configuration the hammer cannot run: every numeric field of ``cfg`` in its range,
    the policy and the injected bug known (:func:`run_hammer` calls it first; so does the CLI,
    before its progress bar).

    :raises ValueError: the first field out of range, named with its value. :raises TypeError:
        not a :class:`HammerConfig`.
    """
    if not isinstance(cfg, HammerConfig):
        raise TypeError(f"run_hammer takes a HammerConfig, got {type(cfg).__name__}")
    at_least = {
        "requests": 0, "concurrency": 1, "chunk": 1, "system_prompts": 1, "min_new_tokens": 1,
        "probe_tokens": 0, "page_size": 1, "stall_steps": 1, "tenants": 0, "images": 0, "snapshot_slots": 1,
    }  # fmt: skip
    for name, lo in at_least.items():
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"hammer {name} must be an int >= {lo}, got {v!r}")
    if (
        isinstance(cfg.max_new_tokens, bool)
        or not isinstance(cfg.max_new_tokens, int)
        or (cfg.max_new_tokens < cfg.min_new_tokens)
    ):
        raise ValueError(
            f"hammer max_new_tokens must be an int >= min_new_tokens ({cfg.min_new_tokens}), got {cfg.max_new_tokens!r}"
        )
    if cfg.workers is not None and (
        isinstance(cfg.workers, bool) or not isinstance(cfg.workers, int) or cfg.workers < 1
    ):
        raise ValueError(f"hammer workers must be None or an int >= 1, got {cfg.workers!r}")
    if cfg.host_slots is not None and (
        isinstance(cfg.host_slots, bool) or not isinstance(cfg.host_slots, int) or cfg.host_slots < 0
    ):
        raise ValueError(f"hammer host_slots must be None or an int >= 0, got {cfg.host_slots!r}")
    for name in ("tenant_share", "image_share", "single_token_share", "shared_corrupt"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"hammer {name} must be a fraction in [0, 1], got {v!r}")
    for name in ("logit_tol", "forward_delay_us"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"hammer {name} must be a number >= 0, got {v!r}")
    if cfg.policy not in POLICIES:
        raise ValueError(f"hammer policy {cfg.policy!r}: known {sorted(POLICIES)}")
    if cfg.clock not in POLICY_CLOCKS:
        raise ValueError(f"hammer clock {cfg.clock!r}: known {list(POLICY_CLOCKS)}")
    if cfg.inject is not None and cfg.inject not in HAMMER_BUGS:
        raise ValueError(f"hammer inject {cfg.inject!r}: known {list(HAMMER_BUGS)}")
    if not isinstance(cfg.device, str) or cfg.device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"hammer device {cfg.device!r}: the reference engine runs on 'cpu' or 'cuda'")
    try:
        check_device(cfg.device)
    except DeviceUnavailable as e:
        raise ValueError(f"hammer device: {e}") from None
    if not (
        isinstance(cfg.replicas, int)
        and isinstance(cfg.replica, int)
        and cfg.replicas >= 1
        and 0 <= cfg.replica < cfg.replicas
    ):
        raise ValueError(f"hammer replica {cfg.replica!r} of {cfg.replicas!r}: need 0 <= replica < replicas")
    if cfg.model != "reference" and not (
        isinstance(cfg.model, str) and cfg.model.startswith("hf:") and cfg.model.removeprefix("hf:") in tiny_families()
    ):
        raise ValueError(
            f"hammer model {cfg.model!r}: 'reference' or hf:FAMILY with FAMILY in {', '.join(tiny_families())}"
        )
    if cfg.shared_redis is not None and (
        not isinstance(cfg.shared_redis, str) or not cfg.shared_redis.startswith(REDIS_URL_SCHEMES)
    ):
        raise ValueError(f"hammer shared_redis {cfg.shared_redis!r}: a redis://host:port/db URL")
    if cfg.forensics is not None:
        where = os.path.dirname(os.path.abspath(cfg.forensics)) if isinstance(cfg.forensics, str) else ""
        if not os.path.isdir(where) or os.path.isdir(cfg.forensics) or not os.access(where, os.W_OK):
            raise ValueError(f"hammer forensics ledger {cfg.forensics!r}: not a file path in a writable folder")


def _hf_config(cfg: HammerConfig) -> HammerConfig:
    """``cfg`` for a transformers model: checked, with what the HF engine serves (text, base model)."""
    from dataclasses import replace

    family = cfg.model.removeprefix("hf:")
    from ..hf.families import TINY_CONFIGS

    if not cfg.model.startswith("hf:") or family not in TINY_CONFIGS:
        raise ValueError(
            f"hammer model {cfg.model!r}: 'reference' or hf:FAMILY with FAMILY in {', '.join(TINY_CONFIGS)}"
        )
    bad = [
        name
        for name, v in (
            ("inject", None if cfg.inject == "hf-conv-shift" else cfg.inject),
            ("forensics", cfg.forensics),
            ("shared_redis", cfg.shared_redis),
            ("device", None if cfg.device == "cpu" else cfg.device),
        )
        if v is not None
    ]
    if bad:
        raise ValueError(f"hammer on {cfg.model}: {', '.join(bad)} need the reference engine")
    return replace(cfg, tenants=0, images=0, warm=False)


def _hf_engine(cfg: HammerConfig) -> tuple[Any, Callable[[list[int], int], tuple[list[int], torch.Tensor]], int]:
    from ..hf import generate_cold_hf, tiny_model
    from .hf_engine import HFEngine

    config, model = tiny_model(cfg.model.removeprefix("hf:"), seed=cfg.seed)
    engine = HFEngine(
        model,
        config,
        max_running=cfg.concurrency,
        chunk=cfg.chunk,
        snapshot_slots=cfg.snapshot_slots,
        host_slots=cfg.host_slots,
        policy=None if cfg.policy == "hit-density" else make_policy(cfg.policy),
        policy_clock=cfg.clock,
    )
    return engine, lambda prompt, n: generate_cold_hf(model, engine.bridge, prompt, n), int(config.vocab_size)


ColdMany = Callable[[list[ColdJob], Callable[[int], None] | None], list[tuple[list[int], torch.Tensor]]]


def _run(
    cfg: HammerConfig, model: HybridModel | None, progress: Callable[[int], None] | None, bars: Bars | None
) -> HammerReport:
    if model is None:
        engine, cold_one, vocab = _hf_engine(cfg)

        def cold(jobs: list[ColdJob], tick: Callable[[int], None] | None) -> list[tuple[list[int], torch.Tensor]]:
            out = []
            for i, (prompt, n, _, _) in enumerate(jobs):
                out.append(cold_one(prompt, n))
                if tick is not None:
                    tick(i)
            return out

    else:
        engine, vocab = _reference_engine(cfg, model), model.cfg.vocab_size
        workers = cfg.workers if cfg.workers is not None else max(1, os.cpu_count() or 1)

        def cold(jobs: list[ColdJob], tick: Callable[[int], None] | None) -> list[tuple[list[int], torch.Tensor]]:
            return generate_cold_many(model, jobs, chunk=cfg.chunk, workers=workers, progress=tick)

    return _hammer(cfg, engine, cold, vocab, progress, bars)


def _reference_engine(cfg: HammerConfig, model: HybridModel) -> ReferenceEngine:
    return ReferenceEngine(
        model,
        max_running=cfg.concurrency,
        chunk=cfg.chunk,
        inject=cfg.inject,
        forensics_ledger=cfg.forensics,
        page_size=cfg.page_size,
        # hit-density gets the engine's default, on the reference kernels' 64-token grid
        policy=None if cfg.policy == "hit-density" else make_policy(cfg.policy),
        forward_delay_us=cfg.forward_delay_us,
        snapshot_slots=cfg.snapshot_slots,
        host_slots=cfg.host_slots,
        shared_store=(
            None
            if cfg.shared_redis is None
            else FaultyStore(
                RedisStore(cfg.shared_redis), seed=cfg.seed * 1000 + cfg.replica, corrupt=cfg.shared_corrupt
            )
        ),
        publisher=f"replica-{cfg.replica}",
        policy_clock=cfg.clock,
    )


def _close(engine: Any) -> None:
    """Close what the run opened: the forensics ledger's file, the shared tier's writer and its
    Redis connection (the engine's shared store is the hammer's own)."""
    if getattr(engine, "forensics", None) is not None:
        engine.forensics.close()
    shared = getattr(engine, "shared", None)
    if shared is not None:
        shared.close()
        store = shared.store.inner if isinstance(shared.store, FaultyStore) else shared.store
        if isinstance(store, RedisStore):
            store.close()


def _hammer(
    cfg: HammerConfig,
    engine: Any,
    cold_many: ColdMany,
    vocab: int,
    progress: Callable[[int], None] | None,
    bars: Bars | None = None,
) -> HammerReport:
    work = _Workload(cfg, vocab)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # The manager's write checks warn per snapshot; the report counts them (a failure).
        warnings.simplefilter("ignore", UnwrittenSlotWarning)
        error, stuck, n_served, probes = _run_mix(cfg, engine, work, progress)
    wall = time.perf_counter() - t0
    return _report(cfg, engine, cold_many, work, wall, error, stuck, n_served, probes, bars)


def _run_mix(
    cfg: HammerConfig, engine: Any, work: _Workload, progress: Callable[[int], None] | None
) -> tuple[str | None, int, int, list[EngineRequest]]:
    """Serve the mix, then the TTFT probes; returns (error, stuck, requests served, probes)."""
    stuck = n_served = 0
    error: str | None = None
    probes: list[EngineRequest] = []
    try:
        if cfg.warm:  # the system prompts, for the base model and for each tenant's adapter
            for tenant in (None, *work.tenants):
                engine.warm(work.systems, namespace=tenant)
        stuck = _serve(cfg, engine, work, progress)
        n_served = len(engine.finished)
        # TTFT probes, run alone: a cold 2,560-token prompt, then one sharing >= 90% of it, cut at
        # a chunk boundary (where every policy's prefill windows end, so every policy can hit there).
        probe = work._tokens(cfg.probe_tokens)
        shared = -(-int(cfg.probe_tokens * 0.9) // cfg.chunk) * cfg.chunk
        tail = work._tokens(cfg.probe_tokens - shared)
        for p in (EngineRequest("probe-cold", probe, 2), EngineRequest("probe-hit", probe[:shared] + tail, 2)):
            if stuck:  # after the watchdog fired the engine is not to be trusted
                break
            engine.submit(p)
            engine.run()
            probes.append(p)
        if engine.forensics is not None:
            engine.forensics.verify_all()
    except Exception as e:  # any failure of the engine or the cache fails the run
        error = f"{type(e).__name__}: {e}"
    return error, stuck, n_served, probes


def _report(
    cfg: HammerConfig,
    engine: Any,
    cold_many: ColdMany,
    work: _Workload,
    wall: float,
    error: str | None,
    stuck: int,
    n_served: int,
    probes: list[EngineRequest],
    bars: Bars | None,
) -> HammerReport:
    # The mix's requests (not the probes); the watchdog's aborts are counted as stuck.
    served = [r for r in engine.finished[: n_served or len(engine.finished)] if not r.stalled]
    findings = engine.forensics.findings if engine.forensics is not None else []
    refused = sum(f.kind.startswith("shared-") for f in findings)
    corruptions = len(findings) - refused
    metrics = engine.manager.metrics().as_dict()
    faults = (
        engine.shared.store.faults
        if isinstance(getattr(engine, "shared", None) and engine.shared.store, FaultyStore)
        else None
    )
    leaked_slots = leaked_kv = 0
    if error is None:
        try:
            leaked_slots, leaked_kv = _leaks(engine)
        except Exception as e:  # a reset that cannot complete is a failure too
            error = f"{type(e).__name__}: {e}"
    _close(engine)

    t1 = time.perf_counter()
    truth: dict[_Key, tuple[list[int], torch.Tensor]] = {}
    need: dict[_Key, int] = {}
    for r in served:
        key = _key(r)
        need[key] = max(need.get(key, 0), len(r.output))
    if cfg.ground_truth and need:
        keys = list(need)
        jobs: list[ColdJob] = [(list(p), need[(p, ns, imgs)], ns, imgs) for p, ns, imgs in keys]
        update, close = bars(len(jobs), "ground truth") if bars is not None else (None, None)
        try:
            truth = dict(zip(keys, cold_many(jobs, update), strict=True))
        finally:
            if close is not None:
                close()
    gt_s = time.perf_counter() - t1
    wrong = cross = drift = 0
    examples: list[str] = []
    outputs_by_prompt = {k: v[0] for k, v in truth.items()}
    for r in served if cfg.ground_truth else ():
        gt, first = truth[_key(r)]
        expected = r.abort_after if r.aborted and r.abort_after is not None else r.max_new_tokens
        off = float((r.first_logits - first).abs().max()) if r.first_logits is not None else float("inf")
        tokens_wrong = r.output != gt[: len(r.output)] or len(r.output) != expected
        if tokens_wrong or off > cfg.logit_tol:
            wrong += 1
            drift += not tokens_wrong
            if tokens_wrong and any(
                o[: len(r.output)] == r.output for k, o in outputs_by_prompt.items() if k != _key(r)
            ):
                cross += 1
            if len(examples) < 5:
                extra = "".join(
                    [
                        f", namespace {r.namespace!r}" if r.namespace is not None else "",
                        f", {len(r.images)} image(s)" if r.images else "",
                    ]
                )
                examples.append(
                    f"request {r.rid}: prompt {len(r.prompt)} tokens{extra}, cached {r.cached_length}: "
                    f"got {r.output}, cold gives {gt[: len(r.output)]}, first logits off by {off:.2e}"
                )
    cold = [1e3 * (r.t_first - r.t_admit) for r in served if r.cached_length == 0 and r.t_first]
    hit = [1e3 * (r.t_first - r.t_admit) for r in served if r.cached_length >= 0.9 * len(r.prompt) and r.t_first]
    p_cold, p_hit = probes if len(probes) == 2 else (None, None)
    cached_tokens = sum(r.cached_length for r in served)
    hit_guard = None
    if cfg.hit_guard and error is None and not stuck:
        hit_guard = guard.check(guard.hammer_key(guard_fields(cfg)), cached_tokens).as_dict()
    return HammerReport(
        requests=len(served),
        finished=sum(not r.aborted for r in served),
        aborted=sum(r.aborted for r in served),
        hits=sum(r.cached_length > 0 for r in served),
        prompt_tokens=sum(len(r.prompt) for r in served),
        cached_tokens=cached_tokens,
        wrong_answers=wrong,
        cross_talk=cross,
        logit_mismatches=drift,
        slots_leaked=leaked_slots,
        kv_leaked=leaked_kv,
        snapshot_corruptions=corruptions,
        shared_rejections=refused,
        shared_corrupted=0 if faults is None else len(faults.served_bad),
        shared_accepted_bad=0 if faults is None else faults.accepted_bad,
        hit_guard=hit_guard,
        unwritten_snapshots=int(metrics.get("unwritten_snapshots", 0)),
        ttft_cold_ms=statistics.mean(cold) if cold else 0.0,
        ttft_hit_ms=statistics.mean(hit) if hit else 0.0,
        probe_ttft_cold_ms=1e3 * max(0.0, p_cold.t_first - p_cold.t_submit) if p_cold else 0.0,
        probe_ttft_hit_ms=1e3 * max(0.0, p_hit.t_first - p_hit.t_submit) if p_hit else 0.0,
        probe_hit_fraction=p_hit.cached_length / len(p_hit.prompt) if p_hit else 0.0,
        wall_s=wall,
        ground_truth_s=gt_s,
        inject=cfg.inject,
        seed=cfg.seed,
        forensics=cfg.forensics,
        policy=cfg.policy,
        page_size=cfg.page_size,
        checked=cfg.ground_truth,
        stuck=stuck,
        error=error,
        tenant_requests=sum(r.namespace is not None for r in served),
        image_requests=sum(bool(r.images) for r in served),
        metrics=metrics,
        wrong_examples=examples,
        device=str(engine.device),
    )


def _serve(cfg: HammerConfig, engine: ReferenceEngine, work: _Workload, progress: Callable[[int], None] | None) -> int:
    """Serve the mix; return how many requests the watchdog aborted."""
    created = drawn = 0
    delayed: list[tuple[int, EngineRequest]] = []  # (release step, request)
    step = seen = stuck = 0
    last_progress, marker = 0, -1
    while created < cfg.requests or delayed or not engine.idle:
        while created < cfg.requests and len(delayed) < cfg.concurrency:
            for delay, req in work.next()[: cfg.requests - created]:
                drawn += 1
                if (drawn - 1) % cfg.replicas != cfg.replica:  # another replica's share of the mix
                    continue
                delayed.append((step + delay, req))
                created += 1
        delayed.sort(key=lambda x: x[0])
        while delayed and delayed[0][0] <= step:
            release, req = delayed[0]
            follower = release > 0 and release == step and req.rid in work.followers
            if not follower and len(engine.waiting) + len(engine.running) >= cfg.concurrency:
                break
            delayed.pop(0)
            engine.submit(req, front=follower)  # a burst's followers arrive right behind its head
        engine.step()
        step += 1
        now_marker = engine.progress
        if now_marker != marker:
            marker, last_progress = now_marker, step
        elif step - last_progress >= cfg.stall_steps:
            # The watchdog: nothing moved for stall_steps steps (a request the engine can never
            # schedule, say one admitted with nothing to compute). Fail the run instead of hanging.
            stuck = engine.abort_all()
            delayed.clear()
            created = cfg.requests
        for req in engine.finished[seen:]:
            work.finished(req)
            if progress is not None:
                progress(seen)
            seen += 1
    engine.drain()
    return stuck


def _leaks(engine: ReferenceEngine) -> tuple[int, int]:
    """Slots (of the device pool and the host tier) and KV indices neither free nor held by the
    tree once every request ended; then the tree is reset and everything must be free."""
    pool, cache, host = engine.pool, engine.cache, engine.host_pool
    host_held = 0 if host is None else host.capacity - host.num_free
    slots = pool.capacity - pool.num_free - cache.num_snapshots + host_held - cache.num_host_snapshots
    kv = engine.kv.capacity - engine.kv.num_free - cache.total_kv_tokens
    engine.manager.reset()
    host_left = 0 if host is None else host.capacity - host.num_free
    slots = max(slots, pool.capacity - pool.num_free + host_left)
    kv = max(kv, engine.kv.capacity - engine.kv.num_free)
    return slots, kv


def format_report(rep: HammerReport) -> str:
    """The hammer's table, as printed by ``radixcache hammer``."""
    rows = [
        ("requests served", f"{rep.requests} ({rep.finished} finished, {rep.aborted} aborted midway)"),
        ("cache hits", f"{rep.hits} ({rep.hits / max(1, rep.requests):.0%})"),
        (
            "prompt tokens from cache",
            f"{rep.cached_tokens:,} of {rep.prompt_tokens:,} ({rep.cached_fraction:.1%})",
        ),
        (
            "wrong answers",
            f"{rep.wrong_answers} (tokens differ: {rep.wrong_answers - rep.logit_mismatches}, "
            f"only first-token logits off by > tol: {rep.logit_mismatches})"
            if rep.checked
            else "not checked (no ground truth)",
        ),
        ("cross-talk (another prompt's answer)", str(rep.cross_talk)),
        ("tenant / image requests", f"{rep.tenant_requests} / {rep.image_requests}"),
        ("stuck requests (aborted by the watchdog)", str(rep.stuck)),
        ("slots leaked", str(rep.slots_leaked)),
        ("snapshot corruptions (forensics)", str(rep.snapshot_corruptions) if rep.forensics else "off"),
        *(
            [
                (
                    "shared blobs corrupted on purpose / kept",
                    f"{rep.shared_corrupted} / {rep.shared_accepted_bad} (every one must be refused)",
                )
            ]
            if rep.shared_corrupted or rep.shared_accepted_bad
            else []
        ),
        ("shared blobs refused (forensics; each a miss)", str(rep.shared_rejections) if rep.forensics else "off"),
        ("KV indices leaked", str(rep.kv_leaked)),
        ("snapshots donated unwritten (write checks)", str(rep.unwritten_snapshots)),
        (
            "hit-rate guard",
            "off" if rep.hit_guard is None else guard.GuardResult.from_dict(rep.hit_guard).describe(),
        ),
        ("TTFT cold / hit >= 90% (mean, under load)", f"{rep.ttft_cold_ms:.1f} ms / {rep.ttft_hit_ms:.1f} ms"),
        (
            f"TTFT probe, {rep.probe_hit_fraction:.0%} cached (alone)",
            f"cold {rep.probe_ttft_cold_ms:.1f} ms, hit {rep.probe_ttft_hit_ms:.1f} ms, "
            f"ratio {rep.probe_ttft_ratio:.2f}",
        ),
        ("policy / page size", f"{rep.policy} / {rep.page_size}"),
        *_metric_rows(rep.metrics),
        ("wall time (serving / ground truth)", f"{rep.wall_s:.1f} s / {rep.ground_truth_s:.1f} s"),
        ("injected bug", rep.inject or "none"),
    ]
    if rep.error is not None:
        rows.append(("error (the run ended here)", rep.error))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if not rep.checked:
        lines.append("RESULT: NOT CHECKED (served without ground truth: no answer was compared)")
    else:
        lines.append("RESULT: " + ("PASS" if rep.ok else "FAIL"))
    lines += [f"  {e}" for e in rep.wrong_examples]
    return "\n".join(lines)


def _metric_rows(m: dict[str, object]) -> list[tuple[str, str]]:
    """The manager's counters, as rows of the hammer's table."""

    def by(key: str) -> str:
        d = m.get(key, {})
        assert isinstance(d, dict)
        return ", ".join(f"{k} {v}" for k, v in d.items() if v) or "none"

    if not m:
        return []
    return [
        ("manager: admissions / refusals", f"{m['admissions']} / {m['refusals']}"),
        ("manager: captures planned", by("captures_planned")),
        ("manager: snapshots donated", by("donations")),
        ("manager: donations skipped", by("donations_skipped")),
        ("manager: snapshots evicted", f"{by('evictions')} ({m['evicted_kv_tokens']:,} KV tokens)"),
        (
            "manager: host tier",
            f"{m.get('demotions', 0)} demoted, {m.get('host_hits', 0)} hits restored from host, "
            f"{m.get('host_snapshots_held', 0)} held at the end",
        ),
        (
            "manager: shared tier",
            f"{m.get('shared_hits', 0)} hits ({m.get('shared_foreign_hits', 0)} on another replica's "
            f"prefixes), {m.get('shared_published', 0)} published, {m.get('shared_rejected', 0)} refused, "
            f"{m.get('shared_errors', 0)} store errors",
        ),
    ]
