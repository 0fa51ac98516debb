"""What the FP8 KV cache costs a trained model's predictions: the shipped model
(torch_sm70attn.model_path()) on held-out Python, float16 cache against E4M3 pages.

    python tools/quality.py --data DATA --json q.json        # DATA: tools/lm_corpus.py's output
    python tools/quality.py --report q.json [q2.json ...]    # the tables (docs/quality.md)

Teacher-forced scoring: each window of --window tokens runs as a real request would, its first
--prompt tokens in one forward (the prompt route: SDPA over the stored pages), the rest 16 rows
a forward (the route of decode and verify steps: sm70attn.paged_attention, the CUDA kernels on
a GPU, the reference on a CPU); every position's logits are scored. The float16 baseline is
transformers' stock path (sdpa, no FP8) over the same windows in one forward. E4M3 scales:

  (a) calibrate     cache.calibrate(model, sample): per KV head, amax / 448 x 2
  (b) per tensor    (a)'s largest head's, one scale per layer
  (c) first forward the default: each window's cache calibrates from its own prompt
  (d) checkpoint    per tensor amax / 448 (a static min-max observer's, no headroom), written
                    into a copy of the checkpoint as model.layers.N.self_attn.k_scale / v_scale
                    (llm-compressor's names) and read back by kv_scales_from_checkpoint

and two emulations in one forward (K and V rounded, then float32 SDPA; reference only): E4M3
with (a)'s scales (it should match (a): the op adds nothing but rounding), and E5M2 with scale 1
(vLLM's fp8_e5m2, the seeds' V100 format). The calibration sample is held-out text outside the
scored windows. Metrics against the float16 path: mean NLL per token, top-1 agreement, mean KL.
Greedy generations: --prompts file beginnings of 256 tokens, --new tokens each, float16 against
E4M3 (a) and (c) through generate(): tokens until the first difference.
--long N: N windows of 32768 tokens, NLL by position, the last 2048 positions 16 rows a forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_sm70attn as sa
from torch_sm70attn.integrations import shipped
from torch_sm70attn.integrations import transformers as hf

ROWS = 16  # rows of a verify step: the most the fused op takes
FAKE = {}  # the emulation attention's format and scales


def fake_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """K and V rounded to FAKE["dtype"] over per-head scales, then causal float32 SDPA."""
    dt, ks, vs = FAKE["dtype"], FAKE["k"][module.layer_idx], FAKE["v"][module.layer_idx]
    top = torch.finfo(dt).max

    def rounded(x, s):
        s = s.view(1, -1, 1, 1).float()
        return (x.float() / s).clamp(-top, top).to(dt).float() * s

    out = F.scaled_dot_product_attention(
        query.float(),
        rounded(key, ks),
        rounded(value, vs),
        is_causal=True,
        scale=scaling,
        enable_gqa=True,
    )
    return out.to(query.dtype).transpose(1, 2), None


class Tally:
    """Sums over scored positions: NLL, top-1 agreement and KL against the reference."""

    def __init__(self):
        self.n = self.nll = self.agree = self.kl = 0.0
        self.by_pos = {}

    def add(self, logits, ids, ref=None, buckets=None):
        """logits [T, V] of the window ids [T]; ref: the reference's log-probs [T - 1, V]."""
        logp = torch.log_softmax(logits[:-1].float(), -1)
        nll = -logp.gather(1, ids[1:, None]).squeeze(1)
        self.n += nll.numel()
        self.nll += float(nll.sum())
        if ref is not None:
            self.agree += float((logp.argmax(-1) == ref.argmax(-1)).sum())
            self.kl += float((ref.exp() * (ref - logp)).sum())
        for a, b in buckets or []:
            s = self.by_pos.setdefault(f"{a}-{b}", [0.0, 0])
            s[0] += float(nll[max(a - 1, 0) : b - 1].sum())
            s[1] += nll[max(a - 1, 0) : b - 1].numel()
        return logp

    def row(self):
        out = {"tokens": int(self.n), "nll": self.nll / self.n}
        if self.agree or self.kl:
            out |= {"top1_agree": self.agree / self.n, "kl": self.kl / self.n}
        if self.by_pos:
            out["nll_by_position"] = {k: s / max(n, 1) for k, (s, n) in self.by_pos.items()}
        return out


