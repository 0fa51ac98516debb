"""Adversarial inputs (issue 13): for each, the outcome README.md's "Errors and odd inputs"
promises, on the CPU and (where one is present) on a CUDA GPU. Nothing here is a shape the
kernels are tuned for; every case is small. Outputs of the CUDA op are poisoned first: the
binding allocates them, so a NaN in a result comes from the inputs or from a bug, and the
cases that expect none say so.

Outcomes by device: the CPU checks values (seq_lens, page ids, slots) and raises ValueError
naming the argument; the GPU does not read them on the host (it would synchronise), so there
lengths are clamped to [0, capacity], tokens on pages outside [0, P) count as masked, and slots
outside the cache are skipped: the oracle's clamp mode gives the expected numbers."""

import math

import pytest
import torch
from oracle import attention_fp64, rel_err
from problems import make_problem, op_args

import torch_sm70attn as sa
from torch_sm70attn import routes
from torch_sm70attn.manifest import MANIFEST

FP8 = torch.float8_e4m3fn
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def run(p):
    return torch.ops.sm70attn.paged_attention(*op_args(p))


def close(out, p, *, clamp=False, tol=2e-3):
    ref = attention_fp64(*op_args(p), clamp=clamp)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < tol, rel_err(out, ref)


def problem(dev, **kw):
    kw = dict(dict(B=2, H_kv=2, G=2, Q=2, D=64, page_size=16, lens=[40, 21]), **kw)
    return make_problem(device=dev, **kw)


def cpu(dev):
    return dev == "cpu"


# --- seq_lens ------------------------------------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES)
def test_zero_length_rows_are_exactly_zero(dev):
    p = problem(dev, lens=[0, 21])
    out = run(p)
    assert (out[0] == 0).all() and not torch.isnan(out).any()
    close(out, p)


@pytest.mark.parametrize("dev", DEVICES)
def test_length_equal_to_capacity(dev):
    p = problem(dev, lens=[40, 21], extra_pages=0)
    cap = p["block_table"].shape[1] * p["key_cache"].shape[1]
    assert (p["block_table"][0] >= 0).all()  # no padding column: request 0 owns every one
    p["seq_lens"][0] = cap
    close(run(p), p)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bad", [-1, -(2**31), "cap+1", 2**31 - 1])
def test_length_outside_0_to_capacity(dev, bad):
    p = problem(dev)
    cap = p["block_table"].shape[1] * p["key_cache"].shape[1]
    p["seq_lens"][1] = cap + 1 if bad == "cap+1" else bad
    if cpu(dev):
        with pytest.raises(ValueError, match="seq_lens must lie in"):
            run(p)
        return
    close(run(p), p, clamp=True)  # clamped to [0, capacity]; junk pages past the end masked


# --- block tables --------------------------------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("bad", [-1, -(2**31), "P", 2**31 - 1])
def test_page_ids_outside_the_cache(dev, bad):
    p = problem(dev)
    P = p["key_cache"].shape[0]
    p["block_table"][0, 1] = P if bad == "P" else bad  # a page request 0 reaches
    if cpu(dev):
        with pytest.raises(ValueError, match="block_table page ids must lie in"):
            run(p)
        return
    close(run(p), p, clamp=True)  # its tokens count as masked


@pytest.mark.parametrize("dev", DEVICES)
def test_requests_sharing_pages(dev):
    p = problem(dev, lens=[40, 40])
    p["block_table"][1] = p["block_table"][0]  # prefix sharing: the same pages twice
    p["query"][1] = p["query"][0]
    out = run(p)
    close(out, p)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("dev", DEVICES)
def test_empty_batch(dev):
    p = problem(dev, B=1, lens=[5])
    for k in ("query", "block_table", "seq_lens"):
        p[k] = p[k][:0]
    out = run(p)
    assert out.shape == (0, 4, 2, 64) and out.dtype == torch.float16


@pytest.mark.parametrize("dev", DEVICES)
def test_page_size_one(dev):
    p = problem(dev, page_size=1, lens=[33, 2])
    close(run(p), p)


