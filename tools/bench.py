#!/usr/bin/env python3
"""Benchmark torch_sm70attn.paged_attention (CUDA route) against the attention as users write
it today: gather pages -> fp16 -> scale -> repeat_interleave (GQA) -> SDPA with verifier_mask,
eager and under torch.compile (inductor).

    python tools/bench.py --json bench.json --plot bench.png          # full grid on the GPU
    python tools/bench.py --page 3296                                 # page-size sweep
    python tools/bench.py --head-dim 128 --group 4 --batches 8 --rows 8
    python tools/bench.py --device cpu --smoke --json /tmp/b.json     # logic test, no GPU
    python tools/bench.py --report a.json b.json --plot m.png         # merge split runs

Every cell rotates over >= --sets KV working sets (block tables over one page pool) so the
cache never sits in L2. On CUDA each implementation is captured into one CUDA graph that
holds one call per working set; a sample is R replays of it, timed with CUDA events, divided
by R x sets; samples alternate op, eager, compiled, op, ... and the median is reported.
The markdown table is printed last (stdout); progress goes to stderr. The inductor peer
compiles per shape: split a long grid over commands (--batches, --peers) and merge the JSONs.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import torch_sm70attn as sa  # noqa: E402
from torch_sm70attn.__main__ import sdpa_over_gather  # noqa: E402

GIB = 2**30
KEYS = ("B", "Q", "ctx", "H_kv", "G", "D", "page")
V100_BW, V100_TC, V100_FP32 = 900e9, 125e12, 15.7e12
FULL = dict(batches=[1, 4, 8, 16], rows=[1, 8], contexts=[8192, 32768, 131072, 262144], hkv=[1, 4])
FULL.update(page=[1648], head_dim=[256], group=[6])
SMOKE = dict(batches=[1, 2], rows=[1, 4], contexts=[1000], hkv=[2], page=[64], head_dim=[128])
COMPILED_HOW = (
    "torch.compile(sdpa_over_gather, backend='inductor', mode=default, dynamic=False), "
    "dynamo reset per cell, then captured by this script into the cell's CUDA graph "
    "(timed eagerly if capture fails: see each cell's mode)"
)


def parse_args(argv=None):
    ints = dict(type=int, nargs="+")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    ap.add_argument("--smoke", action="store_true", help="a handful of tiny cells (seconds)")
    ap.add_argument("--batches", **ints, help="B (default 1 4 8 16)")
    ap.add_argument("--rows", **ints, help="query rows Q (default 1 8)")
    ap.add_argument("--contexts", **ints, help="tokens (default 8192 32768 131072 262144)")
    ap.add_argument("--hkv", **ints, help="KV heads H_kv (default 1 4)")
    ap.add_argument("--page", **ints, help="page size (default 1648)")
    ap.add_argument("--head-dim", **ints, help="D (default 256)")
    ap.add_argument("--group", **ints, help="G = H_q / H_kv (default 6)")
    ap.add_argument("--ragged", action="store_true", help="seq_lens uniform in [ctx/2, ctx]")
    ap.add_argument("--peers", choices=["none", "eager", "all"], help="all (smoke: eager)")
    ap.add_argument("--peer-mem-gb", type=float, default=40.0, help="skip a peer above this")
    ap.add_argument("--pool-gb", type=float, default=24.0, help="cap of the KV page pool, GiB")
    ap.add_argument("--sets", type=int, default=None, help="min. working sets per cell (16)")
    ap.add_argument("--max-sets", type=int, default=64, help="max. sets (small cells, L2)")
    ap.add_argument("--samples", type=int, default=None, help="timed samples of the op (15)")
    ap.add_argument("--peer-samples", type=int, default=5, help="timed samples of each peer")
    ap.add_argument("--target-ms", type=float, default=2.0, help="min. duration of a sample")
    ap.add_argument("--copy-gb", type=float, default=None, help="copy-BW buffer, GiB (2)")
    ap.add_argument("--no-graphs", action="store_true", help="time eagerly, no CUDA graphs")
    ap.add_argument(
        "--sms", type=int, default=None, help="run on a green context of N SMs, planned for N"
    )
    ap.add_argument(
        "--sm-smem", type=int, default=None, help="CTAs per SM as if an SM had this smem"
    )
    ap.add_argument(
        "--v100-grid", action="store_true", help="a V100's grids: --sms 80 --sm-smem 98304"
    )
    ap.add_argument(
        "--kernel",
        choices=["auto", "wmma", "rf-m8n8k4", "rf-m16n8k16"],
        default="auto",
        help="attention kernel where the register-fragment one applies (A/B runs; default auto)",
    )
    ap.add_argument("--max-seconds", type=float, default=480.0, help="skip cells after this")
    ap.add_argument("--l2-mb", type=float, default=None, help="L2 size (default: the GPU's)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, allocate nothing")
    ap.add_argument("--json", default=None, help="write every raw sample here")
    ap.add_argument("--plot", default=None, help="PNG of %% copy BW and latency vs context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", nargs="+", metavar="JSON", help="merge saved runs, print, exit")
    a = ap.parse_args(argv)
    for k, v in FULL.items():
        if getattr(a, k) is None:
            setattr(a, k, SMOKE.get(k, v) if a.smoke else v)
    a.peers = a.peers or ("eager" if a.smoke else "all")
    a.samples = a.samples or (3 if a.smoke else 15)
    a.sets = a.sets or (4 if a.smoke else 16)
    a.peer_samples = min(a.peer_samples, a.samples)
    a.copy_gb = a.copy_gb or (1 / 16 if a.smoke else 2.0)
    a.device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.v100_grid:
        a.sms, a.sm_smem = a.sms or 80, a.sm_smem or 98304
    return a


class Clock:
    """ms of one call of fn, R times in a row: CUDA events on a GPU, else the host clock."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, reps=1) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps


