"""Where snapshots live beyond the device pool: the host tier's size (``host``), the stores the
shared tier talks to (``store``: protocol, Redis, memory), the blob format (``blob``) and the
shared tier with its writer thread (``shared``). A new backend (a disk directory, say) is one new
module implementing :class:`SharedStore`."""

from .blob import BLOB_MAGIC, DIGEST_BYTES, blob_digest, encode_blob
from .host import HOST_TIER_FACTOR, auto_host_pool
from .shared import Fetched, KVCodec, Rejection, RejectReason, SharedStats, SharedTier
from .store import REDIS_URL_SCHEMES, MemoryStore, RedisStore, SharedStore, SharedStoreError, deepest_of

__all__ = [
    "BLOB_MAGIC",
    "DIGEST_BYTES",
    "HOST_TIER_FACTOR",
    "REDIS_URL_SCHEMES",
    "Fetched",
    "KVCodec",
    "MemoryStore",
    "RedisStore",
    "RejectReason",
    "Rejection",
    "SharedStats",
    "SharedStore",
    "SharedStoreError",
    "SharedTier",
    "auto_host_pool",
    "blob_digest",
    "deepest_of",
    "encode_blob",
]