@torch.no_grad()
def stock_logits(model, ids):
    model.set_attn_implementation("sdpa")
    return model(ids[None], use_cache=False).logits[0]


@torch.no_grad()
def fake_logits(model, ids, dtype, ks, vs):
    FAKE.update(dtype=dtype, k=ks, v=vs)
    model.set_attn_implementation("sm70attn_fake")
    return model(ids[None], use_cache=False).logits[0]


@torch.no_grad()
def paged_logits(model, ids, cache, prompt):
    """The window through the cache: `prompt` tokens in one forward, then ROWS a forward."""
    model.set_attn_implementation(hf.NAME)
    cache.reset()
    out, T, s = [], ids.numel(), 0
    while s < T:
        n = min(prompt if s == 0 else ROWS, T - s)
        pos = torch.arange(s, s + n, device=ids.device)[None]
        out.append(model(ids[None, s : s + n], position_ids=pos, cache=cache).logits[0])
        s += n
    return torch.cat(out)


def scales(model, sample, tmp: Path):
    """Per layer (k, v) scale lists of the variants (a), (b), (d); (d) through a checkpoint."""
    from safetensors.torch import load_file, save_file

    model.set_attn_implementation(hf.NAME)
    cache = hf.PagedE4M3Cache(model.config, max_tokens=sample.numel() + 64)
    cache.calibrate(model, sample[None])
    a = cache.scales()
    b = tuple([s.max().reshape(1) for s in ss] for ss in a)
    cache.calibrate(model, sample[None], headroom=1.0)
    amax = [[float(x.max()) for x in xs] for xs in cache.scales()]
    src = Path(model.name_or_path)
    tensors = load_file(src / "model.safetensors")
    for i in range(len(cache.layers)):
        for w, vals in zip("kv", amax, strict=True):
            tensors[f"model.layers.{i}.self_attn.{w}_scale"] = torch.tensor(vals[i])
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    d = hf.kv_scales_from_checkpoint(tmp)
    return {"a": a, "b": b, "d": d}


def windows(stream, n, T, skip):
    starts = torch.linspace(skip, stream.numel() - T - 1, n).long().tolist()
    return [stream[s : s + T] for s in starts]


def perplexity(model, stream, args, dev, out):
    T, n = args.window, args.windows
    sample = stream[: args.sample].to(dev)  # the calibration sample, outside every window
    with tempfile.TemporaryDirectory() as tmp:
        sc = scales(model, sample, Path(tmp))
    per = {"a": sc["a"], "b": sc["b"], "d": sc["d"]}
    out["scales"] = {
        k: {w: [[float(x) for x in s] for s in v[i]] for i, w in enumerate("kv")}
        for k, v in per.items()
    }
    rows = {
        name: Tally()
        for name in ("float16", "e4m3 (a)", "e4m3 (b)", "e4m3 (c)", "e4m3 (d)", "emul e4m3 (a)",
                     "emul e5m2 scale 1")
    }  # fmt: skip
    cfg = model.config
    caches = {
        k: hf.PagedE4M3Cache(cfg, max_tokens=T + 64, k_scale=v[0], v_scale=v[1])
        for k, v in per.items()
    }
    ones = [torch.ones(cfg.num_key_value_heads, device=dev)] * cfg.num_hidden_layers
    t0 = time.perf_counter()
    for i, w in enumerate(windows(stream, n, T, args.sample)):
        w = w.to(dev)
        ref = rows["float16"].add(stock_logits(model, w), w)
        for k, c in caches.items():
            rows[f"e4m3 ({k})"].add(paged_logits(model, w, c, args.prompt), w, ref)
        fresh = hf.PagedE4M3Cache(cfg, max_tokens=T + 64)  # (c): its own first forward
        rows["e4m3 (c)"].add(paged_logits(model, w, fresh, args.prompt), w, ref)
        rows["emul e4m3 (a)"].add(fake_logits(model, w, torch.float8_e4m3fn, *per["a"]), w, ref)
        rows["emul e5m2 scale 1"].add(fake_logits(model, w, torch.float8_e5m2, ones, ones), w, ref)
        print(f"  window {i + 1}/{n}: {time.perf_counter() - t0:.0f} s", flush=True)
    out["perplexity"] = {k: r.row() for k, r in rows.items()}
    return per


