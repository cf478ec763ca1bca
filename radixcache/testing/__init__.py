"""radixcache.testing: what a host needs to prove its integration right.

- the reference hybrid model and engine, and the ground-truth hammer (``model``, ``engine``,
  ``hammer``);
- the fuzzing kit: hypothesis strategies, the host-adapter protocol with our default adapter, the
  state machine and a seeded runner whose programs depend on the seed alone (``strategies``,
  ``adapter``, ``fuzz``, ``reproducible``);
- the misuse fuzzer: wrong calls between valid steps, each refused with nothing changed
  (``misuse``), and the state digest it compares (``digest``);
- the historical bugs to inject (``inject``), a shared store and a KV codec that misbehave on
  purpose (``faults``), and the hit-rate guard that fails a run serving fewer tokens from cache
  than recorded (``guard``).

Names are imported on first use, so ``import radixcache.testing`` needs neither hypothesis nor
transformers; the fuzzing names need the ``test`` extra.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HybridConfig": "model",
    "HybridModel": "model",
    "GatedDeltaNet": "model",
    "KVPool": "model",
    "EngineRequest": "engine",
    "ReferenceEngine": "engine",
    "generate_cold": "engine",
    "HammerConfig": "hammer",
    "HammerReport": "hammer",
    "run_hammer": "hammer",
    "format_report": "hammer",
    "HostAdapter": "adapter",
    "ManagerAdapter": "adapter",
    "advance": "adapter",
    "prefix_state": "adapter",
    "HostMachine": "fuzz",
    "make_machine": "fuzz",
    "run_fuzz": "fuzz",
    "seed_only_constants": "reproducible",
    "token_keys": "strategies",
    "shared_prefix_keys": "strategies",
    "image_prompts": "strategies",
    "lifecycles": "strategies",
    "Lifecycle": "strategies",
    "BUGS": "inject",
    "FUZZ_BUGS": "inject",
    "MISUSE_BUGS": "inject",
    "HAMMER_BUGS": "inject",
    "FaultyStore": "faults",
    "FaultyCodec": "faults",
    "StoreFaults": "faults",
    "GuardResult": "guard",
    "MisuseMachine": "misuse",
    "make_misuse_machine": "misuse",
    "run_misuse": "misuse",
    "state_digest": "digest",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixcache.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
