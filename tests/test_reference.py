"""The CPU reference kernel of sm70attn::paged_attention against the FP64 oracle."""

import pytest
import torch
from oracle import attention_fp64, rel_err
from problems import make_problem, op_args, rising_scores

import torch_sm70attn  # noqa: F401

# FP32 accumulation with an fp16 output: the error is the fp16 rounding of the result,
# about 2^-11 / sqrt(3) relative in the norm; 1e-3 leaves room and still catches any bug
# in masking, paging or scaling (those give errors of order 1).
TOL = 1e-3


def run_and_check(record, suite, case, **kw):
    p = make_problem(**kw)
    out = torch.ops.sm70attn.paged_attention(*op_args(p))
    ref = attention_fp64(*op_args(p))
    assert out.dtype == torch.float16 and out.shape == ref.shape and out.is_contiguous()
    err = rel_err(out, ref)
    record(suite, err, case)
    assert err < TOL, f"{case}: relative error {err:.2e}"
    # Rows that see nothing are exactly zero.
    lens = p["seq_lens"].tolist()
    Q = kw.get("Q", 1)
    for b, L in enumerate(lens):
        for r in range(Q):
            if L - Q + r < 0:
                assert (out[b, :, r] == 0).all()
    return out


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [1, 2, 4, 6, 8])
def test_head_dims_and_groups(record, D, G):
    run_and_check(
        record, "reference", f"D={D} G={G}", D=D, G=G, Q=2, H_kv=2, page_size=16, seed=D + G
    )


@pytest.mark.parametrize("Q", [1, 2, 7, 8, 16])
@pytest.mark.parametrize("page_size", [1, 16, 1000, 1024, 1536, 1648, 3296])
def test_rows_and_pages(record, Q, page_size):
    # Lengths that end mid-page, on a page boundary, and span several pages.
    lens = [min(2 * page_size + 3, 7000), max(Q, page_size), Q + 5]
    run_and_check(
        record,
        "reference",
        f"Q={Q} page={page_size}",
        B=3,
        H_kv=1,
        G=6,
        Q=Q,
        D=64,
        page_size=page_size,
        lens=lens,
        seed=Q * page_size,
    )


@pytest.mark.parametrize("layout", ["interleaved", "kv_first"])
def test_kv_views_of_one_buffer(record, layout):
    run_and_check(record, "reference", layout, layout=layout, G=4, Q=8, D=128, page_size=16)


def test_transposed_query(record):
    p = make_problem(transposed_query=True, G=6, Q=8, D=128, seed=3)
    assert not p["query"].is_contiguous()
    run_and_check(
        record, "reference", "transposed query", transposed_query=True, G=6, Q=8, D=128, seed=3
    )


@pytest.mark.parametrize("per_head", [True, False])
def test_scales(record, per_head):
    run_and_check(
        record, "reference", f"per_head={per_head}", per_head_scale=per_head, H_kv=4, G=2, D=64
    )


def test_zero_length_and_short_rows(record):
    # Request 0 is padding (seq_len 0), request 1 has fewer tokens than query rows.
    out = run_and_check(
        record, "reference", "zero/short", B=3, Q=8, G=2, D=64, page_size=16, lens=[0, 3, 40]
    )
    assert (out[0] == 0).all()
    assert torch.isfinite(out).all()


def test_long_context_bounded_memory(record):
    # Many chunks of the online softmax; checked on a subsample of rows by the oracle.
    run_and_check(
        record, "reference", "ctx 20000", B=1, H_kv=1, G=2, Q=2, D=64, page_size=1648, lens=[20000]
    )


def test_public_wrapper_defaults_and_float_scales():
    p = make_problem(G=2, Q=2, D=64, per_head_scale=False)
    out = torch_sm70attn.paged_attention(
        p["query"],
        p["key_cache"],
        p["value_cache"],
        p["block_table"],
        p["seq_lens"],
        k_scale=float(p["k_scale"]),
        v_scale=float(p["v_scale"]),
    )
    ref = attention_fp64(*op_args(p))
    assert rel_err(out, ref) < TOL


def test_rising_and_falling_scores(record):
    # Scores that move by fractions of a log2 unit and by tens along the context (the online
    # softmax's rescale), through several of the reference kernel's chunks.
    p = rising_scores(make_problem(B=2, H_kv=1, G=6, Q=8, D=256, page_size=16, lens=[3000, 700]))
    out = torch.ops.sm70attn.paged_attention(*op_args(p))
    err = rel_err(out, attention_fp64(*op_args(p)))
    record("reference", err, "rising scores")
    assert err < TOL, f"relative error {err:.2e}"
