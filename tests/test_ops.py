"""Operator contracts: opcheck, fake kernels, input errors, value checks, routes."""

import re
from pathlib import Path

import pytest
import torch
from helpers_cli import cli
from problems import make_problem, op_args
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_sm70attn as sa
from torch_sm70attn import routes

UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)
FP8 = torch.float8_e4m3fn


def store_args(seed=0, T=7):
    p = make_problem(G=1, D=64, page_size=16, seed=seed)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, 2, 64, generator=g).half() * 5
    v = torch.randn(T, 2, 64, generator=g).half() * 5
    P, ps = p["key_cache"].shape[:2]
    slots = torch.randperm(P * ps, generator=g)[:T]
    slots[1] = -1
    return (
        k,
        v,
        p["key_cache"].clone(),
        p["value_cache"].clone(),
        slots,
        p["k_scale"],
        p["v_scale"],
    )


@pytest.mark.parametrize("util", UTILS)
@pytest.mark.parametrize("case", ["decode", "verify", "interleaved", "transposed"])
def test_opcheck_paged_attention(fp8_aware_allclose, util, case):
    kw = dict(
        decode=dict(Q=1, G=6),
        verify=dict(Q=8, G=2, lens=[3, 40]),
        interleaved=dict(Q=2, layout="interleaved"),
        transposed=dict(Q=4, transposed_query=True),
    )[case]
    p = make_problem(D=64, page_size=16, **kw)
    torch.library.opcheck(torch.ops.sm70attn.paged_attention.default, op_args(p), test_utils=util)


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_store_kv(fp8_aware_allclose, util):
    torch.library.opcheck(torch.ops.sm70attn.store_kv.default, store_args(), test_utils=util)


@pytest.mark.parametrize("util", UTILS)
def test_opcheck_verifier_mask(util):
    sl = torch.tensor([0, 5, 17], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sm70attn.verifier_mask.default, (sl, 4, 20), test_utils=util)


def test_fake_matches_real_metadata():
    for kw in (dict(Q=1, G=6), dict(Q=8, transposed_query=True), dict(layout="kv_first", Q=3)):
        p = make_problem(D=64, **kw)
        real = torch.ops.sm70attn.paged_attention(*op_args(p))
        with FakeTensorMode() as mode:
            fake_args = [
                mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in op_args(p)
            ]
            fake = torch.ops.sm70attn.paged_attention(*fake_args)
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    sl = torch.tensor([3, 9], dtype=torch.int32)
    real = sa.verifier_mask(sl, 4, 11)
    with FakeTensorMode() as mode:
        fake = sa.verifier_mask(mode.from_tensor(sl), 4, 11)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


