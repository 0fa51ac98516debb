"""What prompt lookup accepts on real text: the shipped model continuing held-out Python files,
speculative.generate and speculative.serve against plain decode, through the paged E4M3 cache.

    python tools/acceptance.py --data DATA --json acc.json    # a GPU; DATA: lm_corpus's output
    python tools/acceptance.py --report acc.json

Each request continues a held-out file from its first third: its prompt is the --ctx tokens
that end there (the files before it in its package, then the file's first part). --requests
requests, --new greedy tokens each. Paths, all eager, one PagedE4M3Cache with calibrated scales:
plain decode (transformers' generate), speculative.generate (the requests as one batch, verify
steps of drafts + 1 rows a request) and speculative.serve (the requests through --slots slots,
each joining as one frees; by default one a request) with 3, 5 and 7 drafts. Decode tokens/s
count the tokens after the prompts' forward (generate) or after the first round (serve: the
prompts that fill its slots and one verify step); each the median of --runs runs after one
warm-up run. A model this small loops under greedy decoding: the plain decode row gives the
share of its tokens that repeat an earlier 8-gram, and each path its acceptance over each
request's first 64 tokens, before most loops set in. The shipped model was trained at 32768
positions: a --ctx of 32768 generates past them (--new tokens)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import torch_sm70attn as sa
from torch_sm70attn.integrations import demo, shipped, speculative
from torch_sm70attn.integrations import transformers as hf


def repeated_share(prompt: torch.Tensor, new: torch.Tensor, n: int = 8) -> float:
    """The share of the new tokens whose n-gram (ending there) occurred earlier, in the prompt
    or the output: text a loop or a copy produces, which prompt lookup predicts."""
    seq = torch.cat([prompt.cpu(), new.cpu()]).tolist()
    L = prompt.numel()
    seen = {tuple(seq[i : i + n]) for i in range(L - n + 1)}
    hits = 0
    for p in range(L, len(seq)):
        g = tuple(seq[p - n + 1 : p + 1])
        hits += g in seen
        seen.add(g)
    return hits / max(len(seq) - L, 1)


def early_acceptance(emitted: list[list[int]], first: int = 64) -> float:
    """Drafts a request accepted a verify step, over its steps until it had emitted `first`
    tokens, averaged over (request, step). A request's first token is its prompt's; a verify
    step that emits e tokens accepted e - 1 drafts. serve lists its prompt's token in the round
    of its first verify step, so a round's count is taken apart the same way. (Whole-run
    acceptance, Output.accepted, averages each step's mean over its running requests.)"""
    acc, steps = 0, 0
    count = [0] * len(emitted[0])
    for step in emitted:
        for b, e in enumerate(step):
            if e and count[b] == 0:  # the prompt's token
                count[b], e = 1, e - 1
            if e:
                if count[b] < first:
                    acc, steps = acc + e - 1, steps + 1
                count[b] += e
    return acc / max(steps, 1)


def timed(fn, runs):
    fn()  # warm-up
    got = [fn() for _ in range(runs)]
    return got


