"""paged_attention_varlen's CUDA kernels against the FP64 oracle (every head dim and group size,
one call holding decodes, verifies, chunks over a past, whole prompts, empty requests and
padding tokens; short chunks over long pasts that split), and its contracts: a request's bits
alone and in any batch, CUDA-graph replay with new metadata, metadata of any values (no read or
write out of bounds: the clamped semantics of csrc/sm70attn/varlen.h), T = 0 and B = 0. The
prefill kernel (csrc/sm70attn/prefill.cuh: requests of more than 16 tokens) on each MMA atom
(set_prefill_override; m16n8k16 on SM80+), and with it off (the tile loop takes every request).

Error rule (test_cuda.py's): at most twice the FP32 reference's error (reference.py, the same
dequantized values) plus 1e-5. The output's memory is poisoned (NaN) before each call: the op
allocates it from the caching allocator, which hands back the poisoned block."""

import pytest
import torch
from oracle import rel_err, varlen_attention_fp64
from problems import make_varlen_problem, varlen_args

import torch_sm70attn as sa
from torch_sm70attn import reference, routes

pytestmark = pytest.mark.cuda
DEV = "cuda"
MIXED = dict(q_lens=(1, 5, 40, 0, 19, 300, 16, 17), pasts=(30, 7, 0, 12, 100, 20, 900, 3000))


# The prefill kernel's kinds a test runs: the default ("auto"), each atom, and none ("off").
KINDS = ["auto", "m8n8k4", "m16n8k16", "off"]


@pytest.fixture
def prefill():
    """set_prefill_override for one test, back to auto after it whatever happens; m16n8k16 is
    skipped below SM80."""
    mod = sa.ops.load_cuda_kernels()

    def use(kind):
        if kind == "m16n8k16" and torch.cuda.get_device_capability() < (8, 0):
            pytest.skip("m16n8k16 needs SM80 or newer")
        mod.set_prefill_override(kind)

    yield use
    mod.set_prefill_override("auto")


def poisoned_call(p):
    T, H_q, D = p["query"].shape
    junk = torch.full((max(T, 1) * H_q * D,), float("nan"), dtype=torch.float16, device=DEV)
    del junk  # the op's output takes this block
    return torch.ops.sm70attn.paged_attention_varlen(*varlen_args(p))


