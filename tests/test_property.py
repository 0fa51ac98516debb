"""Property tests: any valid geometry, the reference agrees with the FP64 oracle; and the fake
kernel agrees with the reference on metadata and on metadata errors."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import attention_fp64, rel_err
from problems import make_problem, op_args
from torch._subclasses.fake_tensor import FakeTensorMode

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


CORRUPT = {  # metadata errors both kernels must raise alike
    "query dtype": lambda a: {0: a[0].float()},
    "table rows": lambda a: {3: torch.cat([a[3], a[3][:1]])},
    "seq_lens rows": lambda a: {4: a[4][:-1]},
    "k_scale shape": lambda a: {6: torch.ones(a[1].shape[2] + 1)},
    "head dim": lambda a: {0: a[0][..., :32]},
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometry(), st.sampled_from([None, *CORRUPT]))
def test_fake_kernel_agrees_with_the_reference(g, corrupt):
    """The fake kernel (what torch.compile and torch.export trace with) gives the reference's
    output metadata on any valid geometry, and the same error on bad metadata."""
    p = make_problem(**g)
    args = list(op_args(p))
    if corrupt:
        for i, v in CORRUPT[corrupt](args).items():
            args[i] = v
    op = torch.ops.sm70attn.paged_attention.default

    def outcome(call_args):
        try:
            out = op(*call_args)
        except (TypeError, ValueError) as e:
            return type(e), str(e)
        return out.shape, out.dtype, out.stride()

    real = outcome(args)
    with FakeTensorMode() as mode:
        fake = outcome([mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    assert fake == real, (corrupt, g)
    assert (corrupt is None) == (not isinstance(real[0], type)), real
