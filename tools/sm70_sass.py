#!/usr/bin/env python3
"""sm_70 SASS of every kernel: the instruction mix, whole kernel and per iteration of each loop.

The kernels are built as tools/sm70_check.py builds them (NVRTC + ptxas 12.9 wheels, no GPU),
then disassembled with nvdisasm from CUDA 11.8: nvdisasm 13 refuses sm_70. Debian's
`nvidia-cuda-toolkit` (bookworm, component non-free) ships it; without installing anything:

    echo "deb http://deb.debian.org/debian bookworm main non-free" > sources.list
    o="-o Dir::Etc::SourceList=$PWD/sources.list -o Dir::Etc::SourceParts=/dev/null \\
       -o Dir::State::Lists=$PWD/lists"; mkdir -p lists/partial
    apt-get $o update && apt-get $o download nvidia-cuda-toolkit
    dpkg -x nvidia-cuda-toolkit_*.deb x      # x/usr/bin/nvdisasm

    python tools/sm70_sass.py --nvdisasm x/usr/bin/nvdisasm [--kernels 'D256 MB4'] [--json f]

Loops are read from the control flow: a branch to a lower address closes a loop whose body
runs from the branch target to the branch. The static count of a loop body is its dynamic
count per iteration only without inner loops: those are counted once here (their trip counts
are not derived yet), and the table's last column says how many the main loop holds. The loop with the most instructions that holds
a global load is reported as the kernel's main (KV tile) loop. Classes: tensor (HMMA), global
and shared loads and stores, local (spills), shuffles, FP32, FP16x2, MUFU (exp2, rcp),
conversions, integer, moves, control, other.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm70_check  # noqa: E402

CLASSES = {
    "tensor": {"HMMA"},
    "ldg": {"LDG"},
    "stg": {"STG", "RED", "ATOM", "ATOMG"},
    "lds": {"LDS", "LDSM"},
    "sts": {"STS", "ATOMS"},
    "local": {"LDL", "STL"},
    "shfl": {"SHFL"},
    "fp32": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FRND", "FSWZADD"},
    "fp16": {"HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2", "HSET2"},
    "mufu": {"MUFU"},
    "cvt": {"F2F", "F2I", "I2F", "I2I", "F2FP"},
    "int": {"IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "IMNMX", "SEL", "PRMT", "IABS"}
    | {"POPC", "FLO", "BMSK", "SGXT", "IMUL", "IADD", "LOP", "SHL", "SHR", "BREV", "PLOP3"},
    "move": {"MOV", "S2R", "CS2R", "S2UR", "R2UR", "MOVM", "P2R", "R2P", "LDC", "ULDC"},
    "control": {"BRA", "BSSY", "BSYNC", "EXIT", "BAR", "WARPSYNC", "RET", "CALL", "BREAK", "NOP"}
    | {"BMOV", "YIELD", "SSY", "SYNC", "VOTE", "MEMBAR", "ERRBAR", "DEPBAR", "JMP", "BPT"},
}
CLASS_OF = {op: c for c, ops in CLASSES.items() for op in ops}
COLUMNS = [*CLASSES, "other"]
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.\S+)?\s*([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """{kernel: [(address, opcode, operands)]} of an `nvdisasm -c` listing, labels resolved to
    the address of the instruction that follows them ("LABEL" pseudo-entries, opcode '')."""
    kernels, cur, pending = {}, None, []
    for line in sass.splitlines():
        m = re.match(r"^\.text\.(\S+):", line)
        if m:
            cur = kernels.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        m = LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = INSN.search(line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                cur.append((addr, "", lab))
            pending = []
            cur.append((addr, m.group(3), m.group(5)))
    return kernels


def mix(insns) -> collections.Counter:
    c = collections.Counter(CLASS_OF.get(op, "other") for _, op, _ in insns if op)
    c["total"] = sum(c[k] for k in COLUMNS)
    return c


def loops(insns) -> list[tuple[int, int]]:
    """(start, end) addresses of each loop: a branch back to a lower address."""
    labels = {ops: a for a, op, ops in insns if not op}
    out = []
    for a, op, ops in insns:
        t = TARGET.search(ops) if op == "BRA" else None
        if t and t.group(1) in labels and labels[t.group(1)] <= a:
            out.append((labels[t.group(1)], a))
    return out


def analyse(insns) -> dict:
    body = [x for x in insns if x[1]]
    r = {"kernel": mix(body)}
    spans = loops(insns)
    inside = {
        s: [x for x in body if s[0] <= x[0] <= s[1]] for s in spans
    }  # nested loops counted once
    main = [s for s in spans if any(op == "LDG" for _, op, _ in inside[s])]
    if main:
        best = max(main, key=lambda s: len(inside[s]))
        r["main_loop"] = mix(inside[best])
        r["main_loop_span"] = best
        r["inner_loops"] = sum(1 for s in spans if s != best and best[0] <= s[0] <= s[1] <= best[1])
    r["loops"] = len(spans)
    return r


def disassemble(args):
    """Build one kernel for the arch (as the SM70 gate does) and disassemble it."""
    (name, header, inst, _), arch, nvrtc, ptxas, incs, nvdisasm = args
    src = f'#include "sm70attn/{header}"\n{inst}\n'
    ptx = sm70_check.nvrtc_ptx(nvrtc, incs, arch, name.replace(" ", "_") + ".cu", src)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch={arch}", ptx_path, "-o", cubin], check=True)
        sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True)
    kernels = parse(sass.stdout)
    entry = max(kernels, key=lambda k: len(kernels[k]))  # the one entry (plus helpers, if any)
    return name, analyse(kernels[entry])


def table(results) -> str:
    """Static counts per class; main_loop rows: one iteration, its inner loops (last column)
    counted once."""
    cols = ["total", *COLUMNS]
    head = f"{'kernel':<22} {'where':<10}" + "".join(f"{c:>8}" for c in cols) + "   inner"
    lines = [head, "-" * len(head)]
    for name, r in results:
        for where in ("kernel", "main_loop"):
            if where in r:
                inner = f"{r['inner_loops']:>8}" if where == "main_loop" else ""
                row = "".join(f"{r[where][c]:>8}" for c in cols)
                lines.append(f"{name:<22} {where:<10}{row}{inner}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    ap.add_argument("--arch", default="sm_70")
    ap.add_argument("--kernels", default="", help="regular expression on the kernel names")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        out = subprocess.run([args.nvdisasm, "--version"], capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit(f"nvdisasm not found ({args.nvdisasm}): see the top of tools/sm70_sass.py")
    if "release 11" not in out.stdout and args.arch == "sm_70":
        print(f"warning: {args.nvdisasm} is not CUDA 11.x; newer ones refuse sm_70", flush=True)
    nvrtc, ptxas, incs = sm70_check.wheel_paths()
    todo = [k for k in sm70_check.kernel_list() if re.search(args.kernels, k[0])]
    jobs = [(k, args.arch, nvrtc, ptxas, incs, args.nvdisasm) for k in todo]
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(disassemble, jobs))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    n: {
                        k: dict(v) if isinstance(v, collections.Counter) else v
                        for k, v in r.items()
                    }
                    for n, r in results
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
