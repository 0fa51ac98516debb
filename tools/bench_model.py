"""End-to-end model benchmark: the time of one decode or verify step (a forward of Q new
tokens per request after a prompt of `ctx` tokens) of a Qwen3-architecture model (random
weights, transformers' classes) on three paths:

  sm70attn      PagedE4M3Cache + the "sm70attn" attention (this library, eager)
  fp8 gather    the same paged E4M3 cache, gathered, dequantized and fed to SDPA, as users
                write it today, compiled with inductor (dynamic shapes)
  stock fp16    transformers' sdpa attention with its default float16 DynamicCache

Each step is timed with CUDA events (median of --steps after warm-up), the step's tokens then
cropped so every step sees the same context. Usage (GPU):

    python tools/bench_model.py --json out.json
    python tools/bench_model.py --ctx 32768 --batch 1 --rows 8   # one cell
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

import torch_sm70attn as sa
from torch_sm70attn.integrations import demo
from torch_sm70attn.integrations import transformers as hf


def fp8_gather_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The users' FP8 path today: gather the pages, dequantize, SDPA with the verifier mask
    (the integration's prefill route without its fresh-prompt shortcut)."""
    kc, vc, table, lens, ks, vs, _ = kwargs[hf.NAME]
    return hf._prefill(query, kc, vc, table, lens, scaling, ks, vs).transpose(1, 2), None


def register_gather() -> str:
    AttentionInterface.register("fp8_gather", torch.compile(fp8_gather_attention, dynamic=True))
    AttentionMaskInterface.register("fp8_gather", hf._mask)
    return "fp8_gather"


def time_steps(model, cache, batch, rows, steps, warmup=3) -> float:
    """Median ms of a forward of `rows` new tokens per request; the tokens are cropped after."""
    ids = torch.randint(0, 1024, (batch, rows), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            model(ids, cache=cache, logits_to_keep=rows)
            b.record()
            torch.cuda.synchronize()
            cache.crop(-rows)
            if i >= warmup:
                times.append(a.elapsed_time(b))
    return statistics.median(times)


def cell(model, ctx, batch, rows, steps, gather_name, skip_stock, page) -> dict:
    prompt = demo.make_prompt(batch, ctx, "cuda")
    row = {"ctx": ctx, "B": batch, "Q": rows}
    cache = hf.PagedE4M3Cache(
        model.config, max_tokens=batch * (ctx + rows + page), max_batch_size=batch, page_size=page
    )
    model.set_attn_implementation(hf.NAME)
    with torch.no_grad():
        model(prompt, cache=cache, logits_to_keep=1)
    row["sm70attn_ms"] = time_steps(model, cache, batch, rows, steps)
    model.set_attn_implementation(gather_name)
    row["fp8_gather_ms"] = time_steps(model, cache, batch, rows, steps)
    del cache
    if not skip_stock:
        model.set_attn_implementation("sdpa")
        stock = DynamicCache()
        with torch.no_grad():
            model(prompt, cache=stock, logits_to_keep=1)
        row["stock_fp16_ms"] = time_steps(model, stock, batch, rows, steps)
        del stock
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page", type=int, default=16, help="page size of the paged cache")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-stock", action="store_true", help="skip the fp16 stock path")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sa.ops.load_cuda_kernels()
    model = demo.build(torch.device("cuda"), args.layers)
    gather = register_gather()
    cfg = model.config
    p = torch.cuda.get_device_properties(0)
    head = (
        f"{p.name}, torch {torch.__version__}; Qwen3 architecture, {args.layers} layers, "
        f"hidden {cfg.hidden_size}, {cfg.num_attention_heads} query / "
        f"{cfg.num_key_value_heads} KV heads, head dim {cfg.head_dim}; page {args.page}; ms per "
        f"step (median of {args.steps})"
    )
    print(head, flush=True)
    rows = []
    t0 = time.perf_counter()
    for ctx in args.ctx:
        for batch in args.batch:
            for q in args.rows:
                r = cell(model, ctx, batch, q, args.steps, gather, args.no_stock, args.page)
                rows.append(r)
                print(f"[{time.perf_counter() - t0:5.0f}s] {r}", flush=True)
    print(
        "\n| ctx | B | Q | sm70attn ms | fp8 gather ms | stock fp16 ms | x fp8 gather | x stock |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ours, gather, st = r["sm70attn_ms"], r["fp8_gather_ms"], r.get("stock_fp16_ms")
        stock = ("-", "-") if st is None else (f"{st:.3f}", f"{st / ours:.2f}")
        print(
            f"| {r['ctx']} | {r['B']} | {r['Q']} | {ours:.3f} | {gather:.3f} | {stock[0]} | "
            f"{gather / ours:.2f} | {stock[1]} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
