"""Where a :class:`~radixcache.vllm.PagedHostStore` keeps its bytes, and how another process
reaches them.

A store's bytes are its KV pages (``[kv_layers, pages, kv_page_bytes]`` uint8) and its snapshot
slots (each linear layer's conv and recurrent state, ``[layers, slots, ...]`` typed): a
:class:`StoreBytes`, with the copies an engine's worker makes between its blocks and them. Its
bookkeeping (which page and slot belongs to whom, the tree, the policy, verification) stays with
the store, in the process that drives it.

An engine whose worker runs in a process of its own (vLLM's multiprocess executor, which its CPU
build uses whenever the engine core is a process of its own, as under ``vllm serve``) cannot
reach the store's memory: the store then keeps its bytes in a file-backed shared mapping (a
:class:`StoreMapping`, made by ``PagedHostStore(..., mapped=True)``), which the worker maps by
its name. The name is removed as soon as the worker has mapped it (and at the store's
:meth:`~radixcache.vllm.PagedHostStore.close` if it never did): the memory goes when the last
process lets it go, whatever ends them. A process killed between creating a mapping and its
worker's attach leaves the name behind; the next :meth:`StoreMapping.create` in that directory
removes it (:meth:`StoreMapping.sweep`: names whose creating process is gone).

The worker writes only into the pages and slots the store planned for it and reads only the ones
it holds for a hit; the store neither reuses nor reads them until the engine has told it the
worker's step is done (the connector's per-step report): that report is the fence between the
two processes.
"""

from __future__ import annotations

import errno
import math
import os
import re
import secrets
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from linear_state import StateLayout

__all__ = ["StoreBytes", "StoreMapping"]

_ALIGN = 4096  # each region starts on a page of its own (any dtype's alignment)
_PREFIX = "radixcache-store-"
# radixcache-store-<pid namespace>-<pid>-<random>: a pid means something only in its namespace
# (containers sharing /dev/shm, e.g. docker --ipc=host, each have their own)
_NAME = re.compile(rf"{_PREFIX}(\d+)-(\d+)-[0-9a-f]+")


