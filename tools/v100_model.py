#!/usr/bin/env python3
"""A V100 performance model of paged_attention, calibrated on H200 measurements (issue 12).

    python tools/v100_model.py [--markdown] [--json out.json]   # calibration, V100 predictions
    python tools/v100_model.py --ingest RUNS_DIR NCU_CSV        # tools/model_runs.sh's output -> docs/data
    python tools/v100_model.py --sass sm_70 --nvdisasm N70     # with CUDA 12's NVRTC (extra cuda12)
    python tools/v100_model.py --sass sm_90a --nvdisasm N90    # with CUDA 13's NVRTC, as the H200
        # docs/data/sass.json, one arch at a time (N70: CUDA 11.8's nvdisasm, N90 a current one:
        # tools/sm70_sass.py); each build is the runtime's, on the GPU it stands for

Inputs, all in docs/data: the H200 runs of tools/model_runs.sh (the op over both geometries of
issue 12 on the whole GPU, and the same cells with a V100's grids: 80 SMs of a green context,
the plan for 80 SMs, as many CTAs per SM as 96 KB of shared memory holds); ncu's executed
instructions of a few of those cells; and the SASS summary of every kernel (sm_70 as the SM70
gate builds it, sm_90a as the H200's JIT build does).

Besides, the register-fragment kernel's m16n8k16 twin (tools/bench.py --kernel rf-m16n8k16) on
the D256 Q8 (MB3) and Q4 (MB2) cells of both grids (and the WMMA kernel on the MB2 cells,
which the calibration grid lacks: docs/data/h200_mb2_*.json): a kernel kind of its own (32-token tiles, 4 warps a row block,
its own c per MB, shared with the m8n8k4 build the V100 runs), which a call takes where
traits.h's attn_default_kind says (default_kind below).

One call = the plan (a replica of plan.h, checked against every plan the H200 recorded), the
CTAs of each split with their tiles, and for the kernel (D, MB, kind) on the GPU's arch:
- instructions one warp executes per tile and per CTA: static SASS counts (tile loop, inner
  loops x trips; the rest of the kernel) times executed/static ratios that ncu measured on
  the H200 for the same kernel, applied to sm_70 too (same source, same branches);
- resident CTAs per SM from registers, shared memory and warps (the occupancy calculator's
  rules; checked against the H200's launcher) and w = warps per scheduler;
- a tile's cycles, the largest of: latency, instructions x (c_kernel + alpha w), the cycles
  between two issues of one warp, which grow with the warps sharing a scheduler (fitted: the
  kernels are latency-bound on the H200, ncu reads 7-10 cycles per issued instruction of a
  warp); issue, w x the busiest pipe (one instruction a cycle; V100: FP32, INT32, HMMA.884 2
  cycles a warp instruction; H200: FP32 1, INT32 2, HMMA.16816 6.8); smem, resident CTAs x
  shared-memory bytes / 128 B a cycle;
- a CTA = tiles x that + the rest's instructions x c_rest + a fixed latency. CTAs run in rounds
  of the SMs' resident slots, in launch order (rounds); a CTA whose split has no tokens returns
  at once and holds no slot. The block scheduler deals a round's CTAs out one an SM at a time,
  so a round of n CTAs has cdiv(n, SMs) on its busiest SMs, and their warps set w for the
  round: 85 CTAs on 80 SMs of which the last 6 are empty run at one CTA's w, as measured, and a
  last round of 4 CTAs runs at one CTA's w, not the full one's. The kernel takes the sum of its
  rounds, each the longest CTA of the round at the round's w; dram = KV bytes and split
  partials over the bandwidth;
- then the combine kernel (a fixed time plus rounds: waves of its CTAs x passes of a warp over
  its splits; fitted on ncu's durations) and a launch gap.
The V100 keeps every fitted term in cycles and takes its own SM count, clock, bandwidth, shared
memory, occupancy, pipes and sm_70 SASS. Its 8x more tensor instructions (16 HMMA.884 a WMMA)
cannot be calibrated on the H200: "hi" puts every one on the latency path, "lo" only the
eighth that matches the H200's HMMA count (the rest at pipe rate), and the V100 time is quoted
as that range. V100 figures are quoted only while every H200 cell is within 25%.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import heapq
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "data")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Hardware. H200: 132 SMs, the clock ncu read under the attention kernels (1.78-1.84 GHz), the
# device-to-device copy bandwidth the calibration runs measured (read + write, 4.1-4.2 TB/s).
# V100-SXM2: 80 SMs at its 1.53 GHz boost clock, 96 KB of shared memory per SM, 900 GB/s peak
# HBM2 of which we take the fraction the H200's copy reaches of its 4.8 TB/s (86%): 780 GB/s.
# That is an assumption, not a V100 measurement (published V100 microbenchmarks report about
# 750-850 GB/s); the dram bound scales with it.
# Pipes: cycles one warp instruction holds its pipe, per scheduler (issue is one per cycle): V100
# has 16 FP32, 16 INT32 lanes and 4 SFUs per scheduler and does one HMMA.884 (256 MAC) per 2
# cycles; the H200 32 FP32, 16 INT32 lanes, 4 SFUs and about 300 MAC per clock (WMMA measured:
# 637 TFLOP/s, docs/DESIGN.md, 1207 MAC/clk/SM at 2 GHz).
GPUS = {
    "H200": dict(
        arch="sm_90", sms=132, clock=1.80e9, bw=4.15e12, smem_sm=233472, reserved=1024,
        pipe=dict(fp32=1, fp16=1, int=2, tensor=2048 / (1207 / 4), mufu=8, cvt=8),
    ),
    # the H100 SXM, where a prefill run landed on one (its clock and bandwidth from its datasheet)
    "H100": dict(
        arch="sm_90", sms=132, clock=1.755e9, bw=3.35e12, smem_sm=233472, reserved=1024,
        pipe=dict(fp32=1, fp16=1, int=2, tensor=2048 / (1207 / 4), mufu=8, cvt=8),
    ),
    "V100": dict(
        arch="sm_70", sms=80, clock=1.53e9, bw=780e9, smem_sm=98304, reserved=0,
        pipe=dict(fp32=2, fp16=2, int=2, tensor=2, mufu=8, cvt=8),
    ),
}  # fmt: skip
SCHEDULERS, REGS_SM, WARPS_SM, CTAS_SM = 4, 65536, 64, 32
SMEM_BW = 128  # shared-memory bytes per clock per SM (both)
MAX_SPLITS = 512


# --- the kernel's shapes (csrc/sm70attn/traits.h) and plan (csrc/sm70attn/plan.h) ---------
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_row_blocks(d: int) -> int:
    return 4 if d == 256 else 8


def tile_tokens(d: int, mb: int) -> int:
    return 64 if (d == 64 and mb <= 2) or (d == 256 and mb in (2, 3)) else 32


def warps(d: int, mb: int) -> int:
    for_cta = 4 if mb == 1 else 2 if mb <= 3 else 1
    return mb * max(for_cta, d // 64)


# The register-fragment kernel (paged_attention_rf.cuh) where it applies, and where calls take
# it by default (traits.h: attn_default_kind). Its tiles are 32 tokens and its CTAs 4 warps per
# row block; the plan (plan.h) is the same for both kinds.
def uses_rf(d: int, mb: int) -> bool:
    return d == 256 and mb in (2, 3)


def default_kind(arch: str, d: int, mb: int, capacity: int) -> str:
    """traits.h's attn_default_kind: the m8n8k4 kernel on SM70 for D 256 MB2 from 64K tokens and
    MB3 from 128K (below, CTAs a little over one per SM put two on some SMs and make it the
    slower at small batches)."""
    rf = (mb == 2 and capacity >= 65536) or (mb == 3 and capacity >= 131072)
    return "rf" if arch == "sm_70" and d == 256 and rf else "wmma"


def kind_of(rec: dict) -> str:
    """The kind a recorded plan ran (bench JSON: the binding's plan(); older runs: WMMA)."""
    return "rf" if rec.get("kernel", "wmma").startswith("rf") else "wmma"


def plan(B, H_q, H_kv, Q, D, capacity, num_sms, ctas_per_sm=2) -> dict:
    """plan_paged_attention of plan.h: mb, row_groups, num_splits."""
    rows = H_q // H_kv * Q
    need = cdiv(rows, 16)
    rg = cdiv(need, max_row_blocks(D))
    mb = cdiv(need, rg)
    min_split = max(4 * tile_tokens(D, mb), 16 * min(rows, 16 * mb))
    per_request = H_kv * rg
    splits = cdiv(max(ctas_per_sm, 1) * num_sms, per_request)
    splits = min(splits, max(1, capacity // min_split), MAX_SPLITS)
    wave = max(1, max(ctas_per_sm, 1) * num_sms // per_request)
    if splits > wave:
        splits = splits // wave * wave
    return dict(mb=mb, row_groups=rg, num_splits=max(1, splits))


def occupancy(regs: int, threads: int, smem: int, gpu: dict) -> int:
    """Resident CTAs per SM: registers (allocated per warp in units of 256), shared memory
    (plus the per-CTA reservation), warps and CTAs per SM."""
    w = cdiv(threads, 32)
    per_warp = cdiv(regs * 32, 256) * 256
    by_regs = (REGS_SM // per_warp) // w if per_warp else CTAS_SM
    by_smem = gpu["smem_sm"] // (smem + gpu["reserved"]) if smem else CTAS_SM
    return max(0, min(by_regs, by_smem, WARPS_SM // w, CTAS_SM))


# --- SASS summary: docs/data/sass.json --------------------------------------------------------
def build_sass(arch: str, nvdisasm: str, jobs: int) -> dict:
    """Per VEC16 attention kernel (and combine) of one arch: registers, threads, shared memory,
    and the static instructions of one tile (main loop plus inner loops x trips) and of the
    rest of the kernel, by class; from torch_sm70attn.nvrtc and tools/sm70_sass.py. Built as
    the runtime builds it on the GPU the arch stands for, by the NVRTC this Python loads: sm_70
    for a V100 (CUDA 12's, the extra cuda12), sm_90a as the H200 runs it (CUDA 13's, which
    torch 2.11 cu130 loads there; its registers decide the H200's occupancy)."""
    import concurrent.futures

    import sm70_sass

    from torch_sm70attn import nvrtc

    kernels = [k for k in nvrtc.kernels() if "VEC16" in k.name or k.family == "combine"]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:  # threads, shared memory
        built = list(pool.map(lambda k: nvrtc.compile_kernel(k, arch), kernels))
    smem = nvrtc.dynamic_smem(kernels, arch)  # the launcher's dynamic shared memory
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as pool:
        sass = dict(pool.map(sm70_sass.disassemble, [(k, arch, nvdisasm) for k in kernels]))
    out = {}
    for c in built:  # threads and shared memory from the traits; registers of this build
        name = c.kernel.name
        if arch == "sm_70" and name.endswith("m16n8k16"):
            continue  # no m16n8k16 before SM80: that build is a trap
        r = sass[name]
        res = dict(
            regs=r["regs"], threads=c.info["threads"], smem=c.info["smem_static"] + smem[c.kernel]
        )
        if "main_loop" not in r:  # combine: no tile loop
            out[name] = dict(res, total=r["kernel"]["total"])
            continue
        per = [(r["main_loop"], 1)] + [(x, x["trips"]) for x in r["inner_loops"]]
        classes = [*sm70_sass.COLUMNS, "smem_bytes"]
        tile = {cl: sum(m.get(cl, 0) * n for m, n in per) for cl in classes}
        inner = sum(x["total"] for x in r["inner_loops"])
        out[name] = dict(
            res,
            tile=sum(tile[cl] for cl in sm70_sass.COLUMNS),
            tile_mix=tile,
            rest=r["kernel"]["total"] - r["main_loop"]["total"] - inner,
            check=round(r["mac_check"], 3) if "mac_check" in r else None,
        )
    return out


def kernel_sources_digest() -> str:
    """A digest of the kernel headers (csrc/sm70attn/) the SASS summary is built from."""
    h = hashlib.sha256()
    root = os.path.join(ROOT, "csrc", "sm70attn")
    for f in sorted(os.listdir(root)):
        if f.endswith((".h", ".cuh")):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read() + b"\0")
    return h.hexdigest()[:16]


def load_sass() -> dict:
    return json.load(open(os.path.join(DATA, "sass.json")))


def kernel_name(d: int, mb: int, kind: str = "wmma", arch: str = "sm_70") -> str:
    """The kernel's name in docs/data/sass.json: the register-fragment kind on the arch's atom."""
    if kind == "rf":
        return f"attn-rf D{d} MB{mb} VEC16 {'m8n8k4' if arch == 'sm_70' else 'm16n8k16'}"
    return f"attn D{d} MB{mb} VEC16"


def cal_name(d: int, mb: int, kind: str = "wmma") -> str:
    """The name of a kernel's fitted latency constant ("c " + this): the register-fragment
    kernel shares one between its two atoms (its H200 runs are the m16n8k16 twin)."""
    return f"attn-rf D{d} MB{mb}" if kind == "rf" else kernel_name(d, mb)


# --- the time of one call ---------------------------------------------------------------------
# Fitted: per attention kernel "c <kernel>", and alpha, c_rest, lat_us, gap_us (fit); comb_us and
# comb_wave_cyc (fit_combine).


@functools.cache
def splits_tiles(length: int, splits: int, n: int) -> tuple[int, ...]:
    """Tiles of each split of one (request, KV head, row group): the kernel's chunking."""
    chunk = cdiv(cdiv(length, splits), n) * n
    out = []
    for s in range(splits):
        b = min(length, s * chunk)
        e = min(length, b + chunk)
        out.append(cdiv(e - b, n))
    return tuple(out)


def rounds(tiles: tuple[int, ...], copies: int, slots: int) -> list[tuple[int, int]]:
    """The block scheduler's rounds: (CTAs, the most tiles one of them has) per round of `slots`
    CTAs, over the CTAs with work in launch order (blockIdx.x, the `copies` of a split, runs
    fastest; a split never has more tiles than the one before). A CTA with no tiles returns at
    once, so it holds no slot."""
    busy = copies * sum(t > 0 for t in tiles)
    return [(min(slots, busy - i), tiles[i // copies]) for i in range(0, busy, slots)]


def combine_warps_per_row(splits: int) -> int:
    """traits.h's combine_warps_per_row: warps per output row of the combine kernel."""
    return 1 if splits <= 16 else 4 if splits <= 64 else 16


COMBINE_WARPS, COMBINE_U, COMBINE_CW = 16, 16, 64  # traits.h: CombineTraits


def combine_waves(rows: int, D: int, splits: int, gpu: dict, sass: dict, sms: int) -> int:
    """Rounds of the combine: its CTAs (16 / WPR rows and 64 columns each) in waves of the SMs'
    resident CTAs, times the passes of U loads a warp makes over its share of the splits."""
    wpr = combine_warps_per_row(splits)
    k = sass[gpu["arch"]][f"combine D{D} WPR{wpr}"]
    occ = max(1, occupancy(k["regs"], k["threads"], k["smem"], gpu))
    ctas = cdiv(rows, COMBINE_WARPS // wpr) * (D // COMBINE_CW)
    return cdiv(ctas, sms * occ) * cdiv(splits, wpr * COMBINE_U)


def combine_time(rows, D, splits, part_bytes, gpu, sass, prm, sms) -> float:
    """The combine kernel: a fixed time plus its rounds (combine_waves), each a fixed number of
    cycles (fitted on ncu's combine durations on the H200), and at least the partials' bytes
    over the bandwidth."""
    waves = combine_waves(rows, D, splits, gpu, sass, sms)
    t = prm["comb_us"] * 1e-6 + waves * prm["comb_wave_cyc"] / gpu["clock"]
    return max(t, part_bytes / gpu["bw"])


def tile_terms(per_tile, mix, gpu, hmma_latency, cyc, w, resident_warps) -> dict:
    """Cycles of one KV tile of a warp by each bound: latency (lat_insts dependent issues of
    `cyc` cycles each), issue (w warps a scheduler through the busiest pipe) and shared memory
    (the SM's resident warps' bytes). per_tile, mix: the kernel's instructions a tile and their
    classes (sass.json)."""
    lat_insts = per_tile
    if gpu["arch"] == "sm_70" and hmma_latency == "lo":
        # one HMMA.16816 does the products of 8 HMMA.884: 7 in 8 off the latency path
        lat_insts = per_tile - mix["tensor"] * 7 / 8
    # pipes: each scheduler issues one instruction a cycle, each class at its pipe's rate
    pipe = max(
        [per_tile] + [n * gpu["pipe"].get(cl, 1) for cl, n in mix.items() if cl != "smem_bytes"]
    )
    return dict(
        latency=lat_insts * cyc, issue=w * pipe, smem=resident_warps * mix["smem_bytes"] / SMEM_BW
    )


def predict(
    cell: dict,
    gpu_name: str,
    sass: dict,
    dyn: dict,
    prm: dict,
    num_sms=None,
    ctas_per_sm=None,
    hmma_latency="hi",
    kind=None,
) -> dict:
    """Predicted ms of one call and its bounds. cell: B, Q, ctx, H_kv, G, D, page. num_sms and
    ctas_per_sm override the GPU's (the V100-shaped grids on the H200); kind ("wmma" or "rf")
    the GPU's default kernel where the register-fragment one applies."""
    gpu = GPUS[gpu_name]
    arch = gpu["arch"]
    B, Q, ctx, H_kv, G, D, page = (cell[k] for k in ("B", "Q", "ctx", "H_kv", "G", "D", "page"))
    cap = cdiv(ctx, page) * page
    sms = num_sms or gpu["sms"]
    mb0 = plan(B, G * H_kv, H_kv, Q, D, cap, sms)["mb"]
    kind = kind if kind and uses_rf(D, mb0) else default_kind(arch, D, mb0, cap)
    k = sass[arch][kernel_name(D, mb0, kind, arch)]
    occ = ctas_per_sm or occupancy(k["regs"], k["threads"], k["smem"], gpu)
    pl = plan(B, G * H_kv, H_kv, Q, D, cap, sms, occ)
    S = pl["num_splits"]
    W, N = (4 * pl["mb"], 32) if kind == "rf" else (warps(D, pl["mb"]), tile_tokens(D, pl["mb"]))
    tiles = splits_tiles(ctx, S, N)
    name, cname = kernel_name(D, pl["mb"], kind, arch), cal_name(D, pl["mb"], kind)
    if "c " + cname not in prm:
        raise KeyError(f"{cname} is not calibrated: no H200 measurement in docs/data runs it")
    # Executed instructions per warp: per tile and per CTA, static counts scaled by ncu (sm_90)
    d = dyn.get(name, {"tile": 1.0, "rest": 1.0})
    mix = {cl: n * d["tile"] for cl, n in k["tile_mix"].items()}
    per_tile, per_cta = k["tile"] * d["tile"], k["rest"] * d["rest"]
    lat = prm["lat_us"] * 1e-6 * gpu["clock"]
    # Round by round: the scheduler deals a round's CTAs out one an SM at a time, so its busiest
    # SMs hold cdiv(CTAs, sms) of them, and their warps (w per scheduler) set the round's time.
    t_issue, first = 0.0, None
    for n_r, t in rounds(tiles, B * H_kv * pl["row_groups"], sms * occ):
        resident = min(occ, cdiv(n_r, sms))
        w = resident * W / SCHEDULERS  # warps per scheduler
        # latency: cycles between two issues of one warp, c + alpha w
        cyc = prm["c " + cname] + prm["alpha"] * w
        terms = tile_terms(per_tile, mix, gpu, hmma_latency, cyc, w, resident * W)
        bound = max(terms, key=terms.get)
        t_issue += (t * terms[bound] + per_cta * prm["c_rest"] + lat) / gpu["clock"]
        first = first or (bound, w)
    bound, w = first  # the first round, the fullest, names the bound
    kv_bytes = 2 * B * ctx * H_kv * D
    part_bytes = B * G * H_kv * Q * S * (2 * D + 8) if S > 1 else 0  # fp16 O, fp32 (m, l)
    t_dram = (kv_bytes + part_bytes) / gpu["bw"]
    t_attn = max(t_issue, t_dram)
    t_comb = combine_time(B * G * H_kv * Q, D, S, part_bytes, gpu, sass, prm, sms) if S > 1 else 0.0
    total = t_attn + t_comb + prm["gap_us"] * 1e-6
    bounds = {bound: t_issue, "dram": t_dram}
    limiter = max(bounds, key=bounds.get)
    return dict(
        ms=total * 1e3,
        attn_ms=t_attn * 1e3,
        combine_ms=t_comb * 1e3,
        limiter=limiter,
        **{f"{b}_ms": v * 1e3 for b, v in bounds.items()},
        plan=dict(pl, ctas_per_sm=occ, kind=kind),
        warps_per_scheduler=w,
        pct_900=100 * kv_bytes / total / 900e9,
    )


# --- calibration ------------------------------------------------------------------------------
RUNS = ("h200_cal_d256", "h200_cal_d128", "h200_v100grid_d256", "h200_v100grid_d128")
RF_RUNS = ("h200_rf_d256", "h200_rf_v100grid_d256")  # the m16n8k16 twin (bench.py --kernel)
# D256 G6 Q4 (MB2): the WMMA kernel and the twin (bench.py --rows 4 [--kernel ...]), both grids
MB2_RUNS = tuple(f"h200_mb2_{k}_{g}d256" for g in ("", "v100grid_") for k in ("wmma", "rf"))


def load_runs(names=RUNS + RF_RUNS + MB2_RUNS):
    """(cell, measured ms, recorded plan, grid) of the committed H200 runs (kind_of(plan): the
    kernel each ran)."""
    out = []
    for n in names:
        run = json.load(open(os.path.join(DATA, n + ".json")))
        grid = "v100" if "v100" in n else "full"
        for r in run["cells"]:
            if "op" in r.get("impls", {}):
                out.append((r["cell"], r["impls"]["op"]["median_ms"], r["plan"], grid))
    return out


def dynamic_scale(sass: dict) -> dict:
    """Executed / static instructions per kernel on sm_90, from ncu's instruction counts of the
    H200 (docs/data/h200_ncu.json): a least-squares fit of inst = a x warp-tiles + b x warp-CTAs
    per kernel; a / static tile and b / static rest."""
    ncu = json.load(open(os.path.join(DATA, "h200_ncu.json")))
    rows: dict[str, list] = {}
    for r in ncu:
        if r["kernel"] != "attn":
            continue
        name = kernel_name(r["D"], r["mb"])
        rows.setdefault(name, []).append(r)
    out = {}
    for name, rs in rows.items():
        k = sass["sm_90"][name]
        xs = [(r["warp_tiles"], r["warp_ctas"], r["inst"]) for r in rs]
        # two unknowns: normal equations
        s11 = sum(a * a for a, _, _ in xs)
        s12 = sum(a * b for a, b, _ in xs)
        s22 = sum(b * b for _, b, _ in xs)
        y1 = sum(a * y for a, _, y in xs)
        y2 = sum(b * y for _, b, y in xs)
        det = s11 * s22 - s12 * s12
        if abs(det) < 1e-9 * s11 * s22:  # one shape only: the rest at its static count
            a, b = (y1 - s12 * k["rest"]) / s11, k["rest"]
        else:
            a, b = (y1 * s22 - y2 * s12) / det, (y2 * s11 - y1 * s12) / det
        out[name] = dict(tile=a / k["tile"], rest=max(b, 0.0) / k["rest"], cells=len(rs))
    return out


def ingest_ncu(csv_path: str, runs_script: str) -> list[dict]:
    """docs/data/h200_ncu.json from the CSV of tools/model_runs.sh's ncu stage: one row per
    kernel launch, with the cell (the script's --spec list, in order; each cell's kernels run
    twice, a warm-up and one repetition), the executed instructions and the work they did."""
    import csv
    import re

    specs = re.findall(r"\b(\d+,\d+,\d+,\d+,\d+,\d+,\d+)\b", open(runs_script).read())
    launches: dict[str, dict] = {}
    with open(csv_path) as f:
        for r in csv.DictReader(line for line in f if line.startswith('"')):
            d = launches.setdefault(
                r["ID"],
                {"name": r["Kernel Name"], "grid": r["Grid Size"], "block": r["Block Size"]},
            )
            v = r["Metric Value"].replace(",", "")
            d[r["Metric Name"]] = float(v) if re.fullmatch(r"[-+0-9.eE]+", v) else v
    out, cell_i, cells = (
        [],
        -1,
        [
            dict(
                zip(
                    ("B", "Q", "ctx", "H_kv", "G", "D", "page"), map(int, s.split(",")), strict=True
                )
            )
            for s in specs
        ],
    )
    for d in launches.values():
        gx, gy, _ = (int(x) for x in d["grid"].strip("()").split(","))
        threads = int(d["block"].strip("()").split(",")[0])
        row = dict(
            inst=d["smsp__inst_executed.sum"],
            time_us=d["gpu__time_duration.sum"] / 1e3,
            cycles=d["sm__cycles_elapsed.avg"],
            issue_pct=d["smsp__issue_active.avg.pct_of_peak_sustained_active"],
            warps_pct=d["sm__warps_active.avg.pct_of_peak_sustained_active"],
            dram_bytes=d["dram__bytes_read.sum"],
            grid=[gx, gy],
            threads=threads,
        )
        m = re.search(r"AttnTraits<(\d+), (\d+), (\d+)>", d["name"])
        if m:
            cell_i += 1
            c = cells[cell_i % len(cells)]
            D, mb = int(m.group(1)), int(m.group(2))
            tiles = sum(splits_tiles(c["ctx"], gy, tile_tokens(D, mb))) * gx
            row.update(
                kernel="attn",
                D=D,
                mb=mb,
                cell=c,
                warp_tiles=tiles * threads // 32,
                warp_ctas=gx * gy * threads // 32,
            )
        else:
            row.update(kernel="combine", cell=cells[cell_i % len(cells)])
        out.append(row)
    return out


def errors(prm, runs, sass, dyn):
    out = []
    for cell, ms, rec, grid in runs:
        kw = dict(num_sms=80, ctas_per_sm=rec["ctas_per_sm"]) if grid == "v100" else {}
        p = predict(cell, "H200", sass, dyn, prm, kind=kind_of(rec), **kw)
        out.append((p["ms"] / ms - 1, cell, ms, p, grid))
    return out


def fit(runs, sass, dyn) -> dict:
    """Least squares on log(predicted / measured) over every H200 cell, by coordinate search
    with halving steps."""
    names = sorted({cal_name(c["D"], rec["mb"], kind_of(rec)) for c, _, rec, _ in runs})
    prm = dict(alpha=0.5, c_rest=1.0, lat_us=1.0, gap_us=1.0)
    prm.update({"c " + n: 6.0 for n in names})
    steps = dict(alpha=0.25, c_rest=0.5, lat_us=0.5, gap_us=0.5)
    steps.update({"c " + n: 1.0 for n in names})
    fixed = fit_combine(sass)

    def loss(p):
        return sum(math.log1p(e) ** 2 for e, *_ in errors(dict(p, **fixed), runs, sass, dyn))

    best = loss(prm)

    for _ in range(200):
        moved = False
        for k in prm:
            for sgn in (1, -1):
                q = dict(prm, **{k: prm[k] + sgn * steps[k]})
                if q[k] < 0:
                    continue
                v = loss(q)
                if v < best:
                    prm, best, moved = q, v, True
                    break
        if not moved:
            steps = {k: v / 2 for k, v in steps.items()}
            if max(steps[k] / max(prm[k], steps[k], 1e-12) for k in prm) < 2e-3:
                break
    return dict(prm, **fixed)


def fit_combine(sass) -> dict:
    """comb_us and comb_wave_cyc: least squares of ncu's combine durations on the H200 (the
    calibration cells' grids on 132 SMs) against fixed + rounds x cycles (combine_waves; the
    splits are the grid of the attention launch before it)."""
    gpu = GPUS["H200"]
    xs, splits = [], 1
    for r in json.load(open(os.path.join(DATA, "h200_ncu.json"))):
        if r["kernel"] == "attn":
            splits = r["grid"][1]
            continue
        c = r["cell"]
        rows = c["B"] * c["G"] * c["H_kv"] * c["Q"]
        waves = combine_waves(rows, c["D"], splits, gpu, sass, gpu["sms"])
        xs.append((waves, r["time_us"] * 1e-6))
    n, sx, sy = len(xs), sum(x for x, _ in xs), sum(y for _, y in xs)
    sxx, sxy = sum(x * x for x, _ in xs), sum(x * y for x, y in xs)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return dict(comb_us=(sy - slope * sx) / n * 1e6, comb_wave_cyc=slope * gpu["clock"])


SEED_V100_MS = {  # the seed lineage's q8 kernel on a V100-SXM2, per layer call (docs/DESIGN.md)
    (4, 32768): 0.471,
    (8, 32768): 0.924,
    (4, 131072): 1.643,
    (8, 131072): 3.265,
}


def cell_str(c: dict) -> str:
    ctx = f"{c['ctx'] // 1024}K"
    return f"B{c['B']} Q{c['Q']} {ctx} H_kv{c['H_kv']} G{c['G']} D{c['D']} p{c['page']}"


def report(prm, runs, sass, dyn, markdown=False) -> str:
    """The calibration table (H200 measured against modelled, both grids) and the V100
    predictions of the same cells, one row per cell."""
    by = {}
    for e, cell, ms, p, grid in errors(
        prm, [r for r in runs if kind_of(r[2]) == "wmma"], sass, dyn
    ):
        by.setdefault(tuple(cell.values()), {})[grid] = (ms, p, e)
    rows = []
    head = [
        "cell",
        "H200 ms",
        "model",
        "err",
        "80-SM grid ms",
        "model",
        "err",
        "V100 ms (lo-hi)",
        "% of 900 GB/s",
        "V100 limiter",
        "V100 plan (splits, CTAs/SM)",
    ]
    for key, g in by.items():
        cell = dict(zip(("B", "Q", "ctx", "H_kv", "G", "D", "page"), key, strict=True))
        lo = predict(cell, "V100", sass, dyn, prm, hmma_latency="lo")
        hi = predict(cell, "V100", sass, dyn, prm, hmma_latency="hi")
        f, v = g.get("full"), g.get("v100")
        row = [cell_str(cell)]
        for x in (f, v):
            row += [f"{x[0]:.4f}", f"{x[1]['ms']:.4f}", f"{100 * x[2]:+.0f}%"] if x else ["-"] * 3
        row += [
            f"{lo['ms']:.3f}-{hi['ms']:.3f}",
            f"{hi['pct_900']:.0f}-{lo['pct_900']:.0f}",
            lo["limiter"] + ("" if lo["limiter"] == hi["limiter"] else "/" + hi["limiter"]),
            f"{hi['plan']['num_splits']}, {hi['plan']['ctas_per_sm']}",
        ]
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        lines = ["  ".join(head)] + ["  ".join(r) for r in rows]
    seeds = []
    for (B, ctx), ms in SEED_V100_MS.items():
        cell = dict(B=B, Q=8, ctx=ctx, H_kv=1, G=6, D=256, page=1648)
        lo = predict(cell, "V100", sass, dyn, prm, hmma_latency="lo")
        hi = predict(cell, "V100", sass, dyn, prm, hmma_latency="hi")
        seeds.append(
            f"| {cell_str(cell)} | {ms:.3f} | {lo['ms']:.3f}-{hi['ms']:.3f} | "
            f"{ms / hi['ms']:.1f}-{ms / lo['ms']:.1f}x |"
        )
    lines += [
        "",
        "| seed cell | seed V100 ms (measured) | ours, V100 ms (predicted) | seed / ours |",
        "|---|---|---|---|",
        *seeds,
    ]
    return "\n".join(lines)


def rf_report(prm, runs, sass, dyn) -> str:
    """The register-fragment kernel against the WMMA kernel, cell by cell where both ran (the
    MB3 cells, then the MB2 ones): H200 measured (the m16n8k16 twin; the WMMA kernel of the
    calibration runs, same csrc) and modelled, and both kinds' V100 predictions (m8n8k4)."""
    rf = {(tuple(c.values()), g): (ms, rec) for c, ms, rec, g in runs if kind_of(rec) == "rf"}
    wm = {(tuple(c.values()), g): ms for c, ms, rec, g in runs if kind_of(rec) == "wmma"}
    head = "| cell | grid | H200 WMMA ms | H200 RF ms | RF / WMMA | RF model | err | V100 WMMA ms | V100 RF ms | RF / WMMA | V100 RF limiter |"
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for (key, g), (ms, rec) in rf.items():
        cell = dict(zip(("B", "Q", "ctx", "H_kv", "G", "D", "page"), key, strict=True))
        kw = dict(num_sms=80, ctas_per_sm=rec["ctas_per_sm"]) if g == "v100" else {}
        p = predict(cell, "H200", sass, dyn, prm, kind="rf", **kw)
        w = wm.get((key, g))
        v = {}
        for kind in ("wmma", "rf"):
            lo = predict(cell, "V100", sass, dyn, prm, hmma_latency="lo", kind=kind)
            hi = predict(cell, "V100", sass, dyn, prm, hmma_latency="hi", kind=kind)
            v[kind] = (lo, hi)
        ratio = (v["rf"][0]["ms"] / v["wmma"][0]["ms"], v["rf"][1]["ms"] / v["wmma"][1]["ms"])
        lines.append(
            f"| {cell_str(cell)} | {'80 SMs' if g == 'v100' else 'whole'} | "
            + (f"{w:.4f}" if w else "-")
            + f" | {ms:.4f} | "
            + (f"{ms / w:.2f}" if w else "-")
            + f" | {p['ms']:.4f} | {100 * (p['ms'] / ms - 1):+.0f}% | "
            f"{v['wmma'][0]['ms']:.3f}-{v['wmma'][1]['ms']:.3f} | {v['rf'][0]['ms']:.3f}-{v['rf'][1]['ms']:.3f} | "
            f"{min(ratio):.2f}-{max(ratio):.2f} | {v['rf'][1]['limiter']} |"
        )
    return "\n".join(lines)


# --- prefill: paged_attention_varlen (issue 36) ------------------------------------------------
# The H200 (or H100) runs of tools/bench_prefill.py --json, committed as docs/data/prefill_*.json.
# One request a cell: a chunk of `chunk` tokens over `past`. The kernel: 64-row tiles of the
# chunk's position-major rows (row m: token m // G), one CTA a tile and KV head, each over the
# KV tiles its last row sees (causal), the decode kernel's MB 4 tile loop (sass.json's
# "attn-varlen D MB4 VEC16"). Chunks over 256 tokens never split (plan.h: split_q), so there
# is no combine. A tile's cycles as predict()'s (latency, issue, shared memory), with the
# decode fit's alpha, c_rest and latencies and one c per head dim fitted here; the CTAs are
# list-scheduled in launch order on the SMs' resident slots.
VARLEN_SMEM_EXTRA = 32  # traits.h: kVarlenSmemExtra, the CTA's request in shared memory
PREFILL_GRID = dict(shapes=[(256, 6, 4, 1648), (128, 4, 8, 16)],
                    chunks=[512, 1024, 2048, 4096, 8192, 16384], pasts=[0, 32768, 65536, 131072])  # fmt: skip


def prefill_flops(D, G, H_kv, chunk, past) -> float:
    """4 D H_q x the positions the chunk's rows see, summed (QK^T and PV)."""
    return 4 * D * G * H_kv * (chunk * past + chunk * (chunk + 1) / 2)


def prefill_ctas(D, G, H_kv, chunk, past, n, rows=64) -> list[int]:
    """KV tiles (of n tokens) of each CTA of `rows` query rows, in launch order (grid x:
    tile-major, KV head minor)."""
    out = []
    for t in range(cdiv(chunk * G, rows)):
        last = min(chunk - 1, ((t + 1) * rows - 1) // G)  # the tile's last token
        out += [cdiv(past + last + 1, n)] * H_kv
    return out


def predict_prefill_with(cell, gpu_name, k, W, N, rows, c, prm, hmma_latency="hi", order=1, extra_dram=0):
    """Predicted ms, TFLOP/s and bound of one prefill cell (a chunk over a past) on a GPU, for a
    kernel of W warps a CTA, N-token KV tiles and CTAs of `rows` query rows, with its sass.json
    entry k and latency constant c; order -1: the grid runs the tiles backwards (the last tiles,
    which see the most, first); extra_dram: DRAM bytes a CTA moves per KV tile besides its K and
    V tile."""
    gpu = GPUS[gpu_name]
    D, G, H_kv, chunk, past = (cell[k_] for k_ in ("D", "G", "H_kv", "chunk", "past"))
    occ = occupancy(k["regs"], k["threads"], k["smem"], gpu)
    w = occ * W / SCHEDULERS
    cyc = c + prm["alpha"] * w
    terms = tile_terms(k["tile"], k["tile_mix"], gpu, hmma_latency, cyc, w, occ * W)
    t_tile = max(terms.values())
    slots = [0.0] * (gpu["sms"] * occ)
    ctas = prefill_ctas(D, G, H_kv, chunk, past, N, rows)
    for n in ctas[::order]:
        t = heapq.heappop(slots)
        heapq.heappush(slots, t + n * t_tile + k["rest"] * prm["c_rest"])
    t_issue = max(slots) / gpu["clock"] + prm["lat_us"] * 1e-6
    # K and V as each CTA reads them (its tiles, no reuse through L2: the pessimistic end)
    t_dram = sum(ctas) * (2 * N * D + extra_dram) / gpu["bw"]
    total = max(t_issue, t_dram) + prm["gap_us"] * 1e-6
    return dict(
        ms=total * 1e3,
        tflops=prefill_flops(D, G, H_kv, chunk, past) / total / 1e12,
        limiter=max(terms, key=terms.get) if t_issue >= t_dram else "dram",
        ctas_per_sm=occ,
    )


# The two kernels of paged_attention_varlen the model knows: the tile loop (attn-varlen D MB4:
# 64-row CTAs, the decode kernel's tiles; every request before the prefill kernel) and the prefill
# kernel (prefill.cuh: 16 warps, 64-token tiles, CTAs of prefill_rows(D) rows, launched backwards;
# the requests of more than 16 tokens), each on the arch's MMA atom.
def prefill_rows(D: int) -> int:
    """traits.h's prefill_rows: the prefill kernel's query rows a CTA."""
    return 64 if D == 256 else 128


def prefill_kernel_name(D: int, arch: str) -> str:
    return f"prefill D{D} VEC16 {'m8n8k4' if arch == 'sm_70' else 'm16n8k16'}"


def predict_prefill(cell, gpu_name, sass, prm, hmma_latency="hi", kernel="prefill") -> dict:
    """One kernel's prediction of a prefill cell: kernel "prefill" (the prefill kernel) or
    "varlen" (the tile loop)."""
    D, arch = cell["D"], GPUS[gpu_name]["arch"]
    if kernel == "varlen":
        k = dict(sass[arch][f"attn-varlen D{D} MB4 VEC16"])
        k["smem"] += VARLEN_SMEM_EXTRA
        return predict_prefill_with(cell, gpu_name, k, warps(D, 4), tile_tokens(D, 4), 64, prm[f"c varlen D{D}"],
                                    prm, hmma_latency)  # fmt: skip
    k = sass[arch][prefill_kernel_name(D, arch)]
    return predict_prefill_with(cell, gpu_name, k, 16, 64, prefill_rows(D), prm[f"c prefill D{D}"], prm,
                                hmma_latency, order=-1)  # fmt: skip


# --- prefill designs, before one is built ------------------------------------------------------
# A candidate prefill kernel as the model sees one: the instructions one warp issues per 64-token
# KV tile by class (sass.json's tile_mix), its CTA (threads, registers, shared memory, query rows)
# and the bytes it moves through DRAM besides K and V. The mix is counted from the design's tiles:
# m8n8k4's mma.sync is 4 HMMA.884 over a 16 x 16 x 4 block of a warp; a 16-byte shared load feeds
# two k-steps of a row or a key; 7 integer instructions turn 4 E4M3 bytes into fp16 (e4m3.h); the
# softmax takes per S element a lane holds (e) an exp2 (MUFU), a conversion to fp16 and 5 FP32
# instructions, per row it holds (nr) 6 more, two shuffles and an STS. The per-tile costs that
# scale with neither (the gather's page lookups and addresses, the loop, the barriers: INT_FIXED,
# CONTROL) are the built kernel's, read off its sm_70 SASS (sass.json "prefill D VEC16 m8n8k4":
# with them the fused-16w mix equals the built kernel's class by class within 4%). Every design is
# then timed like the kernels that ran (predict_prefill_with: latency, issue, shared memory; the
# CTAs list-scheduled on 80 SMs), with the latency constant of the kernel that ran at that head
# dim (c varlen D), so the designs are compared on their instruction mixes and grids.
INT_FIXED, CONTROL = 123, 28  # per warp and tile; + 28 integer where K and V load apart (D 256)
DESIGNS = ("fused-16w", "fused-8w", "two-product")


def design(name: str, D: int) -> dict:
    """A candidate's per-warp mix of one 64-token tile and its CTA. fused-16w: the prefill kernel
    built (S and O in registers, P through shared memory, 16 warps of 128 registers); fused-8w:
    the same loop in 8 warps of 255 registers (QK^T 32 x 32 warp tiles over half of D each at
    D 256, the two halves added through shared memory); two-product: QK^T and PV as two
    GEMM-tiled products of 128-row CTAs (8 warps, 32 x 32 and 64 x 64 warp tiles) with S in fp32
    through a global score workspace (8 bytes a score: written, read back), P formed as PV loads
    it."""
    n = 64
    if name in ("fused-16w", "fused-8w"):
        W = 16 if name == "fused-16w" else 8
        rows = 64 if D == 256 else 128
        if name == "fused-16w":
            rq, kq, ks = rows // 4, 16, 1  # QK^T warp tile (rows, keys), ways D is split
        else:
            rq, kq, ks = 32, 32, 2 if D == 256 else 1
        rp = 32
        cp = rows * D // (W * rp)  # PV warp tile columns
        nr = 2 * rq // 16  # rows a lane holds in S
        e = rq * kq // 32  # S elements a lane holds
        part = ks - 1  # fp32 partial S tiles written, read and added
        apart = D == 256  # K and V through one tile buffer: two loads a tile
        lds = (D // ks // 8) * (rq // 16 + kq // 16) + (n // 8) * (rp // 16 + cp // 16) + nr + 4 + part * e // 4
        chunks = 2 * n * D // (16 * 32 * W)  # 16-byte K and V chunks a lane gathers
        sts = 2 * n * D * 2 // (W * 512) + e // 2 + 2 * nr + 2 + part * e // 4
        mix = dict(
            tensor=D // ks * rq * kq // 256 + n * rp * cp // 256,
            lds=lds,
            sts=sts,
            ldg=chunks + 1 + apart,
            int=7 * chunks * 4 + INT_FIXED + 28 * apart + e // 2,
            fp32=5 * e + 6 * nr + 5 + part * e,
            mufu=e + nr,
            cvt=e,
            shfl=2 * nr,
            control=CONTROL,
            move=3,
        )
        mix["smem_bytes"] = 512 * (lds - nr - 4 + 2 * n * D * 2 // (W * 512)) + 16 * (nr + 4) + 128 * (e // 2 + 2 * nr + 2)
        smem = rows * (D + 8) * 2 + n * (D + 8) * 2 * (1 if D == 256 else 2) + rows * (n + 8) * 2 + rows * 20
        return dict(mix=mix, threads=32 * W, regs=128 if W == 16 else 255, rows=rows, n=n,
                    smem=smem + (rows * kq * 4 if part else 0), extra_dram=0)  # fmt: skip
    if name == "two-product":
        W, rows = 8, 128
        e = rows * n // (32 * W)  # S elements a lane stores, reads back and exponentiates
        chunks = 2 * n * D // (16 * 32 * W)
        lds = (D // 8) * (2 + 2) + (n // 8) * (4 + 4)
        sts = 2 * n * D * 2 // (W * 512) + e * 2 // 16
        mix = dict(
            tensor=4 * rows * n * D // 512 // W,
            lds=lds,
            sts=sts,
            ldg=chunks + 1 + e // 4,
            stg=e // 4,
            int=7 * chunks * 4 + INT_FIXED + e // 2,
            fp32=3 * e,
            mufu=e,
            cvt=e,
            shfl=8,
            control=CONTROL + 10,
            move=3,
        )
        mix["smem_bytes"] = 512 * (lds + sts)
        return dict(mix=mix, threads=32 * W, regs=255, rows=rows, n=n,
                    smem=rows * n * 2 + 2 * 128 * 40 * 2 + n * (D + 8) * 2, extra_dram=rows * n * 8)  # fmt: skip
    raise KeyError(name)


def design_entry(name: str, D: int) -> dict:
    """design() as a sass.json entry (tile, tile_mix, regs, threads, smem, rest)."""
    d = design(name, D)
    return dict(tile=sum(v for k, v in d["mix"].items() if k != "smem_bytes"), tile_mix=d["mix"],
                regs=d["regs"], threads=d["threads"], smem=d["smem"], rest=600)  # fmt: skip


DESIGN_CELLS = [dict(D=D, G=G, H_kv=H_kv, chunk=chunk, past=past, page=page)
                for D, G, H_kv, page in PREFILL_GRID["shapes"]
                for chunk, past in ((4096, 32768), (4096, 131072), (16384, 0), (512, 131072))]  # fmt: skip


def design_table(rows) -> str:
    """design_report as the markdown table docs/perf.md keeps."""
    lines = ["| cell | design | instructions a warp, tile (HMMA) | V100 TFLOP/s (hi .. lo) | bound (hi / lo) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        c = r["cell"]
        lines.append(f"| D{c['D']} G{c['G']} H_kv{c['H_kv']} {c['chunk']} over {c['past']} | {r['design']} | "
                     f"{r['tile']:.0f} ({r['tensor']}) | {r['hi']['tflops']:.1f} .. {r['lo']['tflops']:.1f} | "
                     f"{r['hi']['limiter']} / {r['lo']['limiter']} |")  # fmt: skip
    return "\n".join(lines)


def design_report(prm, cells) -> list[dict]:
    """Every design of DESIGNS on the V100 at each cell: TFLOP/s (lo .. hi) and the bound."""
    out = []
    for c in cells:
        for name in DESIGNS:
            d = design(name, c["D"])
            k = design_entry(name, c["D"])
            r = {}
            for h in ("lo", "hi"):
                r[h] = predict_prefill_with(c, "V100", k, d["threads"] // 32, d["n"], d["rows"],
                                            prm[f"c varlen D{c['D']}"], prm, h, -1, d["extra_dram"])  # fmt: skip
            out.append(dict(cell=c, design=name, tile=k["tile"], tensor=k["tile_mix"]["tensor"], **r))
    return out


def load_prefill_runs() -> list[tuple[dict, float, str, str]]:
    """(cell, measured ms, the GPU in GPUS, kernel) of every committed prefill run: a run's "ours"
    is the prefill kernel where the run also timed the tile loop ("tile_loop": the op with the
    prefill kernel off), else the tile loop (the runs before the prefill kernel)."""
    out = []
    for name in sorted(os.listdir(DATA)):
        if name.startswith("prefill_") and name.endswith(".json"):
            run = json.load(open(os.path.join(DATA, name)))
            gpu = "H100" if "H100" in run["meta"]["device"] else "H200"
            for r in run["rows"]:
                if "tile_loop" in r:
                    out += [(r["cell"], r["ours"]["ms"], gpu, "prefill"), (r["cell"], r["tile_loop"]["ms"], gpu, "varlen")]
                else:
                    out.append((r["cell"], r["ours"]["ms"], gpu, "varlen"))
    return out


def prefill_errors(prm, runs, sass):
    return [(predict_prefill(c, g, sass, prm, kernel=k)["ms"] / ms - 1, c, ms, k) for c, ms, g, k in runs]


PREFILL_FIT_MS = 1.0  # cells faster than this are launch-bound (costs the model does not hold): not fitted


def fit_prefill(prm, runs, sass) -> dict:
    """c <kernel> D per kernel and head dim, by least squares on log(predicted / measured) over
    the cells of over PREFILL_FIT_MS (a scan, then halving steps), the decode fit's other
    parameters kept."""
    out = dict(prm)
    for kernel, D in sorted({(k, c["D"]) for c, _, _, k in runs}):
        mine = [r for r in runs if r[0]["D"] == D and r[3] == kernel and r[1] > PREFILL_FIT_MS]
        key = f"c {kernel} D{D}"

        def loss(v, key=key, mine=mine):
            return sum(
                math.log1p(e) ** 2 for e, *_ in prefill_errors(dict(out, **{key: v}), mine, sass)
            )

        best = min((loss(v), v) for v in (0.5 * i for i in range(1, 41)))[1]
        step = 0.25
        while step > 1e-3:
            best = min((best - step, best, best + step), key=lambda v: loss(v) if v > 0 else 1e9)
            step /= 2
        out[key] = best
    return out


def prefill_report(prm, sass, runs) -> tuple[dict, list, list, list]:
    """(the fitted parameters, the errors fitted on every run (H200 or H100), errors of the cells
    over no past or 128K when fitted on the others (held out), the V100 rows of --json: the
    prefill kernel's where it ran, else the tile loop's)."""
    fitted = fit_prefill(prm, runs, sass)
    errs = [e for e, *_ in prefill_errors(fitted, runs, sass)]
    inner = [r for r in runs if r[0]["past"] not in (0, 131072)]
    outer = [r for r in runs if r[0]["past"] in (0, 131072) and r[1] > PREFILL_FIT_MS]
    held = (
        [e for e, *_ in prefill_errors(fit_prefill(prm, inner, sass), outer, sass)] if inner else []
    )
    kernel = "prefill" if any(r[3] == "prefill" for r in runs) else "varlen"
    rows = []
    for D, G, H_kv, page in PREFILL_GRID["shapes"]:
        for chunk in PREFILL_GRID["chunks"]:
            for past in PREFILL_GRID["pasts"]:
                c = dict(D=D, G=G, H_kv=H_kv, chunk=chunk, past=past, page=page)
                lo = predict_prefill(c, "V100", sass, fitted, hmma_latency="lo", kernel=kernel)
                hi = predict_prefill(c, "V100", sass, fitted, hmma_latency="hi", kernel=kernel)
                rows.append(dict(cell=c, lo=lo, hi=hi, kernel=kernel))
    return fitted, errs, held, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sass",
        choices=["sm_70", "sm_90a"],
        help="rebuild this arch's part of docs/data/sass.json",
    )
    ap.add_argument(
        "--nvdisasm", default="nvdisasm", help="sm_70: CUDA 11.8's; sm_90a: a current one"
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--markdown", action="store_true", help="tables as markdown")
    ap.add_argument(
        "--json", default=None, help="parameters, errors and every V100 prediction here"
    )
    ap.add_argument(
        "--ingest",
        nargs=2,
        metavar=("RUNS_DIR", "NCU_CSV"),
        help="copy a model_runs.sh output into docs/data",
    )
    a = ap.parse_args()
    path = os.path.join(DATA, "sass.json")
    if a.ingest:
        import shutil

        os.makedirs(DATA, exist_ok=True)
        for tag, dst in (("cal", "h200_cal"), ("v100", "h200_v100grid")):
            for g in ("d256", "d128"):
                shutil.copy(
                    os.path.join(a.ingest[0], f"{tag}_{g}.json"),
                    os.path.join(DATA, f"{dst}_{g}.json"),
                )
        rows = ingest_ncu(a.ingest[1], os.path.join(ROOT, "tools", "model_runs.sh"))
        with open(os.path.join(DATA, "h200_ncu.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {DATA}: {len(rows)} ncu launches")
        return 0
    if a.sass:
        out = json.load(open(path)) if os.path.exists(path) else {}
        key, digest = a.sass.rstrip("a"), kernel_sources_digest()
        out[key] = build_sass(a.sass, a.nvdisasm, a.jobs)
        built = out.setdefault("built_from", {})
        built[key] = digest
        # one digest only where both archs' parts are of these kernel sources
        both = built.get("sm_70") == built.get("sm_90") == digest
        out["kernel_sources"] = digest if both else "mixed: rebuild the other arch's part"
        with open(path, "w") as f:
            json.dump(out, f, indent=1, sort_keys=True)
        print(f"wrote {path}: {a.sass}{'' if both else ' (now rebuild the other arch)'}")
        return 0
    sass = load_sass()
    dyn = dynamic_scale(sass)
    runs = load_runs()
    print("fitting on", len(runs), "H200 cells...", file=sys.stderr)
    prm = fit(runs, sass, dyn)
    errs = [e for e, *_ in errors(prm, runs, sass, dyn)]
    print("fitted parameters:", ", ".join(f"{k} {v:.4g}" for k, v in prm.items()))
    print(
        "executed / static instructions (sm_90, ncu):",
        ", ".join(f"{k[5:-6]} tile {v['tile']:.3f} rest {v['rest']:.3f}" for k, v in dyn.items()),
    )
    print(f"H200, both grids: {len(errs)} cells, |error| {summary(errs)}")
    # Held out: fit on the whole-GPU grid alone, predict the V100-shaped grid (80 SMs, the
    # V100's occupancy and plan): the transfer the V100 figures rely on.
    full, v100 = [r for r in runs if r[3] == "full"], [r for r in runs if r[3] == "v100"]
    held = [e for e, *_ in errors(fit(full, sass, dyn), v100, sass, dyn)]
    print(
        f"held out: fitted on the {len(full)} whole-GPU cells, the {len(v100)} V100-shaped-grid "
        f"cells |error| {summary(held)}"
    )
    worst = max(map(abs, errs + held))
    if worst > 0.25:
        print(
            f"the model misses an H200 cell by {100 * worst:.0f}% (> 25%): no V100 figure is quoted"
        )
        return 1
    print()
    print(report(prm, runs, sass, dyn, a.markdown))
    if any(kind_of(r[2]) == "rf" for r in runs):
        print()
        print(rf_report(prm, runs, sass, dyn))
    pre_runs = load_prefill_runs()
    if pre_runs:
        pfit, perrs, pheld, prefill = prefill_report(prm, sass, pre_runs)
        print()
        print(
            f"prefill (paged_attention_varlen): {len(perrs)} cells measured on {', '.join(sorted({r[2] for r in pre_runs}))}, "
            f"fitted on those over {PREFILL_FIT_MS:g} ms, their |error| {summary([e for e, r in zip(perrs, pre_runs) if r[1] > PREFILL_FIT_MS])}; "
            f"under it (launch-bound) {summary([e for e, r in zip(perrs, pre_runs) if r[1] <= PREFILL_FIT_MS])}"
        )
        if pheld:
            print(
                f"prefill held out: fitted without the no-past and 128K cells, those over {PREFILL_FIT_MS:g} ms |error| {summary(pheld)}"
            )
        print(", ".join(f"{k} {v:.3g}" for k, v in pfit.items() if k.startswith(("c varlen", "c prefill"))))
        print(
            "V100 predictions (lo .. hi: HMMA latency hidden or not), D G H_kv chunk past: ms, TFLOP/s, bound"
        )
        for r in prefill:
            c, lo, hi = r["cell"], r["lo"], r["hi"]
            print(f"  D{c['D']} G{c['G']} H_kv{c['H_kv']} chunk {c['chunk']:>5} past {c['past']:>6}: "
                  f"{lo['ms']:8.2f} .. {hi['ms']:8.2f} ms, {hi['tflops']:5.1f} .. {lo['tflops']:5.1f} TFLOP/s, {hi['limiter']}")  # fmt: skip
        designs = design_report(pfit, DESIGN_CELLS)
        print()
        print(design_table(designs))
    else:
        prefill, perrs, pheld, pre_runs, designs = [], [], [], [], []
        print("prefill: no measured runs in docs/data (prefill_*.json): no V100 prefill figure")
    if a.json:
        cells = {tuple(c.values()): c for c, *_ in runs}.values()
        out = dict(
            prefill=[
                dict(
                    cell=r["cell"],
                    lo={k: r["lo"][k] for k in ("ms", "tflops")},
                    hi={k: r["hi"][k] for k in ("ms", "tflops")},
                    bound=r["hi"]["limiter"],
                )
                for r in prefill
            ],  # fmt: skip
            prefill_designs=[dict(cell=r["cell"], design=r["design"], tile=r["tile"],
                                  hi={k: r["hi"][k] for k in ("ms", "tflops")},
                                  lo={k: r["lo"][k] for k in ("ms", "tflops")}) for r in designs],  # fmt: skip
            prefill_errors=perrs,  # fitted on every measured cell, in load_prefill_runs' order
            prefill_held_out_errors=pheld,
            prefill_measured_on=sorted({r[2] for r in pre_runs}),
            params=prm,
            dynamic=dyn,
            h200_errors=errs,
            held_out_errors=held,
            v100=[
                dict(
                    cell=c,
                    lo=predict(c, "V100", sass, dyn, prm, hmma_latency="lo"),
                    hi=predict(c, "V100", sass, dyn, prm, hmma_latency="hi"),
                )
                for c in cells
            ],
        )
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def summary(errs: list[float]) -> str:
    a = sorted(map(abs, errs))
    return f"median {100 * a[len(a) // 2]:.1f}%, 90th percentile {100 * a[int(0.9 * len(a))]:.1f}%, worst {100 * a[-1]:.1f}%"


if __name__ == "__main__":
    sys.exit(main())
