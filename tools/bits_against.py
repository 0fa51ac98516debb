#!/usr/bin/env python3
"""paged_attention's output bits on a GPU, saved by one build and compared by another: a change
to the kernels that must not change the decode and verify kernels' results (a refactor, a new
kernel sharing their code) is held to the previous commit's bits.

    git archive OLD | tar -x -C /tmp/old
    python tools/bits_against.py save /tmp/old.pt --package /tmp/old   # the old tree's build
    python tools/bits_against.py compare /tmp/old.pt                    # this tree's

The problems (tests/problems.py, this tree's, the same seeds for both) cover every head dim,
the group sizes 1-8, 1-16 rows a request, short contexts and long ones that split, and both
page sizes of the manifest's kind (16 and 1648)."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cases():
    for D, G, Q, page in itertools.product(
        (64, 128, 256), (1, 4, 6, 8), (1, 2, 4, 8, 16), (16, 1648)
    ):
        for lens in ([Q + 3, 200, 977], [40000, Q]):
            yield dict(B=len(lens), H_kv=2, G=G, Q=Q, D=D, page_size=page, lens=lens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["save", "compare"])
    ap.add_argument("file")
    ap.add_argument("--package", help="the tree whose torch_sm70attn to import (default: this one)")
    args = ap.parse_args(argv)
    sys.path[:0] = [args.package or str(ROOT), str(ROOT / "tests")]
    import torch
    from problems import make_problem, op_args

    import torch_sm70attn  # noqa: F401  (the ops)

    print("torch_sm70attn from", Path(torch_sm70attn.__file__).parent)
    outs = []
    for i, kw in enumerate(cases()):
        p = make_problem(**kw, device="cuda", seed=i)
        outs.append(torch.ops.sm70attn.paged_attention(*op_args(p)).cpu())
    if args.mode == "save":
        torch.save(outs, args.file)
        print(f"saved {len(outs)} outputs")
        return 0
    old = torch.load(args.file)
    if len(old) != len(outs):
        print(f"{len(old)} outputs saved, {len(outs)} made: not the same cases")
        return 1
    bad = [
        (i, kw)
        for i, (kw, a, b) in enumerate(zip(cases(), old, outs, strict=True))
        if not torch.equal(a.view(torch.int16), b.view(torch.int16))
    ]
    for i, kw in bad:
        print("differs:", i, kw)
    print(f"{len(outs) - len(bad)} of {len(outs)} outputs bit for bit equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
