"""Connectors broken on purpose, each a bug a hybrid connector is known to ship (the negative
controls of tests/vllm/test_connector.py; loaded by vLLM from ``tests.vllm.broken``)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer import get_kv_transfer_group

from radixcache.vllm.connector import RadixcacheConnector, _cache_ids, _Copy, _copy, _namespace, _Step
from radixcache.vllm.memory import StoreBytes


class AttentionOnlyConnector(RadixcacheConnector):
    """Restores the attention KV of a hit and not its linear state (LMCache's hybrid failure)."""

    def _load_state(self, load: _Copy, mem: StoreBytes) -> None:
        pass


class SavedAtFinishConnector(RadixcacheConnector):
    """Copies nothing in the step that computes it; at each request's finish it files the deepest
    block-aligned prefix from the block table vLLM hands over then (where the state block of an
    earlier boundary is already the null block)."""

    def _plan_step(self, scheduler_output: Any) -> _Step:
        step = super()._plan_step(scheduler_output)
        for save in step.saves:  # never filed in-step
            self.store.abandon(save.plan)
        step.saves = []
        return step

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        worker = get_kv_transfer_group()
        assert isinstance(worker, RadixcacheConnector)
        end = (request.num_computed_tokens // self.block) * self.block
        ids = _cache_ids(request)
        assert ids is not None
        plan = self.store.plan_save(request.request_id, ids[:end], namespace=_namespace(request)) if end else None
        if plan is not None:
            blocks = self._blocks_of(block_ids, plan.start, end)
            RadixcacheConnector._save(worker, _copy(plan.pages, plan.slot, blocks), worker._memory(None))
            self.store.commit(plan)
        return super().request_finished_all_groups(request, block_ids)
