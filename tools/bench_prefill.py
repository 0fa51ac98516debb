#!/usr/bin/env python3
"""Prefill over the paged E4M3 cache: torch_sm70attn.paged_attention_varlen ("ours": its prefill
kernel, csrc/sm70attn/prefill.cuh) against the same op with the prefill kernel off ("tile_loop":
varlen.cuh's tile loop, the op before the prefill kernel), against the route the op replaced
(`dequantized_sdpa`, JSON key "today": gather the request's pages, dequantize to float16, repeat
the KV heads, masked SDPA) and against torch's float16 SDPA over contiguous K/V with a
lower-right causal mask (no gather, no dequantize: the GPU's float16 reference). One request a
cell: a chunk of `chunk` new tokens over `past` tokens already in the cache.

    python tools/bench_prefill.py --json prefill.json          # the grid, on a GPU
    python tools/bench_prefill.py --smoke                      # a few small cells

Then the steps an engine mixes (`--json`'s "mixed" rows): a chunk beside decodes, in one
paged_attention_varlen call against the chunk's call plus paged_attention for the decodes; and
decodes alone through either op (why paging.attend_packed keeps decode steps on paged_attention).

Each cell: every implementation called once (warm-up, kernels compiled), then `reps` rounds
that call each in turn, timed with CUDA events; the median is reported, with TFLOP/s = 4 D H_q x
(positions visible, summed over the chunk's rows) / time, and the memory one call allocates on
top of its inputs (torch.cuda.max_memory_allocated). The output of the op is checked against the
old route's (relative error, printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
import torch_sm70attn as sa  # noqa: E402
from torch_sm70attn import paging  # noqa: E402

GRID = dict(shapes=[(256, 6, 4, 1648), (128, 4, 8, 16)], chunks=[4096, 512, 16384],
            pasts=[32768, 131072, 0])  # fmt: skip
# and one chunk step over a 256K context (the memory target), D256 G6
LONG = (256, 6, 4, 1648, 4096, 262144 - 4096)
SMOKE = dict(shapes=[(128, 4, 2, 16)], chunks=[64, 300], pasts=[0, 1000])


def dequantized_sdpa(query, kc, vc, table, lens, scale, ks, vs, fresh=False):
    """The route paged_attention_varlen replaced, as the engines ran it on a GPU: query [B, H_q,
    Q, D]; the pages dequantized to float16 and the KV heads repeated; SDPA, causal for a fresh
    prompt, else with the op's rule as a mask; rows that see nothing 0."""
    B, H_q, Q, D = query.shape
    k = paging.dequantized(kc, table, ks, query.dtype)
    v = paging.dequantized(vc, table, vs, query.dtype)
    mask = None if fresh else sa.verifier_mask(lens, Q, k.shape[1])
    if fresh:
        k, v = k[:, :Q], v[:, :Q]
    k = k.transpose(1, 2).repeat_interleave(H_q // k.shape[2], dim=1)
    v = v.transpose(1, 2).repeat_interleave(H_q // v.shape[2], dim=1)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, is_causal=fresh, scale=scale)
    if mask is not None:
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0)
    return out


def cell(D, G, H_kv, page, chunk, past, reps, dev):
    H_q, L = G * H_kv, past + chunk
    n_pages = -(-L // page)
    g = torch.Generator(device=dev).manual_seed(0)
    kc = (torch.randn(n_pages, page, H_kv, D, device=dev, generator=g) * 8).to(torch.float8_e4m3fn)
    vc = (torch.randn(n_pages, page, H_kv, D, device=dev, generator=g) * 8).to(torch.float8_e4m3fn)
    table = torch.randperm(n_pages, device=dev, generator=g).int()[None]
    lens = torch.tensor([L], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    q = torch.randn(chunk, H_q, D, device=dev, generator=g, dtype=torch.float16)
    ks = torch.full((1,), 0.12, device=dev)
    vs = torch.full((1,), 0.1, device=dev)
    scale = D**-0.5
    q4 = q.transpose(0, 1)[None]  # [1, H_q, chunk, D]: the old route's layout
    # contiguous float16 K/V of the same values, heads repeated (flash attention's layout)
    k16 = paging.dequantized(kc, table, ks, torch.float16)[0, :L].transpose(0, 1)
    v16 = paging.dequantized(vc, table, vs, torch.float16)[0, :L].transpose(0, 1)
    k16 = k16.repeat_interleave(G, 0)[None].contiguous()
    v16 = v16.repeat_interleave(G, 0)[None].contiguous()
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(chunk, L)

    def op(prefill):
        def run():
            lib.set_prefill_override(prefill)
            try:
                return sa.paged_attention_varlen(q, kc, vc, table, qsl, lens, scale=scale,
                                                 k_scale=ks, v_scale=vs)  # fmt: skip
            finally:
                lib.set_prefill_override("auto")

        return run

    lib = sa.ops.load_cuda_kernels()
    impls = {
        "ours": op("auto"),
        "tile_loop": op("off"),
        "today": lambda: dequantized_sdpa(q4, kc, vc, table, lens, scale, ks, vs, fresh=past == 0),
        "sdpa_fp16": lambda: F.scaled_dot_product_attention(
            q4, k16, v16, attn_mask=mask if past else None, is_causal=not past, scale=scale
        ),
    }
    res = {}
    ours = impls["ours"]()
    today = impls["today"]()[0].transpose(0, 1)
    err = ((ours.double() - today.double()).norm() / today.double().norm()).item()
    tl = impls["tile_loop"]()
    err_tl = ((ours.double() - tl.double()).norm() / tl.double().norm()).item()
    for name, fn in impls.items():  # memory on top of the inputs, one call each
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        res[name] = {"extra_mb": (torch.cuda.max_memory_allocated() - base) / 2**20}
        del out
    times = {name: [] for name in impls}
    for _ in range(reps):
        for name, fn in impls.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b))
    flops = 4 * D * H_q * (chunk * past + chunk * (chunk + 1) / 2)
    for name in impls:
        ms = statistics.median(times[name])
        res[name].update(ms=ms, tflops=flops / ms / 1e9)
    return {"cell": dict(D=D, G=G, H_kv=H_kv, chunk=chunk, past=past, page=page),
            "rel_err_vs_today": err, "rel_err_vs_tile_loop": err_tl, **res}  # fmt: skip


def timed(impls, reps):
    times = {name: [] for name in impls}
    for fn in impls.values():
        fn()  # warm-up: kernels loaded
    for _ in range(reps):
        for name, fn in impls.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b))
    return {name: statistics.median(t) for name, t in times.items()}