def copy_bandwidth(dev, gib, samples, clock):
    """Device-to-device copy: (bytes read + written) / time, median over samples."""
    n = int(gib * GIB)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    clock.sync()
    ms = [clock(lambda: dst.copy_(src)) for _ in range(max(samples, 10))]
    return {"bytes_each_way": n, "samples_ms": ms, "gbps": 2 * n / statistics.median(ms) / 1e6}


def l2_bytes(dev, l2_mb=None) -> int:
    if l2_mb is not None:
        return int(l2_mb * 2**20)
    if dev.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 60 * 2**20)


def plan(cell, a, l2):
    """Pages per working set, number of sets, pool size and the page shift between sets."""
    B, Q, ctx, hkv, G, D, page = cell
    n_pages = -(-ctx // page)
    need, page_bytes = B * n_pages, page * hkv * D  # pages per set; bytes per page, one cache
    set_bytes = 2 * need * page_bytes
    n_sets = a.sets
    if l2:  # keep >= 4 x L2 in rotation for small cells
        n_sets = max(a.sets, min(a.max_sets, -(-4 * l2 // set_bytes)))
    cap_pages = int(a.pool_gb * GIB // (2 * page_bytes))
    P = max(need, min(n_sets * need, cap_pages))
    disjoint = P >= n_sets * need
    stride = need if disjoint else max(P // n_sets, -(-2 * l2 // page_bytes), 1)
    p = dict(n_pages=n_pages, capacity=n_pages * page, pages_per_set=need, n_sets=n_sets)
    p.update(set_bytes=set_bytes, pool_pages=P, pool_bytes=2 * P * page_bytes)
    return dict(p, disjoint=disjoint, stride_pages=stride)


def peer_bytes(B, Q, cap, hkv, G, D) -> int:
    """Peak bytes of gather -> fp16 -> scale -> repeat_interleave -> SDPA (upper bound): K and
    V repeated to H_q heads, one fp8 + two fp16 transients, scores and probabilities in fp32."""
    n = B * cap * hkv * D  # gathered elements per cache
    return 4 * n * G + 5 * n + 3 * B * hkv * G * Q * cap * 4


def counts(cell, lens):
    B, Q, ctx, hkv, G, D, page = cell
    tokens = sum(lens)
    kern_rows = -(-G * Q // 16) * 16  # the kernel's WMMA tiles pad G x Q rows to 16
    c = dict(bytes=2 * tokens * hkv * D, flops=4 * hkv * G * Q * tokens * D)
    return dict(c, kernel_flops=4 * hkv * kern_rows * tokens * D)


def fill_e4m3(buf, gen):
    """Random E4M3 codes of N(0, 8) samples (never NaN, almost never 0), 64 Mi at a time."""
    for chunk in buf.split(2**26):
        x = torch.randn(chunk.numel(), generator=gen, device=buf.device).mul_(8.0)
        chunk.copy_(x.to(torch.float8_e4m3fn))


def loop(calls):
    def run():
        for c in calls:
            c()

    return run


def warm(calls, dev, side=None):
    """Every call once; on CUDA on a side stream, as torch's capture recipe asks."""
    if dev.type != "cuda":
        return loop(calls)()
    side = side or torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        loop(calls)()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)


def capture(calls, dev, pool, graphs, side=None):
    """One runnable doing every call once: a CUDA graph when possible, else a Python loop.
    side: the stream to capture on (a green context's; default: torch's own side stream)."""
    if dev.type != "cuda" or not graphs:
        return loop(calls), "eager"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=side):  # one memory pool for a cell's graphs
            loop(calls)()
        return g.replay, "cuda-graph"
    except Exception as e:  # not capturable: time it eagerly and say so
        torch.cuda.synchronize(dev)
        return loop(calls), f"eager (capture failed: {type(e).__name__}: {str(e)[:200]})"


def green_stream(dev, num_sms):
    """A stream of a CUDA green context holding num_sms SMs (torch.cuda.green_contexts; the
    API moved between torch releases), and the context (keep it alive)."""
    from torch.cuda.green_contexts import GreenContext

    try:
        ctx = GreenContext.create(num_sms=num_sms, device_id=dev.index or 0)
    except TypeError:
        ctx = GreenContext.create(num_sms, dev.index or 0)
    if hasattr(ctx, "Stream"):
        return ctx.Stream(), ctx
    (getattr(ctx, "set_context", None) or ctx.make_current)()  # older API: streams made now are its
    return torch.cuda.Stream(dev), ctx


def green_probe(dev, stream, clock):
    """ms of one fp16 8192^3 matrix product (compute-bound: its time scales with the SMs) in a
    CUDA graph captured and replayed on torch's stream and on `stream`."""
    x = torch.randn(8192, 8192, device=dev, dtype=torch.half)
    out = {}
    for name, s in (("all SMs", torch.cuda.Stream(dev)), ("green context", stream)):
        with torch.cuda.stream(s):
            warm([lambda: torch.mm(x, x)], dev, s)
            run, mode = capture([lambda: torch.mm(x, x)], dev, None, True, s)
            run()
            out[name] = statistics.median(clock(run, 3) for _ in range(5))
    out["ratio"] = out["green context"] / out["all SMs"]
    return out


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def run_cell(cell, a, dev, kv_buf, l2, clock):
    """Inputs of one cell over its working sets, a correctness check, then the timings."""
    B, Q, ctx, hkv, G, D, page = cell
    p = plan(cell, a, l2)
    gen = torch.Generator().manual_seed(a.seed)
    P, need, n_sets = p["pool_pages"], p["pages_per_set"], p["n_sets"]
    kc = kv_buf[: P * page * hkv * D].view(P, page, hkv, D)
    vc = kv_buf[P * page * hkv * D : 2 * P * page * hkv * D].view(P, page, hkv, D)
    tables = [
        ((s * p["stride_pages"] + torch.randperm(need, generator=gen)) % P)
        .view(B, p["n_pages"])
        .int()
        .to(dev)
        for s in range(n_sets)
    ]
    lens = [ctx] * B
    if a.ragged:
        lens = torch.randint(max(Q, ctx // 2), ctx + 1, (B,), generator=gen).tolist()
    sl = torch.tensor(lens, dtype=torch.int32, device=dev)
    ks = (torch.rand(hkv, generator=gen) * 0.1 + 0.08).to(dev)
    vs = (torch.rand(hkv, generator=gen) * 0.1 + 0.08).to(dev)
    qs = [torch.randn(B, hkv * G, Q, D, generator=gen).half().to(dev) for _ in range(n_sets)]
    res = dict(cell=dict(zip(KEYS, cell, strict=True)), lens=lens, **p, **counts(cell, lens))
    res.update(route=sa.admit(qs[0], kc, tables[0]).reason, notes=[], impls={})
    if dev.type == "cuda":  # the launch plan the op makes here (vec 16: the pool is aligned)
        res["plan"] = sa.ops.load_cuda_kernels().plan(
            B, hkv * G, hkv, Q, D, p["capacity"], 16, dev.index or 0
        )

    def op(s):
        return sa.paged_attention(qs[s], kc, vc, tables[s], sl, k_scale=ks, v_scale=vs)

    def peer(fn):
        return lambda s: fn(qs[s], kc, vc, tables[s], sl, ks, vs)

    impls = {"op": op}
    if a.peers != "none":
        est = peer_bytes(B, Q, p["capacity"], hkv, G, D)
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else float("inf")
        res["peer_bytes_estimate"] = est
        if est > a.peer_mem_gb * GIB or est > 0.9 * free:
            res["notes"].append(
                f"peers skipped: need ~{est / GIB:.1f} GiB "
                f"(budget {a.peer_mem_gb:g}, free {free / GIB:.1f})"
            )
        else:
            impls["eager"] = peer(sdpa_over_gather)
            if a.peers == "all":
                torch._dynamo.reset()
                impls["compiled"] = peer(torch.compile(sdpa_over_gather, dynamic=False))
    # Correctness of what is timed: every impl against the eager peer on set 0. The first call
    # also builds: first_call_s of the compiled peer is its compile time.
    outs = {}
    for name, fn in list(impls.items()):
        t0 = time.perf_counter()
        try:
            outs[name] = fn(0)
            clock.sync()
        except Exception as e:
            res["notes"].append(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
            del impls[name]
        res.setdefault("first_call_s", {})[name] = time.perf_counter() - t0
    if "op" in outs:  # the bits of set 0's output: A/B runs of two trees compare them
        res["op_out_sha1"] = hashlib.sha1(outs["op"].cpu().numpy().tobytes()).hexdigest()
    for name, out in outs.items():
        err = rel_err(out, outs["eager"]) if "eager" in outs else None
        res.setdefault("rel_err_vs_eager", {})[name] = err
        if not torch.isfinite(out).all() or (err or 0) > 1e-2:
            res["notes"].append(f"{name} MISMATCH: rel. error {err}, finite {out.isfinite().all()}")
    del outs
    time_impls(impls, n_sets, a, dev, clock, res)
    return res


def time_impls(impls, n_sets, a, dev, clock, res):
    """Graphs of every impl over all working sets, then alternating samples; into res."""
    if dev.type == "cuda":  # the warm-ups run on a side stream: give the cached blocks back
        torch.cuda.empty_cache()
    pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
    calls = {name: [functools.partial(fn, s) for s in range(n_sets)] for name, fn in impls.items()}
    for c in calls.values():  # all warm-ups before any capture: peers' memory is needed once
        warm(c, dev, a.side_stream)
    runs = {}
    for name, c in calls.items():
        run, mode = capture(c, dev, pool, not a.no_graphs, a.side_stream)
        run()
        reps = max(1, math.ceil(a.target_ms / max(clock(run), 1e-6)))
        if reps > 1:
            clock(run, reps)  # warm-up at the sampled length
        runs[name] = run, reps
        if mode != "cuda-graph" and dev.type == "cuda":
            res["notes"].append(f"{name} timed eagerly: {mode}")
        res["impls"][name] = dict(
            mode=mode, replays_per_sample=reps, calls_per_replay=n_sets, samples_ms=[]
        )
    # Alternating op, peers, op, ... so drift hits every impl alike; the fewer peer samples
    # are spread evenly over the op's.
    every = max(1, a.samples // max(a.peer_samples, 1))
    for i in range(a.samples):
        for name, (run, reps) in runs.items():
            if name == "op" or (i % every == 0 and i // every < a.peer_samples):
                res["impls"][name]["samples_ms"].append(clock(run, reps) / n_sets)
    for r in res["impls"].values():
        r["median_ms"] = statistics.median(r["samples_ms"])


def derive(res, copy_gbps):
    """Per-cell columns computed from the medians and the measured copy bandwidth."""
    ms = {k: v["median_ms"] for k, v in res["impls"].items()}
    v100_mem = res["bytes"] / V100_BW * 1e3
    d = dict(floor_ms=res["bytes"] / copy_gbps / 1e6, v100_fp32_ms=res["flops"] / V100_FP32 * 1e3)
    d["v100_ms"] = max(v100_mem, res["flops"] / V100_TC * 1e3)
    d["v100_kernel_flops_ms"] = max(v100_mem, res["kernel_flops"] / V100_TC * 1e3)
    if "op" in ms:
        d.update(gbps=res["bytes"] / ms["op"] / 1e6, tflops=res["flops"] / ms["op"] / 1e9)
        d["pct_copy"] = 100 * d["gbps"] / copy_gbps
        for peer in ("eager", "compiled"):
            if peer in ms:
                d[f"speedup_{peer}"] = ms[peer] / ms["op"]
    return d


def fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def ctx_str(n):
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


COLS = (
    "B|Q|ctx|H_kv|G|D|page|op ms|eager ms|compiled ms|x eager|x compiled|floor ms|GB/s|% copy|"
    "TFLOP/s|GFLOP|kern GFLOP|V100 ms|V100 fp32 ms"
).split("|")


def table(cells) -> str:
    lines = ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    for r in cells:
        c, d = r["cell"], r.get("derived", {})
        ms = {k: v["median_ms"] for k, v in r.get("impls", {}).items()}
        row = [c[k] if k != "ctx" else ctx_str(c[k]) for k in KEYS]
        row += [fmt(ms.get(k)) for k in ("op", "eager", "compiled")]
        row += [fmt(d.get(k), ".1f") for k in ("speedup_eager", "speedup_compiled")]
        row += [fmt(d.get("floor_ms")), fmt(d.get("gbps"), ".0f"), fmt(d.get("pct_copy"), ".0f")]
        row += [fmt(d.get("tflops")), fmt(r["flops"] / 1e9), fmt(r["kernel_flops"] / 1e9)]
        row += [fmt(d.get("v100_ms")), fmt(d.get("v100_fp32_ms"))]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    return "\n".join(lines)


def environment(dev):
    env = dict(command=shlex.join([sys.executable] + sys.argv), host=platform.node())
    env.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    env.update(time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), package=sa.__version__)
    try:
        env["git_head"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, capture_output=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["git_head"] = None
    try:
        from torch_sm70attn import _jit

        env["source_digest"] = _jit.source_digest()
    except Exception as e:
        env["source_digest"] = f"unknown ({type(e).__name__}: {e})"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        env.update(gpu=p.name, sm_count=p.multi_processor_count, cc=f"{p.major}.{p.minor}")
        env.update(gpu_mem_bytes=p.total_memory, l2_bytes=l2_bytes(dev))
        env["driver"] = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
    return env


def plot(cells, path):
    """% of copy bandwidth vs context per (B, Q), and latency vs context at B8 Q8."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def at(r, *keys):
        return tuple(r["cell"][k] for k in keys)

    done = [r for r in cells if "op" in r.get("impls", {})]
    if not done:
        return
    main = at(done[0], "G", "D", "page")  # the first configuration of the run
    hkv = min(r["cell"]["H_kv"] for r in done)
    done = sorted(
        (r for r in done if at(r, "G", "D", "page") == main and r["cell"]["H_kv"] == hkv),
        key=lambda r: at(r, "B", "Q", "ctx"),
    )
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for (b, q), grp in itertools.groupby(done, key=lambda r: at(r, "B", "Q")):
        grp = list(grp)
        x, y = [r["cell"]["ctx"] for r in grp], [r["derived"]["pct_copy"] for r in grp]
        ax1.plot(x, y, marker="o", label=f"B{b} Q{q}")
    title = "H_kv={}, G={}, D={}, page={}".format(hkv, *main)
    ax1.set(xlabel="context", ylabel="% of copy bandwidth", title="op, " + title)
    bq = max({at(r, "B", "Q") for r in done}, key=lambda t: (t == (8, 8), t))  # B8 Q8, else max
    for name in ("op", "eager", "compiled"):
        pts = [
            (r["cell"]["ctx"], r["impls"][name]["median_ms"])
            for r in done
            if at(r, "B", "Q") == bq and name in r["impls"]
        ]
        if pts:
            ax2.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax2.set(
        xscale="log",
        yscale="log",
        xlabel="context",
        ylabel="ms per call",
        title="B{} Q{} ".format(*bq) + title,
    )
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cell_name(c: dict) -> str:
    return "B{B} Q{Q} ctx{} H_kv{H_kv} G{G} D{D} page{page}".format(ctx_str(c["ctx"]), **c)


def report(runs: list[dict]) -> tuple[str, list[dict]]:
    """Markdown of one or more runs' JSON; a cell seen twice takes the later run's impls."""
    merged: dict[tuple, dict] = {}
    for run in runs:
        for r in run["cells"]:
            key = tuple(r["cell"][k] for k in KEYS)
            old = merged.setdefault(key, r)
            if old is not r and "impls" in r:
                impls = {**old.get("impls", {}), **r["impls"]}
                gbps = r["copy_gbps"] if "op" in r["impls"] else old.get("copy_gbps")
                merged[key] = {**old, **r, "impls": impls, "copy_gbps": gbps}
                if "skipped" in old and "skipped" not in r:
                    merged[key].pop("skipped", None)
    cells = list(merged.values())
    done = [r for r in cells if r.get("impls")]
    for r in done:
        r["derived"] = derive(r, r["copy_gbps"])
    env, a = runs[-1]["env"], runs[-1]["config"]
    gbps = sorted({round(run["copy"]["gbps"]) for run in runs})
    text = (
        f"{env.get('gpu', 'cpu')} ({env.get('sm_count', '-')} SMs), torch {env['torch']}, "
        f"CUDA {env['cuda']}, op digest {env.get('loaded_digest', env['source_digest'])}; "
        f"copy bandwidth {'/'.join(map(str, gbps))} GB/s (read + write); "
        f"{'ragged' if a['ragged'] else 'full'} contexts; ms per call, median of "
        f"{a['samples']} samples (peers {a['peer_samples']}), "
        f">= {min((r['n_sets'] for r in done), default='-')} KV working sets rotated.\n\n"
        + table(done)
    )
    notes = [
        f"- {cell_name(r['cell'])}: " + "; ".join(r.get("notes") or [r.get("skipped", "")])
        for r in cells
        if r.get("notes") or r.get("skipped")
    ]
    return text + ("\n\n" + "\n".join(notes) if notes else ""), done


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        text, done = report([json.loads(Path(f).read_text()) for f in a.report])
        print(text)
        if a.plot and done:
            plot(done, a.plot)
        return 0
    t_start, dev, clock = time.monotonic(), a.device, Clock(a.device)
    l2 = l2_bytes(dev, a.l2_mb)
    grid = list(
        itertools.product(a.batches, a.rows, a.contexts, a.hkv, a.group, a.head_dim, a.page)
    )
    plans = [plan(c, a, l2) for c in grid]
    buf_bytes = max(p["pool_bytes"] for p in plans)
    if a.dry_run:
        for c, p in zip(grid, plans, strict=True):
            est = peer_bytes(*c[:2], p["capacity"], *c[3:6])
            print(
                f"{cell_name(dict(zip(KEYS, c, strict=True)))}: {p['n_sets']} sets x "
                f"{p['set_bytes'] / 2**20:.0f} MiB, pool {p['pool_bytes'] / GIB:.2f} GiB, "
                f"disjoint {p['disjoint']}, stride {p['stride_pages']} pages, "
                f"peer ~{est / GIB:.1f} GiB"
            )
        print(f"KV buffer (largest pool of these cells): {buf_bytes / GIB:.2f} GiB")
        return 0
    config = {k: str(v) if k == "device" else v for k, v in vars(a).items()}
    out = dict(env=environment(dev), config=config, compiled_peer=COMPILED_HOW, cells=[])
    if dev.type == "cuda":
        t0 = time.perf_counter()
        out["env"]["loaded_digest"] = sa.ops.load_cuda_kernels().digest()
        print(
            f"CUDA library {out['env']['loaded_digest']} ready in {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
    a.side_stream = None
    if dev.type == "cuda":
        sa.ops.load_cuda_kernels().set_kernel_override(a.kernel)
        out["env"]["kernel_override"] = a.kernel
    if dev.type == "cuda" and (a.sms or a.sm_smem):
        sa.ops.load_cuda_kernels().set_plan_override(a.sms or 0, a.sm_smem or 0)
        out["env"]["plan_override"] = dict(num_sms=a.sms or 0, sm_smem_bytes=a.sm_smem or 0)
    if dev.type == "cuda" and a.sms:
        a.side_stream, a.green_context = green_stream(dev, a.sms)  # (kept alive in a)
        probe = green_probe(dev, a.side_stream, clock)
        out["env"]["green_probe_ms"] = probe
        print(f"green context of {a.sms} SMs: fp16 matmul {probe}", file=sys.stderr)
        # everything below runs on the green context's stream
        torch.cuda.set_stream(a.side_stream)
    out["copy"] = copy_bandwidth(dev, a.copy_gb, a.samples, clock)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    copy_gbps = out["copy"]["gbps"]
    print(
        f"copy bandwidth {copy_gbps:.0f} GB/s; KV buffer {buf_bytes / GIB:.2f} GiB; "
        f"{len(grid)} cells",
        file=sys.stderr,
    )
    kv_buf = torch.empty(buf_bytes, dtype=torch.float8_e4m3fn, device=dev)
    fill_e4m3(kv_buf, torch.Generator(device=dev).manual_seed(a.seed))
    for i, cell in enumerate(grid):
        cdict = dict(zip(KEYS, cell, strict=True))
        name = cell_name(cdict)
        if time.monotonic() - t_start > a.max_seconds:
            res = dict(cell=cdict, skipped=f"not run: --max-seconds {a.max_seconds:g} reached")
        else:
            try:
                t0 = time.monotonic()
                res = run_cell(cell, a, dev, kv_buf, l2, clock)
                res["cell_seconds"] = time.monotonic() - t0
                res["copy_gbps"] = copy_gbps
                res["derived"] = derive(res, copy_gbps)
            except Exception as e:  # OOM or a broken impl: record it and go on
                res = dict(cell=cdict, skipped=f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                torch._dynamo.reset()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        out["cells"].append(res)
        ms = " ".join(f"{k} {v['median_ms']:.4g} ms" for k, v in res.get("impls", {}).items())
        print(
            f"[{i + 1}/{len(grid)} {time.monotonic() - t_start:.0f}s] {name}: "
            f"{ms or res.get('skipped')} {' '.join(res.get('notes', []))}",
            file=sys.stderr,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    text, done = report([out])
    if a.plot and done:
        plot(done, a.plot)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