@pytest.mark.parametrize("dev", DEVICES)
def test_capacity_above_the_manifest_takes_the_reference_route(dev, monkeypatch):
    """A table wider than the kernels are qualified for: computed right (the reference route
    on a GPU, with one warning naming the reason)."""
    page = 4096
    width = MANIFEST.max_context // page + 1
    p = problem(dev, B=1, page_size=page, lens=[100], extra_pages=width - 1)
    assert p["block_table"].shape[1] * page > MANIFEST.max_context
    args = op_args(p)
    kw = dict(scale=args[5], k_scale=args[6], v_scale=args[7])
    if cpu(dev):
        out = sa.paged_attention(*args[:5], **kw)
    else:
        monkeypatch.setattr(routes, "warned", set())  # one warning per reason and process
        with pytest.warns(UserWarning, match="reference route"):
            out = sa.paged_attention(*args[:5], **kw)
    close(out, p)


@pytest.mark.parametrize("dev", DEVICES)
def test_same_request_other_slot_and_pages_is_bitwise_the_same(dev):
    """A request's result depends on its values only: moved to another batch slot, its pages
    copied to other page ids, beside other requests, it gives the same bits (the split plan
    depends on shapes, never on B, positions or page ids)."""
    p = problem(dev, B=3, lens=[700, 40, 333], page_size=16, D=128, Q=4)
    out = run(p)
    P, width = p["key_cache"].shape[0], p["block_table"].shape[1]
    moved = dict(p)
    order = [2, 0, 1]  # request 0 goes to slot 1
    for k in ("query", "seq_lens", "block_table"):
        moved[k] = p[k][order].clone()
    # every page of the cache to a new id: page i -> P - 1 - i
    flip = torch.arange(P - 1, -1, -1, device=p["key_cache"].device)
    moved["key_cache"], moved["value_cache"] = p["key_cache"][flip], p["value_cache"][flip]
    bt = moved["block_table"]
    moved["block_table"] = torch.where((bt >= 0) & (bt < P), P - 1 - bt, bt)
    assert moved["block_table"].shape[1] == width
    got = run(moved)
    for new, old in enumerate(order):
        assert torch.equal(got[new], out[old]), (new, old)


