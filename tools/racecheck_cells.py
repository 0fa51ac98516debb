#!/usr/bin/env python3
"""One attention call per kernel shape whose phases share shared memory, on short contexts, for
compute-sanitizer's race checker (tools/gpu_suite.sh runs it; seconds on an H200):

    compute-sanitizer --tool racecheck --error-exitcode 1 python tools/racecheck_cells.py

D256 MB3 (G6 Q8) stores S over the K tile; D256 MB2 (G4 Q8) and D64 MB1 work on 64-token
tiles; D256 MB1 is decode. Exit status 1 if an output is not finite."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from problems import make_problem, op_args  # noqa: E402

import torch_sm70attn  # noqa: E402,F401

CELLS = (
    dict(G=6, Q=8, D=256),
    dict(G=4, Q=8, D=256),
    dict(G=6, Q=1, D=256),
    dict(G=4, Q=1, D=64),
)


def main():
    bad = 0
    for kw in CELLS:
        p = make_problem(B=1, H_kv=1, lens=[300], page_size=16, device="cuda", **kw)
        out = torch.ops.sm70attn.paged_attention(*op_args(p))
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all())
        bad += not ok
        print(kw, "finite" if ok else "NOT FINITE")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
