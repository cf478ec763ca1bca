"""Counters of a :class:`~radixcache.CacheManager`, a typed snapshot of them, and their export
to prometheus_client (the ``prometheus`` extra) when it is installed.

Counting costs an integer increment per event on the manager's own calls; :meth:`snapshot`
copies the counters (O(number of reasons)), never walks the tree.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

__all__ = ["EvictionReason", "ManagerMetrics", "MetricsCounters", "SkipReason", "register_prometheus"]


class EvictionReason(enum.Enum):
    """Why the manager evicted a snapshot (the value keys ``ManagerMetrics.evictions``)."""

    #: To make room for an admission's slots.
    ADMISSION = "admission"
    #: For a capture's clone.
    DONATION = "donation"
    #: Leaves dropped for KV (the host's ``CacheManager.evict(kv_tokens=)``, an admission's KV).
    KV_PRESSURE = "kv-pressure"
    #: Snapshots the host asked for (``CacheManager.evict(snapshots=)``, ``make_room``).
    HOST = "host"
    #: Snapshots the host found corrupt and dropped (``CacheManager.discard``).
    CORRUPT = "corrupt"


class SkipReason(enum.Enum):
    """Why a donation was not made (the value keys ``ManagerMetrics.donations_skipped``)."""

    #: The tree already had a snapshot there.
    HELD = "held"
    #: No pool slot, even after eviction.
    NO_SLOT = "no-slot"
    #: The policy keeps no final state.
    DECLINED = "declined"
    #: No page-aligned final state was captured.
    UNALIGNED = "unaligned"


@dataclass(frozen=True, slots=True)
class ManagerMetrics:
    """A snapshot of a manager's counters (monotonic unless said otherwise).

    :ivar admissions: requests admitted; :ivar refusals: admissions refused (nothing held);
    :ivar hits: admissions that restored a snapshot; :ivar hit_tokens: prompt tokens they skipped;
    :ivar prompt_tokens: prompt tokens of every admitted request;
    :ivar captures_planned: captures handed to hosts in window plans, by ``prefill``, ``decode``
        and ``final`` (a decode-time capture held back for the final state);
    :ivar donations: snapshots the tree took, by ``capture`` and ``finish``;
    :ivar donations_skipped: donations not made, by why (the :class:`SkipReason` values:
        ``held``, ``no-slot``, ``declined``, ``unaligned``);
    :ivar evictions: snapshots evicted, by why (the :class:`EvictionReason` values:
        ``admission``, ``donation``, ``kv-pressure``, ``host``);
    :ivar evicted_kv_tokens: KV tokens freed by those evictions;
    :ivar restores: hit states copied into a request's slot;
    :ivar host_hits: hits whose state came from the host tier (a demoted snapshot);
    :ivar demotions: snapshots the tree moved to its host tier instead of dropping them;
    :ivar snapshots_held: snapshots in the tree now, on the device (a gauge);
    :ivar snapshot_bytes_held: their bytes (a gauge);
    :ivar host_snapshots_held: snapshots in the host tier now (a gauge);
    :ivar live_requests: requests admitted and not finished or aborted (a gauge);
    :ivar shared_hits: hits served from the shared tier (a blob fetched, verified and inserted);
    :ivar shared_foreign_hits: those whose blob another replica published;
    :ivar shared_published: blobs this manager published;
    :ivar shared_rejected: blobs refused at fetch (corrupt, another layout, a wrong fingerprint);
    :ivar shared_errors: shared-store calls that failed (server down);
    :ivar unwritten_snapshots: snapshots donated from a slot the host never wrote (a capture slot
        still carrying the manager's mark, or a live slot still holding its admission state at
        finish), found when their request ended and evicted (see ``CacheManager(write_checks=)``);
    :ivar refused_hits: snapshots a finding of forensics named that a hit would have served and
        the manager refused (the admission fell back up the path, or ``restore`` /
        ``serve_in_place`` raised ``SnapshotRefused``), each counted once; dropped, they are
        counted under ``evictions["corrupt"]`` too.
    """

    admissions: int
    refusals: int
    hits: int
    hit_tokens: int
    prompt_tokens: int
    captures_planned: Mapping[str, int]
    donations: Mapping[str, int]
    donations_skipped: Mapping[str, int]
    evictions: Mapping[str, int]
    evicted_kv_tokens: int
    restores: int
    snapshots_held: int
    snapshot_bytes_held: int
    live_requests: int
    host_hits: int = 0
    demotions: int = 0
    host_snapshots_held: int = 0
    shared_hits: int = 0
    shared_foreign_hits: int = 0
    shared_published: int = 0
    shared_rejected: int = 0
    shared_errors: int = 0
    unwritten_snapshots: int = 0
    refused_hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from cache / prompt tokens admitted."""
        return self.hit_tokens / max(1, self.prompt_tokens)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, ``hit_rate`` included."""
        d: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            d[f.name] = dict(v) if isinstance(v, Mapping) else v
        d["hit_rate"] = self.hit_rate
        return d


@dataclass(slots=True)
class MetricsCounters:
    """The mutable counters a manager increments (fields as in :class:`ManagerMetrics`)."""

    admissions: int = 0
    refusals: int = 0
    hits: int = 0
    hit_tokens: int = 0
    prompt_tokens: int = 0
    captures_planned: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("prefill", "decode", "final"), 0))
    donations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("capture", "finish"), 0))
    donations_skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys((r.value for r in SkipReason), 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys((r.value for r in EvictionReason), 0))
    evicted_kv_tokens: int = 0
    restores: int = 0
    host_hits: int = 0
    unwritten_snapshots: int = 0
    refused_hits: int = 0

    def snapshot(
        self,
        *,
        snapshots_held: int,
        snapshot_bytes: int,
        live_requests: int,
        demotions: int = 0,
        host_snapshots_held: int = 0,
        shared: Mapping[str, int] | None = None,
    ) -> ManagerMetrics:
        """A frozen copy, with the gauges the caller reads from the tree and the request table."""
        return ManagerMetrics(
            admissions=self.admissions,
            refusals=self.refusals,
            hits=self.hits,
            hit_tokens=self.hit_tokens,
            prompt_tokens=self.prompt_tokens,
            captures_planned=MappingProxyType(dict(self.captures_planned)),
            donations=MappingProxyType(dict(self.donations)),
            donations_skipped=MappingProxyType(dict(self.donations_skipped)),
            evictions=MappingProxyType(dict(self.evictions)),
            evicted_kv_tokens=self.evicted_kv_tokens,
            restores=self.restores,
            snapshots_held=snapshots_held,
            snapshot_bytes_held=snapshots_held * snapshot_bytes,
            live_requests=live_requests,
            host_hits=self.host_hits,
            demotions=demotions,
            host_snapshots_held=host_snapshots_held,
            unwritten_snapshots=self.unwritten_snapshots,
            refused_hits=self.refused_hits,
            **{f"shared_{k}": v for k, v in (shared or {}).items()},
        )


_COUNTERS = (
    "admissions",
    "refusals",
    "hits",
    "hit_tokens",
    "prompt_tokens",
    "evicted_kv_tokens",
    "restores",
    "host_hits",
    "unwritten_snapshots",
    "refused_hits",
    "demotions",
    "shared_hits",
    "shared_foreign_hits",
    "shared_published",
    "shared_rejected",
    "shared_errors",
)
_BY_REASON = {
    "captures_planned": "kind",
    "donations": "reason",
    "donations_skipped": "reason",
    "evictions": "reason",
}
_GAUGES = ("snapshots_held", "snapshot_bytes_held", "live_requests", "host_snapshots_held")


def register_prometheus(
    source: Callable[[], ManagerMetrics], *, registry: Any = None, prefix: str = "radixcache"
) -> Any:
    """Expose ``source()`` (e.g. ``manager.metrics``) to prometheus_client: a collector that
    reads one snapshot per scrape, registered in ``registry`` (default: the global one).

    Counters become ``{prefix}_{name}_total`` (by-reason ones with a label), gauges
    ``{prefix}_{name}``. Returns the collector (unregister it with ``registry.unregister``).

    :raises ImportError: prometheus_client is not installed (``pip install radixcache[prometheus]``).
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("register_prometheus needs prometheus_client: pip install 'radixcache[prometheus]'") from exc

    class _Collector:
        def collect(self) -> Iterator[Any]:
            m = source()
            for name in _COUNTERS:
                yield CounterMetricFamily(
                    f"{prefix}_{name}", f"radixcache {name.replace('_', ' ')}", value=getattr(m, name)
                )
            for name, label in _BY_REASON.items():
                fam = CounterMetricFamily(f"{prefix}_{name}", f"radixcache {name.replace('_', ' ')}", labels=[label])
                for reason, v in getattr(m, name).items():
                    fam.add_metric([reason], v)
                yield fam
            for name in _GAUGES:
                yield GaugeMetricFamily(
                    f"{prefix}_{name}", f"radixcache {name.replace('_', ' ')}", value=getattr(m, name)
                )

        def describe(self) -> list[Any]:
            return []  # collected lazily: prometheus_client then calls collect() only at scrape time

    collector = _Collector()
    (REGISTRY if registry is None else registry).register(collector)
    return collector
