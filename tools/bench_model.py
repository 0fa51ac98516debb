"""End-to-end model benchmark: the time of one decode or verify step (a forward of Q new
tokens per request after a prompt of `ctx` tokens) of a Qwen3-architecture model (random
weights, transformers' classes) on five paths:

  sm70attn           PagedE4M3Cache + the "sm70attn" attention (this library), eager
  sm70attn compiled  the same, the forward compiled whole (fullgraph) by the sm70attn backend
                     and replayed as a CUDA graph (the backend's recorder, a V100's path)
  fp8 gather         the same paged E4M3 cache, gathered, dequantized and fed to SDPA, as users
                     write it today, the attention compiled with inductor (dynamic shapes)
  stock fp16         transformers' sdpa attention with its default float16 DynamicCache, eager
  stock fp16 static compiled   the same attention over transformers' StaticCache, the forward
                     compiled by torch's "cudagraphs" backend (transformers' fast fp16 path)

Each step is timed with CUDA events (median of --steps after warm-up), the step's tokens then
cropped so every step sees the same context. A decode step (Q 1) makes one token per request;
a verify step of Q rows makes 1 to Q. Usage (GPU):

    python tools/bench_model.py --json out.json --plot perf_model.png
    python tools/bench_model.py --ctx 32768 --batch 1 --rows 8   # one cell
    python tools/bench_model.py --report out.json --plot docs/perf_model.png   # no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_prefill import dequantized_sdpa  # tools/
from transformers import AttentionInterface, DynamicCache, StaticCache
from transformers.masking_utils import AttentionMaskInterface

import torch_sm70attn as sa
from torch_sm70attn.integrations import demo
from torch_sm70attn.integrations import transformers as hf

_gather_sdpa = torch.compile(dequantized_sdpa, dynamic=True)


def fp8_gather_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The users' FP8 path today: store the new tokens (store_kv, as ours), then gather the
    pages, dequantize, SDPA with the verifier mask (the integrations' prefill route before
    paged_attention_varlen, without its fresh-prompt shortcut), compiled by inductor with
    dynamic shapes."""
    cache, layer = kwargs[hf.NAME]
    layer, plan = cache.store(layer, key, value, attention_mask)
    out = _gather_sdpa(
        query,
        layer.keys,
        layer.values,
        plan.table,
        plan.lens,
        scaling,
        layer.k_scale,
        layer.v_scale,
    )
    return out.transpose(1, 2), None


def register_gather() -> str:
    AttentionInterface.register("fp8_gather", fp8_gather_attention)
    AttentionMaskInterface.register("fp8_gather", hf.mask_function)
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


def compiled(model, backend="sm70attn"):
    """The whole forward compiled, one graph per shape, replayed as a CUDA graph: through the
    sm70attn backend (its CUDA-graph recorder: the same kernels as eager) or, for the stock
    path, torch's "cudagraphs" backend."""
    torch._dynamo.reset()
    kw = dict(options={"inner": "cudagraphs"}) if backend == "sm70attn" else {}
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False, **kw)


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
    row["sm70attn_compiled_ms"] = time_steps(compiled(model), cache, batch, rows, steps)
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
        # A StaticCache prompt would build a [B, 1, ctx, ctx + Q] mask (137 GB at 128K, B 8):
        # fill the first Q positions, then declare ctx held. A step's time does not depend on
        # the values, and SDPA reads all ctx + Q positions under the static cache's mask.
        static = StaticCache(config=model.config, max_cache_len=ctx + rows)
        with torch.no_grad():
            model(prompt[:, :rows], cache=static, logits_to_keep=1)
        for layer in static.layers:
            layer.cumulative_length.fill_(ctx)
        row["stock_static_compiled_ms"] = time_steps(
            compiled(model, "cudagraphs"), static, batch, rows, steps
        )
        del static
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


COLUMNS = [  # (json key, table heading)
    ("sm70attn_ms", "sm70attn"),
    ("sm70attn_compiled_ms", "sm70attn compiled"),
    ("fp8_gather_ms", "fp8 gather"),
    ("stock_fp16_ms", "stock fp16"),
    ("stock_static_compiled_ms", "stock fp16 static compiled"),
]


def table(rows) -> str:
    """Markdown: ms per step of each path, then how many times faster the compiled library is
    than the users' FP8 path and than the stock paths."""
    names = [h for _, h in COLUMNS]
    head = ["ctx", "B", "Q", *names, "x fp8 gather", "x stock", "x stock static compiled"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours = r["sm70attn_compiled_ms"]
        cells = [f"{r['ctx'] // 1024}K", str(r["B"]), str(r["Q"])]
        cells += [f"{r[k]:.3f}" if k in r else "-" for k, _ in COLUMNS]
        for k in ("fp8_gather_ms", "stock_fp16_ms", "stock_static_compiled_ms"):
            cells.append(f"{r[k] / ours:.2f}" if k in r else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows, path: str) -> None:
    """ms per step of every path, one panel per context, cells (B, Q) along x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({r["ctx"] for r in rows})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs, strict=True):
        cell_rows = [r for r in rows if r["ctx"] == ctx]
        xs = range(len(cell_rows))
        width = 0.8 / len(COLUMNS)
        for i, (k, name) in enumerate(COLUMNS):
            ys = [r.get(k, float("nan")) for r in cell_rows]
            ax.bar([x + (i - len(COLUMNS) / 2 + 0.5) * width for x in xs], ys, width, label=name)
        ax.set_xticks(list(xs), [f"B{r['B']} Q{r['Q']}" for r in cell_rows])
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (log)")
        ax.set_title(f"context {ctx // 1024}K")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    ap.add_argument("--plot", default=None, help="write a PNG of the table (needs matplotlib)")
    ap.add_argument("--report", default=None, help="print the table (and --plot) of a --json file")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            rows = json.load(f)["rows"]
        print(table(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
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
    print("\n" + table(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