def long_context(model, stream, args, dev, out, per):
    T, tail = 32768, 2048
    # the last band: the tokens predicted by 16-row forwards (position T - tail is predicted
    # by the prompt forward's last row)
    buckets = [(0, 4096), (4096, 16384), (16384, T - tail + 1), (T - tail + 1, T)]
    rows = {n: Tally() for n in ("float16", "e4m3 (a)", "e4m3 (c)")}
    cfg = model.config
    for i, w in enumerate(windows(stream, args.long, T, args.sample)):
        w = w.to(dev)
        ref = rows["float16"].add(stock_logits(model, w), w, buckets=buckets)
        ca = hf.PagedE4M3Cache(cfg, max_tokens=T + 64, k_scale=per["a"][0], v_scale=per["a"][1])
        rows["e4m3 (a)"].add(paged_logits(model, w, ca, T - tail), w, ref, buckets)
        cc = hf.PagedE4M3Cache(cfg, max_tokens=T + 64)
        rows["e4m3 (c)"].add(paged_logits(model, w, cc, T - tail), w, ref, buckets)
        print(f"  long window {i + 1}/{args.long}", flush=True)
    out["long"] = {k: r.row() for k, r in rows.items()}


@torch.no_grad()
def greedy(model, tok, stream, args, dev, out, per):
    """Tokens until the first difference from float16, per prompt (a file's first 256 tokens)."""
    eot = shipped.eot_id(tok)
    L, G = 256, args.new
    starts = [s for s in shipped.file_starts(stream, eot) if s + L <= stream.numel()]
    starts = [s for s in starts if s >= args.sample and (stream[s : s + L] != eot).all()]
    pick = torch.linspace(0, len(starts) - 1, args.prompts).long().tolist()
    ids = torch.stack([stream[starts[i] : starts[i] + L] for i in pick]).to(dev)
    P = ids.shape[0]
    kw = dict(do_sample=False, max_new_tokens=G, min_new_tokens=G, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), output_logits=True, **kw)
    ref_logits = torch.stack(ref.logits, 1).float()  # [P, G, V]
    ref_tok = ref.sequences[:, L:]
    model.set_attn_implementation(hf.NAME)
    res = {}
    for name, ks, vs in (("e4m3 (a)", *per["a"]), ("e4m3 (c)", None, None)):
        cache = hf.PagedE4M3Cache(
            model.config, max_tokens=P * (L + G + 16), max_batch_size=P, k_scale=ks, v_scale=vs
        )
        got = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, disable_compile=True, **kw
        ).sequences[:, L:]
        diff = got != ref_tok
        first = [int(d.nonzero()[0]) if d.any() else G for d in diff]
        margins = []
        for b, f in enumerate(first):
            if f < G:
                top2 = ref_logits[b, f].topk(2).values
                margins.append(float(top2[0] - top2[1]))
        res[name] = {
            "first_difference": first,
            "mean": statistics.mean(first),
            "median": statistics.median(first),
            "identical": sum(f == G for f in first),
            "margin_at_difference_median": statistics.median(margins) if margins else None,
        }
        print(f"  greedy {name}: {res[name]['identical']}/{P} identical over {G} tokens, "
              f"median first difference {res[name]['median']}", flush=True)  # fmt: skip
    out["greedy"] = {"prompts": P, "prompt_tokens": L, "new_tokens": G, **res}


