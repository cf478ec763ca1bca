"""A tiny hybrid model with seeded random weights: Gated DeltaNet layers interleaved with causal
attention over a paged KV pool. It exists to prove the cache right: every hit a served request
takes must produce the tokens the same prompt produces computed alone, cold.

Gated DeltaNet (Qwen3-Next style), per token t and value head h::

    q, k, v, z, b, a   = projections of x_t (q, k per key head; a key head serves nv/nk value heads)
    q, k, v            = silu(causal depthwise conv1d over [q k v], window 4)   # conv state: last 3 inputs
    q, k               = l2norm(q), l2norm(k);  q = q / sqrt(dk)
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
    S = exp(g) * S;  S = S + k (beta * (v - S^T k))^T;  o = S^T q        # S: [dk, dv]
    out = out_proj(rmsnorm(o) * weight * silu(z))

Prefill uses the chunked form of the recurrence (exact, up to rounding) and yields the state at
any depth inside the chunk the host asks for; decode is one batched step whose state rows are
gathered and scattered by slot index (never a per-sequence loop over the shared pool). The
projection layout matches Qwen3-Next checkpoints, so weights copy into transformers' layer as-is.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from linear_state import LinearStatePool, StateLayout

from ..core.multimodal import image_runs, mm_window

__all__ = ["GatedDeltaNet", "HybridConfig", "HybridModel", "KVPool", "gdn_chunk"]

CHUNK = 64


@dataclass(frozen=True)
class HybridConfig:
    """Shape of the reference model. ``layer_types`` holds ``"linear"`` (GDN) or ``"full"``."""

    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = ("linear", "linear", "linear", "full")
    num_k_heads: int = 2
    num_v_heads: int = 4
    head_k_dim: int = 16
    head_v_dim: int = 16
    conv_kernel: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: torch.dtype = torch.float64
    seed: int = 0
    # Decay rates: A log-uniform in [a_min, a_max]; small values keep long memory, so a wrong
    # state still shows hundreds of tokens later.
    a_min: float = 0.0001
    a_max: float = 0.5
    linear_layers: tuple[int, ...] = field(init=False)
    full_layers: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        bad = [t for t in self.layer_types if t not in ("linear", "full")]
        if bad:
            raise ValueError(f"layer_types must be 'linear' or 'full', got {bad}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"num_v_heads {self.num_v_heads} must be a multiple of num_k_heads {self.num_k_heads}")
        object.__setattr__(self, "linear_layers", tuple(i for i, t in enumerate(self.layer_types) if t == "linear"))
        object.__setattr__(self, "full_layers", tuple(i for i, t in enumerate(self.layer_types) if t == "full"))

    @property
    def placeholder_id(self) -> int:
        """The image placeholder id: the last id of the vocabulary (text never uses it)."""
        return self.vocab_size - 1

    def state_layout(self) -> StateLayout:
        """The per-sequence linear state of this model, for a :class:`LinearStatePool`."""
        return StateLayout.for_gdn(
            len(self.linear_layers),
            self.num_k_heads,
            self.num_v_heads,
            self.head_k_dim,
            self.head_v_dim,
            self.conv_kernel,
            conv_dtype=self.dtype,
            recurrent_dtype=self.dtype,
        )


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gdn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one chunk, in closed form. Shapes: ``q, k`` [H, c, dk] (normalised,
    ``q`` scaled), ``v`` [H, c, dv], ``g, beta`` [H, c], ``state`` [H, dk, dv]. Returns the outputs
    [H, c, dv] and the state after the chunk.

    With ``G`` the cumulative log decay, the per-token corrections ``u`` solve the unit lower
    triangular system ``(I + A) u = beta * (v - exp(G) * k S0)`` with
    ``A[i, j] = beta_i exp(G_i - G_j) k_i.k_j`` for ``j < i``; then
    ``o = exp(G) * q S0 + (mask(exp(G_i - G_j)) * q k^T) u`` and
    ``S = exp(G_c) S0 + (k * exp(G_c - G))^T u``.
    """
    c = q.shape[1]
    G = g.cumsum(-1)  # [H, c]
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # [H, c, c]: G_i - G_j
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower, float("-inf")).exp()  # exp(G_i - G_j), j <= i
    kk = k @ k.transpose(-1, -2)
    A = (beta.unsqueeze(-1) * kk * decay).tril(-1)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    eG = G.exp().unsqueeze(-1)
    rhs = beta.unsqueeze(-1) * (v - eG * (k @ state))
    u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    out = eG * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ u
    tail = (G[:, -1:] - G).exp().unsqueeze(-1)  # exp(G_c - G_j)
    new_state = G[:, -1].exp()[:, None, None] * state + (k * tail).transpose(-1, -2) @ u
    return out, new_state


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (parameters named and laid out as in Qwen3-Next checkpoints)."""

    def __init__(self, cfg: HybridConfig, gen: torch.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        nk, nv, dk, dv, h = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.hidden_size
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        dt = cfg.dtype

        def rand(*shape: int, scale: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=gen, dtype=dt) * scale)

        self.in_proj_qkvz = rand(2 * self.key_dim + 2 * self.value_dim, h, scale=h**-0.5)
        self.in_proj_ba = rand(2 * nv, h, scale=h**-0.5)
        self.conv_weight = rand(self.conv_dim, cfg.conv_kernel, scale=cfg.conv_kernel**-0.5)
        self.dt_bias = nn.Parameter(torch.ones(nv, dtype=dt))
        lo, hi = math.log(cfg.a_min), math.log(cfg.a_max)  # log-uniform: some heads remember long
        self.A_log = nn.Parameter(torch.rand(nv, generator=gen, dtype=dt) * (hi - lo) + lo)
        self.norm_weight = nn.Parameter(1.0 + 0.1 * torch.randn(dv, generator=gen, dtype=dt))
        self.out_proj = rand(h, self.value_dim, scale=self.value_dim**-0.5)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x`` [..., hidden] -> mixed qkv [..., conv_dim], z [..., nv, dv], b [..., nv], a [..., nv].

        The fused projections are grouped by key head: per key head, ``q, k`` (dk each), then the
        ``v`` and ``z`` of its nv/nk value heads; ``b, a`` likewise.
        """
        cfg = self.cfg
        nk, nv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
        r = nv // nk
        lead = x.shape[:-1]
        qkvz = (x @ self.in_proj_qkvz.T).reshape(*lead, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = (x @ self.in_proj_ba.T).reshape(*lead, nk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat([q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)], dim=-1)
        return mixed, z.reshape(*lead, nv, dv), b.reshape(*lead, nv), a.reshape(*lead, nv)

    def _split_heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        lead = mixed.shape[:-1]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        r = cfg.num_v_heads // cfg.num_k_heads
        q = q.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim).repeat_interleave(r, dim=-2)
        k = k.reshape(*lead, cfg.num_k_heads, cfg.head_k_dim).repeat_interleave(r, dim=-2)
        v = v.reshape(*lead, cfg.num_v_heads, cfg.head_v_dim)
        q = _l2norm(q) * cfg.head_k_dim**-0.5
        return q, _l2norm(k), v

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return -self.A_log.exp() * F.softplus(a + self.dt_bias), b.sigmoid()

    def _finish(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        var = o.pow(2).mean(-1, keepdim=True)
        o = o * torch.rsqrt(var + self.cfg.rms_eps) * self.norm_weight * F.silu(z)
        return o.reshape(*o.shape[:-2], self.value_dim) @ self.out_proj.T

    def prefill(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
        start: int = 0,
        capture: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Run ``x`` [T, hidden] (tokens at absolute positions ``start..start+T-1``) from the given
        states. Returns the output [T, hidden], the final conv [C, K-1] and recurrent [nv, dk, dv]
        states, and the states at each absolute depth in ``capture`` (inside ``(start, start+T]``).

        The recurrence runs in chunks cut at absolute multiples of 64 and at every capture depth.
        """
        T = x.shape[0]
        mixed, z, b, a = self.project(x)
        K1 = self.cfg.conv_kernel - 1
        xs = torch.cat([conv_state.T, mixed], dim=0)  # [K-1+T, C]: the window before each token
        conv_out = F.silu((xs.unfold(0, K1 + 1, 1) * self.conv_weight).sum(-1))  # [T, C]
        q, k, v = self._split_heads(conv_out)
        g, beta = self._gates(b, a)
        q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))  # heads first
        cuts = sorted({d - start for d in capture if 0 < d - start <= T} | set(range(CHUNK - start % CHUNK, T, CHUNK)))
        cuts = [c for c in cuts if 0 < c < T] + [T]
        outs = []
        state = rec_state
        captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        lo = 0
        for hi in cuts:
            o, state = gdn_chunk(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
            outs.append(o)
            if start + hi in capture:
                captured[start + hi] = (xs[hi : hi + K1].T.clone(), state.clone())
            lo = hi
        o = torch.cat(outs, dim=1).transpose(0, 1)  # [T, nv, dv]
        return self._finish(o, z), xs[T : T + K1].T.clone(), state, captured

    def decode(self, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each of B sequences: ``x`` [B, hidden]. ``conv`` [S, C, K-1] and ``rec``
        [S, nv, dk, dv] are this layer's pool tensors; sequence i's state row is ``slots[i]``. The
        rows are gathered by slot index, advanced in one batched step and scattered back by slot
        index. Returns [B, hidden]."""
        mixed, z, b, a = self.project(x)
        window = torch.cat([conv.index_select(0, slots), mixed.unsqueeze(-1)], dim=-1)  # [B, C, K]
        conv_out = F.silu((window * self.conv_weight).sum(-1))
        q, k, v = self._split_heads(conv_out)  # [B, nv, d]
        g, beta = self._gates(b, a)
        S = rec.index_select(0, slots) * g.exp()[..., None, None]
        delta = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta.unsqueeze(-1)
        S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
        o = torch.einsum("bhkv,bhk->bhv", S, q)
        conv.index_copy_(0, slots, window[..., 1:])
        rec.index_copy_(0, slots, S)
        return self._finish(o, z)


class KVPool:
    """A paged KV pool for the attention layers: ``[num_tokens, kv_heads, head_dim]`` per layer,
    addressed by KV indices the host allocates."""

    def __init__(self, cfg: HybridConfig, num_tokens: int, device: torch.device | str = "cpu") -> None:
        shape = (len(cfg.full_layers), num_tokens, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=cfg.dtype, device=device)
        self.v = torch.zeros(shape, dtype=cfg.dtype, device=device)
        self.num_tokens = num_tokens


class Attention(nn.Module):
    """Causal multi-head attention with RoPE, grouped KV heads, over a :class:`KVPool`."""

    def __init__(self, cfg: HybridConfig, gen: torch.Generator) -> None:
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = cfg.dtype
        self.q_proj = nn.Parameter(torch.randn(nh * hd, h, generator=gen, dtype=dt) * h**-0.5)
        self.k_proj = nn.Parameter(torch.randn(nkv * hd, h, generator=gen, dtype=dt) * h**-0.5)
        self.v_proj = nn.Parameter(torch.randn(nkv * hd, h, generator=gen, dtype=dt) * h**-0.5)
        self.o_proj = nn.Parameter(torch.randn(h, nh * hd, generator=gen, dtype=dt) * (nh * hd) ** -0.5)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv.to(dt), persistent=False)  # follows the model's device

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.to(x.dtype).unsqueeze(-1) * self.inv_freq  # [T, hd/2]
        cos, sin = ang.cos().unsqueeze(-2), ang.sin().unsqueeze(-2)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_idx: torch.Tensor,
        end: int | None = None,
    ) -> torch.Tensor:
        """``x`` [T, hidden] at absolute positions ``pos`` (contiguous, ending at ``len(kv_idx)``);
        writes their K/V at ``kv_idx[pos]`` and attends causally over ``kv_idx[:pos+1]``.

        :param end: ``pos[-1] + 1`` when the caller knows it: reading it off a GPU tensor would
            make the host wait for the stream."""
        cfg = self.cfg
        T = x.shape[0]
        q = self._rope((x @ self.q_proj.T).view(T, cfg.num_heads, cfg.head_dim), pos)
        k = self._rope((x @ self.k_proj.T).view(T, cfg.num_kv_heads, cfg.head_dim), pos)
        v = (x @ self.v_proj.T).view(T, cfg.num_kv_heads, cfg.head_dim)
        k_pool.index_copy_(0, kv_idx[pos], k)
        v_pool.index_copy_(0, kv_idx[pos], v)
        end = int(pos[-1]) + 1 if end is None else end
        keys = k_pool.index_select(0, kv_idx[:end]).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 1)
        vals = v_pool.index_select(0, kv_idx[:end]).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 1)
        scores = torch.einsum("thd,shd->hts", q, keys) / math.sqrt(cfg.head_dim)
        mask = torch.arange(end, device=x.device).unsqueeze(0) > pos.unsqueeze(1)  # [T, end]
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), vals)
        return out.reshape(T, -1) @ self.o_proj.T


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float, dtype: torch.dtype, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(n, generator=gen, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _MLP(nn.Module):
    def __init__(self, cfg: HybridConfig, gen: torch.Generator) -> None:
        super().__init__()
        h, m, dt = cfg.hidden_size, cfg.intermediate_size, cfg.dtype
        self.gate = nn.Parameter(torch.randn(m, h, generator=gen, dtype=dt) * h**-0.5)
        self.up = nn.Parameter(torch.randn(m, h, generator=gen, dtype=dt) * h**-0.5)
        self.down = nn.Parameter(torch.randn(h, m, generator=gen, dtype=dt) * m**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.gate.T) * (x @ self.up.T)) @ self.down.T


