#!/usr/bin/env python3
"""Every kernel the launcher can pick, each on a small problem, for compute-sanitizer's tools
(tools/gpu_suite.sh runs memcheck, racecheck, synccheck and initcheck over it):

    compute-sanitizer --tool memcheck --error-exitcode 1 python tools/sanitize_cells.py [--sweep N]

The kernels are the registration list's (csrc/sm70attn/registry.h, as torch_sm70attn.nvrtc reads
it): each attention kernel (D, MB, VEC) of each kind twice, with one split (fp16 output straight
from the kernel) and with several (fp16 partials), the WMMA kernel and each atom of the
register-fragment one (set_kernel_override; m16n8k16 on SM80+), and each combine kernel (D, WPR)
through a decode long enough for its split count; store_kv on both of its paths; the MMA atom
checks (m16n8k16 on SM80+). The plan the binding makes for
each cell is read back (its `plan()` hook) and the run fails unless every listed kernel was
reached, or if an output is not finite. `coverage()` names the cells that launch each family
(tests/test_registry.py: every family has one). Tables carry junk past the pages in use. --sweep N adds N
seeded random valid calls (tests/problems.py: random_geometry, the GPU tests' sweep), each
checked against the reference route. paged_attention_varlen: each of its kernels (D, VEC) on a
mixed call (decodes, a verify, chunks over pasts, a prompt, an empty request, padding tokens)
and on short chunks over long pasts that split (its combine kernel), each against the
reference route, with the prefill kernel on each of its atoms (m16n8k16 on SM80+) and off."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

import torch  # noqa: E402
from problems import make_problem, make_varlen_problem, op_args, varlen_args  # noqa: E402
from v100_model import combine_warps_per_row  # noqa: E402

import torch_sm70attn as sa  # noqa: E402
from torch_sm70attn import reference  # noqa: E402
from torch_sm70attn.nvrtc import FAMILIES, instances  # noqa: E402

FP8 = torch.float8_e4m3fn


KINDS = {f.kind: f.name for f in FAMILIES.values() if f.kind}  # attention kind -> its family
RF_KINDS = tuple(k for k in KINDS if k != "wmma")


def cells(rf_kinds=RF_KINDS):
    """(kernel kind, label, problem kwargs, VEC, several splits wanted) covering every listed
    kernel: the WMMA kernels, and the register-fragment ones on each of rf_kinds."""
    want_attn = {
        (k, *e) for k, f in KINDS.items() if k == "wmma" or k in rf_kinds for e in instances(f)
    }
    want_comb = set(instances("combine"))
    out = []
    for kind, D, mb, vec in sorted(want_attn):
        # G 8 and Q = 2 MB - 1: 16 MB - 8 rows, one row group, padding rows in the last block
        for lens in ([40, 7], [4000, 300]):  # one split; several (>= 2 x 16 x rows tokens)
            kw = dict(B=2, H_kv=1, G=8, Q=2 * mb - 1, D=D, page_size=16, lens=lens)
            if vec == 8:
                kw["layout"] = "padded"
            out.append(
                (kind, f"attn {kind} D{D} MB{mb} VEC{vec} lens {lens}", kw, vec, lens[0] > 40)
            )
    for D, wpr in sorted(
        want_comb
    ):  # decode G 4: 1 / 4 / 16 warps a row need <= 16 / <= 64 / more splits
        ctx = {1: 1000, 4: 5000, 16: 40000}[wpr]
        kw = dict(B=1, H_kv=1, G=4, Q=1, D=D, page_size=64, lens=[ctx])
        out.append(("auto", f"combine D{D} WPR{wpr} ctx {ctx}", kw, 16, True))
    return out, want_attn, want_comb


VARLEN_CALLS = (  # (what, query rows, pasts): a mixed call; short chunks over long pasts that split
    ("mixed", (1, 5, 40, 0, 19, 130, 16), (30, 7, 0, 12, 100, 0, 900)),
    ("split", (1, 8, 40, 200), (9000, 5000, 12000, 20000)),
)
PREFILL = {"prefill-m8n8k4": "m8n8k4", "prefill-m16n8k16": "m16n8k16"}  # family: override


def varlen_labels(sm80=True):
    """(label, D, VEC, call, prefill override) of every varlen cell: each tile loop kernel on
    each call, with each prefill kernel family (the requests of more than 16 tokens on it;
    m16n8k16 on SM80+) and with none ("off": the tile loop takes them all)."""
    kinds = [k for f, k in PREFILL.items() if sm80 or f != "prefill-m16n8k16"] + ["off"]
    return [
        (f"varlen D{D} VEC{vec} prefill {kind} {what}", D, vec, (what, ql, past), kind)
        for kind in kinds
        for D, _, vec in instances("attn-varlen")
        for what, ql, past in VARLEN_CALLS
    ]


STORE_KV_CELLS = ("store_kv 8-element rows", "store_kv element path")


def atom_labels(sm80=True):
    return [f"mma atom {s}" for (s,) in instances("mma") if sm80 or s != 16816]


def coverage(sm80=True) -> dict[str, list[str]]:
    """The registry's families, each with the labels of the cells that launch it."""
    todo, _, _ = cells(RF_KINDS if sm80 else RF_KINDS[:1])
    out = {name: [] for name in FAMILIES}
    for kind, label, _, _, several in todo:
        out[KINDS.get(kind, "attn")].append(label)  # ("auto": the WMMA kernel at these shapes)
        if several:
            out["combine"].append(label)
    for label, _, _, (what, _, _), kind in varlen_labels(sm80):
        out["attn-varlen"].append(label)
        if what == "split":
            out["combine-varlen"].append(label)
        for family, k in PREFILL.items():
            if kind == k:
                out[family].append(label)
    out["store_kv"] += STORE_KV_CELLS
    out["mma"] += atom_labels(sm80)
    return out


