import torch

from linear_state import LinearStatePool, RequestOwner
from radixcache.testing.model import GatedDeltaNet, HybridConfig, HybridModel, KVPool

CFG = HybridConfig()


@torch.no_grad()
def test_chunked_prefill_equals_the_token_recurrence_and_captures_exact_states() -> None:
    layer = GatedDeltaNet(CFG, torch.Generator().manual_seed(3))
    x = torch.randn(300, CFG.hidden_size, generator=torch.Generator().manual_seed(4), dtype=CFG.dtype)
    layout = CFG.state_layout()
    conv0, rec0 = torch.zeros(layout.conv_shape, dtype=CFG.dtype), torch.zeros(layout.recurrent_shape, dtype=CFG.dtype)
    out, conv, rec, cap = layer.prefill(x, conv0, rec0, 0, capture=[100, 128])
    conv_p, rec_p = conv0.unsqueeze(0).clone(), rec0.unsqueeze(0).clone()
    steps = []
    for t in range(300):
        steps.append(layer.decode(x[t : t + 1], conv_p, rec_p, torch.tensor([0])))
        if t + 1 == 100:
            at100 = (conv_p[0].clone(), rec_p[0].clone())
    torch.testing.assert_close(out, torch.cat(steps), atol=1e-12, rtol=0)
    torch.testing.assert_close(rec, rec_p[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(conv, conv_p[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(cap[100][1], at100[1], atol=1e-12, rtol=0)
    torch.testing.assert_close(cap[100][0], at100[0], atol=1e-12, rtol=0)
    # a prefill split anywhere continues exactly
    o1, c1, r1, _ = layer.prefill(x[:150], conv0, rec0, 0)
    o2, _, r2, _ = layer.prefill(x[150:], c1, r1, 150)
    torch.testing.assert_close(torch.cat([o1, o2]), out, atol=1e-12, rtol=0)
    torch.testing.assert_close(r2, rec, atol=1e-12, rtol=0)


@torch.no_grad()
def test_batched_decode_routes_each_sequence_to_its_own_state_row() -> None:
    """Hazard 3 of DESIGN.md: with three or more sequences in one batch, in any slot order, each
    sequence's result equals decoding it alone."""
    model = HybridModel(CFG)
    pool = LinearStatePool(CFG.state_layout(), 6)
    kv = KVPool(CFG, 4096)
    owner = RequestOwner("t")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (40, 75, 130, 9)]
    slots = [pool.alloc(owner) for _ in prompts]
    kv_idx = [torch.arange(i * 1000, i * 1000 + 200) for i in range(len(prompts))]
    first = [model.prefill(p, 0, pool, s, kv, k) for p, s, k in zip(prompts, slots, kv_idx, strict=True)]
    nxt = [int(f.argmax()) for f in first]
    saved = (pool.conv.clone(), pool.recurrent.clone(), kv.k.clone(), kv.v.clone())
    order = [2, 0, 3, 1]
    batched = model.decode(
        torch.tensor([nxt[i] for i in order]),
        [len(prompts[i]) for i in order],
        pool,
        torch.tensor([slots[i] for i in order]),
        kv,
        [kv_idx[i][: len(prompts[i]) + 1] for i in order],
    )
    after_batch = pool.recurrent.clone()
    for j, i in enumerate(order):
        pool.conv.copy_(saved[0])
        pool.recurrent.copy_(saved[1])
        alone = model.decode(
            torch.tensor([nxt[i]]),
            [len(prompts[i])],
            pool,
            torch.tensor([slots[i]]),
            kv,
            [kv_idx[i][: len(prompts[i]) + 1]],
        )
        torch.testing.assert_close(batched[j], alone[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(after_batch[:, slots[i]], pool.recurrent[:, slots[i]], atol=1e-12, rtol=0)


def test_model_is_seeded() -> None:
    a, b = HybridModel(CFG), HybridModel(CFG)
    assert torch.equal(a.embed, b.embed)
    assert not torch.equal(a.embed, HybridModel(HybridConfig(seed=1)).embed)
