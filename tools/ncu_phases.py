#!/usr/bin/env python3
"""Where an attention kernel's instructions go: ncu's per-SASS-instruction counts, summed by
phase of the kernel source (the per-phase table in docs/perf.md).

    # on the GPU machine (see tools/profile_cells.py for the cells):
    ncu --import-source yes --section SourceCounters --section WarpStateStats \\
        -k regex:paged -o prof python tools/profile_cells.py --reps 1
    ncu -i prof.ncu-rep --page source --csv --print-source sass > src.csv
    # where the profiled build's NVRTC is installed (the GPU machine), with an nvdisasm:
    python tools/ncu_phases.py src.csv --arch sm_90 --warp-tiles 16384 393216

ncu reports SASS addresses; nvdisasm -g of the same kernels, as the runtime compiles them
(torch_sm70attn.nvrtc, the cubins of its cache), maps them to source lines (every instruction's
opcode is compared: a different compiler or flags is an error, not a silent misattribution). Phases come from
anchors in the kernel's sources (ANCHORS: csrc/sm70attn/paged_attention.cuh, its pieces and
attend_cta's tile loop; softmax.h; epilogue.h), a line taking the phase of the last anchor above it
in its file; instructions inlined from other headers count with the kernel line before them,
except e4m3.h (conversion) and kv_tile.h.
--warp-tiles: per profiled attention kernel, (warps per CTA) x (tiles it processed: 32 tokens,
64 for D = 64 with at most 32 rows), to print counts per warp per tile; without it, fractions
only.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from torch_sm70attn import nvrtc  # noqa: E402

KERNEL = ROOT / "csrc" / "sm70attn" / "paged_attention.cuh"
PHASES = ["prologue", "loop", "qk", "softmax", "pv", "epilogue"]  # (the table's order)
# per source file, (phase, the text that opens it), in source order
ANCHORS = {
    "paged_attention.cuh": [
        ("prologue", "void load_q("),
        ("qk", "void qk_tile("),
        ("pv", "void pv_tile("),
        ("epilogue", "void stage_o("),
        ("prologue", "void attend_cta("),
        ("loop", "for (int t0 = t_begin"),
        ("qk", "qk_tile<KT>(Qs"),
        ("softmax", "softmax_tile<KT>(p"),
        ("pv", "pv_tile<KT>(o"),
        ("epilogue", "// Epilogue"),
    ],
    "softmax.h": [
        ("prologue", "void softmax_init("),
        ("softmax", "void softmax_tile("),
        ("epilogue", "void softmax_store("),
    ],
    # (the split that sees nothing returns from the prologue)
    "epilogue.h": [
        ("epilogue", "#pragma once"),
        ("prologue", "void store_empty("),
        ("epilogue", "void store_out("),
    ],
}
INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LINE = re.compile(r'File "(.*?)", line (\d+)')


def opcode(sass: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split()[0].split(".")[0]


def read_ncu_csv(text: str) -> list[dict]:
    """Kernels of an ncu source-page CSV: name, header and rows, in report order."""
    kernels, cur = [], None
    for row in csv.reader(text.splitlines()):
        if not row:
            continue
        if row[0] == "Kernel Name":
            cur = {"name": row[1], "rows": []}
            kernels.append(cur)
        elif row[0] == "Address" and cur is not None:
            cur["header"] = row
        elif cur is not None and "header" in cur:
            cur["rows"].append(row)
    return kernels


def read_disasm(text: str) -> dict[int, tuple[str, int, str]]:
    """nvdisasm -g output of one function: offset -> (file name, line, opcode)."""
    where, out = ("?", 0), {}
    for line in text.splitlines():
        m = LINE.search(line)
        if m:
            where = (Path(m.group(1)).name, int(m.group(2)))
            continue
        m = INSTR.match(line)
        if m:
            out[int(m.group(1), 16)] = (*where, opcode(m.group(2)))
    return out


def phase_starts(source: str, anchors=None, name: str = KERNEL.name) -> list[tuple[int, str]]:
    """(first line, phase) of each phase of one source file (default: paged_attention.cuh)."""
    lines = source.splitlines()
    starts = [(0, "prologue")]
    for phase, anchor in anchors or ANCHORS[name]:
        hits = [i + 1 for i, text in enumerate(lines) if anchor in text]
        if len(hits) != 1:
            raise SystemExit(f"anchor {anchor!r} found {len(hits)} times in {name}")
        starts.append((hits[0], phase))
    if [s for s, _ in starts] != sorted(s for s, _ in starts):
        raise SystemExit("phase anchors out of order")
    return starts


def source_starts() -> dict[str, list[tuple[int, str]]]:
    """phase_starts of every file of ANCHORS."""
    return {f: phase_starts((KERNEL.parent / f).read_text(), name=f) for f in ANCHORS}


def classify(file: str, line: int, starts) -> str | None:
    """The phase of a source line; None for a file without anchors. starts: source_starts(), or
    one list for paged_attention.cuh."""
    if file == "e4m3.h":
        return "convert"
    if file == "kv_tile.h":
        return "kv gather/store"
    by_file = starts if isinstance(starts, dict) else {KERNEL.name: starts}
    if file not in by_file:
        return None
    return [name for s, name in by_file[file] if s <= line][-1]


def attribute(
    kernel: dict, disasm: dict, starts
) -> tuple[collections.Counter, collections.Counter, int]:
    """Executed warp-instructions and stall samples per phase; number of opcode mismatches."""
    h = kernel["header"]
    ie, ss = h.index("Instructions Executed"), h.index("Warp Stall Sampling (All Samples)")
    base = int(kernel["rows"][0][0], 16)
    instr, stalls, mismatch, last = collections.Counter(), collections.Counter(), 0, "prologue"
    for row in kernel["rows"]:
        off = int(row[0], 16) - base
        file, line, op = disasm.get(off, ("?", 0, ""))
        mismatch += op != opcode(row[1])
        ph = classify(file, line, starts)
        if ph is None:
            ph = last
        elif file not in ("e4m3.h", "kv_tile.h"):
            last = ph
        instr[ph] += int(row[ie] or 0)
        stalls[ph] += int(row[ss] or 0)
    return instr, stalls, mismatch


def stall_reasons(kernel: dict) -> collections.Counter:
    h = kernel["header"]
    cols = [i for i, c in enumerate(h) if c.startswith("stall_") and "Not Issued" not in c]
    out = collections.Counter()
    for row in kernel["rows"]:
        for i in cols:
            out[h[i][6:]] += int(row[i] or 0)
    return out


def traits_of(name: str) -> tuple[int, int, int]:
    m = re.search(r"AttnTraits<\(int\)(\d+), \(int\)(\d+), \(int\)(\d+)>", name)
    if not m:
        raise SystemExit(f"not an attention kernel: {name}")
    return tuple(int(x) for x in m.groups())


def disassemble(traits, arch: str, tools: Path | None, work: Path) -> str:
    """nvdisasm -g of the (D, MB, VEC) WMMA kernel's cubin for arch, as the runtime builds it."""
    d, mb, vec = traits
    cubin = work / f"k{d}_{mb}_{vec}.cubin"
    cubin.write_bytes(nvrtc.cubin(nvrtc.Kernel("attn", (d, mb, vec)), arch).cubin)
    nvdisasm = str(tools / "nvdisasm") if tools else (shutil.which("nvdisasm") or "nvdisasm")
    return subprocess.run(
        [nvdisasm, "-g", "-c", str(cubin)], check=True, capture_output=True, text=True
    ).stdout


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass")
    ap.add_argument("--arch", default="sm_90", help="the profiled GPU's arch (default sm_90)")
    ap.add_argument(
        "--warp-tiles",
        type=float,
        nargs="*",
        default=[],
        help="per attention kernel in the CSV: warps per CTA x tiles processed",
    )
    ap.add_argument("--tools", type=Path, help="folder holding nvdisasm (default: PATH)")
    a = ap.parse_args(argv)
    kernels, prev = [], None
    for k in read_ncu_csv(Path(a.csv).read_text()):
        if "paged_attention_kernel" in k["name"] and k != prev:  # ncu may print a launch twice
            kernels.append(k)
        prev = k
    starts = source_starts()
    names = [*PHASES, "convert", "kv gather/store"]
    with tempfile.TemporaryDirectory() as tmp:
        for n, k in enumerate(kernels):
            instr, stalls, mism = attribute(
                k,
                read_disasm(disassemble(traits_of(k["name"]), a.arch, a.tools, Path(tmp))),
                starts,
            )
            if mism:
                raise SystemExit(
                    f"{mism} SASS opcodes differ from the profiled build: other compiler or flags"
                )
            total, tot_st = sum(instr.values()), sum(stalls.values()) or 1
            wt = a.warp_tiles[n] if n < len(a.warp_tiles) else None
            print(f"\n{k['name'][:100]}\n")
            print(
                "| phase | warp-instructions"
                + (" per warp-tile" if wt else "")
                + " | % | % of stall samples |"
            )
            print("|---|---|---|---|")
            for ph in names:
                v = instr[ph] / wt if wt else instr[ph]
                print(
                    f"| {ph} | {v:.0f} | {100 * instr[ph] / total:.1f} | {100 * stalls[ph] / tot_st:.1f} |"
                )
            print(f"| total | {total / wt if wt else total:.0f} | 100 | 100 |")
            sr = stall_reasons(k)
            s = sum(sr.values()) or 1
            print(
                "\nstall reasons: "
                + ", ".join(f"{r} {100 * v / s:.0f}%" for r, v in sr.most_common(8))
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