# --- input errors: each bad argument gets its own error, naming it ---------------------
def _bad(name):
    p = make_problem(H_kv=2, G=2, Q=2, D=64, page_size=16, lens=[5, 20])
    q, kc, vc, bt, sl = (
        p["query"],
        p["key_cache"],
        p["value_cache"],
        p["block_table"],
        p["seq_lens"],
    )
    ks, vs = p["k_scale"], p["v_scale"]
    cases = {
        "query dtype": (TypeError, "query must be torch.float16", dict(query=q.float())),
        "query rank": (ValueError, "query must be 4-D", dict(query=q[0])),
        "key_cache dtype": (
            TypeError,
            "key_cache must be torch.float8_e4m3fn",
            dict(key_cache=kc.view(torch.uint8)),
        ),
        "value_cache dtype": (TypeError, "value_cache must be", dict(value_cache=vc.float())),
        "cache rank": (ValueError, "key_cache must be 4-D", dict(key_cache=kc[0])),
        "value shape": (ValueError, "value_cache shape", dict(value_cache=vc[:-1])),
        "block_table dtype": (
            TypeError,
            "block_table must be torch.int32",
            dict(block_table=bt.long()),
        ),
        "block_table rows": (ValueError, "block_table has 1 rows", dict(block_table=bt[:1])),
        "seq_lens dtype": (TypeError, "seq_lens must be torch.int32", dict(seq_lens=sl.long())),
        "seq_lens size": (
            ValueError,
            "seq_lens has 3 entries",
            dict(seq_lens=torch.cat([sl, sl[:1]])),
        ),
        "head dim": (
            ValueError,
            "query head dim 32 != key_cache head dim 64",
            dict(query=q[..., :32].contiguous()),
        ),
        "heads": (ValueError, "multiple of cache heads", dict(query=q[:, :3].contiguous())),
        "query layout": (  # a decode query [B, Q=1, H_q, D] not transposed to SDPA layout
            ValueError,
            r"H_q=1 must be a multiple of cache heads H_kv=2.*\[B, H_q, Q, D\].*transpose\(1, 2\)",
            dict(query=q[:, :, :1].transpose(1, 2)),
        ),
        "query last dim": (
            ValueError,
            "query must have a contiguous last dim",
            dict(query=q.transpose(2, 3).contiguous().transpose(2, 3)),
        ),
        "cache last dim": (
            ValueError,
            "key_cache must have a contiguous last dim",
            dict(key_cache=kc.transpose(2, 3).contiguous().transpose(2, 3)),
        ),
        "k_scale dtype": (TypeError, "k_scale must be torch.float32", dict(k_scale=ks.double())),
        "v_scale shape": (
            ValueError,
            r"v_scale must have shape \[\], \[1\] or \[H_kv=2\]",
            dict(v_scale=torch.ones(3)),
        ),
        "seq_len > capacity": (
            ValueError,
            "seq_lens must lie in",
            dict(seq_lens=torch.tensor([5, 10**6], dtype=torch.int32)),
        ),
        "negative seq_len": (
            ValueError,
            "seq_lens must lie in",
            dict(seq_lens=torch.tensor([-1, 5], dtype=torch.int32)),
        ),
        "page id": (
            ValueError,
            "page ids must lie in",
            dict(block_table=torch.where(bt >= 0, bt + 1000, bt)),
        ),
    }
    exc, msg, change = cases[name]
    args = dict(
        query=q,
        key_cache=kc,
        value_cache=vc,
        block_table=bt,
        seq_lens=sl,
        scale=0.1,
        k_scale=ks,
        v_scale=vs,
    )
    args.update(change)
    return exc, msg, args


ERRORS = [
    "query dtype",
    "query rank",
    "key_cache dtype",
    "value_cache dtype",
    "cache rank",
    "value shape",
    "block_table dtype",
    "block_table rows",
    "seq_lens dtype",
    "seq_lens size",
    "head dim",
    "heads",
    "query layout",
    "query last dim",
    "cache last dim",
    "k_scale dtype",
    "v_scale shape",
    "seq_len > capacity",
    "negative seq_len",
    "page id",
]


@pytest.mark.parametrize("name", ERRORS)
def test_paged_attention_errors(name):
    exc, msg, args = _bad(name)
    with pytest.raises(exc, match=msg):
        torch.ops.sm70attn.paged_attention(*args.values())


def test_device_mismatch_error():
    p = make_problem(D=64)
    args = list(op_args(p))
    args[4] = args[4].to("meta")
    with pytest.raises(ValueError, match="seq_lens is on meta but query is on cpu"):
        torch.ops.sm70attn.paged_attention(*args)


def test_unused_table_entries_are_not_checked():
    # make_problem pads every table with -1 and out-of-range ids beyond the used pages.
    p = make_problem(D=64, lens=[1, 16], extra_pages=2)
    P = p["key_cache"].shape[0]
    assert (p["block_table"] < 0).any() and (p["block_table"] >= P).any()
    torch.ops.sm70attn.paged_attention(*op_args(p))