def report(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"\n{r['header']}\n")
        base = r["perplexity"]["float16"]["nll"]
        lines.append("| cache | scales | NLL / token | vs float16 | top-1 agreement | KL |")
        lines.append("|---|---|---|---|---|---|")
        for name, row in r["perplexity"].items():
            fmt, _, sc = name.partition(" (")
            agree = f"{row['top1_agree']:.4f}" if "top1_agree" in row else "-"
            kl = f"{row['kl']:.5f}" if "kl" in row else "-"
            lines.append(f"| {fmt} | {sc.rstrip(')') or '-'} | {row['nll']:.4f} | "
                         f"{row['nll'] - base:+.4f} | {agree} | {kl} |")  # fmt: skip
        if "long" in r:
            keys = list(r["long"]["float16"]["nll_by_position"])
            lines.append(
                f"\n| cache (32768-token windows) | {' | '.join(keys)} | top-1 agreement |"
            )
            lines.append("|---|" + "---|" * (len(keys) + 1))
            for name, row in r["long"].items():
                cells = [f"{row['nll_by_position'][k]:.4f}" for k in keys]
                agree = f"{row['top1_agree']:.4f}" if "top1_agree" in row else "-"
                lines.append(f"| {name} | {' | '.join(cells)} | {agree} |")
        if "greedy" in r:
            g = r["greedy"]
            lines.append(f"\nGreedy: {g['prompts']} prompts of {g['prompt_tokens']} tokens, "
                         f"{g['new_tokens']} new tokens each")  # fmt: skip
            lines.append("\n| cache | identical to float16 | first difference: median | mean | "
                         "float16's top-2 margin there (median) |")  # fmt: skip
            lines.append("|---|---|---|---|---|")
            for name in ("e4m3 (a)", "e4m3 (c)"):
                x = g[name]
                m = x["margin_at_difference_median"]
                lines.append(f"| {name} | {x['identical']} of {g['prompts']} | {x['median']} | "
                             f"{x['mean']:.1f} | {'-' if m is None else f'{m:.3f}'} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=None,
                    help="tools/lm_corpus.py's folder (heldout.u16); default: this package's own source")  # fmt: skip
    ap.add_argument("--model", type=Path, default=None, help="default: the shipped model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--sample", type=int, default=4096, help="calibration tokens")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--long", type=int, default=0, help="32768-token windows (a GPU's work)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", nargs="+", default=None)
    args = ap.parse_args()
    if args.report:
        print(report([json.loads(Path(f).read_text()) for f in args.report]))
        return 0
    from transformers import AttentionInterface

    AttentionInterface.register("sm70attn_fake", fake_attention)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        sa.ops.load_cuda_kernels()
    model, tok = shipped.load(dev, args.model)
    if args.data:
        stream, src = shipped.token_file(args.data / "heldout.u16"), f"{args.data}/heldout.u16"
    else:
        stream, src = shipped.own_source(tok), "torch_sm70attn's own source"
    route = sa.admit(
        torch.empty(1, 12, 16, 256, dtype=torch.float16, device=dev),
        torch.empty(1, 16, 2, 256, dtype=torch.float8_e4m3fn, device=dev),
    )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    out = {
        "header": (
            f"{name}, torch {torch.__version__}; {src} ({stream.numel()} tokens); {args.windows} "
            f"windows of {args.window} tokens, prompt {args.prompt}, then {ROWS} rows a forward "
            f"(route: {route.route}); calibration sample {args.sample} tokens"
        ),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(out["header"], flush=True)
    per = perplexity(model, stream, args, dev, out)
    if args.long:
        long_context(model, stream, args, dev, out, per)
    if args.prompts:
        greedy(model, tok, stream, args, dev, out, per)
    print(report([out]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
