"""The FX rewrites on the CPU: each accepted idiom is rewritten (graph before and after,
compiled equals eager) and has a negative twin that must stay unchanged."""

import logging
import operator

import expecttest
import pytest
import torch
import torch.nn.functional as F
from helpers_models import Decoder, q8, repeat_kv, write_slots
from oracle import rel_err
from torch._dynamo.utils import counters
from torch_sm70attn.fx_passes import paged_attention as attention_pass

import torch_sm70attn as sa
from torch_sm70attn import backend as sa_backend

FP8 = torch.float8_e4m3fn
G = 6


# --- a graph printer that does not depend on Dynamo's naming --------------------------------
def _target(n: torch.fx.Node) -> str:
    if n.op == "call_method":
        return "." + n.target
    t = n.target
    if t is torch._C._nn.scaled_dot_product_attention:
        return "sdpa"
    if isinstance(t, torch._ops.OpOverload):
        return str(t).replace(".default", "")
    if t is operator.setitem:
        return "setitem"
    return getattr(t, "__name__", str(t))


def show(graph: torch.fx.Graph) -> str:
    names, lines = {}, []
    for n in graph.nodes:
        if n.op == "placeholder":
            names[n] = n.target.removeprefix("L_").removesuffix("_").lower()
            continue
        if n.op == "output":
            out = torch.fx.node.map_arg(n.args[0], lambda a: names[a])
            lines.append(f"return {out}".replace("'", ""))
            continue
        names[n] = f"v{sum(1 for m in names if m.op != 'placeholder')}"

        def fmt(a):
            return torch.fx.node.map_arg(a, lambda x: names[x])

        args = ", ".join(
            [repr(fmt(a)) for a in n.args] + [f"{k}={fmt(v)!r}" for k, v in n.kwargs.items()]
        )
        lines.append(f"{names[n]} = {_target(n)}({args})".replace("'", ""))
    return "\n".join(lines)


class Captured:
    """A backend that keeps the graph before and after the rewrite, then runs it eagerly."""

    def __init__(self):
        self.before = self.after = None

    def __call__(self, gm, example_inputs):
        self.before = show(gm.graph)
        sa_backend.rewrite(gm.graph)
        gm.recompile()
        self.after = show(gm.graph)
        return gm.forward


def compile_and_run(fn, *args, warmup=None):
    """Compile `fn` with the rewrite and run it on `args`. With `warmup` (other arguments of
    other sizes), run those first: Dynamo then recompiles for `args` with automatic dynamic
    shapes, as in a serving loop, and `cap` holds that second, symbolic graph."""
    torch._dynamo.reset()
    counters.clear()
    cap = Captured()
    compiled = torch.compile(fn, backend=cap, fullgraph=True)
    if warmup is not None:
        compiled(*warmup)
        counters.clear()
    out = compiled(*args)
    return cap, out, dict(counters["sm70attn"])


# --- problems ------------------------------------------------------------------------------
def problem(B=2, H=2, Q=4, D=64, P=12, ps=16, W=3, per_head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, Q, D, generator=g).half()
    kc = (torch.randn(P, ps, H, D, generator=g) * 8).to(FP8)
    vc = (torch.randn(P, ps, H, D, generator=g) * 8).to(FP8)
    bt = torch.randperm(P, generator=g)[: B * W].view(B, W).int()
    sl = torch.randint(Q, W * ps + 1, (B,), generator=g).int()
    shape = (H,) if per_head else ()
    ks = torch.rand(shape, generator=g) * 0.1 + 0.08
    vs = torch.rand(shape, generator=g) * 0.1 + 0.08
    return q, kc, vc, bt, sl, ks, vs


# --- accepted idioms -------------------------------------------------------------------------
def plain(q, kc, vc, bt, sl, ks, vs):
    """Plain PyTorch: gather, flatten, convert, scale, transpose, repeat_interleave."""
    k = kc[bt].flatten(1, 2).to(torch.float16) * ks
    v = vc[bt].flatten(1, 2).to(torch.float16) * vs
    k = k.transpose(1, 2).repeat_interleave(G, dim=1)
    v = v.transpose(1, 2).repeat_interleave(G, dim=1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# repeat_kv (HF transformers' own) is in helpers_models.py, with the toy decoder made of it.
def hf(q, kc, vc, bt, sl, ks, vs):
    """HF style: .half(), scale, transpose, repeat_kv; mask built once."""
    k = (kc[bt.long()].flatten(1, 2).half() * ks).transpose(1, 2)
    v = (vc[bt.long()].flatten(1, 2).half() * vs).transpose(1, 2)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=mask)


def gqa(q, kc, vc, bt, sl, ks, vs):
    """index_select on the page view, via float32, per-head scale, permute, enable_gqa."""
    B = q.shape[0]
    _, ps, H, D = kc.shape
    k = torch.index_select(kc, 0, bt.view(-1)).view(B, -1, H, D).float() * ks.view(1, 1, H, 1)
    v = torch.index_select(vc, 0, bt.view(-1)).view(B, -1, H, D).float() * vs.view(1, 1, H, 1)
    k, v = k.half().permute(0, 2, 1, 3), v.half().permute(0, 2, 1, 3)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def reshape_first(q, kc, vc, bt, sl, ks, vs):
    """Layout first (reshape, permute, contiguous), dequantize last, python float scale."""
    B = q.shape[0]
    _, ps, H, D = kc.shape
    k = kc[bt].reshape(B, -1, H, D).permute(0, 2, 1, 3).contiguous().to(dtype=torch.float16) * 0.09
    v = vc[bt].reshape(B, -1, H, D).permute(0, 2, 1, 3).contiguous().to(dtype=torch.float16) * 0.07
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1)


