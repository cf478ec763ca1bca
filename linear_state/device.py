"""Which devices this process can put a pool on: a check made once, at construction, so that a
missing CUDA is a typed error naming the device, not torch's assertion from deep inside an
allocation."""

from __future__ import annotations

import torch

from .errors import DeviceUnavailable

__all__ = ["check_device"]


def check_device(device: object) -> torch.device:
    """``device`` as a :class:`torch.device` this process can allocate on.

    :raises TypeError: not a ``torch.device`` or a string. :raises DeviceUnavailable: an unknown
        device type, CUDA without CUDA, a CUDA index past the last device.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device or a string, got {type(device).__name__}")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise DeviceUnavailable(f"unknown device {device!r}: {e}") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {device!r}: CUDA is not available to this process")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"device {device!r}: only {torch.cuda.device_count()} CUDA devices")
    elif d.type not in ("cpu", "meta"):
        mod = getattr(torch, d.type, None)
        available = getattr(mod, "is_available", None)
        if not callable(available) or not available():
            raise DeviceUnavailable(f"device {device!r}: {d.type} is not available to this process")
    return d
