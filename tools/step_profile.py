#!/usr/bin/env python3
"""Where an eager decode step of a transformers model spends its time: ours (PagedE4M3Cache +
the sm70attn attention) against stock (sdpa attention, float16 DynamicCache), the demo's model
(demo.build), one request after a prompt of --ctx tokens.

    python tools/step_profile.py [--ctx 32768] [--layers 4] [--json out.json]

Per path, in --rounds rounds that alternate the paths (host timing drifts): the wall time of a
decode forward (a token, synchronized after each), and the host time of one (the forward
enqueued with the GPU kept busy before it, so that the host never waits: the time the host
needs to issue a step); medians over every step of every round. The difference of ours and
stock per layer is what our cache update and attention add. Then what a user of generate()
sees: decode ms per token after the prompt (--new tokens, greedy), median of the rounds after a
warm-up run of each path. Last, torch.profiler's table of the host-side ops of 10 of our steps
and cProfile's Python functions, printed for the reader. Only the public API is used, so the
same script times an older tree (PYTHONPATH=TREE).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch
from transformers import DynamicCache

import torch_sm70attn as sa
from torch_sm70attn.integrations import demo
from torch_sm70attn.integrations import transformers as hf


def steps(model, cache, ids, ctx, n):
    """Yields n decode forwards' (wall ms, host ms)."""
    tok = ids[:, -1:]
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.half)
    with torch.no_grad():
        model(ids, cache=cache, logits_to_keep=1)
        for i in range(n):
            pos = torch.tensor([[ctx + i]], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(tok, cache=cache, position_ids=pos, logits_to_keep=1)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            for _ in range(40):  # keep the GPU busy for a few ms: the host runs ahead
                busy @ busy
            t0 = time.perf_counter()
            model(tok, cache=cache, position_ids=pos + 1, logits_to_keep=1)
            host = time.perf_counter() - t0
            torch.cuda.synchronize()
            cache.crop(-2)  # every step sees the same context
            yield wall * 1e3, host * 1e3


def decode_ms(model, ids, cache, new) -> float:
    """generate(): ms per token after the prompt's forward (a hook marks its end)."""
    marks = []

    def first(*_):
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        hook.remove()

    hook = model.register_forward_hook(first)
    try:
        with torch.no_grad():
            model.generate(
                ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                disable_compile=True,
            )  # fmt: skip
    finally:
        hook.remove()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - marks[0]) / (new - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sa.ops.load_cuda_kernels()
    model = demo.build(torch.device("cuda"), a.layers)
    ids = demo.make_prompt(1, a.ctx, "cuda")
    res = {"ctx": a.ctx, "layers": a.layers, "tree": sa.__file__}
    paths = (
        ("stock", "sdpa", lambda: None),
        ("ours", hf.NAME, lambda: hf.PagedE4M3Cache(model.config, max_tokens=a.ctx + 2 * a.new)),
    )
    got = {name: [] for name, *_ in paths}
    for _ in range(a.rounds):
        for name, impl, make in paths:
            model.set_attn_implementation(impl)
            got[name] += list(steps(model, make() or DynamicCache(), ids, a.ctx, a.steps))[3:]
    for name in got:
        res[name] = {
            "wall_ms": statistics.median(w for w, _ in got[name]),
            "host_ms": statistics.median(h for _, h in got[name]),
        }
        print(name, res[name], flush=True)
    gen = {name: [] for name, *_ in paths}
    for r in range(a.rounds + 1):
        for name, impl, make in paths:
            model.set_attn_implementation(impl)
            ms = decode_ms(model, ids, make(), a.new)
            if r:  # the first round warms up
                gen[name].append(ms)
    res["generate_decode_ms_per_token"] = {k: statistics.median(v) for k, v in gen.items()}
    res["generate_runs"] = gen
    print("generate, decode ms/token:", res["generate_decode_ms_per_token"], flush=True)
    per_layer = {
        k: 1e3 * (res["ours"][k] - res["stock"][k]) / a.layers for k in ("wall_ms", "host_ms")
    }
    res["ours_minus_stock_us_per_layer"] = per_layer
    print("ours - stock, us per layer:", per_layer, flush=True)
    model.set_attn_implementation(hf.NAME)
    cache = hf.PagedE4M3Cache(model.config, max_tokens=a.ctx + 64)
    tok, pos = ids[:, -1:], torch.tensor([[a.ctx]], device="cuda")

    def step():
        model(tok, cache=cache, position_ids=pos, logits_to_keep=1)
        torch.cuda.synchronize()
        cache.crop(-1)

    with torch.no_grad():
        model(ids, cache=cache, logits_to_keep=1)
        for _ in range(5):
            step()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            step()
        pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