# The "before" graphs are Dynamo's output: pinned to the torch that CI installs (2.13.0);
# regenerate with EXPECTTEST_ACCEPT=1 when that pin moves. The "after" graphs are the pass's.
def gqa_kv(kc, vc, bt, ks, vs):
    """K and V gathered, dequantized and expanded to the query heads ([B, H_q, T, D])."""
    k = (kc[bt].flatten(1, 2).half() * ks).transpose(1, 2).repeat_interleave(G, dim=1)
    v = (vc[bt].flatten(1, 2).half() * vs).transpose(1, 2).repeat_interleave(G, dim=1)
    return k, v


def arange_mask(q, kc, vc, bt, sl, ks, vs):
    """The verifier mask written out with arange comparisons instead of verifier_mask."""
    Q = q.shape[2]
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    t = torch.arange(k.shape[2])
    last = sl[:, None] - Q + torch.arange(Q)
    mask = (t[None, None, :] <= last[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_exact_length(q, kc, vc, bt, sl, ks, vs):
    """Decode of one request without a mask: K/V cut to its exact (static) length."""
    L = 37  # tokens of this request; the table holds 3 pages of 16
    k = (kc[bt].flatten(1, 2).half() * ks).transpose(1, 2)[:, :, :L]
    v = (vc[bt].flatten(1, 2).half() * vs).transpose(1, 2)[:, :, :L]
    return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G))


def arange_mask_symbolic(q, kc, vc, bt, sl, ks, vs):
    """The arange mask over T = k.shape[2], HF's repeat_kv: symbolic sizes after a recompile."""
    Q = q.shape[2]
    k = (kc[bt].flatten(1, 2).half() * ks).transpose(1, 2)
    v = (vc[bt].flatten(1, 2).half() * vs).transpose(1, 2)
    t = torch.arange(k.shape[2])
    last = sl[:, None] - Q + torch.arange(Q)
    mask = (t[None, None, :] <= last[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G), attn_mask=mask)


def decode_full_table(q, kc, vc, bt, sl, ks, vs):
    """Decode without a mask: every position of the table is visible (as in eager)."""
    k = (kc[bt].flatten(1, 2).half() * ks).transpose(1, 2)
    v = (vc[bt].flatten(1, 2).half() * vs).transpose(1, 2)
    return F.scaled_dot_product_attention(q, repeat_kv(k, G), repeat_kv(v, G))


