"""Run a few paged_attention calls per cell, for a profiler to look at (ncu, torch.profiler).

ncu --clock-control none -k regex:"paged|combine" python tools/profile_cells.py
python tools/profile_cells.py --torch-profiler   # kernel times, attention vs combine
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from problems import make_problem, op_args  # noqa: E402

import torch_sm70attn  # noqa: E402,F401

CELLS = {  # name: (B, Q, ctx, H_kv)
    "B1Q1-128K": (1, 1, 131072, 1),
    "B8Q8-128K": (8, 8, 131072, 1),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", nargs="*", default=list(CELLS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-profiler", action="store_true")
    args = ap.parse_args()
    probs = {}
    for name in args.cells:
        B, Q, ctx, H = CELLS[name]
        probs[name] = make_problem(
            B=B,
            H_kv=H,
            G=6,
            Q=Q,
            D=256,
            page_size=1648,
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
