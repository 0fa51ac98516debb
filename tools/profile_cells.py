"""Run a few paged_attention calls per cell, for a profiler to look at (ncu, torch.profiler).

ncu --clock-control none -k regex:"paged|combine" python tools/profile_cells.py
python tools/profile_cells.py --torch-profiler   # kernel times, attention vs combine
python tools/profile_cells.py --spec 8,1,131072,8,4,128,16   # any cell: B,Q,ctx,H_kv,G,D,page
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from problems import make_problem, op_args  # noqa: E402

import torch_sm70attn  # noqa: E402,F401

CELLS = {  # name: (B, Q, ctx, H_kv, G, D, page)
    "B1Q1-128K": (1, 1, 131072, 1, 6, 256, 1648),
    "B8Q8-128K": (8, 8, 131072, 1, 6, 256, 1648),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="*", default=None, help=f"of {list(CELLS)} (default: all)")
    ap.add_argument(
        "--spec", action="append", default=[], help="B,Q,ctx,H_kv,G,D,page (repeatable)"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-profiler", action="store_true")
    args = ap.parse_args()
    cells = {
        n: CELLS[n] for n in (args.cells if args.cells is not None else [] if args.spec else CELLS)
    }
    cells.update({s: tuple(int(x) for x in s.split(",")) for s in args.spec})
    probs = {}
    for name, (B, Q, ctx, H, G, D, page) in cells.items():
        probs[name] = make_problem(
            B=B,
            H_kv=H,
            G=G,
            Q=Q,
            D=D,
            page_size=page,
            lens=[ctx] * B,
            extra_pages=0,
            device="cuda",
            seed=0,
        )
        torch.ops.sm70attn.paged_attention(*op_args(probs[name]))  # build, warm up
    torch.cuda.synchronize()
    if not args.torch_profiler:
        for p in probs.values():
            for _ in range(args.reps):
                torch.ops.sm70attn.paged_attention(*op_args(p))
        torch.cuda.synchronize()
        return
    from torch.profiler import ProfilerActivity, profile

    for name, p in probs.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                torch.ops.sm70attn.paged_attention(*op_args(p))
            torch.cuda.synchronize()
        print(f"== {name}")
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or "cuda" in str(e.device_type).lower():
                us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / e.count
                print(f"  {e.key[:70]:<70} {us:9.1f} us x{e.count}")


if __name__ == "__main__":
    main()
