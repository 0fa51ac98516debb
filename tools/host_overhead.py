#!/usr/bin/env python3
"""Host time per call of the ops: what an eager decode step pays per layer on the CPU, apart
from the GPU's time. Uses the public API only, so one copy of this script times any tree of the
project (PYTHONPATH=TREE python tools/host_overhead.py) for a before/after table.

    python tools/host_overhead.py [--json out.json] [--calls 200] [--reps 15]

Per case: N calls enqueued back to back with no synchronisation, after warm-up (so every kernel
is compiled and every plan cached), timed on the host clock; N stays well under the launch
queue's depth, so the loop measures the host and not the GPU. The median over the repetitions of
the time per call, in microseconds: the public function, the raw op (what a compiled graph
calls), store_kv, and one CUDA graph replay of a call (the cost of a step under
mode="reduce-overhead", which runs none of our host code).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torch_sm70attn as sa

CASES = [  # (label, B, Q, H_kv, G, D, context)
    ("decode B1 G6 D256", 1, 1, 1, 6, 256, 4096),
    ("verify B8 Q8 G6 D256", 8, 8, 1, 6, 256, 4096),
    ("decode B8 G4 D128 Hkv8", 8, 1, 8, 4, 128, 4096),
]


def per_call_us(fn, calls: int, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def problem(B, Q, H_kv, G, D, ctx, page=16):
    pages = -(-ctx // page)
    kc = torch.randn(B * pages, page, H_kv, D, device="cuda").to(torch.float8_e4m3fn)
    vc = torch.randn_like(kc, dtype=torch.float16).to(torch.float8_e4m3fn)
    bt = torch.arange(B * pages, dtype=torch.int32, device="cuda").view(B, pages)
    sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H_kv * G, Q, D, device="cuda").half()
    ks = torch.full((H_kv,), 0.02, device="cuda")
    return q, kc, vc, bt, sl, ks


def case(label, B, Q, H_kv, G, D, ctx, calls, reps) -> dict:
    q, kc, vc, bt, sl, ks = problem(B, Q, H_kv, G, D, ctx)
    args = (q, kc, vc, bt, sl, D**-0.5, ks, ks)
    raw = torch.ops.sm70attn.paged_attention.default
    k = torch.randn(B * Q, H_kv, D, device="cuda").half()
    slots = torch.arange(B * Q, dtype=torch.int64, device="cuda")
    r = dict(case=label)
    r["public"] = per_call_us(
        lambda: sa.paged_attention(q, kc, vc, bt, sl, k_scale=ks, v_scale=ks), calls, reps
    )
    r["raw_op"] = per_call_us(lambda: raw(*args), calls, reps)
    r["store_kv"] = per_call_us(
        lambda: sa.store_kv(k, k, kc, vc, slots, k_scale=ks, v_scale=ks), calls, reps
    )
    raw(*args)  # warm (kernels, plans) before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        raw(*args)
    r["graph_replay"] = per_call_us(g.replay, calls, reps)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = [case(*c, a.calls, a.reps) for c in CASES]
    cols = ("public", "raw_op", "store_kv", "graph_replay")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {sa.__file__}")
    print(f"{'us per call (median)':<26}" + "".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(f"{r['case']:<26}" + "".join(f"{r[c]:>14.2f}" for c in cols))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
