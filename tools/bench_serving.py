"""The seeds' endpoint protocol on a transformers model: C concurrent requests (C1, C4, C8),
each a 32K-token prompt (a shared prefix and a distinct suffix, as the seeds' fixture),
admitted as one wave, 256 new tokens each, greedy. Decode tokens/s are counted between the
last request's first token and the first request's last token (all requests' tokens in that
window over its length). The model: a Qwen3 architecture with random weights (transformers' own
classes, `demo.build`) and random prompts, or with --shipped the shipped trained model
(`torch_sm70attn.model_path()`) and real text (--data: tools/lm_corpus.py's held-out split;
default this package's own source: a shared prefix and a distinct 512-token suffix a request).
The shipped model was trained at 32768 positions: --ctx 32768 generates past them. Paths:

  sm70attn spec            PagedE4M3Cache + speculative.generate: prompt lookup, 7 drafts
                           (verify steps of 8 rows a request), per-request acceptance; eager
  sm70attn spec compiled   the same, the verify forward compiled whole (fullgraph) by the
                           sm70attn backend and replayed as a CUDA graph (a V100's path)
  sm70attn decode          generate() through the paged cache, greedy, called as users call it:
                           on a GPU where Triton runs, transformers compiles the decode step of
                           a compileable cache with its default CompileConfig (inductor, CUDA
                           graph trees); not a V100's path (see the demo for eager decode)
  fp8 gather spec          the spec loop over the same paged cache with the users' FP8
                           attention: gather the pages, dequantize, SDPA (inductor, dynamic)
  stock fp16               transformers' generate, sdpa attention, float16 DynamicCache,
                           greedy decode of the whole wave (static batching), eager

Each figure is the median of --runs warm runs (a first run of each path warms it up). The
random model's acceptance is what prompt lookup finds in its output, which repeats itself
far more than a trained model's does on real text: it says the verify path runs at that
acceptance, not what a real model would accept. Usage (GPU):

    python tools/bench_serving.py --json serving.json
    python tools/bench_serving.py --shipped --data DATA --json serving_trained.json
    python tools/bench_serving.py --report serving.json        # the table, no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import torch_sm70attn as sa
from torch_sm70attn.integrations import demo, speculative
from torch_sm70attn.integrations import transformers as hf


def prompts(C: int, ctx: int, suffix: int = 512, seed: int = 0) -> torch.Tensor:
    """[C, ctx]: one shared prefix (the demo's prompt: random tokens repeated, so that prompt
    lookup finds drafts) and per request a distinct random suffix."""
    prefix = demo.make_prompt(1, ctx - suffix, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    tails = torch.randint(0, 1024, (C, suffix), generator=g)
    return torch.cat([prefix.expand(C, -1), tails], 1).cuda()


def real_prompts(stream: torch.Tensor, C: int, ctx: int, suffix: int = 512) -> torch.Tensor:
    """[C, ctx] of real text: the stream's first ctx - suffix tokens shared, and per request a
    distinct suffix taken from further on in the stream."""
    starts = torch.linspace(ctx, stream.numel() - suffix - 1, C).long().tolist()
    tails = torch.stack([stream[s : s + suffix] for s in starts])
    return torch.cat([stream[: ctx - suffix].expand(C, -1), tails], 1).cuda()


def window(out: speculative.Output, new: int) -> tuple[float, float]:
    """(decode tokens/s, mean tokens a request emits per step) between the last request's first
    token (the prompt's end: one wave) and the first request's last token."""
    done = [None] * len(out.emitted[0])
    count = [0] * len(done)
    for i, step in enumerate(out.emitted):
        for b, n in enumerate(step):
            count[b] += n
            if done[b] is None and count[b] >= new:
                done[b] = i
    end = min(d for d in done if d is not None)
    tokens = sum(sum(step) for step in out.emitted[1 : end + 1])
    return tokens / (out.times[end] - out.times[0]), tokens / (end * len(done))


def spec_run(model, ids, cache, new, drafts, forward=None):
    out = speculative.generate(
        model, ids, cache=cache, max_new_tokens=new, drafts=drafts, forward=forward,
        eos_token_id=[],  # every request to `new` tokens, as generate_run's min_new_tokens
    )
    rate, per_step = window(out, new)
    return rate, per_step, statistics.mean(out.accepted)


def generate_run(model, ids, cache, new):
    """transformers' generate as users call it (its default CompileConfig): (decode tokens/s
    after the prompt's forward, 1, 0)."""
    from transformers import CompileConfig

    _, _, (_, after) = demo.timed_generate(model, ids, cache, new, compile_config=CompileConfig())
    return ids.shape[0] * (new - 1) / after, 1.0, 0.0


PATHS = ["sm70attn spec", "sm70attn spec compiled", "sm70attn decode", "fp8 gather spec",
         "stock fp16"]  # fmt: skip


def measure(model, C, ctx, new, drafts, runs, gather, compiled, skip, stream=None) -> dict:
    ids = prompts(C, ctx) if stream is None else real_prompts(stream, C, ctx)
    row = {"C": C, "ctx": ctx, "new": new, "drafts": drafts}

    def paged():
        return hf.PagedE4M3Cache(
            model.config, max_tokens=C * (ctx + new + drafts + 32), max_batch_size=C
        )

    cache = paged()
    model.set_attn_implementation(hf.NAME)
    cache.calibrate(model, ids[:1, :4096])  # the scales from a sample, kept for every run
    plans = {
        "sm70attn spec": (hf.NAME, lambda: spec_run(model, ids, cache, new, drafts)),
        "sm70attn spec compiled": (
            hf.NAME,
            lambda: spec_run(model, ids, cache, new, drafts, forward=compiled),
        ),
        "sm70attn decode": (hf.NAME, lambda: generate_run(model, ids, cache, new)),
        "fp8 gather spec": (gather, lambda: spec_run(model, ids, cache, new, drafts)),
        "stock fp16": ("sdpa", lambda: generate_run(model, ids, None, new)),
    }
    for name in PATHS:
        if name in skip:
            continue
        impl, fn = plans[name]
        model.set_attn_implementation(impl)
        got = []
        for i in range(runs + 1):  # the first run warms up (compiles, records graphs)
            cache.reset()
            r = fn()
            if i:
                got.append(r)
        rates = [g[0] for g in got]
        row[name] = {
            "tokens_per_s": statistics.median(rates),
            "runs": rates,
            "tokens_per_step": statistics.median(g[1] for g in got),
            "accepted_per_step": statistics.median(g[2] for g in got),
        }
        print(f"  C{C} {name}: {row[name]}", flush=True)
    model.set_attn_implementation(hf.NAME)
    torch.cuda.empty_cache()
    return row


def table(rows) -> str:
    head = ["C", *PATHS, "spec compiled / stock", "spec compiled / fp8 gather",
            "tokens a request emits per step (spec)", "accepted drafts per step"]  # fmt: skip
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"C{r['C']}"]
        cells += [f"{r[p]['tokens_per_s']:.0f}" if p in r else "-" for p in PATHS]
        ours = r.get("sm70attn spec compiled", {}).get("tokens_per_s")
        for base in ("stock fp16", "fp8 gather spec"):
            ok = ours and base in r
            cells.append(f"{ours / r[base]['tokens_per_s']:.2f}" if ok else "-")
        spec = r.get("sm70attn spec compiled") or r.get("sm70attn spec") or {}
        cells.append(f"{spec.get('tokens_per_step', float('nan')):.2f}")
        cells.append(f"{spec.get('accepted_per_step', float('nan')):.2f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(path: str, files: list[str]) -> None:
    """Decode tokens/s of every path by concurrency (log scale), one panel per JSON file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(files), figsize=(7 * len(files), 4.2), squeeze=False)
    for ax, f in zip(axes[0], files, strict=True):
        with open(f) as fh:
            data = json.load(fh)
        rows, width = data["rows"], 0.8 / len(PATHS)
        for i, name in enumerate(PATHS):
            ys = [r[name]["tokens_per_s"] if name in r else float("nan") for r in rows]
            xs = [x + (i - len(PATHS) / 2 + 0.5) * width for x in range(len(rows))]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(rows)), [f"C{r['C']}" for r in rows])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (log)")
        ax.set_title(data["header"].split(";")[0], fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--drafts", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[], choices=PATHS)
    ap.add_argument("--v100-grid", action="store_true",
                    help="the op planned for 80 SMs of 96 KB (a V100's grids; the GPU stays whole)")  # fmt: skip
    ap.add_argument(
        "--shipped",
        action="store_true",
        help="the shipped trained model (torch_sm70attn.model_path()) and real prompts",
    )
    ap.add_argument(
        "--data",
        default=None,
        help="with --shipped: tools/lm_corpus.py's folder (prompts from heldout.u16); "
        "default: this package's own source",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="print the table of a --json file")
    ap.add_argument("--plot", nargs="+", default=None,
                    help="with --report: PNG path, then --json files (one panel each)")  # fmt: skip
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            print(table(json.load(f)["rows"]))
        if args.plot:
            plot(args.plot[0], [args.report, *args.plot[1:]])
        return 0
    if args.data and not args.shipped:
        ap.error("--data gives the shipped model's prompts: add --shipped")
    mod = sa.ops.load_cuda_kernels()
    if args.v100_grid:
        mod.set_plan_override(80, 98304)
    stream = None
    if args.shipped:
        from pathlib import Path

        from torch_sm70attn.integrations import shipped

        model, tok = shipped.load("cuda")
        stream = (
            shipped.token_file(Path(args.data) / "heldout.u16")
            if args.data
            else shipped.own_source(tok)
        )
        what = f"the shipped model (trained), real prompts ({'held-out split' if args.data else 'own source'})"
    else:
        model = demo.build(torch.device("cuda"), args.layers)
        what = "random weights, repeated random prompts"
    from bench_model import register_gather

    gather = register_gather()
    compiled = torch.compile(
        model, backend=hf.NAME, fullgraph=True, dynamic=False, options={"inner": "cudagraphs"}
    )
    p, cfg = torch.cuda.get_device_properties(0), model.config
    head = (
        f"{p.name} ({p.multi_processor_count} SMs{', op planned for 80 SMs' if args.v100_grid else ''}), "
        f"torch {torch.__version__}; Qwen3 architecture, {what}, {cfg.num_hidden_layers} layers, "
        f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, head dim "
        f"{cfg.head_dim}; prompts {args.ctx}, {args.new} new tokens, {args.drafts} drafts; "
        f"decode tokens/s, median of {args.runs} warm runs"
    )
    print(head, flush=True)
    rows = []
    for C in args.concurrency:
        rows.append(measure(model, C, args.ctx, args.new, args.drafts, args.runs, gather,
                            compiled, args.skip, stream))  # fmt: skip
    print("\n" + table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
