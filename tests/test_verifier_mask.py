"""verifier_mask semantics, and agreement between SDPA-with-the-mask and the fused op."""

import torch
from oracle import attention_fp64, rel_err
from problems import make_problem, op_args

import torch_sm70attn as sa


def test_mask_matches_definition():
    sl = torch.tensor([0, 1, 5, 9], dtype=torch.int32)
    Q, kv_len = 3, 10
    m = sa.verifier_mask(sl, Q, kv_len)
    assert m.shape == (4, 1, Q, kv_len) and m.dtype == torch.bool
    for b, L in enumerate(sl.tolist()):
        for r in range(Q):
            for t in range(kv_len):
                assert bool(m[b, 0, r, t]) == (t <= L - Q + r)


def test_sdpa_with_mask_equals_paged_attention():
    p = make_problem(B=2, H_kv=2, G=3, Q=4, D=64, page_size=16, lens=[20, 33])
    out = torch.ops.sm70attn.paged_attention(*op_args(p))
    bt = p["block_table"].clamp_min(0).clamp_max(p["key_cache"].shape[0] - 1).long()
    k = p["key_cache"][bt].flatten(1, 2).double() * p["k_scale"].view(1, 1, -1, 1)
    v = p["value_cache"][bt].flatten(1, 2).double() * p["v_scale"].view(1, 1, -1, 1)
    k = k.transpose(1, 2).repeat_interleave(3, dim=1)
    v = v.transpose(1, 2).repeat_interleave(3, dim=1)
    mask = sa.verifier_mask(p["seq_lens"], 4, k.shape[2])
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        p["query"].double(), k, v, attn_mask=mask
    )
    assert rel_err(out, sdpa) < 1e-3
    assert rel_err(out, attention_fp64(*op_args(p))) < 1e-3
