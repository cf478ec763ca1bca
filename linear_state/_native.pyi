# Types of the C extension linear_state/_native.c (see linear_state.native).
from typing import Any

def fingerprint(views: list[Any], slot: int, weights: Any, block: int, /) -> int: ...