# Mask forms users write: view/reshape/unsqueeze/None indexing, < ... + 1, either side.
def view_form(q, kc, vc, bt, sl, ks, vs, plus):
    """t.view(1, 1, 1, T) < (last + plus).reshape(B, 1, Q, 1)."""
    B, _, Q, _ = q.shape
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    T = k.shape[2]
    last = sl.view(B, 1) - Q + torch.arange(Q).view(1, Q)
    mask = torch.arange(T).view(1, 1, 1, T) < (last + plus).reshape(B, 1, Q, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def gt_form(q, kc, vc, bt, sl, ks, vs, plus):
    """last + plus > t with None indexing to 4-D on both sides; int64 arithmetic (.long())."""
    Q = q.shape[2]
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    r = torch.arange(Q)
    mask = (
        sl.long()[:, None, None, None] - Q + r[None, None, :, None] + plus
        > torch.arange(k.shape[2])[None, None, None, :]
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def arange_mask_view(*args):
    """t < last + 1 through view/reshape: the verifier mask."""
    return view_form(*args, plus=1)


def arange_mask_unsqueeze_ge(q, kc, vc, bt, sl, ks, vs):
    """last.unsqueeze(-1) >= t, the bound on the left; the head dim by unsqueeze(1)."""
    Q = q.shape[2]
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    last = sl.unsqueeze(1) - Q + torch.arange(Q).unsqueeze(0)
    mask = (last.unsqueeze(-1) >= torch.arange(k.shape[2])).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def arange_mask_gt(*args):
    """last + 1 > t: the verifier mask."""
    return gt_form(*args, plus=1)


def arange_mask_view_off_by_one(*args):
    """t < last instead of t < last + 1: one key fewer per row."""
    return view_form(*args, plus=0)


def arange_mask_gt_off_by_one(*args):
    """last + 2 > t: one key more per row."""
    return gt_form(*args, plus=2)


def offset_form(q, kc, vc, bt, sl, ks, vs, plus, past=None):
    """transformers' sdpa mask: kv_arange <= arange(Q) + past, [1, 1, Q, T] expanded over the
    batch; every request holds past + Q tokens (past: an int, or a 0-d tensor)."""
    B, _, Q, _ = q.shape
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    past = sl.max() - Q if past is None else past
    kv = torch.arange(k.shape[2])[None, None, None, :]
    rows = (torch.arange(Q) + past + plus)[None, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(kv <= rows).expand(B, -1, -1, -1))


def offset_mask_int(*args):
    """past an int: seq_lens = full(B, 30 + Q)."""
    return offset_form(*args, plus=0, past=30)


def offset_mask_tensor(*args):
    """past a 0-d tensor (sl.max() - Q): seq_lens = full(B, sl.max())."""
    return offset_form(*args, plus=0)


def offset_mask_past_the_table(*args):
    """past 60 with 48 keys gathered: every row sees every key, which seq_lens = 64 (clamped
    to the table's 48 by the op) would not give the first rows."""
    return offset_form(*args, plus=0, past=60)


def arange_mask_regrouped(q, kc, vc, bt, sl, ks, vs):
    """last [B, Q] reshaped through [Q, B]: the rows of different requests mixed up."""
    B, _, Q, _ = q.shape
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    T = k.shape[2]
    last = sl.view(B, 1) - Q + torch.arange(Q).view(1, Q)
    mask = torch.arange(T).view(1, 1, 1, T) <= last.reshape(Q, B).reshape(B, 1, Q, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attn(expecttest.TestCase):
    def run_fn(self, fn, args, warmup=None):
        """Compile with the rewrite; one rewrite, compiled equals eager; the captured graphs."""
        cap, out, ctr = compile_and_run(fn, *args, warmup=warmup)
        self.assertEqual(ctr.get("paged_attention_rewrite"), 1)
        err = rel_err(out, fn(*args).double())
        assert err < 2e-3, err
        return cap

    def test_plain(self):
        cap = self.run_fn(plain, problem())
        self.assertExpectedInline(
            cap.before,
            """\
v0 = getitem(kc, bt)
v1 = .flatten(v0, 1, 2)
v2 = .to(v1, torch.float16)
v3 = mul(v2, ks)
v4 = getitem(vc, bt)
v5 = .flatten(v4, 1, 2)
v6 = .to(v5, torch.float16)
v7 = mul(v6, vs)
v8 = .transpose(v3, 1, 2)
v9 = .repeat_interleave(v8, 6, dim=1)
v10 = .transpose(v7, 1, 2)
v11 = .repeat_interleave(v10, 6, dim=1)
v12 = sm70attn.verifier_mask(sl, 4, 48)
v13 = sdpa(q, v9, v11, attn_mask=v12)
return (v13,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .reshape(ks, (-1,))
v1 = .to(v0, device=device(type=cpu), dtype=torch.float32)
v2 = .reshape(vs, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = sm70attn.paged_attention(q, kc, vc, bt, sl, 0.125, v1, v3)
return (v4,)""",
        )

    def test_hf_repeat_kv(self):
        cap = self.run_fn(hf, problem(seed=1))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = .long(bt)
v1 = getitem(kc, v0)
v2 = .flatten(v1, 1, 2)
v3 = .half(v2)
v4 = mul(v3, ks)
v5 = .transpose(v4, 1, 2)
v6 = .long(bt)
v7 = getitem(vc, v6)
v8 = .flatten(v7, 1, 2)
v9 = .half(v8)
v10 = mul(v9, vs)
v11 = .transpose(v10, 1, 2)
v12 = sm70attn.verifier_mask(sl, 4, 48)
v13 = getitem(v5, (slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None)))
v14 = .expand(v13, 2, 2, 6, 48, 64)
v15 = .reshape(v14, 2, 12, 48, 64)
v16 = getitem(v11, (slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None)))
v17 = .expand(v16, 2, 2, 6, 48, 64)
v18 = .reshape(v17, 2, 12, 48, 64)
v19 = sdpa(q, v15, v18, attn_mask=v12)
return (v19,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .reshape(ks, (-1,))
v1 = .to(v0, device=device(type=cpu), dtype=torch.float32)
v2 = .reshape(vs, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = sm70attn.paged_attention(q, kc, vc, bt, sl, 0.125, v1, v3)
return (v4,)""",
        )

    def test_index_select_enable_gqa_per_head_scale(self):
        cap = self.run_fn(gqa, problem(per_head=True, seed=2))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = .view(bt, -1)
v1 = index_select(kc, 0, v0)
v2 = .view(v1, 2, -1, 2, 64)
v3 = .float(v2)
v4 = .view(ks, 1, 1, 2, 1)
v5 = mul(v3, v4)
v6 = .view(bt, -1)
v7 = index_select(vc, 0, v6)
v8 = .view(v7, 2, -1, 2, 64)
v9 = .float(v8)
v10 = .view(vs, 1, 1, 2, 1)
v11 = mul(v9, v10)
v12 = .half(v5)
v13 = .permute(v12, 0, 2, 1, 3)
v14 = .half(v11)
v15 = .permute(v14, 0, 2, 1, 3)
v16 = sm70attn.verifier_mask(sl, 4, 48)
v17 = sdpa(q, v13, v15, attn_mask=v16, enable_gqa=True)
return (v17,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .view(ks, 1, 1, 2, 1)
v1 = .view(vs, 1, 1, 2, 1)
v2 = .reshape(v0, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = .reshape(v1, (-1,))
v5 = .to(v4, device=device(type=cpu), dtype=torch.float32)
v6 = sm70attn.paged_attention(q, kc, vc, bt, sl, 0.125, v3, v5)
return (v6,)""",
        )

    def test_layout_before_conversion_float_scale(self):
        cap = self.run_fn(reshape_first, problem(seed=3))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = getitem(kc, bt)
v1 = .reshape(v0, 2, -1, 2, 64)
v2 = .permute(v1, 0, 2, 1, 3)
v3 = .contiguous(v2)
v4 = .to(v3, dtype=torch.float16)
v5 = mul(v4, 0.09)
v6 = getitem(vc, bt)
v7 = .reshape(v6, 2, -1, 2, 64)
v8 = .permute(v7, 0, 2, 1, 3)
v9 = .contiguous(v8)
v10 = .to(v9, dtype=torch.float16)
v11 = mul(v10, 0.07)
v12 = .repeat_interleave(v5, 6, 1)
v13 = .repeat_interleave(v11, 6, 1)
v14 = sm70attn.verifier_mask(sl, 4, 48)
v15 = sdpa(q, v12, v13, attn_mask=v14, scale=0.1)
return (v15,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = full((), 0.09, dtype=torch.float32, device=device(type=cpu))
v1 = full((), 0.07, dtype=torch.float32, device=device(type=cpu))
v2 = sm70attn.paged_attention(q, kc, vc, bt, sl, 0.1, v0, v1)
return (v2,)""",
        )

    def test_decode_without_mask_exact_length(self):
        cap = self.run_fn(decode_exact_length, problem(B=1, Q=1, seed=6))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = getitem(kc, bt)
v1 = .flatten(v0, 1, 2)
v2 = .half(v1)
v3 = mul(v2, ks)
v4 = .transpose(v3, 1, 2)
v5 = getitem(v4, (slice(None, None, None), slice(None, None, None), slice(None, 37, None)))
v6 = getitem(vc, bt)
v7 = .flatten(v6, 1, 2)
v8 = .half(v7)
v9 = mul(v8, vs)
v10 = .transpose(v9, 1, 2)
v11 = getitem(v10, (slice(None, None, None), slice(None, None, None), slice(None, 37, None)))
v12 = getitem(v5, (slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None)))
v13 = .expand(v12, 1, 2, 6, 37, 64)
v14 = .reshape(v13, 1, 12, 37, 64)
v15 = getitem(v11, (slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None)))
v16 = .expand(v15, 1, 2, 6, 37, 64)
v17 = .reshape(v16, 1, 12, 37, 64)
v18 = sdpa(q, v14, v17)
return (v18,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = full((1,), 37, dtype=torch.int32, device=device(type=cpu))
v1 = .reshape(ks, (-1,))
v2 = .to(v1, device=device(type=cpu), dtype=torch.float32)
v3 = .reshape(vs, (-1,))
v4 = .to(v3, device=device(type=cpu), dtype=torch.float32)
v5 = sm70attn.paged_attention(q, kc, vc, bt, v0, 0.125, v2, v4)
return (v5,)""",
        )

    def test_arange_mask(self):
        cap = self.run_fn(arange_mask, problem(seed=7))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = getitem(kc, bt)
v1 = .flatten(v0, 1, 2)
v2 = .half(v1)
v3 = mul(v2, ks)
v4 = .transpose(v3, 1, 2)
v5 = .repeat_interleave(v4, 6, dim=1)
v6 = getitem(vc, bt)
v7 = .flatten(v6, 1, 2)
v8 = .half(v7)
v9 = mul(v8, vs)
v10 = .transpose(v9, 1, 2)
v11 = .repeat_interleave(v10, 6, dim=1)
v12 = arange(48)
v13 = getitem(sl, (slice(None, None, None), None))
v14 = sub(v13, 4)
v15 = arange(4)
v16 = add(v14, v15)
v17 = getitem(v12, (None, None, slice(None, None, None)))
v18 = getitem(v16, (slice(None, None, None), slice(None, None, None), None))
v19 = le(v17, v18)
v20 = getitem(v19, (slice(None, None, None), None))
v21 = sdpa(q, v5, v11, attn_mask=v20)
return (v21,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .reshape(ks, (-1,))
v1 = .to(v0, device=device(type=cpu), dtype=torch.float32)
v2 = .reshape(vs, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = sm70attn.paged_attention(q, kc, vc, bt, sl, 0.125, v1, v3)
return (v4,)""",
        )

    def test_symbolic_batch_and_table_width(self):
        # After a recompile with automatic dynamic shapes B (s19) and the table width (s95)
        # are symbolic; T = k.shape[2] is 16 * s95. The same rewrite, with no guard added.
        cap = self.run_fn(arange_mask_symbolic, problem(B=3, W=4, seed=8), problem(B=2, W=3))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = getitem(kc, bt)
v1 = .flatten(v0, 1, 2)
v2 = .half(v1)
v3 = mul(v2, ks)
v4 = .transpose(v3, 1, 2)
v5 = getitem(vc, bt)
v6 = .flatten(v5, 1, 2)
v7 = .half(v6)
v8 = mul(v7, vs)
v9 = .transpose(v8, 1, 2)
v10 = mul(16, s95)
v11 = arange(v10)
v12 = getitem(sl, (slice(None, None, None), None))
v13 = sub(v12, 4)
v14 = arange(4)
v15 = add(v13, v14)
v16 = getitem(v11, (None, None, slice(None, None, None)))
v17 = getitem(v15, (slice(None, None, None), slice(None, None, None), None))
v18 = le(v16, v17)
v19 = getitem(v18, (slice(None, None, None), None))
v20 = getitem(v4, (slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None)))
v21 = .expand(v20, s19, 2, 6, v10, 64)
v22 = .reshape(v21, s19, 12, v10, 64)
v23 = getitem(v9, (slice(None, None, None), slice(None, None, None), None, slice(None, None, None), slice(None, None, None)))
v24 = .expand(v23, s19, 2, 6, v10, 64)
v25 = .reshape(v24, s19, 12, v10, 64)
v26 = sdpa(q, v22, v25, attn_mask=v19)
return (v26,)""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .reshape(ks, (-1,))
v1 = .to(v0, device=device(type=cpu), dtype=torch.float32)
v2 = .reshape(vs, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = sm70attn.paged_attention(q, kc, vc, bt, sl, 0.125, v1, v3)
return (v4,)""",
        )

    def test_decode_without_mask_symbolic_length(self):
        # Decode (Q = 1) without a mask attends to every gathered position: the op with
        # seq_lens = the table's capacity, built from the symbolic B and table width.
        cap = self.run_fn(decode_full_table, problem(B=3, W=4, Q=1, seed=9), problem(B=2, W=3, Q=1))
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .size(bt, 1)
v1 = mul(v0, 16)
v2 = .size(bt, 0)
v3 = full((v2,), v1, dtype=torch.int32, device=device(type=cpu))
v4 = .reshape(ks, (-1,))
v5 = .to(v4, device=device(type=cpu), dtype=torch.float32)
v6 = .reshape(vs, (-1,))
v7 = .to(v6, device=device(type=cpu), dtype=torch.float32)
v8 = sm70attn.paged_attention(q, kc, vc, bt, v3, 0.125, v5, v7)
return (v8,)""",
        )

    def test_batch_one_one_kv_head(self):
        # Size-1 dims (B = 1, H_kv = 1) are dropped from the tracking: same rewrite.
        cap, out, ctr = compile_and_run(hf, *problem(B=1, H=1, seed=4))
        self.assertEqual(ctr.get("paged_attention_rewrite"), 1)


@pytest.mark.parametrize(
    "fn",
    [
        arange_mask_view,
        arange_mask_unsqueeze_ge,
        arange_mask_gt,
        offset_mask_int,
        offset_mask_tensor,
    ],
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_mask_forms(fn, dynamic):
    args = problem(B=3, W=4, seed=10)
    cap, out, ctr = compile_and_run(fn, *args, warmup=problem(B=2, W=3) if dynamic else None)
    assert ctr.get("paged_attention_rewrite") == 1, ctr
    assert rel_err(out, fn(*args).double()) < 2e-3


# --- negative twins: each must leave the graph unchanged ------------------------------------
def reused(q, kc, vc, bt, sl, ks, vs):
    k = kc[bt].flatten(1, 2).to(torch.float16) * ks
    v = vc[bt].flatten(1, 2).to(torch.float16) * vs
    kk = k.transpose(1, 2).repeat_interleave(G, dim=1)
    vv = v.transpose(1, 2).repeat_interleave(G, dim=1)
    mask = sa.verifier_mask(sl, q.shape[2], kk.shape[2])
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask), k.sum()


def group_major(q, kc, vc, bt, sl, ks, vs):
    # None before the head dim: query head h reads KV head h % H_kv, not h // G.
    def rep(x, n):
        b, h, s, d = x.shape
        return x[:, None].expand(b, n, h, s, d).reshape(b, h * n, s, d)

    k = (kc[bt].flatten(1, 2).half() * ks).transpose(1, 2)
    v = (vc[bt].flatten(1, 2).half() * vs).transpose(1, 2)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, rep(k, G), rep(v, G), attn_mask=mask)


def own_mask(q, kc, vc, bt, sl, ks, vs):
    B = q.shape[0]
    _, ps, H, D = kc.shape
    k = torch.index_select(kc, 0, bt.view(-1)).view(B, -1, H, D).float() * ks.view(1, 1, H, 1)
    v = torch.index_select(vc, 0, bt.view(-1)).view(B, -1, H, D).float() * vs.view(1, 1, H, 1)
    k, v = k.half().permute(0, 2, 1, 3), v.half().permute(0, 2, 1, 3)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def wrong_table_order(q, kc, vc, bt, sl, ks, vs):
    # Pages flattened column-major: not the block table's order.
    B = q.shape[0]
    _, ps, H, D = kc.shape
    k = kc[bt.t()].transpose(0, 1).reshape(B, -1, H, D).to(torch.float16) * 0.09
    v = vc[bt].reshape(B, -1, H, D).to(torch.float16) * 0.07
    k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1)


def e5m2_cache(q, kc, vc, bt, sl, ks, vs):
    return plain(q, kc.to(torch.float8_e5m2), vc.to(torch.float8_e5m2), bt, sl, ks, vs)


def head_dim_96(q, kc, vc, bt, sl, ks, vs):
    return plain(q[..., :48].contiguous(), kc[..., :48], vc[..., :48], bt, sl, ks, vs)


def dropout(q, kc, vc, bt, sl, ks, vs):
    k = kc[bt].flatten(1, 2).to(torch.float16).transpose(1, 2).repeat_interleave(G, dim=1)
    v = vc[bt].flatten(1, 2).to(torch.float16).transpose(1, 2).repeat_interleave(G, dim=1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)


def different_tables(q, kc, vc, bt, sl, ks, vs):
    k = kc[bt].flatten(1, 2).to(torch.float16) * ks
    v = vc[bt.flip(1)].flatten(1, 2).to(torch.float16) * vs
    k = k.transpose(1, 2).repeat_interleave(G, dim=1)
    v = v.transpose(1, 2).repeat_interleave(G, dim=1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def arange_mask_off_by_one(q, kc, vc, bt, sl, ks, vs):
    # t < last instead of t <= last: each row sees one key fewer than the op would.
    Q = q.shape[2]
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    t = torch.arange(k.shape[2])
    last = sl[:, None] - Q + torch.arange(Q)
    mask = (t[None, None, :] < last[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def cache_written_after_gather(q, kc, vc, bt, sl, ks, vs):
    # The op would read the cache at the SDPA, after this write; eager read it before.
    k = kc[bt].flatten(1, 2).to(torch.float16) * ks
    v = vc[bt].flatten(1, 2).to(torch.float16) * vs
    kc.view(-1, kc.shape[2], kc.shape[3])[bt[:, 0].long() * kc.shape[1]] = torch.full(
        (q.shape[0], kc.shape[2], kc.shape[3]), 100.0
    ).to(FP8)
    k = k.transpose(1, 2).repeat_interleave(G, dim=1)
    v = v.transpose(1, 2).repeat_interleave(G, dim=1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def reinterpreted_cache(q, kc, vc, bt, sl, ks, vs):
    # A dtype view is not a dequantization.
    k = kc[bt].view(torch.float8_e5m2).flatten(1, 2).half().transpose(1, 2).repeat_interleave(G, 1)
    v = vc[bt].flatten(1, 2).half().transpose(1, 2).repeat_interleave(G, 1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def arange_mask_alpha(q, kc, vc, bt, sl, ks, vs):
    # torch.add(..., alpha=2) is seq_len - Q + 2r, not the verifier mask.
    Q = q.shape[2]
    k, v = gqa_kv(kc, vc, bt, ks, vs)
    last = torch.add(sl[:, None] - Q, torch.arange(Q), alpha=2)
    mask = (torch.arange(k.shape[2])[None, None, :] <= last[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def verify_without_mask(q, kc, vc, bt, sl, ks, vs):
    # Q = 4 rows with no mask all see the same keys: not the op's verifier semantics.
    return decode_exact_length(q, kc, vc, bt, sl, ks, vs)


def per_query_head_scale(q, kc, vc, bt, sl, ks, vs):
    qs = torch.linspace(0.05, 0.1, q.shape[1]).view(1, -1, 1, 1)
    k = (kc[bt].flatten(1, 2).half().transpose(1, 2).repeat_interleave(G, dim=1) * qs).half()
    v = vc[bt].flatten(1, 2).half().transpose(1, 2).repeat_interleave(G, dim=1)
    mask = sa.verifier_mask(sl, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "fn, reason",
    [
        (reused, "is used elsewhere"),
        (group_major, "arrives as"),
        (own_mask, "attn_mask is not sm70attn.verifier_mask"),
        (wrong_table_order, "arrives as"),
        (e5m2_cache, "does not come from a page gather"),
        (head_dim_96, "head dim 48"),
        (dropout, "dropout_p"),
        (different_tables, "different block tables"),
        (per_query_head_scale, "does not vary along the KV heads alone"),
        (verify_without_mask, "no attn_mask with Q = 4 > 1"),
        (arange_mask_off_by_one, "arange mask is not t <= seq_len - Q + r"),
        (cache_written_after_gather, "may write"),
        (reinterpreted_cache, "reinterprets K/V as torch.float8_e5m2"),
        (arange_mask_alpha, "alpha"),
        (arange_mask_view_off_by_one, "arange mask is not t <= seq_len - Q + r"),
        (arange_mask_gt_off_by_one, "arange mask is not t <= seq_len - Q + r"),
        (arange_mask_regrouped, "only size-1 dims may change"),
        (offset_mask_past_the_table, "more than the 48 keys"),
    ],
)
def test_negative_twins(fn, reason, caplog):
    args = problem(per_head=fn is own_mask)
    eager_args = [a.clone() for a in args]  # some twins write their inputs
    with caplog.at_level(logging.DEBUG, logger="torch_sm70attn"):
        cap, out, ctr = compile_and_run(fn, *args)
    assert cap.before == cap.after, "graph changed"
    assert ctr.get("paged_attention_rewrite") is None and ctr.get("sdpa_refused") == 1
    assert reason in caplog.text, caplog.text
    if fn is not dropout:  # the unchanged graph computes what eager does
        torch.testing.assert_close(out, fn(*eager_args))


def test_disable_switch_refuses(monkeypatch, caplog):
    monkeypatch.setenv("TORCH_SM70ATTN_DISABLE", "1")
    monkeypatch.setattr(attention_pass, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="torch_sm70attn"):
        cap, _, ctr = compile_and_run(plain, *problem())
    assert cap.before == cap.after and ctr.get("sdpa_refused") == 1
    assert not caplog.records  # asked for: no warning


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_refusal_warns_once_per_site_with_cause_and_fix(monkeypatch, caplog):
    monkeypatch.setattr(attention_pass, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="torch_sm70attn"):
        _, _, ctr = compile_and_run(own_mask, *problem(per_head=True))
        assert ctr.get("sdpa_refused") == 1
        # a recompile (new batch size) refuses again, counted, but the warning is not repeated
        _, _, ctr = compile_and_run(own_mask, *problem(B=3, per_head=True))
        assert ctr.get("sdpa_refused") == 1
    (msg,) = warnings_of(caplog)
    assert "the attention at " in msg and "test_fx_passes.py:" in msg and "in own_mask" in msg
    assert "stays on the slow gather path: attn_mask is not sm70attn.verifier_mask" in msg
    assert "To fix: pass attn_mask=torch_sm70attn.verifier_mask(seq_lens, Q, k.shape[2])" in msg


def test_refusal_of_a_reused_gather_names_the_user(monkeypatch, caplog):
    monkeypatch.setattr(attention_pass, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="torch_sm70attn"):
        compile_and_run(reused, *problem())
    (msg,) = warnings_of(caplog)
    assert "is used elsewhere (by " in msg and "To fix: use the dequantized K/V only" in msg


def test_no_warning_for_attention_without_a_float8_cache(monkeypatch, caplog):
    monkeypatch.setattr(attention_pass, "_warned", set())

    def fp16_attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (torch.randn(2, 4, 8, 64).half() for _ in range(3))
    with caplog.at_level(logging.WARNING, logger="torch_sm70attn"):
        cap, _, ctr = compile_and_run(fp16_attention, q, k, v)
    assert cap.before == cap.after and ctr.get("sdpa_refused") == 1
    assert not warnings_of(caplog)


# --- the cache write -------------------------------------------------------------------------
# q8 and write_slots (vLLM-style slot assignment) are in helpers_models.py, with the toy decoder
# that writes its caches with them.
def write_index_put(k, v, kc, vc, slots, ks, vs):
    """index_put_ / index_copy_ on the view, the division in float32, clamp(min=, max=)."""
    H, D = kc.shape[2:]
    kc.view(-1, H, D).index_put_((slots,), (k.float() / ks).clamp(min=-448, max=448).to(FP8))
    vc.view(-1, H, D).index_copy_(0, slots, torch.clamp(v.float() / vs, -448, 448).to(FP8))


def write_page_offset(k, v, kc, vc, slots, ks, vs):
    """cache[slot // page_size, slot % page_size] = ..., per-KV-head scales."""
    ps = kc.shape[1]
    # a [H, 1] fp32 scale promotes fp16 x: the division is in float32 without .float()
    kc[slots // ps, slots % ps] = (k / ks.view(-1, 1)).clamp(-448, 448).to(FP8)
    vc[slots // ps, slots % ps] = (v / vs.view(-1, 1)).clamp(-448, 448).to(FP8)


def store_problem(per_head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    P, ps, H, D, T = 6, 16, 2, 64, 9
    k = (torch.randn(T, H, D, generator=g) * 40).half()
    v = (torch.randn(T, H, D, generator=g) * 40).half()
    kc = (torch.randn(P, ps, H, D, generator=g) * 8).to(FP8)
    vc = (torch.randn(P, ps, H, D, generator=g) * 8).to(FP8)
    slots = torch.randperm(P * ps, generator=g)[:T]
    shape = (H,) if per_head else ()
    ks = torch.rand(shape, generator=g) * 0.2 + 0.05
    vs = torch.rand(shape, generator=g) * 0.2 + 0.05
    return k, v, kc, vc, slots, ks, vs


class Store(expecttest.TestCase):
    def run_fn(self, fn, args):
        """Rewrites into one store_kv; the caches end bit-equal to eager slot assignment."""
        eager = [a.clone() for a in args]
        write_slots(*eager) if fn is not write_page_offset else write_page_offset(*eager)
        cap, _, ctr = compile_and_run(fn, *args)
        self.assertEqual(ctr.get("store_kv_rewrite"), 1)
        for got, want in ((args[2], eager[2]), (args[3], eager[3])):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return cap

    def test_slot_assignment(self):
        cap = self.run_fn(write_slots, store_problem())
        self.assertExpectedInline(
            cap.before,
            """\
v0 = .float(k)
v1 = truediv(v0, ks)
v2 = .clamp(v1, -448, 448)
v3 = .to(v2, torch.float8_e4m3fn)
v4 = .view(kc, -1, 2, 64)
v5 = setitem(v4, slots, v3)
v6 = .float(v)
v7 = truediv(v6, vs)
v8 = .clamp(v7, -448, 448)
v9 = .to(v8, torch.float8_e4m3fn)
v10 = .view(vc, -1, 2, 64)
v11 = setitem(v10, slots, v9)
return ()""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .reshape(ks, (-1,))
v1 = .to(v0, device=device(type=cpu), dtype=torch.float32)
v2 = .reshape(vs, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = sm70attn.store_kv(k, v, kc, vc, slots, v1, v3)
return ()""",
        )

    def test_index_put_and_index_copy(self):
        # eager index_copy_ has no float8 CPU kernel: compared against slot assignment
        cap = self.run_fn(write_index_put, store_problem(seed=1))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = .view(kc, -1, 2, 64)
v1 = .float(k)
v2 = truediv(v1, ks)
v3 = .clamp(v2, min=-448, max=448)
v4 = .to(v3, torch.float8_e4m3fn)
v5 = .index_put_(v0, (slots,), v4)
v6 = .view(vc, -1, 2, 64)
v7 = .float(v)
v8 = truediv(v7, vs)
v9 = clamp(v8, -448, 448)
v10 = .to(v9, torch.float8_e4m3fn)
v11 = .index_copy_(v6, 0, slots, v10)
return ()""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .reshape(ks, (-1,))
v1 = .to(v0, device=device(type=cpu), dtype=torch.float32)
v2 = .reshape(vs, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = sm70attn.store_kv(k, v, kc, vc, slots, v1, v3)
return ()""",
        )

    def test_page_offset_per_head_scale(self):
        cap = self.run_fn(write_page_offset, store_problem(per_head=True, seed=2))
        self.assertExpectedInline(
            cap.before,
            """\
v0 = .view(ks, -1, 1)
v1 = truediv(k, v0)
v2 = .clamp(v1, -448, 448)
v3 = .to(v2, torch.float8_e4m3fn)
v4 = floordiv(slots, 16)
v5 = mod(slots, 16)
v6 = setitem(kc, (v4, v5), v3)
v7 = .view(vs, -1, 1)
v8 = truediv(v, v7)
v9 = .clamp(v8, -448, 448)
v10 = .to(v9, torch.float8_e4m3fn)
v11 = floordiv(slots, 16)
v12 = mod(slots, 16)
v13 = setitem(vc, (v11, v12), v10)
return ()""",
        )
        self.assertExpectedInline(
            cap.after,
            """\
v0 = .view(ks, -1, 1)
v1 = .view(vs, -1, 1)
v2 = .reshape(v0, (-1,))
v3 = .to(v2, device=device(type=cpu), dtype=torch.float32)
v4 = .reshape(v1, (-1,))
v5 = .to(v4, device=device(type=cpu), dtype=torch.float32)
v6 = sm70attn.store_kv(k, v, kc, vc, slots, v3, v5)
return ()""",
        )


def no_saturation(k, v, kc, vc, slots, ks, vs):
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = (k / ks).to(FP8)
    vc.view(-1, H, D)[slots] = (v / vs).to(FP8)


def key_only(k, v, kc, vc, slots, ks, vs):
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = q8(k, ks)


def read_between(k, v, kc, vc, slots, ks, vs):
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = q8(k, ks)
    total = kc.float().sum()
    vc.view(-1, H, D)[slots] = q8(v, vs)
    return total


def fp16_division(k, v, kc, vc, slots, ks, vs):
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = (k / ks).clamp(-448, 448).to(FP8)
    vc.view(-1, H, D)[slots] = (v / vs).clamp(-448, 448).to(FP8)


def key_changed_between(k, v, kc, vc, slots, ks, vs):
    # store_kv would take K at the V write, after this in-place change.
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = q8(k, ks)
    k.mul_(0.5)
    vc.view(-1, H, D)[slots] = q8(v, vs)


def multiplied(k, v, kc, vc, slots, ks, vs):
    H, D = kc.shape[2:]
    kc.view(-1, H, D)[slots] = (k * ks).clamp(-448, 448).to(FP8)
    vc.view(-1, H, D)[slots] = (v * vs).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize(
    "fn, reason",
    [
        (no_saturation, "no clamp(-448, 448)"),
        (key_only, "has no K/V partner"),
        (read_between, "have a cache read between them"),
        (multiplied, "is not x / scale"),
        (fp16_division, "is computed in torch.float16"),
        (key_changed_between, "may write"),
    ],
)
def test_store_negative_twins(fn, reason, caplog):
    args = store_problem()
    eager = [a.clone() for a in args]
    want = fn(*eager)
    with caplog.at_level(logging.DEBUG, logger="torch_sm70attn"):
        cap, out, ctr = compile_and_run(fn, *args)
    assert cap.before == cap.after, "graph changed"
    assert not ctr.get("store_kv_rewrite") and ctr.get("store_refused", 0) >= 1
    assert reason in caplog.text, caplog.text
    assert torch.equal(args[2].view(torch.uint8), eager[2].view(torch.uint8))
    if want is not None:
        torch.testing.assert_close(out, want)


# --- a toy decoder (helpers_models.py) through the real backend --------------------------------
def test_two_layer_decoder_rewrites_every_layer():
    torch.manual_seed(0)
    B, Q, H, D, ps, P = 2, 3, 2, 64, 16, 10
    model = Decoder(H=H, D=D).half()
    bt = torch.tensor([[3, 7, 1], [0, 9, 4]], dtype=torch.int32)
    sl = torch.tensor([20, 35], dtype=torch.int32)
    # the Q new tokens of each request sit at positions seq_len - Q .. seq_len - 1
    pos = sl[:, None] - Q + torch.arange(Q)
    slots = (bt.gather(1, (pos // ps).long()) * ps + pos % ps).reshape(-1).long()
    x = torch.randn(B, Q, 64).half()

    def caches():
        g = torch.Generator().manual_seed(1)
        return [
            tuple((torch.randn(P, ps, H, D, generator=g) * 8).to(FP8) for _ in "kv")
            for _ in range(2)
        ]

    eager_caches, compiled_caches = caches(), caches()
    with torch.no_grad():
        want = model(x, eager_caches, bt, sl, slots)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="sm70attn", fullgraph=True)
        got = compiled(x, compiled_caches, bt, sl, slots)
    assert counters["sm70attn"]["paged_attention_rewrite"] == 2
    assert counters["sm70attn"]["store_kv_rewrite"] == 2
    assert rel_err(got, want.double()) < 5e-3
    # The projections run through inductor's matmuls, so the stored tokens may differ in
    # their last fp16 bits and then by one E4M3 step: compare values, not bytes.
    for (ek, ev), (ck, cv) in zip(eager_caches, compiled_caches, strict=True):
        for e, c in ((ek, ck), (ev, cv)):
            torch.testing.assert_close(c.float(), e.float(), rtol=2**-3, atol=2**-9)
            assert (c.view(torch.uint8) != e.view(torch.uint8)).float().mean() < 0.01


def test_inductor_custom_pass_and_buckets():
    sa_backend.install_inductor_pass()
    # On a cache hit inductor skips the (late) pre-grad passes and the counter would not move.
    no_caches = (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    )
    try:
        with no_caches[0], no_caches[1]:
            torch._dynamo.reset()
            counters.clear()
            args = problem(seed=5)
            got = torch.compile(plain, backend="inductor", fullgraph=True)(*args)
        assert counters["sm70attn"]["paged_attention_rewrite"] == 1
        assert rel_err(got, plain(*args).double()) < 2e-3
        assert sa_backend.RewritePass().uuid() == sa_backend.RewritePass().uuid()
    finally:
        torch._inductor.config.pre_grad_custom_pass = None
    q, _, _, bt, sl, _, _ = problem(B=3)
    qp, btp, slp, B = sa_backend.pad_batch(q, bt, sl)
    assert (qp.shape[0], btp.shape[0], slp.tolist()[3:], B) == (4, 4, [0], 3)
    assert sa_backend.bucket(5) == 8
    with pytest.raises(ValueError):
        sa_backend.bucket(33)


def offset_then_written(q, kc, vc, bt, past, how):
    """The mask reads a 0-d length tensor (through .long(), an alias of an int64 tensor), then
    the length moves on before the SDPA: eager's mask keeps the old length."""
    B, _, Q, _ = q.shape
    k, v = gqa_kv(kc, vc, bt, torch.tensor(0.1), torch.tensor(0.1))
    rows = (torch.arange(Q) + past.long())[None, None, :, None]
    mask = (torch.arange(k.shape[2])[None, None, None, :] <= rows).expand(B, -1, -1, -1)
    if how == "iadd":
        past += 7
    elif how == "add_":
        past.long().add_(7)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("how", ["iadd", "add_", None])
def test_offset_length_written_after_the_mask(how, caplog):
    q, kc, vc, bt = problem()[:4]
    past = torch.tensor(20)

    def fn(q, kc, vc, bt, past):
        return offset_then_written(q, kc, vc, bt, past, how)

    with caplog.at_level(logging.DEBUG, logger="torch_sm70attn"):
        cap, out, ctr = compile_and_run(fn, q, kc, vc, bt, past.clone())
    want = fn(q, kc, vc, bt, past.clone())
    if how is None:  # nothing written: rewritten, seq_lens = 20 + Q
        assert ctr.get("paged_attention_rewrite") == 1, ctr
        assert rel_err(out, want.double()) < 2e-3
    else:
        assert ctr.get("sdpa_refused") == 1 and "may write" in caplog.text, ctr
        torch.testing.assert_close(out, want)
