"""The CUDA kernels against the FP64 oracle, and their contracts: determinism, batch
invariance, CUDA-graph replay, streams, safety on invalid inputs, store_kv bit-exactness.

Error rule (flash-attn's): the kernel's error against the FP64 oracle is at most twice
that of an FP32 PyTorch implementation (reference.py) over the same dequantized values,
plus 1e-5 for round-off when both are tiny. Outputs are poisoned (NaN) before every run
that writes into an existing buffer; NaN never passes (rel_err returns inf).
"""

import warnings

import numpy as np
import pytest
import torch
from oracle import attention_fp64, encode_e4m3, rel_err
from problems import ROUTE_CASES, make_problem, op_args, rising_scores, route_case_problem

import torch_sm70attn as sa
from torch_sm70attn import ops, reference, routes

pytestmark = pytest.mark.cuda
DEV = "cuda"


def op(p):
    return torch.ops.sm70attn.paged_attention(*op_args(p))


def check_vs_oracle(record, case, p, *, oracle_clamp=False):
    torch.cuda.synchronize()
    out = op(p)
    ref64 = attention_fp64(*op_args(p), clamp=oracle_clamp)
    fp32 = reference.paged_attention(*op_args(p)) if not oracle_clamp else None
    err = rel_err(out, ref64)
    bound = 2 * rel_err(fp32, ref64) + 1e-5 if fp32 is not None else 2e-3
    record("cuda", err, case)
    assert err <= bound, f"{case}: error {err:.3e} > bound {bound:.3e}"
    Q = p["query"].shape[2]
    for b, L in enumerate(p["seq_lens"].tolist()):
        for r in range(Q):
            if L - Q + r < 0:
                assert (out[b, :, r] == 0).all(), f"{case}: row {r} of request {b} not zero"
    return out


# --- the CPU grid, on the GPU -------------------------------------------------------------
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("G", [1, 2, 4, 6, 8])
def test_head_dims_and_groups(record, D, G):
    for Q in (1, 8):
        p = make_problem(D=D, G=G, Q=Q, H_kv=2, page_size=16, device=DEV, seed=D + G + Q)
        check_vs_oracle(record, f"D={D} G={G} Q={Q}", p)


@pytest.mark.parametrize("Q", [1, 2, 7, 8, 16])
@pytest.mark.parametrize("page_size", [1, 16, 1000, 1024, 1536, 1648, 3296])
def test_rows_and_pages(record, Q, page_size):
    lens = [min(2 * page_size + 3, 7000), max(Q, page_size), Q + 5]
    p = make_problem(B=3, H_kv=1, G=6, Q=Q, D=256, page_size=page_size, lens=lens, device=DEV)
    check_vs_oracle(record, f"Q={Q} page={page_size}", p)


@pytest.mark.parametrize("layout", ["interleaved", "kv_first"])
@pytest.mark.parametrize("D", [64, 256])
def test_kv_views_of_one_buffer(record, layout, D):
    # interleaved rows are only 8-byte aligned when D = 64 ... 2D apart: both load widths.
    p = make_problem(layout=layout, G=4, Q=8, D=D, page_size=16, device=DEV)
    check_vs_oracle(record, f"{layout} D={D}", p)


def test_eight_byte_aligned_rows(record):
    # Rows 72 bytes apart: the kernel must fall back to 8-byte loads.
    kv = torch.randn(40, 16, 2, 72, device=DEV).mul(8).to(torch.float8_e4m3fn)
    p = make_problem(B=2, H_kv=2, G=3, Q=4, D=64, page_size=16, lens=[100, 37], device=DEV)
    P = p["key_cache"].shape[0]
    p["key_cache"], p["value_cache"] = kv[:P, :, :, :64], kv[:P, :, :, 8:]
    assert p["key_cache"].stride(2) == 72
    check_vs_oracle(record, "8-byte rows", p)


@pytest.mark.parametrize("per_head", [True, False])
def test_scales_and_transposed_query(record, per_head):
    p = make_problem(
        per_head_scale=per_head, transposed_query=True, H_kv=4, G=6, Q=8, D=128, device=DEV
    )
    assert not p["query"].is_contiguous()
    check_vs_oracle(record, f"per_head={per_head} transposed", p)