def mixed_cell(D, G, H_kv, page, chunk, past, decodes, dpast, reps, dev):
    """A chunk of `chunk` tokens over `past` beside `decodes` one-token requests over `dpast`."""
    H_q = G * H_kv
    lens = [past + chunk] + [dpast + 1] * decodes
    width = max(-(-n // page) for n in lens)
    g = torch.Generator(device=dev).manual_seed(1)
    P = sum(-(-n // page) for n in lens)
    kc = torch.randn(P, page, H_kv, D, device=dev, generator=g).to(torch.float8_e4m3fn)
    vc = torch.randn(P, page, H_kv, D, device=dev, generator=g).to(torch.float8_e4m3fn)
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
    perm, used = torch.randperm(P, device=dev, generator=g).int(), 0
    for b, n in enumerate(lens):
        table[b, : -(-n // page)] = perm[used : used + -(-n // page)]
        used += -(-n // page)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    qsl = torch.tensor(
        [0, chunk, *range(chunk + 1, chunk + decodes + 1)], dtype=torch.int32, device=dev
    )
    q = torch.randn(chunk + decodes, H_q, D, device=dev, generator=g, dtype=torch.float16)
    qd = q[chunk:].view(decodes, 1, H_q, D).transpose(1, 2)
    one = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    dq = qsl[1:] - chunk
    kw = dict(scale=D**-0.5, k_scale=0.1, v_scale=0.1)
    step = timed({
        "one varlen call": lambda: sa.paged_attention_varlen(q, kc, vc, table, qsl, seq, **kw),
        "varlen chunk + paged_attention decodes": lambda: (
            sa.paged_attention_varlen(q[:chunk], kc, vc, table[:1], one, seq[:1], **kw),
            sa.paged_attention(qd, kc, vc, table[1:], seq[1:], **kw),
        ),
        "decodes alone: paged_attention": lambda: sa.paged_attention(qd, kc, vc, table[1:], seq[1:], **kw),
        "decodes alone: varlen": lambda: sa.paged_attention_varlen(
            q[chunk:], kc, vc, table[1:], dq.contiguous(), seq[1:], **kw
        ),
    }, reps)  # fmt: skip
    cell = dict(
        D=D, G=G, H_kv=H_kv, page=page, chunk=chunk, past=past, decodes=decodes, dpast=dpast
    )
    return {"cell": cell, "ms": step}


MIXED = [(256, 6, 4, 16, 2048, 32768, 32, 32768), (128, 4, 8, 16, 2048, 32768, 64, 16384)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    grid = SMOKE if args.smoke else GRID
    rows = []
    print("| D | G | H_kv | page | chunk | past | ours ms | TFLOP/s | MB | tile loop ms | TFLOP/s | "
          "dequantized ms | MB | fp16 SDPA ms | TFLOP/s | ours / SDPA | ours / tile loop | err |")  # fmt: skip
    print("|---" * 18 + "|")
    cells = [(*sh, c, p) for sh in grid["shapes"] for c in grid["chunks"] for p in grid["pasts"]]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    mixed = []

    def save():  # after every cell: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(
                json.dumps({"meta": meta, "rows": rows, "mixed": mixed}, indent=1)
            )

    # the targets' cells first (chunks of 4096 over a past, the 256K step, the mixed steps):
    # a run cut short has those
    first = [c for c in cells if c[4] == 4096 and c[5] > 0]
    order = cells if args.smoke else first + [LONG, "mixed"] + [c for c in cells if c not in first]
    for c in order:
        if c == "mixed":
            for m in MIXED:
                r = mixed_cell(*m, reps=args.reps, dev="cuda")
                mixed.append(r)
                print(r["cell"], " | ".join(f"{k}: {v:.3f} ms" for k, v in r["ms"].items()))
                torch.cuda.empty_cache()
                save()
            continue
        D, G, H_kv, page, chunk, past = c
        reps = max(2, args.reps if chunk * (past + chunk) < 2**31 else args.reps // 2)
        r = cell(D, G, H_kv, page, chunk, past, reps, "cuda")
        rows.append(r)
        o, tl, t, s = r["ours"], r["tile_loop"], r["today"], r["sdpa_fp16"]
        print(f"| {D} | {G} | {H_kv} | {page} | {chunk} | {past} | {o['ms']:.3f} | "
              f"{o['tflops']:.0f} | {o['extra_mb']:.0f} | {tl['ms']:.3f} | {tl['tflops']:.0f} | "
              f"{t['ms']:.3f} | {t['extra_mb']:.0f} | {s['ms']:.3f} | {s['tflops']:.0f} | "
              f"{o['ms'] / s['ms']:.2f} | {o['ms'] / tl['ms']:.2f} | {r['rel_err_vs_today']:.1e} |",
              flush=True)  # fmt: skip
        torch.cuda.empty_cache()
        save()


if __name__ == "__main__":
    main()