class HybridModel(nn.Module):
    """Embeddings, pre-norm blocks (GDN or attention mixer + MLP), final norm, LM head.

    States live outside the model: linear state in a :class:`LinearStatePool` (one slot per
    sequence), attention KV in a :class:`KVPool` addressed by the host's KV indices, both on the
    model's :attr:`device`.

    :param device: where the weights live and the forward passes run. The weights are drawn on the
        CPU from ``cfg.seed`` and then moved, so every device holds the same model. Index inputs
        (token ids, KV indices, slots) may be given on the CPU: each call moves them itself.
    """

    def __init__(self, cfg: HybridConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=cfg.dtype))
        self.mixers = nn.ModuleList(
            [GatedDeltaNet(cfg, gen) if t == "linear" else Attention(cfg, gen) for t in cfg.layer_types]
        )
        self.norms1 = nn.ModuleList([_RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.dtype, gen) for _ in cfg.layer_types])
        self.norms2 = nn.ModuleList([_RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.dtype, gen) for _ in cfg.layer_types])
        self.mlps = nn.ModuleList([_MLP(cfg, gen) for _ in cfg.layer_types])
        self.final_norm = _RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.dtype, gen)
        self.lm_head = nn.Parameter(
            torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=cfg.dtype) * cfg.hidden_size**-0.5
        )
        self.requires_grad_(False)
        self._adapters: dict[Hashable, torch.Tensor] = {}  # namespace -> its bias, made once
        self._image_rows: dict[bytes, list[torch.Tensor]] = {}  # image digest -> its rows so far
        self.to(device)

    @property
    def device(self) -> torch.device:
        """The device of the weights, where :meth:`prefill` and :meth:`decode` run."""
        return self.embed.device

    def adapter(self, namespace: Hashable) -> torch.Tensor | None:
        """The input bias of ``namespace``'s adapter (``None``: the base model): a seeded vector of
        ``hidden_size``, added to every input embedding, so each tenant is another model."""
        if namespace is None:
            return None
        bias = self._adapters.get(namespace)
        if bias is None:  # made once per namespace: every decode step of a tenant asks for it
            gen = torch.Generator().manual_seed(_seed(b"adapter", repr(namespace).encode(), self.cfg.seed))
            bias = self._adapters[namespace] = (
                torch.randn(self.cfg.hidden_size, generator=gen, dtype=self.cfg.dtype) * 0.5
            ).to(self.device)
        return bias

    def image_rows(self, image: bytes, n: int) -> torch.Tensor:
        """Embedding rows of the first ``n`` tokens of ``image`` ([n, hidden_size]): row k is seeded
        by a SHA-256 of all the image's bytes and k, so images that differ anywhere differ."""
        digest = hashlib.sha256(bytes(image)).digest()
        h, dt = self.cfg.hidden_size, self.cfg.dtype
        rows = self._image_rows.setdefault(digest, [])  # made once per row: each window asks again
        for k in range(len(rows), n):
            rows.append(
                torch.randn(
                    h, generator=torch.Generator().manual_seed(_seed(digest, k.to_bytes(4, "little"))), dtype=dt
                ).to(self.device)
            )
        return torch.stack(rows[:n]) if n else torch.empty(0, h, dtype=dt, device=self.device)

    def inputs(
        self,
        prompt: Sequence[int],
        start: int,
        end: int,
        *,
        namespace: Hashable = None,
        images: Sequence[bytes] = (),
    ) -> torch.Tensor:
        """Input embeddings of ``prompt[start:end]`` ([end - start, hidden_size]): token
        embeddings, the i-th run of placeholders replaced by rows of ``images[i]`` (the rows of
        the placeholders inside the window only, as a host scatters them after a hit), plus the
        namespace's adapter bias.

        :raises ValueError: the prompt's placeholder runs and ``images`` cannot be paired."""
        ids = _to(torch.tensor(list(prompt[start:end]), dtype=torch.int64), self.device)
        x = self.embed[ids]
        if images:
            runs = image_runs(list(prompt), self.cfg.placeholder_id)
            if len(runs) != len(images):
                raise ValueError(f"{len(runs)} placeholder run(s) but {len(images)} image(s)")
            rows = torch.cat([self.image_rows(img, e - s) for (s, e), img in zip(runs, images, strict=True)])
            w = mm_window(list(prompt), self.cfg.placeholder_id, start, end)
            x[_to(torch.from_numpy(w.positions), self.device)] = rows[w.rows.start : w.rows.stop]
        bias = self.adapter(namespace)
        return x if bias is None else x + bias

    def greedy(self, logits: torch.Tensor) -> int:
        """The greedy next token: the highest logit, the placeholder id excluded."""
        return int(torch.argmax(logits[..., : self.cfg.placeholder_id]))

    def _gdn(self, i: int) -> tuple[int, GatedDeltaNet]:
        """Layer ``i``'s index among the linear layers (its row in the pool), and its mixer."""
        mixer = self.mixers[i]
        assert isinstance(mixer, GatedDeltaNet)
        return self.cfg.linear_layers.index(i), mixer

    @torch.no_grad()
    def prefill(
        self,
        ids: torch.Tensor,
        start: int,
        pool: LinearStatePool,
        slot: int,
        kv: KVPool,
        kv_idx: torch.Tensor,
        captures: Sequence[tuple[int, int]] = (),
        *,
        embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Extend a sequence by ``ids`` (positions ``start..``) from the state in ``slot``; write the
        new state back into ``slot`` and, for each ``(depth, track_slot)`` in ``captures``, the
        state after exactly ``depth`` tokens into ``track_slot``. Returns the last token's logits.

        :param embeds: the window's input embeddings (see :meth:`inputs`) instead of ``ids``'."""
        cfg, dev = self.cfg, self.device
        ids, kv_idx = _to(ids, dev), _to(kv_idx, dev)
        x = self.embed[ids] if embeds is None else _to(embeds, dev)
        pos = torch.arange(start, start + ids.shape[0], device=dev)
        depths = [d for d, _ in captures]
        for i, kind in enumerate(cfg.layer_types):
            hcur = self.norms1[i](x)
            if kind == "linear":
                li, mixer = self._gdn(i)
                out, conv, rec, cap = mixer.prefill(hcur, pool.conv[li, slot], pool.recurrent[li, slot], start, depths)
                pool.conv[li, slot].copy_(conv)
                pool.recurrent[li, slot].copy_(rec)
                for d, t in captures:
                    c, r = cap[d]
                    pool.conv[li, t].copy_(c)
                    pool.recurrent[li, t].copy_(r)
            else:
                fi = cfg.full_layers.index(i)
                out = self.mixers[i](hcur, pos, kv.k[fi], kv.v[fi], kv_idx, start + ids.shape[0])
            x = x + out
            x = x + self.mlps[i](self.norms2[i](x))
        logits: torch.Tensor = self.final_norm(x[-1]) @ self.lm_head.T
        return logits

    @torch.no_grad()
    def decode(
        self,
        ids: torch.Tensor,
        positions: Sequence[int],
        pool: LinearStatePool,
        slots: torch.Tensor,
        kv: KVPool,
        kv_idx: Sequence[torch.Tensor],
        *,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token for each of B sequences (batched for the linear layers: state rows routed by
        ``slots``). Returns logits [B, vocab].

        :param bias: [B, hidden_size] adapter biases (see :meth:`adapter`; zero rows for none)."""
        cfg, dev = self.cfg, self.device
        ids, slots = _to(ids, dev), _to(slots, dev)
        pos = _to(torch.tensor(list(positions), dtype=torch.int64), dev)
        idx = [_to(t, dev) for t in kv_idx]
        x = self.embed[ids] if bias is None else self.embed[ids] + _to(bias, dev)
        for i, kind in enumerate(cfg.layer_types):
            hcur = self.norms1[i](x)
            if kind == "linear":
                li, mixer = self._gdn(i)
                out = mixer.decode(hcur, pool.conv[li], pool.recurrent[li], slots)
            else:
                fi = cfg.full_layers.index(i)
                attn = self.mixers[i]
                out = torch.cat(
                    [
                        attn(hcur[b : b + 1], pos[b : b + 1], kv.k[fi], kv.v[fi], idx[b], p + 1)
                        for b, p in enumerate(positions)
                    ]
                )
            x = x + out
            x = x + self.mlps[i](self.norms2[i](x))
        logits: torch.Tensor = self.final_norm(x) @ self.lm_head.T
        return logits


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A CPU tensor bound for a GPU goes through pinned memory, asynchronously:
    a copy from pageable memory may wait for the stream's queued work, a hidden host
    synchronisation that would serialise the host with every forward."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _seed(*parts: bytes | int) -> int:
    """A 63-bit generator seed from ``parts`` (SHA-256)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest()[:8], "little") >> 1
