"""paged_attention_varlen on the CPU: the reference against the FP64 oracle for every kind of
request in one call (decodes, verifies, chunks over a past, whole prompts, empty requests,
padding tokens), the same bits as paged_attention for a request of one kind, the fake kernel
and opcheck, and the errors bad metadata gets."""

import pytest
import torch
from oracle import rel_err, varlen_attention_fp64
from problems import make_problem, make_varlen_problem, op_args, varlen_args

import torch_sm70attn as sa

UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)
# q_lens, pasts: a decode, a verify, a whole prompt, an empty request, a chunk over a past,
# a prompt of more rows than the reference's row block
MIXED = dict(q_lens=(1, 5, 40, 0, 19, 300), pasts=(30, 7, 0, 12, 100, 20))


def call(p, **kw):
    keys = ("query", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens")
    return sa.paged_attention_varlen(
        *(p[k] for k in keys), scale=p["scale"], k_scale=p["k_scale"], v_scale=p["v_scale"], **kw
    )


@pytest.mark.parametrize("G, D", [(1, 64), (3, 64), (6, 256), (4, 128)])
def test_reference_against_the_fp64_oracle(G, D, record):
    p = make_varlen_problem(**MIXED, G=G, D=D, H_kv=2 if D < 256 else 1)
    out = call(p)
    want = varlen_attention_fp64(*varlen_args(p))
    err = rel_err(out, want)
    record("varlen reference", err, f"G{G} D{D}")
    assert err < 2e-3, err
    assert out.dtype == torch.float16 and out.shape == p["query"].shape
    T = int(p["query_start_loc"][-1])
    assert out[T:].eq(0).all()  # padding tokens


def test_one_kind_of_request_is_paged_attentions_bits():
    """Requests of Q rows each, packed, give paged_attention's bits on [B, H_q, Q, D]."""
    Q = 6
    p = make_problem(B=3, Q=Q, G=2, D=64, lens=[6, 40, 17])
    want = sa.paged_attention(*op_args(p)[:5], scale=p["scale"], k_scale=p["k_scale"],
                              v_scale=p["v_scale"])  # fmt: skip
    v = dict(p, query=p["query"].transpose(1, 2).flatten(0, 1).contiguous(),
             query_start_loc=torch.arange(0, 4 * Q, Q, dtype=torch.int32))  # fmt: skip
    got = call(v).unflatten(0, (3, Q)).transpose(1, 2)
    assert torch.equal(got, want)


def test_a_left_padded_prompt_gets_the_bits_of_its_rows_alone():
    """A prompt of 300 rows behind 100 rows of left padding (a transformers batch's shorter
    request: q = 400 > seq_len = 300, the first 100 rows see nothing) gives its 300 rows the
    bits of the same prompt unpadded. The reference's row blocks (ROW_BLOCK rows) end at the
    request's last row, so padding moves no real row to another block; blocks counted from the
    first (padding) row put each row's keys in sums of other lengths, off by a rounding."""
    from torch_sm70attn.reference import ROW_BLOCK

    p = make_varlen_problem(q_lens=(300,), pasts=(0,), G=6, D=128, H_kv=1, pad_tokens=0)
    assert 300 > ROW_BLOCK  # more rows than a block: the case that differed
    g = torch.Generator().manual_seed(5)
    pad = torch.randn(100, *p["query"].shape[1:], generator=g).half()
    padded = dict(p, query=torch.cat([pad, p["query"]]),
                  query_start_loc=torch.tensor([0, 400], dtype=torch.int32))  # fmt: skip
    alone, got = call(p), call(padded)
    assert got[:100].eq(0).all()
    assert torch.equal(got[100:], alone)


def test_rows_that_see_nothing_are_zero():
    """q > seq_len: the first q - seq_len rows see nothing (0, never NaN); seq_len 0 too."""
    p = make_varlen_problem(q_lens=(8, 4), pasts=(0, 0))
    p["seq_lens"] = torch.tensor([5, 0], dtype=torch.int32)
    out = call(p)
    assert out[:3].eq(0).all() and out[8:].eq(0).all() and out[3:8].abs().sum() > 0
    assert rel_err(out, varlen_attention_fp64(*varlen_args(p))) < 2e-3


def test_no_tokens_and_no_requests():
    p = make_varlen_problem(q_lens=(0, 0), pasts=(3, 0), pad_tokens=0)
    assert call(p).shape == (0, 6, 64)
    p = make_varlen_problem(q_lens=(), pasts=(), pad_tokens=4)
    p["block_table"] = p["block_table"][:0]
    out = call(p)
    assert out.shape == (4, 6, 64) and out.eq(0).all()


@pytest.mark.parametrize("util", UTILS)
def test_opcheck(fp8_aware_allclose, util):
    p = make_varlen_problem(q_lens=(1, 3, 9), pasts=(20, 0, 5))
    torch.library.opcheck(
        torch.ops.sm70attn.paged_attention_varlen.default, varlen_args(p), test_utils=util
    )


def test_fake_kernel_under_torch_compile():
    p = make_varlen_problem(q_lens=(1, 3, 9), pasts=(20, 0, 5))
    fn = torch.compile(lambda *a: sa.paged_attention_varlen(*a, scale=0.1) * 2, fullgraph=True)
    args = varlen_args(p)[:6]
    assert torch.equal(fn(*args), sa.paged_attention_varlen(*args, scale=0.1) * 2)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(query_start_loc=[1, 2, 6, 15]), ValueError, r"query_start_loc\[0\] must be 0"),
        (dict(query_start_loc=[0, 5, 3, 15]), ValueError, "non-decreasing.*\\[1\\] = 5"),
        (dict(query_start_loc=[0, 1, 4, 99]), ValueError, "query_start_loc\\[B\\] = 99 exceeds"),
        (dict(query_start_loc=[0, 1, 4]), ValueError, "query_start_loc has 3 entries, seq_lens has 3"),
        (dict(seq_lens=[21, 3, 999]), ValueError, "seq_lens must lie in"),
        (dict(block_table=-1), ValueError, "page ids"),
        (dict(query="4d"), ValueError, "query must be 3-D \\[T, H_q, D\\]"),
        (dict(query_start_loc="int64"), TypeError, "query_start_loc must be torch.int32"),
        (dict(query="list"), TypeError, "query must be a torch.Tensor \\(float16 \\[T, H_q, D\\]\\)"),
        (dict(query_start_loc="list"), TypeError, "query_start_loc must be a torch.Tensor \\(int32 \\[B \\+ 1\\]\\)"),
    ],
)  # fmt: skip
def test_bad_metadata_says_what_is_wrong(change, error, words):
    p = make_varlen_problem(q_lens=(1, 3, 11), pasts=(20, 0, 5))
    for k, v in change.items():
        if v == "4d":
            p[k] = p[k][None]
        elif v == "int64":
            p[k] = p[k].long()
        elif v == "list":
            p[k] = p[k].tolist()
        elif k == "block_table":
            p[k] = torch.full_like(p[k], v)
        else:
            p[k] = torch.tensor(v, dtype=torch.int32)
    with pytest.raises(error, match=words):
        call(p)