def measure(model, ids, args) -> dict:
    """One context: plain decode, then generate and serve with each number of drafts."""
    (B, ctx), new, top = ids.shape, args.new, max(args.drafts)
    cache = hf.PagedE4M3Cache(model.config, max_tokens=B * (ctx + new + top + 32), max_batch_size=B)
    cache.calibrate(model, ids[:1, :4096])
    scales = cache.scales()
    slots = hf.PagedE4M3Cache(
        model.config, max_tokens=args.slots * (ctx + new + top + 32),
        max_batch_size=args.slots, k_scale=scales[0], v_scale=scales[1],
    )  # fmt: skip

    def plain():
        cache.reset()
        seqs, _, (_, after) = demo.timed_generate(model, ids, cache, new)
        return seqs.cpu(), B * (new - 1) / after

    base = timed(plain, args.runs)
    greedy = base[-1][0]
    share = statistics.mean(repeated_share(ids[b], greedy[b]) for b in range(B))
    row = {"ctx": ctx, "plain": {"tokens_per_s": statistics.median(r[1] for r in base)},
           "repeated_8gram_share": share}  # fmt: skip
    print(f"  {ctx}: plain decode {row['plain']['tokens_per_s']:.0f} tokens/s", flush=True)
    for k in args.drafts:

        def gen(k=k):
            cache.reset()
            o = speculative.generate(  # every request to `new` tokens, as plain decode
                model, ids, cache=cache, max_new_tokens=new, drafts=k, eos_token_id=[]
            )
            toks = torch.stack(o.tokens)
            after = sum(map(sum, o.emitted[1:]))
            rate = after / (o.times[-1] - o.times[0])
            return toks, rate, statistics.mean(o.accepted), early_acceptance(o.emitted)

        def srv(k=k):
            o = speculative.serve(
                model, list(ids.unbind(0)), cache=slots, max_new_tokens=new, drafts=k,
                eos_token_id=[],
            )
            toks = torch.stack(o.tokens)
            after = sum(map(sum, o.emitted[1:]))  # after the first round's prompts
            rate = after / (o.times[-1] - o.times[0])
            return toks, rate, statistics.mean(o.accepted), early_acceptance(o.emitted)

        for path, fn in (("generate", gen), ("serve", srv)):
            got = timed(fn, args.runs)
            same = sum(bool(torch.equal(a, b)) for a, b in zip(got[-1][0], greedy, strict=True))
            row[f"{path} {k}"] = {
                "tokens_per_s": statistics.median(g[1] for g in got),
                "accepted_per_step": statistics.median(g[2] for g in got),
                "accepted_first_64": statistics.median(g[3] for g in got),
                "requests_equal_to_plain": same,
            }
            print(f"  {ctx}: {path} {k} drafts: {row[f'{path} {k}']}", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=None, help="default: this package's own source")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--slots", type=int, default=None, help="serve's slots (default: --requests)")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--drafts", type=int, nargs="+", default=[3, 5, 7])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None)
    args = ap.parse_args()
    args.slots = args.slots or args.requests
    if args.report:
        print(table(json.loads(Path(args.report).read_text())))
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        sa.ops.load_cuda_kernels()
    model, tok = shipped.load(dev, args.model)
    eot = shipped.eot_id(tok)
    if args.data:
        stream, src = shipped.token_file(args.data / "heldout.u16"), "held-out split"
    else:
        stream, src = shipped.own_source(tok), "torch_sm70attn's own source"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    out = {
        "header": f"{name}, torch {torch.__version__}; shipped model, {src}; {args.requests} "
        f"requests, {args.new} new tokens each, serve through {args.slots} slots; eager; "
        f"medians of {args.runs} runs",
        "rows": [],
    }
    print(out["header"], flush=True)
    model.set_attn_implementation(hf.NAME)
    B = args.requests
    for ctx in args.ctx:
        out["rows"].append(measure(model, shipped.continuations(stream, eot, ctx, B).to(dev), args))
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def table(out) -> str:
    lines = [out["header"], "", "| context | path | drafts | accepted drafts a step | over the first 64 tokens | tokens/s | vs plain decode | requests equal to plain decode |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in out["rows"]:
        base = r["plain"]["tokens_per_s"]
        share = r.get("repeated_8gram_share")
        note = "-" if share is None else f"{share:.0%} of its tokens repeat an earlier 8-gram"
        lines.append(f"| {r['ctx']} | plain decode | - | {note} | - | {base:.0f} | 1.00 | - |")
        for key, v in r.items():
            if not isinstance(v, dict) or key == "plain":
                continue
            path, k = key.split()
            early = v.get("accepted_first_64")
            lines.append(f"| {r['ctx']} | {path} | {k} | {v['accepted_per_step']:.2f} | "
                         f"{'-' if early is None else f'{early:.2f}'} | "
                         f"{v['tokens_per_s']:.0f} | {v['tokens_per_s'] / base:.2f} | "
                         f"{v['requests_equal_to_plain']} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
