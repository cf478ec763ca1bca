"""radixcache: a radix prefix cache for hybrid LLMs (attention + linear-attention layers).

The tree's nodes own private clones of linear-state snapshots from a
:class:`linear_state.LinearStatePool`; donation and restore are ordered by fences.
"""

__all__: list[str] = []
