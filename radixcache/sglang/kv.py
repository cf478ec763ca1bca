"""How a prefix's attention KV travels through the shared tier inside SGLang: the
:class:`~radixcache.tiers.shared.KVCodec` over SGLang's token-indexed KV pool.

SGLang keeps one K and one V tensor per full-attention layer (``MHATokenToKVPool.k_buffer`` and
``v_buffer``; a hybrid model's ``HybridLinearKVPool`` holds such a pool as ``full_kv_pool``), each
``[rows, heads, head_dim]`` with one row per KV index. A prefix's KV travels as those rows' bytes,
layer by layer, K then V: ``[layers][K, V][tokens][row bytes]``, C order, in the pool's storage
dtype. Only such plain pools are served: MLA, per-row quantization scales and the head-major
(``SGLANG_USE_HND_KVCACHE``) layout are refused when the codec is built.

Importing this module does not import SGLang.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from linear_state import Fence

from ..tiers.export_buffers import ExportBuffers

__all__ = ["KEEP_BYTES", "SGLangKVCodec"]

KEEP_BYTES = 1 << 30  # the default cap on the exported buffers a codec keeps (host memory)


def _kv_buffers(kvcache: Any) -> tuple[list[torch.Tensor], list[str]]:
    """The pool's K and V tensors, layer by layer (``[k0, v0, k1, v1, ...]``), and why it cannot
    be served (empty when it can)."""
    full = getattr(kvcache, "full_kv_pool", kvcache)
    why: list[str] = []
    k, v = getattr(full, "k_buffer", None), getattr(full, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list) or not k or len(k) != len(v):
        return [], [f"a KV pool without per-layer K and V buffers ({type(full).__name__})"]
    if getattr(full, "use_hnd", False):
        why.append("the head-major KV layout (SGLANG_USE_HND_KVCACHE)")
    if getattr(full, "k_scale_buffer", None) is not None or getattr(full, "v_scale_buffer", None) is not None:
        why.append("a KV cache quantized with per-row scales")
    bufs = [t for pair in zip(k, v, strict=True) for t in pair]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 and t.is_contiguous() for t in bufs):
        why.append("K/V buffers that are not contiguous tensors of rows")
    elif len({int(t.shape[0]) for t in bufs}) != 1:
        why.append("K/V buffers with different row counts")
    return bufs, why


class SGLangKVCodec:
    """The shared tier's :class:`~radixcache.tiers.shared.KVCodec` over SGLang's KV pool and its
    token allocator (``token_to_kv_pool_allocator``, whose ``get_kvcache()`` is the pool).

    - :meth:`export_kv`: the rows of the given KV indices, read once the fence completed (on a
      CUDA pool, once the device finished what was queued before), into a buffer of their own:
      one the tier handed back (:meth:`reuse_kv`) when one fits, memory written before (up to
      two kept, together at most ``keep_bytes``: :class:`~radixcache.tiers.export_buffers.ExportBuffers`).
    - :meth:`import_kv`: ``num_tokens`` indices from SGLang's allocator (a whole number of pages:
      the tier fetches whole pages) when it has that many free, the rows written, the device
      synchronized after a CUDA write, so any later forward reads them. None when the allocator
      has too few free (nothing allocated).
    - :meth:`free_tokens`: what the allocator has free, so a fetch evicts the tree's KV (never a
      locked path) for a prefix that does not fit, as SGLang's own admission does.

    :ivar identity: the layers' row shapes and storage dtype: replicas share blobs only when
        their KV rows mean the same.
    :ivar bytes_per_token: what one token's rows take, every layer's K and V.
    :param keep_bytes: what the buffers kept for later exports take together, at most (default:
        a quarter of the pool's KV bytes, at most :data:`KEEP_BYTES`).
    :raises NotImplementedError: a pool this codec cannot read (see the module docstring), naming why.
    :raises ValueError: ``keep_bytes`` not an int >= 0.
    """

    def __init__(self, allocator: Any, *, keep_bytes: int | None = None) -> None:
        get = getattr(allocator, "get_kvcache", None)
        if not callable(get) or not callable(getattr(allocator, "alloc", None)):
            raise TypeError(f"allocator must be SGLang's token-to-KV allocator, got {type(allocator).__name__}")
        bufs, why = _kv_buffers(get())
        if why:
            raise NotImplementedError("the shared tier does not serve " + "; ".join(why) + " yet")
        self.allocator = allocator
        self._bufs = bufs
        self._row_bytes = [int(t[0].numel()) * t.element_size() for t in bufs]
        self.bytes_per_token = sum(self._row_bytes)
        self._cuda = bufs[0].device.type == "cuda"
        self.device = bufs[0].device
        rows = ",".join(f"{'x'.join(str(int(d)) for d in t.shape[1:])}" for t in bufs[:2])
        self.identity = f"sglang-kv layers={len(bufs) // 2} k,v={rows} dtype={bufs[0].dtype}"
        # On the CPU, each buffer as rows of bytes (numpy views, made once): numpy copies rows
        # without holding the interpreter lock.
        self._rows_np = None if self._cuda else [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in bufs]
        pool_bytes = int(bufs[0].shape[0]) * self.bytes_per_token
        self.buffers = ExportBuffers(min(pool_bytes // 4, KEEP_BYTES) if keep_bytes is None else keep_bytes)

    def free_tokens(self) -> int:
        """KV tokens SGLang's allocator can hand out now (its ``available_size()``: whole free
        pages' tokens)."""
        return int(self.allocator.available_size())

    def export_kv(self, kv_indices: torch.Tensor, after: Fence | None) -> memoryview:
        """The rows of ``kv_indices`` (one per token, in order), layer by layer, K then V, read
        once ``after`` completed: a flat byte view of a buffer of their own (one handed back
        through :meth:`reuse_kv` when one fits).

        :raises ValueError: an index outside the pool."""
        if after is not None:
            after.wait()
        elif self._cuda:
            torch.cuda.synchronize(self.device)
        idx = kv_indices.to(torch.int64).cpu()
        n = int(idx.numel())
        rows = int(self._bufs[0].shape[0])
        if n and not (int(idx.min()) >= 0 and int(idx.max()) < rows):
            raise ValueError(f"KV indices must be in [0, {rows}), got [{int(idx.min())}, {int(idx.max())}]")
        need = n * self.bytes_per_token
        if not need:
            return memoryview(b"")
        out = self.buffers.take(need)[:need]
        at = 0
        if self._rows_np is not None:
            where = idx.numpy()
            for src, rb in zip(self._rows_np, self._row_bytes, strict=True):
                np.take(src, where, axis=0, out=out[at : at + n * rb].reshape(n, rb), mode="clip")  # checked above
                at += n * rb
        else:
            dev = idx.to(self.device)
            for t, rb in zip(self._bufs, self._row_bytes, strict=True):
                dst = torch.from_numpy(out[at : at + n * rb]).view(n, rb)
                dst.copy_(t.index_select(0, dev).view(torch.uint8).reshape(n, rb))
                at += n * rb
        return out.data

    def reuse_kv(self, kv: bytes | memoryview) -> None:
        """The tier is done with ``kv``, a view :meth:`export_kv` returned: its buffer may be
        written by a later export (anything else is ignored: :meth:`ExportBuffers.give_back`)."""
        self.buffers.give_back(kv)

    def import_kv(self, data: bytes | memoryview, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` KV indices from SGLang's allocator with ``data`` (what :meth:`export_kv`
        returned) written into their rows; None when the allocator has fewer free (nothing
        allocated). The indices are the caller's (the tree's, once inserted) and go back through
        the allocator's ``free``.

        :raises ValueError: ``data`` is not ``num_tokens`` tokens' rows (nothing allocated)."""
        n = int(num_tokens)
        src = np.frombuffer(data, np.uint8)
        if src.size != n * self.bytes_per_token:
            raise ValueError(f"KV data of {src.size} bytes for {n} tokens of {self.bytes_per_token} bytes each")
        if self.allocator.available_size() < n:
            return None
        idx: torch.Tensor | None = self.allocator.alloc(n)
        if idx is None:
            return None
        at = 0
        if self._rows_np is not None:
            where = idx.cpu().numpy()
            for dst, rb in zip(self._rows_np, self._row_bytes, strict=True):
                dst[where] = src[at : at + n * rb].reshape(n, rb)
                at += n * rb
        else:
            dev = idx.to(self.device)
            for t, rb in zip(self._bufs, self._row_bytes, strict=True):
                rows = torch.from_numpy(src[at : at + n * rb].copy()).to(self.device).view(n, rb)
                t.view(torch.uint8).reshape(t.shape[0], -1).index_copy_(0, dev, rows)
                at += n * rb
            torch.cuda.synchronize(self.device)
        return idx.to(torch.int64).cpu()