def test_zero_length_and_short_rows(record):
    p = make_problem(B=4, Q=8, G=6, D=256, page_size=16, lens=[0, 3, 40, 0], device=DEV)
    out = check_vs_oracle(record, "zero/short rows", p)
    assert (out[0] == 0).all() and (out[3] == 0).all()


# --- long contexts and batches --------------------------------------------------------
@pytest.mark.parametrize("ctx", [3297, 8192, 32768, 131072, 262144])
def test_long_contexts(record, ctx):
    for Q in (1, 8):
        lens = [ctx, max(Q, ctx // 3)]
        p = make_problem(
            B=2, H_kv=1, G=6, Q=Q, D=256, page_size=1648, lens=lens, device=DEV, seed=ctx
        )
        check_vs_oracle(record, f"ctx={ctx} Q={Q}", p)


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16])
def test_batches(record, B):
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 40000, (B,), generator=g).tolist()
    p = make_problem(B=B, H_kv=2, G=6, Q=8, D=256, page_size=3296, lens=lens, device=DEV, seed=B)
    check_vs_oracle(record, f"B={B}", p)


def test_batched_equals_alone_and_run_to_run():
    lens = [5000, 0, 17, 33000, 8]
    p = make_problem(B=5, H_kv=2, G=6, Q=8, D=256, page_size=1648, lens=lens, device=DEV)
    out = op(p)
    assert torch.equal(out, op(p)), "not bitwise equal run to run"
    for b in range(5):
        alone = dict(p)
        for k in ("query", "block_table", "seq_lens"):
            alone[k] = p[k][b : b + 1]
        assert torch.equal(op(alone)[0], out[b]), f"request {b} differs when batched"


# --- each attention kernel where the register-fragment one applies ----------------------
RF_KINDS = ["wmma", "rf-m8n8k4", "rf-m16n8k16"]


@pytest.fixture
def kernel_override():
    """set_kernel_override for one test, back to auto after it whatever happens."""
    mod = ops.load_cuda_kernels()
    yield mod.set_kernel_override
    mod.set_kernel_override("auto")


@pytest.mark.parametrize("kind", RF_KINDS)
def test_each_kernel_kind_meets_the_oracle(record, kernel_override, kind):
    """D = 256 verify shapes (48 rows: MB3; 24: MB2; 96: two row groups of MB3; 30 rows; an
    invalid page; 8-byte rows; splits and no splits) on the WMMA kernel and both atoms of the
    register-fragment kernel (m8n8k4 runs as ptxas emulates it on SM80+); the plan names the
    kernel it launches; batched equals alone and run to run, bitwise."""
    if kind == "rf-m16n8k16" and torch.cuda.get_device_capability()[0] < 8:
        with pytest.raises(ValueError, match="SM80"):
            kernel_override(kind)
            op(make_problem(G=6, Q=8, D=256, device=DEV))
        return
    kernel_override(kind)
    mod = ops.load_cuda_kernels()
    # (the last: a table of a few pages, one split)
    for Q, lens, page in (
        (8, [5000, 0, 17, 40000], 1648),
        (4, [3000, 9], 16),
        (16, [700, 33], 37),
        (5, [40, 6], 16),
    ):
        p = make_problem(
            B=len(lens), H_kv=1, G=6, Q=Q, D=256, page_size=page, lens=lens, device=DEV, seed=Q
        )
        plan = mod.plan(len(lens), 6, 1, Q, 256, p["block_table"].shape[1] * page)
        assert plan["kernel"] == kind, plan
        assert Q != 5 or plan["num_splits"] == 1, plan
        check_vs_oracle(record, f"{kind} Q={Q} page={page}", p)
        out = op(p)
        assert torch.equal(op(p), out), f"{kind} Q={Q}: run to run"
        for b in range(len(lens)):
            alone = dict(p)
            for k in ("query", "block_table", "seq_lens"):
                alone[k] = p[k][b : b + 1]
            assert torch.equal(op(alone)[0], out[b]), (
                f"{kind} Q={Q}: request {b} differs when batched"
            )
    p = make_problem(B=2, H_kv=2, G=6, Q=8, D=256, page_size=16, lens=[900, 50], device=DEV, seed=3)
    p["block_table"][0, 5] = -1  # an invalid page: masked like a future token
    check_vs_oracle(record, f"{kind} invalid page", p, oracle_clamp=True)
    p = make_problem(
        B=2, H_kv=2, G=6, Q=8, D=256, page_size=16, lens=[300, 37], layout="padded", device=DEV
    )
    check_vs_oracle(record, f"{kind} 8-byte rows", p)


