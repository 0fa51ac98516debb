"""store_kv against an independent E4M3 encoder (tests/oracle.py), bit for bit."""

import numpy as np
import pytest
import torch
from oracle import decode_e4m3, encode_e4m3
from problems import special_values

import torch_sm70attn as sa


@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("layout", ["separate", "interleaved"])
def test_store_kv_bit_exact(per_head, layout):
    gen = torch.Generator().manual_seed(1)
    H, D, ps = 2, 64, 16
    vals = special_values(2000, gen)
    T = vals.numel() // (H * D) + 1
    x = torch.cat([vals, torch.randn(T * H * D - vals.numel(), generator=gen).half()])
    k = x[torch.randperm(x.numel(), generator=gen)].view(T, H, D)
    v = x[torch.randperm(x.numel(), generator=gen)].view(T, H, D)
    P = T // ps + 3
    if layout == "separate":
        kc = torch.zeros(P, ps, H, D, dtype=torch.float8_e4m3fn)
        vc = torch.zeros(P, ps, H, D, dtype=torch.float8_e4m3fn)
    else:
        kv = torch.zeros(P, ps, H, 2, D, dtype=torch.float8_e4m3fn)
        kc, vc = kv[:, :, :, 0], kv[:, :, :, 1]
    slots = torch.randperm(P * ps, generator=gen)[:T]
    slots[::7] = -1
    if per_head:
        ks, vs = torch.tensor([1.0, 0.37]), torch.tensor([0.5, 3.0])
    else:
        ks, vs = torch.tensor(1.0), torch.tensor([0.0625])
    before_k = kc.view(torch.uint8).clone()
    sa.store_kv(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    for src, cache, sc, before in ((k, kc, ks, before_k), (v, vc, vs, None)):
        s32 = sc.reshape(-1).expand(H).numpy().astype(np.float32)
        want = encode_e4m3(src.float().numpy() / s32[None, :, None])  # float32 division
        got = cache.view(torch.uint8).numpy()
        keep = slots >= 0
        page, off = slots[keep] // ps, slots[keep] % ps
        np.testing.assert_array_equal(got[page.numpy(), off.numpy()], want[keep.numpy()])
        if before is not None:  # slot -1 and untouched slots keep their bytes
            mask = torch.ones(P, ps, dtype=torch.bool)
            mask[page, off] = False
            assert torch.equal(cache.view(torch.uint8)[mask], before[mask])


def test_encoder_oracle_agrees_with_definition():
    # Round trip of every finite code through the oracle's own decoder.
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    vals = decode_e4m3(torch.from_numpy(codes).view(torch.float8_e4m3fn)).numpy().astype(np.float32)
    back = encode_e4m3(vals)
    back[codes == 0x80] = 0x80  # -0.0 keeps its sign
    np.testing.assert_array_equal(back, codes)


def test_store_then_attend_round_trip():
    from oracle import attention_fp64, rel_err

    gen = torch.Generator().manual_seed(2)
    H, D, ps, L = 1, 64, 16, 37
    kc = torch.zeros(4, ps, H, D, dtype=torch.float8_e4m3fn)
    vc = torch.zeros_like(kc)
    bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    t = torch.arange(L)
    slots = bt[0, t // ps].long() * ps + t % ps
    k, v = torch.randn(L, H, D, generator=gen).half(), torch.randn(L, H, D, generator=gen).half()
    sa.store_kv(k, v, kc, vc, slots, k_scale=0.01, v_scale=0.02)
    q = torch.randn(1, 2, 1, D, generator=gen).half()
    sl = torch.tensor([L], dtype=torch.int32)
    out = sa.paged_attention(q, kc, vc, bt, sl, k_scale=0.01, v_scale=0.02)
    ref = attention_fp64(q, kc, vc, bt, sl, D**-0.5, torch.tensor(0.01), torch.tensor(0.02))
    assert rel_err(out, ref) < 1e-3
    # And the dequantized cache is close to what was stored (E4M3 has 3 mantissa bits).
    back = decode_e4m3(kc[bt[0, t // ps].long(), t % ps]) * 0.01
    assert ((back - k.double()).abs() <= k.double().abs() * 2**-4 + 0.01 * 2**-9).all()
