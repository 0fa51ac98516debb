#!/usr/bin/env python3
"""One attention call per kernel shape whose phases share shared memory, on short contexts, for
compute-sanitizer's race checker (tools/gpu_suite.sh runs it; seconds on an H200):

    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/racecheck_cells.py

D256 MB3 (G6 Q8) stores S over the K tile; D256 MB2 (G4 Q8) and D64 MB1 work on 64-token
tiles; D256 MB1 is decode; the D128 decodes of 5000 and 40000 tokens reach the combine kernels
whose warps of a row merge through shared memory (4 and 16 warps per row: 17-64 and more
splits). Exit status 1 if an output is not finite."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from problems import make_problem, op_args  # noqa: E402

import torch_sm70attn  # noqa: E402

CELLS = (
    dict(G=6, Q=8, D=256),
    dict(G=4, Q=8, D=256),
    dict(G=6, Q=1, D=256),
    dict(G=4, Q=1, D=64),
    dict(G=4, Q=1, D=128, lens=[5000], page_size=64),
    dict(G=4, Q=1, D=128, lens=[40000], page_size=64),
)


def main():
    bad = 0
    lib = torch_sm70attn.ops.load_cuda_kernels()
    for kw in CELLS:
        p = make_problem(**dict(dict(B=1, H_kv=1, lens=[300], page_size=16, device="cuda"), **kw))
        out = torch.ops.sm70attn.paged_attention(*op_args(p))
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        bad += not ok
        bt = p["block_table"]
        cap = bt.shape[1] * p["key_cache"].shape[1]
        pl = lib.plan(1, kw["G"], 1, kw["Q"], kw["D"], cap, 16, 0)
        print(kw, pl, "finite" if ok else "NOT FINITE")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
