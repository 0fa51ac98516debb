"""Property test: any valid geometry, the reference agrees with the FP64 oracle."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import attention_fp64, rel_err
from problems import make_problem, op_args

import torch_sm70attn  # noqa: F401


@st.composite
def geometry(draw):
    B = draw(st.integers(1, 3))
    Q = draw(st.integers(1, 16))
    page_size = draw(st.sampled_from([1, 3, 16, 17, 64, 1000]))
    lens = draw(st.lists(st.integers(0, 3 * page_size + Q + 40), min_size=B, max_size=B))
    return dict(
        B=B,
        H_kv=draw(st.integers(1, 3)),
        G=draw(st.integers(1, 8)),
        Q=Q,
        D=draw(st.sampled_from([64, 128, 256])),
        page_size=page_size,
        lens=lens,
        layout=draw(st.sampled_from(["separate", "interleaved", "kv_first"])),
        per_head_scale=draw(st.booleans()),
        transposed_query=draw(st.booleans()),
        extra_pages=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometry())
def test_reference_matches_oracle(g):
    p = make_problem(**g)
    out = torch.ops.sm70attn.paged_attention(*op_args(p))
    ref = attention_fp64(*op_args(p))
    assert rel_err(out, ref) < 1e-3, g
    for b, L in enumerate(g["lens"]):
        for r in range(g["Q"]):
            if L - g["Q"] + r < 0:
                assert (out[b, :, r] == 0).all()
