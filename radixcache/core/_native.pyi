# Types of the C extension radixcache/core/_native.c (see radixcache.core.native).
from types import NotImplementedType
from typing import Any

def walk(kb: bytes, end: int, root: Any, page_bytes: int, /) -> tuple[list[Any], int, int, Any]: ...
def duplicates(
    kvn: Any, path: list[Any], split_child: Any, split_k: int, known: int, /
) -> bytearray | NotImplementedType | None: ...
