"""linear_state: slots of linear-attention state on a device, each with exactly one owner,
and the streams and fences that order every read and write of them.

Nothing here imports :mod:`radixcache`.
"""

from .device import check_device
from .errors import DeviceUnavailable, ForeignSlot, PoolError, PoolExhausted, PrecisionLoss, SlotMisuse
from .fencecheck import FenceCheck, cuda_fence_check
from .fingerprint import Fingerprint
from .layout import StateLayout
from .owners import NodeOwner, Owner, RequestOwner, SlotId
from .pool import SLOT_VIEWS_KEPT, FingerprintJob, HostedStatePool, LinearStatePool, SlotLender, SlotWrite
from .stream import (
    COMPLETE,
    CudaStream,
    DeferredStream,
    Fence,
    ImmediateStream,
    Stream,
    StreamFailed,
    ThreadStream,
    device_synchronize,
)

__all__ = [
    "COMPLETE",
    "SLOT_VIEWS_KEPT",
    "CudaStream",
    "DeferredStream",
    "DeviceUnavailable",
    "Fence",
    "FenceCheck",
    "Fingerprint",
    "FingerprintJob",
    "ForeignSlot",
    "HostedStatePool",
    "ImmediateStream",
    "LinearStatePool",
    "NodeOwner",
    "Owner",
    "PoolError",
    "PoolExhausted",
    "PrecisionLoss",
    "RequestOwner",
    "SlotId",
    "SlotLender",
    "SlotMisuse",
    "SlotWrite",
    "StateLayout",
    "Stream",
    "StreamFailed",
    "ThreadStream",
    "check_device",
    "cuda_fence_check",
    "device_synchronize",
]