@pytest.mark.parametrize("kind", RF_KINDS)
def test_each_kernel_kind_on_rising_scores(record, kernel_override, kind):
    """Scores that rise within a split by less and by more than the register-fragment kernel's
    lazy-rescale threshold (2^8), and fall back (problems.rising_scores), on each kernel kind,
    with splits and without."""
    if kind == "rf-m16n8k16" and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip(
            "m16n8k16 needs SM80 (test_each_kernel_kind_meets_the_oracle checks the refusal)"
        )
    kernel_override(kind)
    mod = ops.load_cuda_kernels()
    for Q, lens, page in ((8, [3000, 700], 16), (4, [2000, 300], 16), (8, [500, 90], 1648)):
        p = make_problem(
            B=2, H_kv=1, G=6, Q=Q, D=256, page_size=page, lens=lens, device=DEV, seed=Q
        )
        rising_scores(p, seed=Q + page)
        assert mod.plan(2, 6, 1, Q, 256, p["block_table"].shape[1] * page)["kernel"] == kind
        check_vs_oracle(record, f"{kind} rising Q={Q} page={page}", p)


def test_default_kernel_kind_by_gpu_and_capacity(kernel_override):
    """auto: the register-fragment m8n8k4 kernel for D 256 in CTAs of 2 row blocks from a cache
    of 64K tokens and of 3 from 128K on a V100 (SM 7.0), the WMMA kernel otherwise (traits.h
    attn_default_kind), as the V100 model assumes (tools/v100_model.py default_kind)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import v100_model as vm

    kernel_override("auto")
    mod = ops.load_cuda_kernels()
    v100 = torch.cuda.get_device_capability() == (7, 0)
    # (capacity, Q, G): 48 rows (MB3) at and below 128K, 96 rows (two row groups of MB3), 24
    # and 32 rows (MB2) at and below 64K
    for cap, Q, G in (
        (131072, 8, 6),
        (131071, 8, 6),
        (65536, 8, 6),
        (1 << 18, 16, 6),
        (1 << 18, 4, 6),
        (1 << 18, 8, 4),
        (65536, 4, 6),
        (65535, 4, 6),
    ):
        pl = mod.plan(1, G, 1, Q, 256, cap)
        rf = v100 and ((pl["mb"] == 2 and cap >= 65536) or (pl["mb"] == 3 and cap >= 131072))
        assert pl["kernel"] == ("rf-m8n8k4" if rf else "wmma"), (cap, Q, G, pl)
        arch = "sm_70" if v100 else "sm_90"
        assert vm.default_kind(arch, 256, pl["mb"], cap) == ("rf" if rf else "wmma")
    if torch.cuda.get_device_capability()[0] < 8:  # refused when set, not at the next call
        with pytest.raises(ValueError, match="'rf-m16n8k16' needs SM80"):
            kernel_override("rf-m16n8k16")


def test_kernel_override_rejects_unknown_kinds(kernel_override):
    with pytest.raises(ValueError, match="auto, wmma, rf-m8n8k4 or rf-m16n8k16"):
        kernel_override("rf")


@pytest.mark.parametrize("shape", [884, 8844, 16816])
def test_mma_atom_element_maps_are_the_hardwares(shape):
    """csrc/sm70attn/mma_atoms.h's maps (which element of A, B, C and D each lane's register
    holds) against the GPU: through one mma.sync atom, with every operand gathered and the
    result scattered by the maps, D = A B + C exactly (small integers: every product and sum is
    exact in fp32) in every group, and no element is left at the binding's NaN poison.
    m8n8k4 (SM70's shape: four quad-pair products; 8844 with B row-major, as the
    register-fragment kernel reads V) runs emulated by ptxas on newer GPUs; m16n8k16 needs SM80
    and is refused before it."""
    ops.load_cuda_kernels()
    check = torch.ops.sm70attn_test.mma_atom_check
    G, M, N, K = (1, 16, 8, 16) if shape == 16816 else (4, 8, 8, 4)
    gen = torch.Generator().manual_seed(shape)
    A = torch.randint(-8, 9, (G, M, K), generator=gen).half().to(DEV)
    B = torch.randint(-8, 9, (G, K, N), generator=gen).half().to(DEV)
    C = torch.randint(-64, 65, (G, M, N), generator=gen).float().to(DEV)
    if shape == 16816 and torch.cuda.get_device_capability()[0] < 8:
        with pytest.raises(ValueError, match="SM80"):
            check(shape, A, B, C)
        return
    D = check(shape, A, B, C)
    want = torch.bmm(A.double(), B.double()) + C.double()
    assert torch.equal(D.double(), want), (D - want).abs().amax(dim=(1, 2))
    with pytest.raises(ValueError, match="contiguous A"):
        check(shape, A.transpose(1, 2), B, C)


def test_plan_matches_the_models_replica_and_the_override_keeps_results_right(record):
    """The binding's plan() against tools/v100_model.py's replica of plan.h and occupancy
    rules (with the registers of the kernels this process runs: NVRTC's build, whose sm_90 code
    is not the nvcc build's of the SASS summary); set_plan_override(80, 96 KB) plans and launches
    a V100's grid, whose results still meet the oracle, and 0, 0 restores it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import v100_model as vm

    from torch_sm70attn import nvrtc

    mod = ops.load_cuda_kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [
        (8, 6, 1, 8, 256, 131072),
        (1, 6, 1, 1, 256, 32768),
        (8, 32, 8, 1, 128, 131072),
        (4, 32, 8, 8, 128, 8192),
    ]
    base = {}
    for B, H_q, H_kv, Q, D, cap in shapes:
        got = mod.plan(B, H_q, H_kv, Q, D, cap, 16, 0)
        want = vm.plan(B, H_q, H_kv, Q, D, cap, sms, got["ctas_per_sm"])
        assert {k: got[k] for k in want} == want and got["num_sms"] == sms
        if torch.cuda.get_device_capability() == (9, 0):  # the H200's registers and 228 KB
            k = nvrtc.cubin(nvrtc.Kernel("attn", (D, got["mb"], 16)), nvrtc.device_arch(0)).info
            occ = vm.occupancy(k["regs"], k["threads"], got["smem_bytes"], vm.GPUS["H200"])
            want_smem = vm.load_sass()["sm_90"][vm.kernel_name(D, got["mb"])]["smem"]
            assert got["ctas_per_sm"] == occ and got["smem_bytes"] == want_smem, (got, occ)
        base[(B, H_q, H_kv, Q, D, cap)] = got
    p = make_problem(B=3, H_kv=1, G=6, Q=8, D=256, page_size=64, lens=[9000, 4000, 8], device=DEV)
    try:
        mod.set_plan_override(80, 98304)
        for key, got in base.items():  # as many CTAs as 96 KB holds, no more than the GPU's
            v = mod.plan(*key, 16, 0)
            want = max(1, min(got["ctas_per_sm"], 98304 // got["smem_bytes"]))
            assert (
                v["num_sms"] == 80
                and v["ctas_per_sm"] == want
                and v["smem_bytes"] >= got["smem_bytes"]
            ), (v, got)
        check_vs_oracle(record, "V100-shaped grid", p)
    finally:
        mod.set_plan_override(0, 0)
    for key, got in base.items():
        assert mod.plan(*key, 16, 0) == got
    with pytest.raises(ValueError, match=">= 0"):
        mod.set_plan_override(-1, 0)
    try:  # shared memory given in KB by mistake: a clear error, not one CTA per SM
        mod.set_plan_override(80, 96)
        with pytest.raises(ValueError, match="holds no CTA"):
            mod.plan(*next(iter(base)), 16, 0)
    finally:
        mod.set_plan_override(0, 0)
    with pytest.raises(ValueError, match="not a shape"):
        mod.plan(1, 0, 1, 1, 128, 4096, 16, 0)  # H_q = 0


# --- CUDA graphs and streams ----------------------------------------------------------
def test_cuda_graph_replay_with_new_inputs(record):
    B, Q, ps = 4, 8, 1648
    cap_pages = 20
    p = make_problem(
        B=B,
        H_kv=1,
        G=6,
        Q=Q,
        D=256,
        page_size=ps,
        lens=[ps * cap_pages] * B,
        extra_pages=0,
        device=DEV,
    )
    static = dict(p)
    static["query"] = p["query"].clone()
    static["seq_lens"] = p["seq_lens"].clone()
    static["block_table"] = p["block_table"].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            op(static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = op(static)
    gen = torch.Generator().manual_seed(0)
    capacity = cap_pages * ps
    cases = {
        "new lengths": torch.randint(Q, capacity + 1, (B,), generator=gen).tolist(),
        "full": [capacity] * B,
        "padded requests": [capacity, 0, 5000, 0],
        "single zero rows": [3, 7, 1, 12],
        "all zero": [0, 0, 0, 0],
        "short": [9, 100, 1649, 3297],
    }
    for name, lens in cases.items():
        static["query"].copy_(torch.randn_like(static["query"]))
        static["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        static["block_table"].copy_(static["block_table"][torch.randperm(B, generator=gen)])
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert torch.equal(replayed, op(static)), f"{name}: replay != eager"
        err = rel_err(replayed, attention_fp64(*op_args(static)))
        record("cuda graph", err, name)
        assert err < 2e-3, f"{name}: error {err:.3e}"


def test_two_streams_at_once():
    pa = make_problem(
        B=2, H_kv=1, G=6, Q=8, D=256, page_size=1648, lens=[60000, 30000], device=DEV, seed=1
    )
    pb = make_problem(
        B=3, H_kv=2, G=4, Q=1, D=128, page_size=16, lens=[9000, 1, 0], device=DEV, seed=2
    )
    want_a, want_b = op(pa), op(pb)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    outs = []
    for _ in range(4):
        with torch.cuda.stream(s1):
            oa = op(pa)
        with torch.cuda.stream(s2):
            ob = op(pb)
        outs.append((oa, ob))
    torch.cuda.synchronize()
    for oa, ob in outs:
        assert torch.equal(oa, want_a) and torch.equal(ob, want_b)


def test_two_threads_at_once():
    """Two Python threads calling the op at once, each on its own stream, as a server's request
    threads would: every result bitwise the one-thread result (the binding's plan caches and
    hooks are shared between them)."""
    import threading

    pa = make_problem(B=2, H_kv=1, G=6, Q=8, D=256, page_size=1648, lens=[9000, 300], device=DEV)
    pb = make_problem(B=3, H_kv=2, G=4, Q=1, D=128, page_size=16, lens=[5000, 1, 0], device=DEV)
    want = {id(pa): op(pa), id(pb): op(pb)}
    torch.cuda.synchronize()
    errors = []
    start = threading.Barrier(2)

    def worker(p):
        try:
            stream = torch.cuda.Stream()
            start.wait()
            with torch.cuda.stream(stream):
                for i in range(100):
                    out = op(p)
                    stream.synchronize()
                    if not torch.equal(out, want[id(p)]):
                        errors.append(f"call {i} differs")
        except Exception as e:  # noqa: BLE001 (reported below, with the thread's others)
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(p,)) for p in (pa, pb)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


def test_a_hundred_thousand_replays_with_changing_lengths():
    """One captured call replayed 100,000 times, its lengths changed before each replay: no
    allocation grows, and the last replay still equals an eager call."""
    B, ps = 4, 16
    p = make_problem(B=B, H_kv=2, G=4, Q=4, D=128, page_size=ps, lens=[300] * B, device=DEV)
    cap = p["block_table"].shape[1] * ps
    lens = torch.randint(0, cap + 1, (1000, B), dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(p)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = op(p)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for i in range(100_000):
        p["seq_lens"].copy_(lens[i % 1000])
        g.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert torch.equal(out, op(p))


# --- invalid inputs: never outside the caches ----------------------------------------
def test_lengths_beyond_capacity_are_clamped(record):
    p = make_problem(B=2, G=6, Q=8, D=256, page_size=16, lens=[40, 50], extra_pages=0, device=DEV)
    capacity = p["block_table"].shape[1] * 16
    p["seq_lens"] = torch.tensor([capacity + 1000, -5], dtype=torch.int32, device=DEV)
    check_vs_oracle(record, "len > capacity", p, oracle_clamp=True)


def test_bad_page_ids_contribute_nothing(record):
    p = make_problem(B=2, G=6, Q=8, D=256, page_size=16, lens=[60, 50], device=DEV)
    bt = p["block_table"].clone()
    bt[0, 1] = -7
    bt[1, 0] = 10**9
    p["block_table"] = bt
    check_vs_oracle(record, "bad page ids", p, oracle_clamp=True)


def test_random_sweep_meets_the_error_rule():
    """300 seeded random valid calls (tests/problems.py: random_geometry) against the FP64
    oracle with the error rule of this file, zero rows exactly 0, no NaN."""
    import random

    from problems import random_geometry

    rng = random.Random(1301)
    worst = 0.0
    for i in range(300):
        g = random_geometry(rng)
        p = make_problem(device=DEV, **g)
        out = op(p)
        ref64 = attention_fp64(*op_args(p))
        err = rel_err(out, ref64)
        bound = 2 * rel_err(reference.paged_attention(*op_args(p)), ref64) + 1e-5
        assert err <= bound, (i, g, err, bound)
        for b, L in enumerate(g["lens"]):
            for r in range(g["Q"]):
                if L - g["Q"] + r < 0:
                    assert (out[b, :, r] == 0).all(), (i, g)
        worst = max(worst, err / bound)
    assert worst <= 1.0


def test_validate_mode_raises_on_bad_values():
    mod = ops.load_cuda_kernels()
    p = make_problem(B=2, G=2, Q=1, D=64, page_size=16, lens=[20, 30], device=DEV)
    bt = p["block_table"].clone()
    bt[0, 0] = 10**6
    mod.set_validate(True)
    try:
        with pytest.raises(ValueError, match="block_table"):
            op(dict(p, block_table=bt))
        with pytest.raises(ValueError, match="seq_lens"):
            op(dict(p, seq_lens=torch.tensor([10**7, 1], dtype=torch.int32, device=DEV)))
    finally:
        mod.set_validate(False)
    op(dict(p, block_table=bt))  # off: no check, no fault


def test_cuda_errors_name_the_argument():
    p = make_problem(B=2, G=2, Q=1, D=64, page_size=16, device=DEV)
    with pytest.raises(TypeError, match="query"):
        op(dict(p, query=p["query"].float()))
    with pytest.raises(ValueError, match="seq_lens"):
        op(dict(p, seq_lens=p["seq_lens"][:1]))


@pytest.mark.parametrize("case", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_raw_op_and_public_function_take_the_route_admit_says(case, monkeypatch, record):
    """One rule (routes.RULES), one case per rule and per tensor (tests/problems.py): the binding
    decides the route by the manifest it was handed at load, for the raw op (a compiled graph's)
    and the public function alike, and names the first rule a call fails; such a call runs the
    reference, once per reason with a warning whose reason is admit's. The rules applied before
    the binding (DISABLE: the public function; the device: the dispatcher) and the op's dtype
    rules (TypeError) are checked the same way where they apply."""
    label, want_rule, _, _ = case
    monkeypatch.delenv("TORCH_SM70ATTN_DISABLE", raising=False)
    ops.load_cuda_kernels()
    if want_rule == "compute capability" and torch.cuda.get_device_capability() >= (7, 0):
        pytest.skip("every CUDA device this suite runs on is SM70 or newer")
    p = route_case_problem(case, device="cpu" if want_rule == "device" else DEV)
    if want_rule == "TORCH_SM70ATTN_DISABLE":
        monkeypatch.setenv("TORCH_SM70ATTN_DISABLE", "1")
    want = sa.admit(p["query"], p["key_cache"], p["block_table"], value_cache=p["value_cache"])
    rule = routes.first_refusal(
        routes.Call(p["query"], p["key_cache"], p["value_cache"], p["block_table"])
    )
    assert (rule[0].name if rule else "admitted") == want_rule, (label, want)
    args = op_args(p)

    def raw():
        return torch.ops.sm70attn.paged_attention(*args)

    def public():
        return sa.paged_attention(*args[:5], scale=args[5], k_scale=args[6], v_scale=args[7])

    if want.route == sa.UNSUPPORTED:  # the op's own rule: TypeError naming the tensor
        for call in (raw, public):
            with pytest.raises(TypeError, match=rule[0].tensor):
                call()
        return
    # Which route ran: the reference through the fallback counts a call, and the binding's
    # refusal names its rule.
    calls, named = [], []
    real_ref, real_reason = ops.paged_attention_ref, routes.binding_reason
    monkeypatch.setattr(ops, "paged_attention_ref", lambda *a: calls.append(a) or real_ref(*a))
    monkeypatch.setattr(
        routes, "binding_reason", lambda name, c: named.append(name) or real_reason(name, c)
    )
    monkeypatch.setattr(routes, "warned", set())
    # DISABLE is the public function's (read on every call; a raw op call reads it at the load
    # only); a CPU call never reaches the binding (the dispatcher runs the CPU kernel).
    by = rule[0].by if rule else "binding"
    checked = [public] if want_rule == "TORCH_SM70ATTN_DISABLE" else [raw, public]
    for call in checked:
        calls.clear(), named.clear()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = call()
        warned = [str(x.message) for x in w if "reference route" in str(x.message)]
        if want.route == sa.CUDA:
            assert not calls and not named and not warned, (label, warned)
        elif by == "binding":
            assert len(calls) == 1 and named == [want_rule], (label, named)
            assert warned == [
                f"torch_sm70attn: paged_attention takes the slow reference route: {want.reason}"
            ] or (call is public and not warned), (label, warned)  # (warned once: by the raw op)
        else:
            assert not named and not warned, (label, named, warned)
            assert len(calls) == (want_rule == "TORCH_SM70ATTN_DISABLE"), label
        if out.numel():
            ref64 = attention_fp64(*args)
            bound = 2 * rel_err(real_ref(*args), ref64) + 1e-5
            assert rel_err(out, ref64) <= bound, label
            record("cuda routes", rel_err(out, ref64), label)
        else:
            assert out.shape == args[0].shape, label
    assert routes.warned == (
        {want.reason} if by == "binding" and want.route == sa.REFERENCE else set()
    )


def test_public_wrapper_falls_back_with_one_warning(record):
    q = torch.randn(1, 4, 2, 96, device=DEV).half()
    c = torch.randn(4, 16, 2, 96, device=DEV).mul(8).to(torch.float8_e4m3fn)
    bt = torch.tensor([[2, 0]], dtype=torch.int32, device=DEV)
    sl = torch.tensor([20], dtype=torch.int32, device=DEV)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = sa.paged_attention(q, c, c, bt, sl)
        sa.paged_attention(q, c, c, bt, sl)
    assert sum("head dim 96" in str(x.message) for x in w) == 1
    ref = attention_fp64(q, c, c, bt, sl, 96**-0.5, torch.tensor(1.0), torch.tensor(1.0))
    assert rel_err(out, ref) < 1e-3


# --- store_kv ---------------------------------------------------------------------------
def test_store_kv_bit_equal_to_cpu_reference():
    from problems import special_values

    gen = torch.Generator().manual_seed(3)
    H, D, ps = 4, 256, 16
    vals = special_values(4000, gen)
    T = vals.numel() // (H * D) + 50
    x = torch.cat([vals, torch.randn(T * H * D - vals.numel(), generator=gen).half() * 30])
    k = x[torch.randperm(x.numel(), generator=gen)].view(T, H, D)
    v = x[torch.randperm(x.numel(), generator=gen)].view(T, H, D)
    P = T // ps + 4
    kv = torch.zeros(P, ps, H, 2, D, dtype=torch.float8_e4m3fn)
    slots = torch.randperm(P * ps, generator=gen)[:T]
    slots[::5] = -1
    ks, vs = torch.tensor([1.0, 0.37, 2.5, 0.01]), torch.tensor([0.5])
    kv_cpu = kv.clone()
    sa.store_kv(k, v, kv_cpu[:, :, :, 0], kv_cpu[:, :, :, 1], slots, k_scale=ks, v_scale=vs)
    kv_gpu = kv.to(DEV)
    kv_gpu.view(torch.uint8).fill_(0x55)  # poison: every byte must match the CPU's
    kv_cpu_poisoned = kv.clone()
    kv_cpu_poisoned.view(torch.uint8).fill_(0x55)
    sa.store_kv(
        k,
        v,
        kv_cpu_poisoned[:, :, :, 0],
        kv_cpu_poisoned[:, :, :, 1],
        slots,
        k_scale=ks,
        v_scale=vs,
    )
    sa.store_kv(
        k.to(DEV),
        v.to(DEV),
        kv_gpu[:, :, :, 0],
        kv_gpu[:, :, :, 1],
        slots.to(DEV),
        k_scale=ks.to(DEV),
        v_scale=vs.to(DEV),
    )
    got = kv_gpu.cpu().view(torch.uint8)
    assert torch.equal(got, kv_cpu_poisoned.view(torch.uint8))
    # and against the independent encoder
    keep = slots >= 0
    want = encode_e4m3(k[keep].float().numpy() / ks.numpy()[None, :, None])
    page, off = slots[keep] // ps, slots[keep] % ps
    np.testing.assert_array_equal(got[page, off, :, 0].numpy(), want)


def test_store_kv_skips_out_of_range_slots_on_gpu():
    k = torch.randn(3, 1, 64, device=DEV).half()
    kc = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn, device=DEV)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([-1, 32, 10**9], device=DEV)
    sa.store_kv(k, k, kc, vc, slots)
    torch.cuda.synchronize()
    assert (kc.view(torch.uint8) == 0).all()


def test_store_then_attend_round_trip(record):
    B, H, G, D, ps, L = 2, 2, 6, 256, 1648, 5000
    kc = torch.zeros(8, ps, H, D, dtype=torch.float8_e4m3fn, device=DEV)
    vc = torch.zeros_like(kc)
    bt = torch.tensor([[5, 1, 7, 3], [0, 2, 4, 6]], dtype=torch.int32, device=DEV)
    t = torch.arange(L, device=DEV)
    for b in range(B):
        slots = bt[b, t // ps].long() * ps + t % ps
        kv = torch.randn(2, L, H, D, device=DEV).half()
        sa.store_kv(kv[0], kv[1], kc, vc, slots, k_scale=0.02, v_scale=0.03)
    q = torch.randn(B, H * G, 8, D, device=DEV).half()
    sl = torch.tensor([L, L - 1000], dtype=torch.int32, device=DEV)
    out = sa.paged_attention(q, kc, vc, bt, sl, k_scale=0.02, v_scale=0.03)
    ks, vs = torch.tensor(0.02, device=DEV), torch.tensor(0.03, device=DEV)
    err = rel_err(out, attention_fp64(q, kc, vc, bt, sl, D**-0.5, ks, vs))
    record("cuda", err, "store+attend")
    assert err < 2e-3


def test_check_uses_the_cuda_route():
    from helpers_cli import cli

    r = cli("check", "--reps", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("route=cuda") == 2, r.stdout


def test_model_demo_on_the_gpu():
    pytest.importorskip("transformers")
    from helpers_cli import cli

    r = cli("demo", "--context", "4096", "--new-tokens", "16")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "route of a decode step: cuda" in r.stdout, r.stdout
    assert "--- torch_sm70attn (paged E4M3 cache) continues ---" in r.stdout, r.stdout
    print(r.stdout)


def test_sanitizer_smoke():
    """Small problems of every kind; tools/gpu_suite.sh runs this under compute-sanitizer."""
    for kw in (
        dict(B=3, Q=1, G=6, D=256, page_size=16, lens=[0, 33, 100]),
        dict(B=2, Q=8, G=6, D=256, page_size=1648, lens=[3000, 5]),
        dict(B=2, Q=16, G=8, D=128, page_size=1, lens=[40, 16]),
        dict(B=2, Q=2, G=1, D=64, page_size=17, layout="interleaved"),
    ):
        p = make_problem(device=DEV, **kw)
        p["block_table"][0, -1] = 10**6  # junk beyond the used pages
        op(p)
    k = torch.randn(5, 2, 64, device=DEV).half()
    kc = torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn, device=DEV)
    sa.store_kv(k, k, kc, kc.clone(), torch.tensor([0, -1, 31, 32, 5], device=DEV))
    torch.cuda.synchronize()