def test_store_kv_errors():
    k, v, kc, vc, slots, ks, vs = store_args()
    with pytest.raises(TypeError, match="key must be torch.float16"):
        sa.store_kv(k.float(), v, kc, vc, slots)
    with pytest.raises(TypeError, match="slot_mapping must be torch.int64"):
        sa.store_kv(k, v, kc, vc, slots.int())
    with pytest.raises(ValueError, match="slot_mapping has 6 entries"):
        sa.store_kv(k, v, kc, vc, slots[:6])
    with pytest.raises(ValueError, match=r"key is \[T, H_kv=2, D=32\]"):
        sa.store_kv(k[..., :32].contiguous(), v[..., :32].contiguous(), kc, vc, slots)
    with pytest.raises(ValueError, match="value shape"):
        sa.store_kv(k, v[:, :1].contiguous(), kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping entries must be -1 or lie in"):
        sa.store_kv(k, v, kc, vc, torch.full_like(slots, 10**6))
    with pytest.raises(ValueError, match="slot_mapping entries must be -1 or lie in"):
        sa.store_kv(k, v, kc, vc, torch.full_like(slots, -2))


def test_wrappers_name_non_tensor_arguments():
    p = make_problem(H_kv=2, G=2, Q=1, D=64, lens=[5, 20])
    args = dict(p)
    del args["scale"]
    for name in ("query", "key_cache", "value_cache", "block_table", "seq_lens"):
        bad = dict(args, **{name: p[name].tolist()})
        with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor \(.*\), got list"):
            sa.paged_attention(**bad)
    for name in ("k_scale", "v_scale"):
        for value in ("0.1", None, [0.1, 0.2]):
            with pytest.raises(TypeError, match=rf"^{name} must be a float or a float32 tensor"):
                sa.paged_attention(**dict(args, **{name: value}))
    sa.paged_attention(**dict(args, k_scale=1, v_scale=0.5))  # plain numbers are fine
    k, v, kc, vc, slots, ks, vs = store_args()
    with pytest.raises(TypeError, match=r"^seq_lens must be a torch.Tensor \(int32 \[B\]\)"):
        sa.paged_attention(*op_args(p)[:4], [5, 20])
    with pytest.raises(TypeError, match=r"^key must be a torch.Tensor \(float16 \[T, H_kv, D\]"):
        sa.store_kv(k.tolist(), v, kc, vc, slots)
    with pytest.raises(TypeError, match=r"^slot_mapping must be a torch.Tensor \(int64 \[T\]\)"):
        sa.store_kv(k, v, kc, vc, slots.tolist())
    with pytest.raises(TypeError, match="^v_scale must be a float or a float32 tensor"):
        sa.store_kv(k, v, kc, vc, slots, v_scale="1")


def test_verifier_mask_errors():
    with pytest.raises(TypeError, match="seq_lens must be torch.int32"):
        sa.verifier_mask(torch.tensor([1]), 1, 4)
    with pytest.raises(ValueError, match="q_rows must be >= 1"):
        sa.verifier_mask(torch.tensor([1], dtype=torch.int32), 0, 4)


# --- contract and routes ----------------------------------------------------------------
def test_shape_admission_traces_without_a_graph_break():
    """The wrapper decides the route inside a compiled model's attention (the transformers
    integration calls it there): shape_refusal must trace with fullgraph=True."""
    q = torch.zeros(1, 12, 1, 256, dtype=torch.float16)
    kc = torch.zeros(4, 16, 2, 256, dtype=torch.float8_e4m3fn)

    def f(q, kc):
        return q + (routes.shape_refusal(q, kc) is None)

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kc)
    assert torch.equal(got, q + 1)
    assert routes.shape_refusal(q, kc[:, :, :, 1:]) is not None  # eager: offset 1 refused


def test_contract_is_min_of_capability_and_capacity():
    cap = sa.capabilities()["max_context"]
    assert sa.contract() == cap
    assert sa.contract(cap // 2) == cap // 2
    assert sa.contract(cap * 4) == cap
    with pytest.raises(ValueError):
        sa.contract(-1)


def test_no_literal_context_bound_outside_the_manifest():
    root = Path(sa.__file__).resolve().parent.parent
    cap = str(sa.capabilities()["max_context"])
    offenders = []
    for d in ("torch_sm70attn", "fx_passes", "csrc"):
        for f in (root / d).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".cu", ".cuh", ".h") and f.name != "manifest.py":
                if re.search(rf"\b({cap}|262_144|256 \* 1024|1 << 18)\b", f.read_text()):
                    offenders.append(str(f.relative_to(root)))
    assert not offenders, f"context bound written outside manifest.py: {offenders}"