def _pid_namespace() -> int:
    """This process's pid namespace (its inode), 0 where the system does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StoreBytes:
    """A store's KV pages and snapshot slots, and the copies between an engine's blocks and
    them.

    :ivar kv: ``[kv_layers, pages, kv_page_bytes]`` uint8. :ivar conv: ``[layers, slots,
        *conv_shape]``. :ivar recurrent: ``[layers, slots, *recurrent_shape]``.
    :raises ValueError: tensors that disagree on their sizes (the message gives them).
    """

    def __init__(self, kv: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        if kv.dim() != 3 or kv.dtype != torch.uint8:
            raise ValueError(f"kv must be [layers, pages, page bytes] uint8, got {list(kv.shape)} {kv.dtype}")
        if conv.dim() < 2 or recurrent.dim() < 2 or conv.shape[:2] != recurrent.shape[:2]:
            raise ValueError(
                "conv and recurrent must be [layers, slots, ...] alike, "
                f"got {list(conv.shape)}, {list(recurrent.shape)}"
            )
        self.kv = kv
        self.conv = conv
        self.recurrent = recurrent

    @property
    def num_pages(self) -> int:
        """KV pages held."""
        return int(self.kv.shape[1])

    @property
    def num_slots(self) -> int:
        """Snapshot slots held."""
        return int(self.conv.shape[1])

    def copy_in_pages(self, pages: Sequence[int], layers: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        """Copy engine blocks into host ``pages``: ``layers[i]`` is attention layer ``i``'s
        cache as ``(engine blocks, kv_page_bytes)`` uint8 and the blocks to copy (one per page,
        in order).

        :raises ValueError: a layer count, a block count or a page outside the store."""
        self._check_layers(pages, layers)
        if not pages:
            return
        dst = torch.tensor(pages, dtype=torch.int64)
        for i, (t, blocks) in enumerate(layers):
            if t.device.type == "cpu":
                _copy_rows(self.kv[i], pages, t, blocks)
                continue
            src = torch.tensor(list(blocks), dtype=torch.int64, device=t.device)
            self.kv[i].index_copy_(0, dst, t.index_select(0, src).to("cpu"))

    def copy_out_pages(self, pages: Sequence[int], layers: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        """Copy host ``pages`` into engine blocks (``layers`` as :meth:`copy_in_pages`).

        :raises ValueError: a layer count, a block count or a page outside the store."""
        self._check_layers(pages, layers)
        if not pages:
            return
        src = torch.tensor(pages, dtype=torch.int64)
        for i, (t, blocks) in enumerate(layers):
            if t.device.type == "cpu":
                _copy_rows(t, blocks, self.kv[i], pages)
                continue
            dst = torch.tensor(list(blocks), dtype=torch.int64, device=t.device)
            t.index_copy_(0, dst, self.kv[i].index_select(0, src).to(t.device))

    def write_state(self, slot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Write a whole state (``[layers, *conv_shape]``, ``[layers, *recurrent_shape]``) into
        ``slot``. The slot's owner is the store's business: call it only for a slot the store
        planned for this copy.

        :raises ValueError: a slot outside the store, or shapes that are not a slot's."""
        s = self._slot(slot)
        if conv.shape != self.conv.shape[:1] + self.conv.shape[2:] or (
            recurrent.shape != self.recurrent.shape[:1] + self.recurrent.shape[2:]
        ):
            raise ValueError(
                f"a state of {list(conv.shape)}, {list(recurrent.shape)} for slots of "
                f"{[self.conv.shape[0], *self.conv.shape[2:]]}, {[self.recurrent.shape[0], *self.recurrent.shape[2:]]}"
            )
        self.conv[:, s].copy_(conv)
        self.recurrent[:, s].copy_(recurrent)

    def read_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``slot``'s conv ``[layers, ...]`` and recurrent ``[layers, ...]`` state (valid
        while the store holds the slot for the reader).

        :raises ValueError: a slot outside the store."""
        s = self._slot(slot)
        return self.conv[:, s], self.recurrent[:, s]

    def _slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} outside [0, {self.num_slots})")
        return int(slot)

    def _check_layers(self, pages: Sequence[int], layers: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
        if len(layers) != self.kv.shape[0]:
            raise ValueError(f"{len(layers)} attention layers given, the store has {self.kv.shape[0]}")
        bad = [p for p in pages if not 0 <= p < self.num_pages]
        if bad:
            raise ValueError(f"pages {bad[:4]} outside [0, {self.num_pages})")
        for t, blocks in layers:
            if len(blocks) != len(pages):
                raise ValueError(f"{len(blocks)} blocks for {len(pages)} pages")
            if t.dim() != 2 or t.dtype != torch.uint8 or t.shape[1] != self.kv.shape[2]:
                raise ValueError(
                    f"an engine cache of {tuple(t.shape)} {t.dtype}; want (blocks, {self.kv.shape[2]}) uint8"
                )
            bad = [b for b in blocks if not 0 <= b < t.shape[0]]
            if bad:
                raise ValueError(f"blocks {bad[:4]} outside the engine cache's [0, {t.shape[0]})")


@dataclass(frozen=True)
class StoreMapping:
    """A store's bytes in a file-backed shared mapping: what a process needs to map them (small;
    pickled to a worker in another process).

    :ivar path: the mapping's file (under ``/dev/shm`` where there is one), until the first
        :meth:`attach` removes it.
    :ivar kv_shape: ``(kv_layers, pages, kv_page_bytes)``. :ivar state: the slots' layout.
    :ivar slots: snapshot slots.
    """

    path: str
    kv_shape: tuple[int, int, int]
    state: StateLayout
    slots: int

    @property
    def nbytes(self) -> int:
        """The mapping's size: each region rounded up to a page."""
        return sum(_round_up(n) for n in self._regions())

    def _regions(self) -> tuple[int, int, int]:
        st = self.state
        kv = math.prod(self.kv_shape)
        conv = st.num_layers * self.slots * math.prod(st.conv_shape) * st.conv_dtype.itemsize
        rec = st.num_layers * self.slots * math.prod(st.recurrent_shape) * st.recurrent_dtype.itemsize
        return kv, conv, rec

    @classmethod
    def create(
        cls, kv_shape: tuple[int, int, int], state: StateLayout, slots: int, *, directory: str | None = None
    ) -> tuple[StoreMapping, StoreBytes]:
        """A new mapping of zeroed bytes for ``kv_shape`` pages and ``slots`` slots, mapped here.
        Its memory is reserved now where the system can (``posix_fallocate``: a file system short
        of it fails here, not at a later write):
        ``directory`` defaults to ``/dev/shm``, else the temporary directory. The name is removed
        when this process lets the mapping go, unless :meth:`attach` removed it first.

        Names left there by processes that are gone are removed first (:meth:`sweep`).

        :raises OSError: the file system lacks the room (the message gives the bytes free and
            needed)."""
        where = directory or _default_directory()
        cls.sweep(where)
        path = os.path.join(where, f"{_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}")
        spec = cls(path, tuple(int(x) for x in kv_shape), state, int(slots))  # type: ignore[arg-type]
        size = spec.nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:  # macOS: no reservation, the file only sized
                    os.ftruncate(fd, size)
            except OSError as e:
                free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
                os.unlink(path)
                raise OSError(
                    e.errno or errno.ENOSPC,
                    f"{where} has {free} bytes free; the store's shared mapping needs {size} "
                    "(give it more room, e.g. a container's --shm-size, or a smaller host budget)",
                ) from e
        finally:
            os.close(fd)
        out = spec._map()
        weakref.finalize(out, _remove, path)
        return spec, out

    @staticmethod
    def sweep(directory: str | None = None) -> list[str]:
        """Remove the mappings' names in ``directory`` (default as :meth:`create`'s) that a process
        which is gone created: one killed between creating a mapping and its worker's attach. Only
        names this user owns, made in this process's pid namespace (a pid of another, e.g. another
        container sharing ``/dev/shm``, says nothing here), whose process no longer runs. A
        process that maps one of them still has its memory; only the name goes. Returns the paths
        removed."""
        where = directory or _default_directory()
        here, uid = _pid_namespace(), os.getuid()
        gone = []
        with os.scandir(where) as entries:
            for entry in entries:
                m = _NAME.fullmatch(entry.name)
                if m is None or int(m[1]) != here or _alive(int(m[2])):
                    continue
                try:
                    if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == uid:
                        os.unlink(entry.path)
                        gone.append(entry.path)
                except FileNotFoundError:  # another sweep, or its worker, took it meanwhile
                    continue
        return gone

    def attach(self) -> StoreBytes:
        """Map the bytes :meth:`create` made (in another process), and remove the name: nothing
        else needs it.

        :raises FileNotFoundError: the mapping's name is gone (attached already, or its store
            closed). :raises ValueError: the file's size is not this mapping's."""
        size = os.stat(self.path).st_size
        if size != self.nbytes:
            raise ValueError(f"{self.path} holds {size} bytes, the store's mapping {self.nbytes}")
        out = self._map()
        _remove(self.path)
        return out

    def remove(self) -> None:
        """Remove the name if it is still there (the memory stays mapped where it is)."""
        _remove(self.path)

    def _map(self) -> StoreBytes:
        raw = torch.from_file(self.path, shared=True, size=self.nbytes, dtype=torch.uint8)
        st = self.state
        kv_n, conv_n, rec_n = self._regions()
        at = 0

        def take(n: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            nonlocal at
            view = raw[at : at + n].view(dtype).view(shape)
            at += _round_up(n)
            return view

        kv = take(kv_n, torch.uint8, self.kv_shape)
        conv = take(conv_n, st.conv_dtype, (st.num_layers, self.slots, *st.conv_shape))
        rec = take(rec_n, st.recurrent_dtype, (st.num_layers, self.slots, *st.recurrent_shape))
        return StoreBytes(kv, conv, rec)


def _copy_rows(dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]) -> None:
    """``dst[dst_rows[j]] = src[src_rows[j]]`` for every ``j``, both on the CPU: one ``copy_`` per
    run of rows consecutive on both sides (a memcpy each). PERF: torch's uint8 ``index_select`` and
    ``index_copy_`` took 4x a memcpy of the same bytes on the CPU (benchmarks/bench_vllm_store.py),
    and these copies sit on the engine's step (the worker's save and load)."""
    n = len(dst_rows)
    j = 0
    while j < n:
        d, s = int(dst_rows[j]), int(src_rows[j])
        k = 1
        while j + k < n and int(dst_rows[j + k]) == d + k and int(src_rows[j + k]) == s + k:
            k += 1
        dst[d : d + k].copy_(src[s : s + k])
        j += k


def _default_directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _remove(path: str) -> None:
    Path(path).unlink(missing_ok=True)