# --- cache values --------------------------------------------------------------------------
def _codes(p, which, codes, request=0, token=0):
    """Write e4m3 codes (bytes) into the first len(codes) elements of one token of one KV
    head 0 of `which` cache."""
    page = int(p["block_table"][request, token // p[which].shape[1]])
    c = p[which].view(torch.uint8)
    c[page, token % p[which].shape[1], 0, : len(codes)] = torch.tensor(codes, dtype=torch.uint8)


@pytest.mark.parametrize("dev", DEVICES)
def test_extreme_finite_codes_are_read_exactly(dev):
    """+-448 (0x7E, 0xFE), the subnormals (0x01-0x07 and their negatives) and -0: the oracle
    decodes every byte from the format's definition."""
    p = problem(dev)
    codes = [0x7E, 0xFE, 0x80, *range(1, 8), *range(0x81, 0x88)]
    for t in range(0, 40, 3):
        _codes(p, "key_cache", codes, token=t)
        _codes(p, "value_cache", codes[::-1], token=t)
    p["k_scale"].fill_(1 / 448)  # keep the scores in range: the row max is +-448 * q
    close(run(p), p)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_codes_in_the_cache(dev, code):
    """CPU: NaN where the input is NaN (every row that sees the token; the other request is
    untouched). GPU: the kernels' bit-level conversion has no NaN case and reads the codes as
    +-480 (csrc/sm70attn/e4m3.h): a one-token request returns 480 x v_scale there."""
    p = problem(dev, lens=[40, 21])
    _codes(p, "value_cache", [code], request=0, token=5)
    out = run(p)
    ref = attention_fp64(*op_args(p))
    assert rel_err(out[1], ref[1]) < 2e-3  # request 1 does not see the page
    if cpu(dev):
        seen = out[0, :2, :, 0]  # KV head 0, every row sees token 5
        assert torch.isnan(seen).all()
        return
    assert torch.isfinite(out).all()
    one = problem(dev, B=1, lens=[1], Q=1)
    _codes(one, "value_cache", [code])
    v = float(one["v_scale"].reshape(-1)[0])
    got = run(one)[0, 0, 0, 0].item()
    assert got == pytest.approx(math.copysign(480.0, 0x80 - code - 0.5) * v, rel=2e-3)


# --- query and scales ----------------------------------------------------------------------
SPLITS = {"one split": [40, 21], "several splits": [600, 21]}  # GPU: capacity 64 / 624 (D 64)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("lens", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_query_rows(dev, bad, lens):
    """NaN or +-Inf in a query row: that row is NaN (Inf: its scores are +-Inf or NaN, and
    exp(Inf - Inf) is NaN); every other row is right. On a GPU with one split and through the
    split combine (a split's NaN sum must not read as an empty split there)."""
    p = problem(dev, lens=lens)
    p["query"][0, 1, 0, 3] = bad  # request 0, query head 1, row 0
    out = run(p)
    assert torch.isnan(out[0, 1, 0]).all()
    ref = attention_fp64(*op_args(p))
    keep = torch.ones(out.shape[:3], dtype=torch.bool)
    keep[0, 1, 0] = False
    assert rel_err(out[keep], ref[keep]) < 2e-3


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize(
    "which, value",
    [("k_scale", 0.0), ("k_scale", -0.3), ("k_scale", 1e4), ("v_scale", 0.0), ("v_scale", -2.0)],
)
def test_scales_are_used_as_given(dev, which, value):
    """Scales are not checked (they may live on the GPU): zero, negative and large ones are
    computed as written. k_scale 0 is a uniform softmax, v_scale 0 a zero output, k_scale 1e4
    close to a hard max."""
    p = problem(dev)
    p[which].fill_(value)
    out = run(p)
    if which == "v_scale" and value == 0:
        assert (out == 0).all()
    close(out, p, tol=5e-3)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("lens", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_nan_or_overflowing_scale_gives_nan_rows(dev, which, lens):
    """A NaN scale, or a k_scale so large that the FP32 scores overflow, makes NaN of every
    row that sees a token (no silent finite answer)."""
    for value in (math.nan, 3e38) if which == "k_scale" else (math.nan,):
        p = problem(dev, lens=lens)
        p[which].fill_(value)
        out = run(p)
        assert torch.isnan(out).all(), (which, value)


@pytest.mark.parametrize("dev", DEVICES)
def test_eight_byte_aligned_kv_views(dev):
    """K and V as views of one interleaved buffer with an 8-byte pad per token: strides 8-byte
    but not 16-byte aligned (the GPU's 8-byte load path)."""
    p = problem(dev, layout="padded")
    kc, vc = p["key_cache"], p["value_cache"]
    assert kc.stride(2) % 16 == 8 and vc.storage_offset() % 16 == 8
    close(run(p), p)


# --- store_kv ------------------------------------------------------------------------------
@pytest.mark.parametrize("dev", DEVICES)
def test_store_kv_duplicate_and_skipped_slots(dev):
    """Duplicate slots store one of the tokens in each 8-element chunk (which one is
    unspecified: the GPU writes the chunks of both concurrently, so a row may mix them); -1
    leaves the slot untouched; a slot past the cache raises on the CPU and is skipped on the
    GPU."""
    gen = torch.Generator().manual_seed(5)
    key = torch.randn(4, 1, 64, generator=gen).half().to(dev)
    kc = torch.zeros(2, 8, 1, 64, dtype=FP8, device=dev)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 3, -1, 9], device=dev)
    sa.store_kv(key, key, kc, vc, slots, k_scale=0.5, v_scale=0.5)
    flat = kc.view(-1, 64).float().cpu()
    q = (key.float().cpu() / 0.5).to(FP8).float().view(4, 64)
    for c in range(0, 64, 8):  # chunk by chunk
        got = flat[3, c : c + 8]
        assert torch.equal(got, q[0, c : c + 8]) or torch.equal(got, q[1, c : c + 8]), c
    assert torch.equal(flat[9], q[3])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[3, 9]] = False
    assert (flat[untouched] == 0).all()
    far = torch.tensor([0, 1, 2, 16], device=dev)  # 16 = P * page_size: past the end
    if cpu(dev):
        with pytest.raises(ValueError, match="slot_mapping entries must be -1 or lie in"):
            sa.store_kv(key, key, kc, vc, far, k_scale=0.5, v_scale=0.5)
    else:
        sa.store_kv(key, key, kc, vc, far, k_scale=0.5, v_scale=0.5)
        torch.cuda.synchronize()
        assert torch.equal(kc.view(-1, 64).float().cpu()[:3], q[:3])