def check(record, case, p):
    out = poisoned_call(p)
    torch.cuda.synchronize()
    want = varlen_attention_fp64(*(a.cpu() if torch.is_tensor(a) else a for a in varlen_args(p)))
    fp32 = reference.paged_attention_varlen(*varlen_args(p))
    err, bound = rel_err(out, want), 2 * rel_err(fp32, want) + 1e-5
    record("cuda varlen", err, case)
    assert err <= bound, f"{case}: error {err:.3e} > bound {bound:.3e}"
    T = int(p["query_start_loc"][-1])
    assert out[T:].eq(0).all(), f"{case}: padding rows not zero"
    return out


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [1, 4, 6, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_mixed_requests_against_the_oracle(record, prefill, D, G, kind):
    prefill(kind)
    p = make_varlen_problem(**MIXED, G=G, D=D, H_kv=2, page_size=16, device=DEV, seed=D + G)
    check(record, f"mixed D{D} G{G} {kind}", p)


@pytest.mark.parametrize("kind", ["m8n8k4", "m16n8k16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("vec, page_size", [(16, 37), (8, 16), (16, 1648)])
def test_every_prefill_kernel_against_the_oracle(record, prefill, kind, D, vec, page_size):
    """Each (D, VEC) of each atom: whole prompts, chunks over pasts of several tiles (the
    unmasked main loop, then the diagonal), page sizes that split the 64-token tiles (37),
    caches only 8-byte aligned (VEC 8), a decode and a verify beside them."""
    prefill(kind)
    p = make_varlen_problem(
        q_lens=(17, 1, 130, 8, 64, 333), pasts=(0, 500, 700, 40, 1000, 211), G=6 if D == 256 else 4,
        D=D, H_kv=2, page_size=page_size, layout="padded" if vec == 8 else "separate", device=DEV,
        seed=D + vec,
    )  # fmt: skip
    check(record, f"prefill {kind} D{D} VEC{vec} page {page_size}", p)


@pytest.mark.parametrize("kind", ["m8n8k4", "m16n8k16"])
@pytest.mark.parametrize("D, G, H_kv, page_size", [(256, 6, 1, 1648), (128, 4, 2, 16)])
def test_prefill_chunks_over_pasts_of_100k(record, prefill, kind, D, G, H_kv, page_size):
    prefill(kind)
    p = make_varlen_problem(q_lens=(40, 300), pasts=(100_000, 120_000), G=G, D=D, H_kv=H_kv,
                            page_size=page_size, device=DEV, seed=3)  # fmt: skip
    check(record, f"prefill {kind} over 100K D{D} page {page_size}", p)


def test_steps_without_long_requests_are_the_tile_loops_bits(prefill):
    """Decodes and verifies (at most 16 tokens a request) stay on the tile loop: the same bits
    with the prefill kernel on or off."""
    p = make_varlen_problem(q_lens=(1, 16, 8, 0, 3), pasts=(3000, 20, 900, 5, 17), G=6, D=256,
                            H_kv=1, device=DEV)  # fmt: skip
    prefill("off")
    off = poisoned_call(p)
    prefill("auto")
    assert torch.equal(poisoned_call(p), off)


@pytest.mark.parametrize("D, G, H_kv", [(256, 6, 4), (128, 4, 8), (64, 8, 1)])
@pytest.mark.parametrize("page_size", [16, 1648])
def test_short_chunks_over_long_pasts_split(record, D, G, H_kv, page_size):
    """A decode, an 8-row verify and chunks of 40 and 200 tokens over 20-40K pasts: few CTAs,
    so each splits its context (plan.h); a 1000-token prompt beside them does not."""
    p = make_varlen_problem(
        q_lens=(1, 8, 40, 200, 1000), pasts=(30000, 21000, 40000, 25000, 0), G=G, D=D,
        H_kv=H_kv, page_size=page_size, device=DEV, seed=7,
    )  # fmt: skip
    check(record, f"split D{D} G{G} page {page_size}", p)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_alone_and_in_a_batch_is_the_same_bits(prefill, kind):
    prefill(kind)
    p = make_varlen_problem(**MIXED, G=6, D=256, H_kv=1, device=DEV)
    out = poisoned_call(p)
    qsl = p["query_start_loc"].tolist()
    for b in (0, 2, 5, 7):
        s, e = qsl[b], qsl[b + 1]
        one = dict(
            p, query=p["query"][s:e], block_table=p["block_table"][b : b + 1],
            seq_lens=p["seq_lens"][b : b + 1],
            query_start_loc=torch.tensor([0, e - s], dtype=torch.int32, device=DEV),
        )  # fmt: skip
        assert torch.equal(poisoned_call(one), out[s:e]), b


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay_equals_eager_with_new_metadata(prefill, kind):
    """One capture at T tokens; replays with other splits of them into requests (short ones and
    long ones: each kernel's share changes) and other lengths give the eager call's bits."""
    prefill(kind)
    p = make_varlen_problem(q_lens=(4, 60, 1), pasts=(3000, 10, 5000), G=4, D=128, device=DEV)
    static = {k: v.clone() if torch.is_tensor(v) else v for k, v in p.items()}
    torch.ops.sm70attn.paged_attention_varlen(*varlen_args(static))  # kernels loaded
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = torch.ops.sm70attn.paged_attention_varlen(*varlen_args(static))
    for qsl, lens in (([0, 4, 64, 65], [3004, 70, 5001]), ([0, 30, 31, 60], [31, 4000, 90]),
                      ([0, 1, 2, 3], [9000, 1, 65])):  # fmt: skip
        static["query_start_loc"].copy_(torch.tensor(qsl, dtype=torch.int32))
        static["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        want = torch.ops.sm70attn.paged_attention_varlen(*varlen_args(static))
        assert torch.equal(out, want), (qsl, lens)


def normalized(p):
    """The metadata as the kernel reads any values (varlen.h): query_start_loc's running max over
    entries 1..B clamped to [0, T], 0 first; lengths clamped to [0, capacity]."""
    T = p["query"].shape[0]
    cap = p["block_table"].shape[1] * p["key_cache"].shape[1]
    qsl = p["query_start_loc"].cpu().long()
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qsl[1:].clamp(0, T).cummax(0).values])
    lens = p["seq_lens"].clamp(0, cap)
    return dict(p, query_start_loc=qsl.int().to(DEV), seq_lens=lens)


@pytest.mark.parametrize(
    "qsl, lens",
    [
        ([5, 9, 4, 20, 12, 60], [3, 70, -5, 10**6, 30]),  # not 0 first, decreasing, past T
        ([0, 0, 0, 0, 0, 0], [50, 0, -1, 7, 2**30]),  # no tokens at all: every row padding
        ([0, 30, 30, 30, 30, 30], [1, 2, 3, 4, 5]),  # q > seq_len: the first rows see nothing
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_metadata_of_any_values_reads_and_writes_in_bounds(prefill, kind, qsl, lens):
    prefill(kind)
    p = make_varlen_problem(q_lens=(9, 0, 11, 0, 10), pasts=(1, 2, 3, 4, 5), G=4, D=64,
                            pad_tokens=0, device=DEV)  # fmt: skip
    p["query_start_loc"] = torch.tensor(qsl, dtype=torch.int32, device=DEV)
    p["seq_lens"] = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = poisoned_call(p)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    # (the FP64 oracle as the CUDA route reads invalid inputs: lengths clamped to the capacity,
    # positions on pages outside the pool masked)
    args = (a.cpu() if torch.is_tensor(a) else a for a in varlen_args(normalized(p)))
    want = varlen_attention_fp64(*args, clamp=True)
    assert rel_err(out, want) < 2e-3


def test_table_entries_past_the_length_and_bad_pages_are_not_read():
    p = make_varlen_problem(q_lens=(3, 20), pasts=(40, 5), G=6, D=128, device=DEV)
    good = poisoned_call(p)
    bt = p["block_table"].clone()
    for b, L in enumerate(p["seq_lens"].tolist()):
        bt[b, -(-L // 16) :] = torch.tensor([-(2**31), 2**31 - 1, 10**9])[
            torch.arange(bt.shape[1] - -(-L // 16)) % 3
        ]
    assert torch.equal(poisoned_call(dict(p, block_table=bt)), good)
    bt[1, 0] = -3  # a page in use that is out of range: its tokens count as masked
    out = poisoned_call(dict(p, block_table=bt))
    assert torch.isfinite(out).all()


def test_no_tokens_and_no_requests():
    p = make_varlen_problem(q_lens=(0, 0), pasts=(3, 0), pad_tokens=0, device=DEV)
    assert poisoned_call(p).shape == (0, 6, 64)
    p = make_varlen_problem(q_lens=(), pasts=(), pad_tokens=4, device=DEV)
    p["block_table"] = p["block_table"][:0]
    out = poisoned_call(p)
    assert out.shape == (4, 6, 64) and out.eq(0).all()


def test_paged_attention_varlen_through_the_public_function_and_admit(monkeypatch):
    monkeypatch.setattr(routes, "warned", set())  # one warning per reason and process
    p = make_varlen_problem(q_lens=(2, 30), pasts=(100, 0), G=4, D=128, device=DEV)
    keys = ("query", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens")
    out = sa.paged_attention_varlen(*(p[k] for k in keys), scale=p["scale"], k_scale=p["k_scale"],
                                    v_scale=p["v_scale"])  # fmt: skip
    assert torch.equal(out, poisoned_call(p))
    # a head dim the kernels lack: the reference route, with the rule's reason
    q = torch.randn(5, 4, 96, dtype=torch.float16, device=DEV)
    kc = torch.zeros(8, 16, 1, 96, dtype=torch.float8_e4m3fn, device=DEV)
    args = (q, kc, kc, torch.zeros(1, 2, dtype=torch.int32, device=DEV),
            torch.tensor([0, 5], dtype=torch.int32, device=DEV),
            torch.tensor([5], dtype=torch.int32, device=DEV))  # fmt: skip
    with pytest.warns(UserWarning, match="head dim 96"):
        sa.paged_attention_varlen(*args)