def atom_cells(sm80):
    """Each MMA atom's element maps on the hardware (tests/test_cuda.py's check): D = A B + C."""
    bad = 0
    for (shape,) in instances("mma"):
        if shape == 16816 and not sm80:
            continue
        G, M, N, K = (1, 16, 8, 16) if shape == 16816 else (4, 8, 8, 4)
        gen = torch.Generator().manual_seed(shape)
        A = torch.randint(-8, 9, (G, M, K), generator=gen).half().cuda()
        B = torch.randint(-8, 9, (G, K, N), generator=gen).half().cuda()
        C = torch.randint(-64, 65, (G, M, N), generator=gen).float().cuda()
        D = torch.ops.sm70attn_test.mma_atom_check(shape, A, B, C)
        ok = torch.equal(D.double(), torch.bmm(A.double(), B.double()) + C.double())
        bad += not ok
        print(f"mma atom {shape}:", "ok" if ok else "BAD")
    return bad


def varlen_cells(lib, sm80, only=None):
    bad = 0
    for label, D, vec, (_, ql, past), kind in varlen_labels(sm80):
        if only and only not in label:
            continue
        lib.set_prefill_override(kind)
        kw = dict(layout="padded") if vec == 8 else {}
        p = make_varlen_problem(ql, past, G=6, D=D, H_kv=1, device="cuda", **kw)
        out = torch.ops.sm70attn.paged_attention_varlen(*varlen_args(p))
        ref = reference.paged_attention_varlen(*varlen_args(p))
        err = float((out.float() - ref.float()).abs().max())
        ok = bool(torch.isfinite(out).all()) and err <= 2e-2
        bad += not ok
        print(f"{label}: max |op - reference| {err:.2e}", "ok" if ok else "BAD")
    lib.set_prefill_override("auto")
    return bad


def sweep(n):
    import random

    from problems import random_geometry

    rng, bad = random.Random(1301), 0
    for i in range(n):
        g = random_geometry(rng)
        p = make_problem(device="cuda", **g)
        out = torch.ops.sm70attn.paged_attention(*op_args(p))
        ref = sa.ops.paged_attention_ref(*op_args(p))
        err = float((out.float() - ref.float()).abs().max()) if out.numel() else 0.0
        ok = bool(torch.isfinite(out).all()) and err <= 2e-2
        bad += not ok
        print(f"sweep {i}: {g} max |op - reference| {err:.2e}", "ok" if ok else "BAD")
    return bad


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", type=int, default=0, help="random valid calls to add")
    ap.add_argument(
        "--only", default=None, help="the cells whose label has this (and only their kernels)"
    )
    args = ap.parse_args()
    lib = sa.ops.load_cuda_kernels()
    sm80 = torch.cuda.get_device_capability()[0] >= 8
    todo, want_attn, want_comb = cells(RF_KINDS if sm80 else RF_KINDS[:1])
    if args.only:
        todo = [t for t in todo if args.only in t[1]]
        want_attn = {
            k
            for k in want_attn
            if any(f"attn {k[0]} D{k[1]} MB{k[2]} VEC{k[3]} " in t[1] for t in todo)
        }
        want_comb = set()
    seen_attn, seen_comb, bad = set(), set(), 0
    for kind, label, kw, vec, several in todo:
        lib.set_kernel_override(kind)
        p = make_problem(device="cuda", **kw)
        cap = p["block_table"].shape[1] * p["key_cache"].shape[1]
        H_q = kw["G"] * kw["H_kv"]
        pl = lib.plan(kw["B"], H_q, kw["H_kv"], kw["Q"], kw["D"], cap, vec, 0)
        out = torch.ops.sm70attn.paged_attention(*op_args(p))
        torch.cuda.synchronize()
        ok = bool(torch.isfinite(out).all()) and (pl["num_splits"] > 1) == several
        bad += not ok
        seen_attn.add((pl["kernel"], kw["D"], pl["mb"], vec))
        if pl["num_splits"] > 1:
            seen_comb.add((kw["D"], combine_warps_per_row(pl["num_splits"])))
        print(
            f"{label}: mb {pl['mb']} splits {pl['num_splits']}",
            "ok" if ok else "NOT FINITE or other splits",
        )
    lib.set_kernel_override("auto")
    # store_kv (STORE_KV_CELLS): the 8-element path (aligned rows) and the element path (an odd
    # head dim stride)
    key = torch.randn(6, 2, 64, device="cuda").half()
    kc = torch.zeros(4, 16, 2, 64, dtype=FP8, device="cuda")
    slots = torch.tensor([0, 5, -1, 63, 17, 5], device="cuda")
    sa.store_kv(key, key, kc, kc.clone(), slots)
    odd = torch.randn(6, 2, 65, device="cuda").half()[..., 1:]
    sa.store_kv(odd, odd, kc, kc.clone(), slots)
    torch.cuda.synchronize()
    bad += varlen_cells(lib, sm80, args.only)
    if not args.only or args.only in "mma atom":
        bad += atom_cells(sm80)
    bad += sweep(args.sweep)
    missing = sorted(want_attn - seen_attn) + sorted(want_comb - seen_comb)
    print(f"{len(todo)} cells, {len(seen_attn)} attention and {len(seen_comb)} combine kernels")
    if missing:
        print("kernels no cell reached:", missing)
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main())
