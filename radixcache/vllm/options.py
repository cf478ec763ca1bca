"""The connector's options (vLLM's ``kv_connector_extra_config``) and the errors it raises for an
engine it cannot serve. Nothing here imports vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..core.errors import RadixCacheError
from ..policies import POLICIES

__all__ = ["ConnectorOptions", "UnsupportedEngine"]


class UnsupportedEngine(RadixCacheError, ValueError):
    """The engine's configuration is one the connector cannot serve correctly (named in the
    message); raised when vLLM builds the connector, before anything is allocated."""


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of :class:`~radixcache.vllm.RadixcacheConnector`.

    :ivar host_budget_bytes: host memory for KV pages and snapshots together (default: twice
        vLLM's own KV space, at most a quarter of the machine's memory).
    :ivar policy: which snapshots and pages stay when the budget is full (a name of
        :data:`radixcache.policies.POLICIES`; default ``"hit-density"``).
    :ivar verify: fingerprint every page and snapshot copied in, check it before it is served;
        a mismatch is a finding and a miss (default ``True``).
    :ivar snapshots_per_block: snapshot slots per KV page in the budget (default 0.5).
    :ivar ledger: a path for the forensics ledger (JSON lines; with ``verify``), or ``None``.
    :ivar redis_url: a Redis server other engines reach too (``redis://host:port/db``): every
        snapshot is published there with its prefix's pages and a deeper prefix found there is
        fetched (verified) before a lookup; ``None`` (default): no shared tier. Needs the
        ``redis`` extra.
    :ivar shared_namespace: the deployment's key prefix on that server (default ``"radixcache"``).
    :ivar model_identity: what names the model in the shared tier's content address (default: the
        model path, revision and dtype vLLM loaded); engines share blobs only when it agrees.
    :ivar copy_thread: the store's copies of saved states (and their fingerprints) on a thread of
        its own rather than vLLM's scheduler thread (default ``True``; see
        :class:`~radixcache.vllm.PagedHostStore`).
    """

    host_budget_bytes: int | None = None
    policy: str = "hit-density"
    verify: bool = True
    snapshots_per_block: float = 0.5
    ledger: str | None = None
    redis_url: str | None = None
    shared_namespace: str = "radixcache"
    model_identity: str | None = None
    copy_thread: bool = True

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Parse and check vLLM's extra config.

        :raises UnsupportedEngine: an unknown key (named, with the known ones) or a bad value.
        """
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise UnsupportedEngine(
                f"unknown kv_connector_extra_config keys {unknown} for RadixcacheConnector; known: {sorted(known)}"
            )
        opts = cls(**extra)
        b = opts.host_budget_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise UnsupportedEngine(f"host_budget_bytes must be an int >= 1, got {b!r}")
        if opts.policy not in POLICIES:
            raise UnsupportedEngine(f"unknown policy {opts.policy!r}; known: {sorted(POLICIES)}")
        if type(opts.verify) is not bool:
            raise UnsupportedEngine(f"verify must be a bool, got {opts.verify!r}")
        if type(opts.copy_thread) is not bool:
            raise UnsupportedEngine(f"copy_thread must be a bool, got {opts.copy_thread!r}")
        s = opts.snapshots_per_block
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 4:
            raise UnsupportedEngine(f"snapshots_per_block must be a number in (0, 4], got {s!r}")
        if opts.ledger is not None and not isinstance(opts.ledger, str):
            raise UnsupportedEngine(f"ledger must be a path string or None, got {opts.ledger!r}")
        if opts.redis_url is not None and (
            not isinstance(opts.redis_url, str) or not opts.redis_url.startswith(("redis://", "rediss://", "unix://"))
        ):
            raise UnsupportedEngine(f"redis_url must be a redis://, rediss:// or unix:// URL, got {opts.redis_url!r}")
        ns = opts.shared_namespace
        if not isinstance(ns, str) or not ns or ":" in ns:
            raise UnsupportedEngine(f"shared_namespace must be a non-empty string without ':', got {ns!r}")
        mi = opts.model_identity
        if mi is not None and (not isinstance(mi, str) or not mi):
            raise UnsupportedEngine(f"model_identity must be a non-empty string or None, got {mi!r}")
        return opts
