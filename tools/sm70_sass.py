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

Loops are the natural loops of the control-flow graph (basic blocks from labels and branches,
back edges to a dominating block). The main loop is the KV tile loop: the smallest loop that
holds HMMA and a barrier. Its row counts one iteration outside its inner loops; the last
column lists the inner loops' body sizes, whose trip counts (not derived yet) multiply them,
and the source `for` of each inner loop is printed after the table (the kernels are built
with line info, which changes no instruction). The loop with the most instructions that holds
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
    | {"POPC", "FLO", "BMSK", "SGXT", "IMUL", "IADD", "LOP", "SHL", "SHR", "BREV", "PLOP3"}
    | {"UIADD3", "USHF", "ULEA", "UIMAD", "ULOP3", "UISETP", "USEL", "UPRMT"},  # sm_80+: uniform
    "move": {"MOV", "S2R", "CS2R", "S2UR", "R2UR", "MOVM", "P2R", "R2P", "LDC", "ULDC", "UMOV"},
    "control": {"BRA", "BSSY", "BSYNC", "EXIT", "BAR", "WARPSYNC", "RET", "CALL", "BREAK", "NOP"}
    | {"BMOV", "YIELD", "SSY", "SYNC", "VOTE", "MEMBAR", "ERRBAR", "DEPBAR", "JMP", "BPT"}
    | {"ENDCOLLECTIVE", "ELECT", "VOTEU"},
}
CLASS_OF = {op: c for c, ops in CLASSES.items() for op in ops}
COLUMNS = [*CLASSES, "other"]
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.\S+)?\s*([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")
SOURCE = re.compile(r'//## File "([^"]+)", line (\d+)')


def parse(sass: str) -> dict[str, list[tuple]]:
    """{kernel: [(address, opcode, operands, predicated, "file:line" or None)]} of an
    `nvdisasm -c [-g]` listing; a label is an entry with opcode '' and its name as operands, at
    the next instruction's address."""
    kernels, cur, pending, src = {}, None, [], None
    for line in sass.splitlines():
        m = SOURCE.search(line)
        if m:  # nvdisasm -g: the source line of the instructions that follow
            src = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
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
                cur.append((addr, "", lab, False, None))
            pending = []
            pred = m.group(2) is not None
            cur.append((addr, m.group(3), (m.group(2) or "") + m.group(5), pred, src))
    return kernels


def mix(insns) -> collections.Counter:
    c = collections.Counter(CLASS_OF.get(x[1], "other") for x in insns if x[1])
    c["total"] = sum(c[k] for k in COLUMNS)
    return c


def blocks(insns) -> tuple[list[list], dict[int, set[int]]]:
    """Basic blocks (lists of instructions) and their successor edges: a block ends at a label
    or after a branch or exit; an unconditional BRA/EXIT/RET does not fall through."""
    out, cur, labels = [], [], {}
    for x in insns:
        if not x[1]:  # a label starts a block
            if cur:
                out.append(cur)
                cur = []
            labels[x[2]] = len(out)
            continue
        cur.append(x)
        if x[1] in ("BRA", "EXIT", "RET", "JMP", "BREAK"):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    succ: dict[int, set[int]] = {i: set() for i in range(len(out))}
    for i, blk in enumerate(out):
        last = blk[-1]
        t = TARGET.search(last[2]) if last[1] == "BRA" else None
        if t and t.group(1) in labels:
            succ[i].add(labels[t.group(1)])
        predicated = last[3]
        if last[1] not in ("BRA", "EXIT", "RET", "JMP", "BREAK") or predicated:
            if i + 1 < len(out):
                succ[i].add(i + 1)
    return out, succ


def natural_loops(succ: dict[int, set[int]]) -> dict[int, set[int]]:
    """{header: blocks of its natural loop} from back edges u -> h, h dominating u."""
    seen, work = {0}, [0]  # blocks reachable from the entry (not subroutines only CALLed)
    while work:
        for v in succ[work.pop()]:
            if v not in seen:
                seen.add(v)
                work.append(v)
    nodes = sorted(seen)
    pred = {n: set() for n in nodes}
    for u in nodes:
        for v in succ[u]:
            pred[v].add(u)
    dom = {n: set(nodes) for n in nodes}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for n in nodes[1:]:
            ps = [dom[p] for p in pred[n]]
            new = (set.intersection(*ps) if ps else set()) | {n}
            if new != dom[n]:
                dom[n], changed = new, True
    loops: dict[int, set[int]] = {}
    for u in nodes:
        for h in succ[u]:
            if h in dom[u]:  # back edge
                body, work = {h, u}, ([u] if u != h else [])  # never past the header
                while work:
                    for p in pred[work.pop()]:
                        if p not in body:
                            body.add(p)
                            work.append(p)
                loops.setdefault(h, set()).update(body)
    return loops


def loops(insns) -> list[tuple[int, int]]:
    """(first, last) addresses of each natural loop's blocks (for reading; loops may hold
    blocks the compiler laid out elsewhere)."""
    bl, succ = blocks(insns)
    out = []
    for body in natural_loops(succ).values():
        addrs = [x[0] for b in body for x in bl[b]]
        out.append((min(addrs), max(addrs)))
    return sorted(out)


def analyse(insns) -> dict:
    """The kernel's mix; and for the main loop (the natural loop holding HMMA and a barrier
    with the fewest blocks, else the largest one holding a global load): the mix of one
    iteration outside its inner loops ("main_loop"), and each inner loop's body."""
    body = [x for x in insns if x[1]]
    r = {"kernel": mix(body)}
    bl, succ = blocks(insns)
    nat = natural_loops(succ)
    r["loops"] = len(nat)

    def has(loop, *ops):
        return all(any(x[1] == op for b in loop for x in bl[b]) for op in ops)

    cands = [h for h, lb in nat.items() if has(lb, "HMMA", "BAR")]
    if cands:
        main = min(cands, key=lambda h: len(nat[h]))
    else:
        cands = [h for h, lb in nat.items() if has(lb, "LDG")]
        main = max(cands, key=lambda h: len(nat[h])) if cands else None
    if main is None:
        return r
    inner = [h for h in nat if h != main and nat[h] < nat[main]]
    in_inner = set().union(*(nat[h] for h in inner)) if inner else set()
    own = [x for b in sorted(nat[main] - in_inner) for x in bl[b]]
    r["main_loop"] = mix(own)
    r["inner_loops"] = []
    for h in inner:
        xs = [x for b in sorted(nat[h]) for x in bl[b]]
        r["inner_loops"].append({**mix(xs), "for": _for_line(xs)})
    return r


def _for_line(insns) -> str | None:
    """The first `for` statement among the source lines of a loop's instructions (with line
    info), e.g. "paged_attention.cuh:169 for (int i = 0; i < KT::DPK; ++i) {"."""
    found = []
    for loc in {x[4] for x in insns if x[4]}:
        path, line = loc.rsplit(":", 1)
        full = os.path.join(sm70_check.CSRC, "sm70attn", path)
        if os.path.exists(full):
            text = open(full).read().splitlines()[int(line) - 1].strip()
            if text.startswith("for ("):
                found.append((path, int(line), text))
    if not found:
        return None
    path, line, text = min(found)
    return f"{path}:{line} {text}"


def disassemble(args):
    """Build one kernel for the arch (as the SM70 gate does) and disassemble it."""
    (name, header, inst, _), arch, nvrtc, ptxas, incs, nvdisasm = args
    src = f'#include "sm70attn/{header}"\n{inst}\n'
    fname = name.replace(" ", "_") + ".cu"
    ptx = sm70_check.nvrtc_ptx(nvrtc, incs, arch, fname, src, extra=("-lineinfo",))
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        subprocess.run([ptxas, f"-arch={arch}", "-lineinfo", ptx_path, "-o", cubin], check=True)
        cmd = [nvdisasm, "-c", "-g", cubin]
        sass = subprocess.run(cmd, check=True, capture_output=True, text=True)
    kernels = parse(sass.stdout)
    entry = max(kernels, key=lambda k: len(kernels[k]))  # the one entry (plus helpers, if any)
    return name, analyse(kernels[entry])


def table(results) -> str:
    """Static counts per class; main_loop rows: one iteration outside its inner loops, whose
    body sizes the last column lists (their trip counts multiply them)."""
    cols = ["total", *COLUMNS]
    head = f"{'kernel':<22} {'where':<10}" + "".join(f"{c:>8}" for c in cols) + "   inner"
    lines = [head, "-" * len(head)]
    for name, r in results:
        for where in ("kernel", "main_loop"):
            if where in r:
                sizes = "+".join(str(x["total"]) for x in r.get("inner_loops", [])) or "-"
                inner = f"   {sizes}" if where == "main_loop" else ""
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
    loops = {x["for"] for _, r in results for x in r.get("inner_loops", []) if x["for"]}
    if loops:
        print("\ninner loops of the tile loops (trip counts multiply their bodies):")
        print("\n".join(f"  {f}" for f in sorted(loops)))
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
