"""radixcache on transformers hybrid models (the ``hf`` extra): the slot/cache bridge, one request's
protocol (:class:`HFSequence`, :class:`KVStore`), the cold ground truth, tiny seeded configs of
every covered family. Importing it needs transformers. (The hammer's transformers engine is
:mod:`radixcache.testing.hf_engine`.)

Layouts come from :meth:`linear_state.StateLayout.from_hf_config` (families, shapes, dtypes:
:mod:`linear_state.hf`; docs/models.md).
"""

from __future__ import annotations

from linear_state.hf import FAMILIES, UNSUPPORTED, hf_family, linear_layer_ids

from .bridge import HFStateBridge, PrecisionLoss
from .cold import ColdGeneration, cold_generation_hf, generate_cold_hf
from .families import TINY_CONFIGS, tiny_config, tiny_model
from .sequence import HFSequence, KVStore, forward_logits

__all__ = [
    "FAMILIES",
    "TINY_CONFIGS",
    "UNSUPPORTED",
    "ColdGeneration",
    "HFSequence",
    "HFStateBridge",
    "KVStore",
    "PrecisionLoss",
    "cold_generation_hf",
    "forward_logits",
    "generate_cold_hf",
    "hf_family",
    "linear_layer_ids",
    "tiny_config",
    "tiny_model",
]
