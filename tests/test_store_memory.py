"""A paged store's bytes where a worker in another process reaches them (radixcache.vllm.memory):
the mapping a store makes with ``mapped=True``, attached by a spawned process that copies in and
out as vLLM's worker does in a process of its own; bad input refused with nothing changed."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from radixcache.vllm import PagedHostStore
from radixcache.vllm.memory import StoreBytes, StoreMapping

from .test_paged_store import LAYOUT, STATE, Engine, _store

B = LAYOUT.block_tokens
IDS = list(range(300, 300 + 3 * B))


def _worker(mapping: StoreMapping, conn: Any) -> None:
    """A worker in a process of its own: maps the store's bytes, copies the planned save in from
    its blocks, then copies the hit it is told of out into other blocks and sends them back."""
    mem = mapping.attach()
    eng = Engine()
    eng.compute(IDS, [0, 1, 2])
    pages, slot = conn.recv()
    mem.copy_in_pages(pages, eng.layers([0, 1, 2]))
    mem.write_state(slot, eng.conv[2], eng.rec[2])
    conn.send("saved")
    pages, slot = conn.recv()
    out = Engine()
    mem.copy_out_pages(pages, out.layers([9, 10, 11]))
    conv, rec = mem.read_state(slot)
    # numpy arrays travel by value (torch's own reduction would share memory with this process)
    conn.send(([t[9:12].numpy().copy() for t in out.kv], conv.float().numpy().copy(), rec.numpy().copy()))


def test_a_worker_in_another_process_copies_in_and_out_through_the_stores_mapping() -> None:
    store = _store(mapped=True)
    assert store.mapping is not None and Path(store.mapping.path).exists()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(store.mapping, there))
    proc.start()
    try:
        plan = store.plan_save("a", IDS)
        assert plan is not None
        here.send((plan.pages, int(plan.slot)))
        assert here.poll(120) and here.recv() == "saved"
        assert not Path(store.mapping.path).exists(), "the worker's attach leaves the name behind"
        assert store.commit(plan)  # the fingerprints are taken here, of what the worker wrote
        store.check_invariants()
        hit = store.lookup("b", [*IDS, 1], computed=0)
        assert hit is not None and hit.end == 3 * B, "the worker's copy was not filed (or failed verification)"
        here.send((hit.pages, int(hit.slot)))
        assert here.poll(120)
        pages, conv, rec = here.recv()
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    eng = Engine()
    eng.compute(IDS, [0, 1, 2])
    for got, want in zip(pages, eng.kv, strict=True):
        assert torch.equal(torch.from_numpy(got), want[0:3])
    assert torch.equal(torch.from_numpy(conv), eng.conv[2].float()) and torch.equal(torch.from_numpy(rec), eng.rec[2])
    store.release(hit, loaded=True)
    store.check_invariants()
    assert store.describe()["mapped"] and store.stats.hit_tokens == 3 * B and store.close()


def test_the_mapping_is_the_stores_own_memory_and_its_name_goes_at_close() -> None:
    store = _store(mapped=True)
    assert store.mapping is not None
    path = Path(store.mapping.path)
    assert path.stat().st_size == store.mapping.nbytes
    other = store.mapping.attach()  # as a worker would (in this process: the same bytes twice)
    assert not path.exists()
    eng = Engine()
    eng.compute(IDS, [0, 1, 2])
    plan = store.plan_save("a", IDS)
    assert plan is not None
    other.copy_in_pages(plan.pages, eng.layers([0, 1, 2]))
    other.write_state(int(plan.slot), eng.conv[2], eng.rec[2])
    assert torch.equal(store.pool.read(plan.slot)[1], eng.rec[2]) and torch.equal(store.kv, other.kv)
    assert store.commit(plan)
    with pytest.raises(FileNotFoundError):
        store.mapping.attach()  # one worker maps it; the name is gone after
    unmapped = _store(mapped=True)
    assert unmapped.mapping is not None and Path(unmapped.mapping.path).exists()
    assert unmapped.close() and not Path(unmapped.mapping.path).exists()  # no worker came: removed at close
    assert unmapped.close()


def test_a_mapping_short_of_room_fails_at_once_naming_the_bytes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"has \d+ bytes free; the store's shared mapping needs \d+") as e:
        StoreMapping.create((2, 4, 64), STATE, 2, directory=str(tmp_path))
    assert e.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == [], "a mapping that failed left its file"


def test_attach_refuses_a_file_that_is_not_the_mapping(tmp_path: Path) -> None:
    spec, _mem = StoreMapping.create((2, 4, 64), STATE, 2, directory=str(tmp_path))
    wrong = StoreMapping(spec.path, (2, 100, 64), STATE, 2)
    with pytest.raises(ValueError, match=rf"holds {spec.nbytes} bytes, the store's mapping {wrong.nbytes}"):
        wrong.attach()
    assert Path(spec.path).exists()  # refused: nothing removed
    spec.remove()
    with pytest.raises(FileNotFoundError):
        spec.attach()


def test_store_bytes_refuse_pages_slots_and_shapes_outside_them() -> None:
    store = _store()
    mem = store.bytes
    assert isinstance(mem, StoreBytes) and mem.num_pages == store.num_pages and mem.num_slots == store.num_slots
    before = mem.kv.clone(), mem.conv.clone(), mem.recurrent.clone()
    eng = Engine()
    with pytest.raises(ValueError, match=rf"pages \[{store.num_pages}\] outside \[0, {store.num_pages}\)"):
        mem.copy_in_pages([0, store.num_pages], eng.layers([0, 1]))
    with pytest.raises(ValueError, match="1 attention layers given, the store has 2"):
        mem.copy_out_pages([0], eng.layers([0])[:1])
    with pytest.raises(ValueError, match=rf"slot {store.num_slots} outside"):
        mem.write_state(store.num_slots, eng.conv[0], eng.rec[0])
    with pytest.raises(ValueError, match="slot -1 outside"):
        mem.read_state(-1)
    with pytest.raises(ValueError, match="a state of"):
        mem.write_state(0, eng.conv[0][:1], eng.rec[0])
    engine_before = [t.clone() for t in eng.kv]
    for bad in (-1, len(eng.kv[0])):  # a negative block would be the last one to a slice
        with pytest.raises(ValueError, match=rf"blocks \[{bad}\] outside the engine cache's \[0, {len(eng.kv[0])}\)"):
            mem.copy_in_pages([0, 1], eng.layers([0, bad]))
        with pytest.raises(ValueError, match=rf"blocks \[{bad}\] outside"):
            mem.copy_out_pages([0, 1], eng.layers([bad, 0]))
    assert all(torch.equal(a, b) for a, b in zip(engine_before, eng.kv, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before, (mem.kv, mem.conv, mem.recurrent), strict=True))
    with pytest.raises(ValueError, match=r"kv must be \[layers, pages, page bytes\] uint8"):
        StoreBytes(mem.kv.float(), mem.conv, mem.recurrent)
    store.check_invariants()


def test_a_mapped_store_takes_no_pinned_memory() -> None:
    with pytest.raises(ValueError, match="mapped=True, pin_memory=True"):
        _store(mapped=True, pin_memory=True)
    with pytest.raises(ValueError, match="mapped must be a bool"):
        PagedHostStore(LAYOUT, 1 << 16, mapped=1)  # type: ignore[arg-type]


_CREATE_AND_WAIT = """
import sys, time
from radixcache.vllm.memory import StoreMapping
from tests.test_paged_store import STATE
spec, mem = StoreMapping.create((2, 4, 64), STATE, 2, directory=sys.argv[1])
print(spec.path, flush=True)
time.sleep(600)
"""


def _creator(directory: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process that creates a mapping in ``directory`` and waits, as an engine between its start
    and its worker's first step."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CREATE_AND_WAIT, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_mapping_left_by_a_killed_process_is_removed_at_the_next_create(tmp_path: Path) -> None:
    killed, left = _creator(tmp_path)
    living, kept = _creator(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert left.exists(), "a killed process's mapping name outlives it (what the sweep is for)"
        ns, pid = left.name.split("-")[2:4]
        assert int(pid) == killed.pid
        other_namespace = tmp_path / f"radixcache-store-{int(ns) + 1}-{killed.pid}-00ff"
        unrelated = tmp_path / f"radixcache-scratch-{killed.pid}"
        for p in (other_namespace, unrelated):
            p.write_bytes(b"x")
        spec, _mem = StoreMapping.create((2, 4, 64), STATE, 2, directory=str(tmp_path))
        assert not left.exists(), "the killed process's mapping was not swept"
        assert kept.exists(), "a living process's mapping was swept before its worker attached"
        assert other_namespace.exists(), "a name from another pid namespace was swept"
        assert unrelated.exists() and Path(spec.path).exists()
        assert StoreMapping.sweep(str(tmp_path)) == []
    finally:
        for proc in (killed, living):
            proc.kill()
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
    assert StoreMapping.sweep(str(tmp_path)) == [str(kept)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [Path(spec.path).name, other_namespace.name, unrelated.name]
    )


@pytest.mark.parametrize(
    ("pages", "blocks"),
    [([3, 4, 5, 6], [10, 11, 12, 13]), ([6, 2, 3, 9], [7, 0, 1, 4]), ([1, 2, 5, 6], [9, 8, 20, 21]), ([0], [31])],
    ids=["one-run", "runs-apart", "runs-on-one-side", "one-page"],
)
def test_copies_move_each_page_to_its_block_whatever_the_runs(pages: list[int], blocks: list[int]) -> None:
    """The CPU copies go run by run (rows consecutive on both sides): every page lands in its
    block and back, and nothing else moves."""
    mem = _store().bytes
    eng = Engine()
    g = torch.Generator().manual_seed(5)
    for t in eng.kv:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    kv_before = mem.kv.clone()
    mem.copy_in_pages(pages, eng.layers(blocks))
    want = kv_before.clone()
    for i, t in enumerate(eng.kv):
        want[i, pages] = t[blocks]
    assert torch.equal(mem.kv, want)
    out = Engine()
    dst = [b + 1 for b in blocks] if max(blocks) < 31 else blocks  # other blocks than they came from
    mem.copy_out_pages(pages, out.layers(dst))
    for i, t in enumerate(out.kv):
        assert torch.equal(t[dst], eng.kv[i][blocks])
        rest = sorted(set(range(len(t))) - set(dst))
        assert not t[rest].any(), "a block outside the copy was written"