def test_shape_refusal_at_the_capacity_bound():
    """Whole pages covering the contract are admitted, more is not (one case per rule:
    tests/test_routes.py)."""
    q = torch.empty(1, 6, 1, 64, dtype=torch.float16)
    cap = sa.contract()
    page = 3296
    cache = torch.empty(1, page, 1, 64, dtype=FP8)
    ok = torch.empty(1, -(-cap // page), dtype=torch.int32)
    too_big = torch.empty(1, -(-cap // page) + 1, dtype=torch.int32)
    assert routes.shape_refusal(q, cache, ok) is None
    assert "exceeds the contract" in routes.shape_refusal(q, cache, too_big)
    assert "exceeds the contract" in routes.shape_refusal(q, cache, ok, served_capacity=cap // 2)
    # Interleaved K/V views are 8-byte aligned: admitted.
    kv = torch.empty(1, 16, 1, 2, 64, dtype=FP8)
    assert routes.shape_refusal(q, kv[:, :, :, 0], value_cache=kv[:, :, :, 1]) is None


# --- the CLI --------------------------------------------------------------------------
def test_cli_info():
    r = cli("info")
    assert r.returncode == 0, r.stderr
    assert "capability manifest" in r.stdout and "262144" in r.stdout
    if torch.version.cuda is None:  # a CPU build: what it has, not an extra that cannot help
        assert "is a CPU-only build: every op runs the reference route" in r.stdout, r.stdout
        assert "pip install" not in r.stdout, r.stdout
    else:
        assert "C++ binding (source digest" in r.stdout


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch has no NVRTC to find")
def test_cli_info_says_where_nvrtc_comes_from():
    """The NVRTC it found and the headers' folders, or the extra to install."""
    from torch_sm70attn import toolchain

    r = cli("info", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("NVRTC"))
    try:
        tk = toolchain.toolkit()
        assert line.startswith(f"NVRTC {tk.version[0]}.{tk.version[1]}, CUDA headers in "), line
    except RuntimeError:
        assert "pip install 'nvidia-cuda-nvrtc" in line and "-e '.[cuda1" in line, line


def test_cli_check():
    r = cli("check", "--device", "cpu", "--context", "2000", "--reps", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok") == 2, r.stdout


def test_cli_build_without_gpu_or_arch_list():
    r = cli("build", CUDA_VISIBLE_DEVICES="", TORCH_CUDA_ARCH_LIST="")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "no CUDA device and no TORCH_CUDA_ARCH_LIST" in r.stderr
    assert "For V100s, TORCH_CUDA_ARCH_LIST=7.0 python -m torch_sm70attn build" in r.stderr


def test_cli_help_gives_every_option_its_words_and_default():
    """`check --reps` had no help; demo's --batch, --draft and --runs showed no default."""
    out = " ".join(cli("check", "--help").stdout.split())
    assert "--reps REPS timed calls of each path, their median reported (default: 5)" in out, out
    assert "--context CONTEXT longest request, tokens (default: 5000)" in out, out
    out = " ".join(cli("demo", "--help").stdout.split())
    for words in ("--batch BATCH concurrent requests (default: 1)",
                  "--draft DRAFT prompt-lookup draft tokens (default: 4)",
                  "(default: 3)", "--new-tokens NEW_TOKENS tokens to generate (default: CPU 32"):  # fmt: skip
        assert words in out, (words, out)


def test_cli_build_for_sm70_without_the_cuda12_extra_is_one_message():
    """`build` with TORCH_CUDA_ARCH_LIST=7.0 where cuda-bindings (the cuda12 extra) is missing:
    the install command, no traceback."""
    import importlib.util

    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("cuda-bindings is installed here: build would compile, not fail")
    r = cli("build", CUDA_VISIBLE_DEVICES="", TORCH_CUDA_ARCH_LIST="7.0")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "python -m torch_sm70attn build: error: " in r.stderr, r.stderr
    assert "cuda-bindings, which is not installed: pip install" in r.stderr, r.stderr


def test_cli_check_small_context():
    r = cli("check", "--device", "cpu", "--context", "100", "--reps", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok") == 2, r.stdout
    for bad in ("0", "-5", "7"):
        r = cli("check", "--device", "cpu", "--context", bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "argument --context: must be >= 8" in r.stderr, r.stderr


def test_cli_check_cuda_without_gpu():
    r = cli("check", "--device", "cuda", "--reps", "1", CUDA_VISIBLE_DEVICES="")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "argument --device: cuda is not available" in r.stderr, r.stderr
    assert "--device cpu" in r.stderr, r.stderr
