"""radixcache inside SGLang: a radix-cache backend plugin for hybrid (linear-attention) models.

Install the extra (``pip install 'radixcache[sglang]'``) and start SGLang with
``--radix-cache-backend radixcache``: SGLang loads its plugins from the ``sglang.srt.plugins``
entry-point group, whose ``radixcache`` entry (:func:`radixcache.sglang.plugin.register`)
registers the factory. See docs/sglang.md for what the backend serves and what it refuses.

Importing this package does not import SGLang; :mod:`radixcache.sglang.backend` does.
"""

from __future__ import annotations

BACKEND_NAME = "radixcache"
"""The name ``--radix-cache-backend`` selects."""

SGLANG_VERSION = "0.5.23"
"""The SGLang release the backend is written and tested against (the extra pins it)."""

__all__ = ["BACKEND_NAME", "SGLANG_VERSION"]
