"""Random paged-attention problems for the tests (CPU and CUDA)."""

from __future__ import annotations

import torch


def table_width(lens, page_size, extra_pages=1) -> int:
    """Columns of make_problem's block table: the longest request's pages plus extra_pages."""
    return max([-(-max(L, 0) // page_size) for L in lens] + [1]) + extra_pages


def make_problem(
    B=2,
    H_kv=2,
    G=2,
    Q=1,
    D=64,
    page_size=16,
    lens=None,
    *,
    layout="separate",  # "separate", "interleaved" ([P, ps, H, 2, D]), "kv_first" ([P, 2, ps, H, D])
    # or "padded" ([P, ps, H, 2 D + 8]: K then 8 bytes then V, rows 8- but not 16-byte aligned)
    per_head_scale=True,
    transposed_query=False,
    extra_pages=1,
    device="cpu",
    seed=0,
):
    """Inputs of paged_attention as a dict, with shuffled pages and junk in unused table
    slots (-1 and out-of-range ids), so that anything read beyond seq_lens shows up."""
    gen = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(Q, 3 * page_size + Q + 1, (B,), generator=gen).tolist()
    need = [-(-max(L, 0) // page_size) for L in lens]
    max_pages = table_width(lens, page_size, extra_pages)
    P = sum(need) + 3
    perm = torch.randperm(P, generator=gen)
    bt = torch.where(torch.arange(max_pages) % 2 == 0, -1, P + 5).repeat(B, 1).int()
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i : i + n].int()
        i += n

    dev = torch.device(device)
    dev_gen = torch.Generator(device=dev).manual_seed(seed)

    def fp8(shape):
        # N(0, 8) codes: dequantized with a scale near 1/8, K and V are about N(0, 1).
        # Drawn on the target device: long-context caches are hundreds of MB.
        x = torch.randn(shape, generator=dev_gen, device=dev) * 8
        return x.to(torch.float8_e4m3fn)

    if layout == "separate":
        kc, vc = fp8((P, page_size, H_kv, D)), fp8((P, page_size, H_kv, D))
    elif layout == "interleaved":
        kv = fp8((P, page_size, H_kv, 2, D))
        kc, vc = kv[:, :, :, 0], kv[:, :, :, 1]
    elif layout == "kv_first":
        kv = fp8((P, 2, page_size, H_kv, D))
        kc, vc = kv[:, 0], kv[:, 1]
    elif layout == "padded":
        kv = fp8((P, page_size, H_kv, 2 * D + 8))
        kc, vc = kv[..., :D], kv[..., D + 8 :]
    else:
        raise ValueError(layout)
    n_scale = H_kv if per_head_scale else 1
    ks = (torch.rand(n_scale, generator=gen) * 0.1 + 0.08).float()
    vs = (torch.rand(n_scale, generator=gen) * 0.1 + 0.08).float()
    if not per_head_scale:
        ks, vs = ks.reshape(()), vs.reshape(())
    if transposed_query:
        q = torch.randn(B, Q, H_kv * G, D, generator=gen).half().to(dev).transpose(1, 2)
    else:
        q = torch.randn(B, H_kv * G, Q, D, generator=gen).half().to(dev)
    return dict(
        query=q,
        key_cache=kc,
        value_cache=vc,
        block_table=bt.to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        scale=D**-0.5,
        k_scale=ks.to(dev),
        v_scale=vs.to(dev),
    )


def rising_scores(p, seed=0):
    """Makes a problem's scores rise and fall along each request's context in steps, by a
    fraction of a log2 unit and by tens of them (the online softmax's rescale, lazy in the
    register-fragment kernel): every K element of token t is one level, a random walk of
    factors 0.7-2 every 16 tokens or so, from 0.5 (E4M3); the query is positive."""
    g = torch.Generator().manual_seed(seed)
    kb, bt = p["key_cache"].view(torch.uint8), p["block_table"].cpu().long()
    ps = kb.shape[1]
    p["query"] = p["query"].abs() + 0.5
    factors = torch.tensor([0.7, 1.1, 1.1, 1.25, 2.0])
    for b, L in enumerate(p["seq_lens"].tolist()):
        if L <= 0:
            continue
        step = torch.rand(L, generator=g) < 1 / 16
        f = factors[torch.randint(0, len(factors), (L,), generator=g)]
        level = (torch.cumsum(torch.where(step, f.log(), 0.0), 0).exp() * 0.5).clamp(0.25, 64)
        t = torch.arange(L)
        code = level.to(torch.float8_e4m3fn).view(torch.uint8).to(kb.device)
        kb[bt[b, t // ps].to(kb.device), (t % ps).to(kb.device)] = code[:, None, None]
    return p


def op_args(p):
    """Positional arguments of torch.ops.sm70attn.paged_attention for a problem dict."""
    return (
        p["query"],
        p["key_cache"],
        p["value_cache"],
        p["block_table"],
        p["seq_lens"],
        p["scale"],
        p["k_scale"],
        p["v_scale"],
    )


def random_geometry(rng) -> dict:
    """make_problem keyword arguments of one random valid call (any head dim, group, rows,
    batch, page size, lengths from 0 to past a few pages, layout, scale shape, query strides),
    drawn from `rng` (a random.Random): the seeded sweeps of the GPU tests and sanitizers."""
    B, Q = rng.randint(1, 4), rng.randint(1, 16)
    page_size = rng.choice([1, 3, 16, 17, 64, 100, 1648])
    top = rng.choice([40, 400, 3000])
    lens = [rng.choice([0, rng.randint(0, Q), rng.randint(0, top)]) for _ in range(B)]
    return dict(
        B=B,
        H_kv=rng.randint(1, 4),
        G=rng.randint(1, 8),
        Q=Q,
        D=rng.choice([64, 128, 256]),
        page_size=page_size,
        lens=lens,
        layout=rng.choice(["separate", "interleaved", "kv_first", "padded"]),
        per_head_scale=rng.random() < 0.5,
        transposed_query=rng.random() < 0.5,
        extra_pages=rng.randint(0, 2),
        seed=rng.randint(0, 2**31 - 1),
    )


# The route table's cases (torch_sm70attn/routes.py: RULES): (id, the rule the call fails first,
# or "admitted"; make_problem kwargs; {tensor: change}). One case per rule and per tensor it
# reads; tests/test_routes.py checks admit on each (fake CUDA tensors on the CPU), and
# tests/test_cuda.py that the binding's route and reason on the GPU are admit's.
ROUTE_CASES = [
    ("admitted", "admitted", dict(D=128, G=4, Q=2), {}),
    ("query dtype", "query dtype", dict(D=64, G=2, Q=1), {"query": "float32"}),
    ("key_cache dtype", "key_cache dtype", dict(D=64, G=2, Q=1), {"key_cache": "uint8"}),
    ("value_cache dtype", "value_cache dtype", dict(D=64, G=2, Q=1), {"value_cache": "uint8"}),
    ("disabled", "TORCH_SM70ATTN_DISABLE", dict(D=64, G=2, Q=1), {}),  # the test sets it
    ("device cpu", "device", dict(D=64, G=2, Q=1), {}),  # the test keeps the tensors on the CPU
    ("sm_61", "compute capability", dict(D=64, G=2, Q=1), {}),  # (on the CPU: a faked sm_61)
    ("head dim 96", "head dim", dict(D=96, G=4, Q=1), {}),
    ("group size 12", "group size", dict(D=64, G=12, Q=1), {}),
    ("query rows 0", "query rows", dict(D=64, G=2, Q=0), {}),
    ("query rows 17", "query rows", dict(D=64, G=2, Q=17), {}),
    (
        "table capacity",
        "table capacity",
        dict(D=64, G=2, Q=1, page_size=4096, lens=[100, 37], extra_pages=64),
        {},
    ),
    ("key_cache offset", "key_cache alignment", dict(D=64, G=2, Q=1), {"key_cache": "offset"}),
    ("key_cache stride", "key_cache alignment", dict(D=64, G=2, Q=1), {"key_cache": "stride"}),
    (
        "value_cache offset",
        "value_cache alignment",
        dict(D=64, G=2, Q=1),
        {"value_cache": "offset"},
    ),
    (
        "value_cache stride",
        "value_cache alignment",
        dict(D=64, G=2, Q=1),
        {"value_cache": "stride"},
    ),
    (
        "both caches offset",  # the first rule failed is the reason
        "key_cache alignment",
        dict(D=64, G=2, Q=1),
        {"key_cache": "offset", "value_cache": "offset"},
    ),
]


def route_case_problem(case, device="cpu"):
    """make_problem(B=2, H_kv=1, **kwargs) with the case's changes, on `device`."""
    _, _, kw, changes = case
    p = make_problem(B=2, H_kv=1, device=device, **kw)
    for name, change in changes.items():
        t = p[name]
        if change == "float32":
            p[name] = t.float()
        elif change == "uint8":
            p[name] = t.view(torch.uint8)
        elif change in ("offset", "stride"):
            # The same values one byte into rows 8 bytes wider (an odd offset, aligned strides),
            # or in rows 1 byte wider (offset 0, odd strides).
            D = t.shape[-1]
            extra, start = (8, 1) if change == "offset" else (1, 0)
            wide = torch.zeros(*t.shape[:-1], D + extra, dtype=t.dtype, device=t.device)
            wide[..., start : start + D] = t
            p[name] = wide[..., start : start + D]
        else:
            raise ValueError(change)
    return p


def make_varlen_problem(
    q_lens=(1, 5, 40, 0, 19), pasts=(30, 7, 0, 12, 100), *, H_kv=2, G=3, D=64, page_size=16,
    pad_tokens=3, device="cpu", seed=0, **kw,
):  # fmt: skip
    """Inputs of paged_attention_varlen as a dict: make_problem's caches and table for lengths
    past + q, the requests' query rows packed into query [T, H_q, D] (T = their sum plus
    pad_tokens padding rows at the end), query_start_loc [B + 1]."""
    lens = [p + q for p, q in zip(q_lens, pasts, strict=True)]
    p = make_problem(
        B=len(lens), H_kv=H_kv, G=G, Q=1, D=D, page_size=page_size, lens=lens, device=device,
        seed=seed, **kw,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    T = sum(q_lens) + pad_tokens
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    del p["query"]
    return dict(
        query=torch.randn(T, H_kv * G, D, generator=g).half().to(device),
        query_start_loc=qsl.to(device),
        **p,
    )


def varlen_args(p):
    """The raw op's positional arguments, in its schema's order."""
    keys = ("query", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens")
    return (*(p[k] for k in keys), p["scale"], p["k_scale"], p["v_scale"])


def special_values(n, gen):
    """fp16 values that exercise every rounding case once divided by the scale."""
    parts = [
        torch.randn(n, generator=gen) * 100,  # in range
        torch.randn(n, generator=gen) * 1e4,  # saturates
        torch.rand(n, generator=gen) * 2**-6,  # E4M3 subnormals (after scale 1)
        torch.tensor(
            [
                0.0,
                -0.0,
                float("inf"),
                float("-inf"),
                float("nan"),
                448,
                464,
                465,
                480,
                -464,
                2**-9,
                2**-10,
                3 * 2**-10,
                2**-10 * 1.0001,
                6e-8,
                240,
                232,
                248,
            ]
        ),
        (torch.rand(n, generator=gen) * 2**-14),  # fp16 subnormals
    ]
    x = torch.cat(parts)
    # Exact midpoints between neighbouring E4M3 values: ties must go to the even code.
    from oracle import _POS

    mids = torch.tensor((_POS[1:] + _POS[:-1]) / 2)
    return torch.cat([x, mids, -mids]).half()
