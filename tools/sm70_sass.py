#!/usr/bin/env python3
"""sm_70 SASS of every kernel: the instruction mix, whole kernel and per iteration of each loop.

The kernels are built as the runtime builds them (torch_sm70attn.nvrtc: NVRTC of the installed
CUDA wheels, no GPU; the extra cuda12 for sm_70), then disassembled with nvdisasm from CUDA 11.8: nvdisasm 13 refuses sm_70. Debian's
`nvidia-cuda-toolkit` (bookworm, component non-free) ships it; without installing anything:

    echo "deb http://deb.debian.org/debian bookworm main non-free" > sources.list
    o="-o Dir::Etc::SourceList=$PWD/sources.list -o Dir::Etc::SourceParts=/dev/null \\
       -o Dir::State::Lists=$PWD/lists"; mkdir -p lists/partial
    apt-get $o update && apt-get $o download nvidia-cuda-toolkit
    dpkg -x nvidia-cuda-toolkit_*.deb x      # x/usr/bin/nvdisasm

    python tools/sm70_sass.py --nvdisasm x/usr/bin/nvdisasm [--kernels 'D256 MB4'] [--json f]

For sm_90 (--arch sm_90, the H200's code, which the V100 model calibrates on) use a current
nvdisasm: 11.8 silently leaves out sm_90 opcodes it does not know (VIADD, the loop counters'
increment), which this tool detects from the gaps in the addresses. PyPI's wheel has one:

    pip download --no-deps -d w nvidia-cuda-nvdisasm && unzip -q w/*.whl -d w   # w/nvidia/cu13/bin

Loops are the natural loops of the control-flow graph (basic blocks from labels and branches,
back edges to a dominating block). The main loop is the KV tile loop: the smallest loop that
holds HMMA and a barrier (else the largest that holds a global load). Its row counts one
iteration outside its inner loops; the last column lists the inner loops' body sizes times
their trip counts and the total of one tile (the instructions each warp issues per tile).
Each inner loop is named by its source `for` (the kernels are built with line info, which
changes no instruction); its trip count is the source bound, evaluated by NVRTC for the
kernel's traits in the scope of the kernel's own constexprs, divided by the step of the loop
counter in the SASS (partial unrolling). A loop with two back edges (the softmax's `continue`
for padding rows) is two natural loops here, both counted at the full trip count: an upper
bound by those few instructions. The check after each tile total is the tile's HMMA products
over all warps divided by the 2 x ROWS x N x D the tile needs: 1.00 where the count is whole.
Classes: tensor (HMMA), global and shared loads and stores, local (spills), shuffles, FP32,
FP16x2, MUFU (exp2, rcp), conversions, integer, moves, control, other.
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

from torch_sm70attn import _jit, nvrtc

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
    | {"UIADD3", "USHF", "ULEA", "UIMAD", "ULOP3", "UISETP", "USEL", "UPRMT"}  # sm_80+: uniform
    | {"VIADD", "VIMNMX", "VIADDMNMX"},  # sm_90
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
    """{kernel: [(address, opcode, operands, predicated, "file:line" or None, modifiers)]} of an
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
                cur.append((addr, "", lab, False, None, None))
            pending = []
            pred = m.group(2) is not None
            cur.append((addr, m.group(3), (m.group(2) or "") + m.group(5), pred, src, m.group(4)))
    return kernels


# multiply-adds per warp of one HMMA, by shape: sm_70's 884, sm_80+'s 1688 and 16816
HMMA_MACS = {"884": 256, "1688": 1024, "16816": 2048}


def missing(insns) -> int:
    """Instructions absent from a listing: sm_70+ instructions are 16 bytes, so every address
    follows the one before by 16; nvdisasm leaves out opcodes it cannot decode, silently."""
    addrs = sorted({x[0] for x in insns if x[1]})
    return sum((b - a) // 16 - 1 for a, b in zip(addrs, addrs[1:], strict=False))


def mix(insns) -> collections.Counter:
    c = collections.Counter(CLASS_OF.get(x[1], "other") for x in insns if x[1])
    c["total"] = sum(c[k] for k in COLUMNS)
    for x in insns:  # hmma_macs and smem_bytes: no column (the product check, the V100 model)
        if x[1] == "HMMA" and x[5]:
            c["hmma_macs"] += HMMA_MACS.get(x[5].split(".")[1], 0)
        c["smem_bytes"] += smem_bytes(x[1], x[5] or "")
    return c


def smem_bytes(op: str, mods: str) -> int:
    """Shared-memory bytes one warp moves with an LDS/STS (32 lanes x the width: .128, .64,
    .U8/.S8, .U16/.S16, else 4 bytes) or an LDSM (.M88.N / .MT88.N: N 8x8 fp16 matrices)."""
    if op == "LDSM":
        m = re.search(r"\.MT?88(?:\.(\d))?", mods)
        return 128 * int(m.group(1) or 1) if m else 0
    if op not in ("LDS", "STS"):
        return 0
    width = {"128": 16, "64": 8, "U8": 1, "S8": 1, "U16": 2, "S16": 2}
    return 32 * next((width[p] for p in mods.split(".") if p in width), 4)


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


RARE = "// (not a whole tile's)"


def rare_lines(header: str) -> set[str]:
    """"file:line" of every line of the blocks a kernel header marks as off the path a whole tile
    takes (the line opening the block ends in RARE: the prefill kernel's masked branch, taken by
    the causal diagonal and tiles with an invalid page, and its O rescale, taken when a row's
    maximum moves); the tile's count leaves their instructions out."""
    path = os.path.join(_jit.csrc_dir(), "sm70attn", header)
    if not os.path.exists(path):
        return set()
    lines, out = open(path).read().splitlines(), set()
    for i, text in enumerate(lines):
        if not text.rstrip().endswith(RARE):
            continue
        depth = 1  # the block this line opens (its "} else {" closes nothing of it)
        out.add(f"{header}:{i + 1}")
        for j in range(i + 1, len(lines)):
            code = lines[j].split("//")[0]
            depth += code.count("{") - code.count("}")
            out.add(f"{header}:{j + 1}")
            if depth <= 0:
                break
    return out


def analyse(insns, rare=frozenset()) -> dict:
    """The kernel's mix; and for the main loop (the natural loop holding HMMA and a barrier
    with the fewest blocks, else the largest one holding a global load): the mix of one
    iteration outside its inner loops ("main_loop", leaving out the instructions of the source
    lines in `rare`: rare_lines), and each inner loop's body."""
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
    own = [x for b in sorted(nat[main] - in_inner) for x in bl[b] if x[4] not in rare]
    r["main_loop"] = mix(own)
    r["inner_loops"] = []
    for h in inner:
        xs = [x for b in sorted(nat[h]) for x in bl[b]]
        r["inner_loops"].append({**mix(xs), "for": _for_line(xs), "step": _unroll(xs)})
    return r


def _unroll(insns) -> int:
    """Source iterations per trip of a loop: the step of its counter (`IADD3 Rc, Rc, STEP, RZ`
    with Rc compared by an ISETP of the loop), 1 if there is none (the compiler unrolls
    partially: D128's QK^T loop runs 2 trips of 4 slices)."""
    compared = {r for x in insns if x[1] == "ISETP" for r in re.findall(r"\bR\d+\b", x[2])}
    for x in insns:  # sm_70: IADD3 Rc, Rc, STEP, RZ; sm_90: VIADD Rc, Rc, STEP
        step = {"IADD3": r", RZ", "VIADD": ""}.get(x[1])
        m = (
            re.match(rf"\s*(R\d+), \1, (0x[0-9a-f]+|\d+){step}\s*$", x[2])
            if step is not None
            else None
        )
        if m and m.group(1) in compared and 0 < int(m.group(2), 0) <= 64:  # not a count-down
            return int(m.group(2), 0)
    return 1


def _for_line(insns) -> str | None:
    """The first `for` statement among the source lines of a loop's instructions (with line
    info), e.g. "paged_attention.cuh:169 for (int i = 0; i < KT::DPK; ++i) {"."""
    found = []
    for loc in {x[4] for x in insns if x[4]}:
        path, line = loc.rsplit(":", 1)
        full = os.path.join(_jit.csrc_dir(), "sm70attn", path)
        if os.path.exists(full):
            text = open(full).read().splitlines()[int(line) - 1].strip()
            if text.startswith("for ("):
                found.append((path, int(line), text))
    if not found:
        return None
    path, line, text = min(found)
    return f"{path}:{line} {text}"


FOR = re.compile(r"for \(int (\w+) = (\d+); \1 < ([^;]+); \+\+\1\)")
# a function's constants (and the type aliases they use) in a kernel header
KERNEL_CONSTANTS = re.compile(r"^\s*constexpr (int|bool) ([^;]*);$|^\s+using (\w+) = [^;]*;$", re.M)


def kernel_constants(text: str) -> str:
    """A header's function-scope constexprs and type aliases, as members of a probe struct. The
    kernels' pieces are functions of their own (paged_attention.cuh's QK^T and PV tiles, the
    softmax.h steps), several of which declare a name (ROWS = KT::ROWS): it is taken once, and
    dropped where two functions disagree on it."""
    seen, out, clash = {}, [], set()
    for m in KERNEL_CONSTANTS.finditer(text):
        if m.group(3):  # using NAME = ...;
            if m.group(3) not in seen:
                seen[m.group(3)] = m.group(0).strip()
                out.append(m.group(0).strip())
            continue
        keep = []
        for d in re.split(r",\s*(?=\w+\s*=)", m.group(2)):
            name, expr = (x.strip() for x in d.split("=", 1))
            if name not in seen:
                seen[name] = expr
                keep.append(d.strip())
            elif seen[name] != expr:
                clash.add(name)
        if keep:
            out.append(f"static constexpr {m.group(1)} {', '.join(keep)};")
    return "\n".join(
        ln for ln in out if not any(re.match(rf"static constexpr \w+ {c} =", ln) for c in clash)
    )


def constants(arch, prelude: str, exprs: list) -> list:
    """Integer constant expressions (None entries skipped) evaluated by NVRTC after `prelude`,
    read back from the PTX; a list of None if the probe does not compile."""
    src = prelude + "".join(
        f'extern "C" __device__ long long probe_{i} = {e};\n' for i, e in enumerate(exprs) if e
    )
    try:
        ptx = nvrtc.compile_program(src, "compute_" + arch[3:].rstrip("a"), cubin=False)[0]
    except RuntimeError:
        return [None] * len(exprs)
    found = [
        re.search(rf"probe_{i}\s*=\s*(-?\d+)", ptx) if e else None for i, e in enumerate(exprs)
    ]
    return [int(m.group(1)) if m else None for m in found]


def trip_counts(arch, traits: str, header: str, loops: list) -> list:
    """Trip count of each `for (int i = A; i < BOUND; ++i)` in `loops` (source lines, "file:line
    for ..."), BOUND evaluated by NVRTC for these traits in the scope of the constexprs of the
    file the loop is in (copied into a probe struct: kernel_constants; `header`, the kernel's,
    is included, and stands for a loop without a file); None where the form or the evaluation
    fails."""
    forms = [FOR.search(f or "") for f in loops]
    if not traits or not any(forms):
        return [None] * len(loops)
    files = [(f or "").split(":")[0] if ":" in (f or "") else header for f in loops]
    out = [None] * len(loops)
    for src in sorted({files[i] for i, m in enumerate(forms) if m}):
        mine = [i for i, m in enumerate(forms) if m and files[i] == src]
        text = open(os.path.join(_jit.csrc_dir(), "sm70attn", src)).read()
        members = "".join(
            f"static constexpr long long value_{i} = ({forms[i].group(3)}) - {forms[i].group(2)};\n"
            for i in mine
        )
        prelude = (
            f'#include "sm70attn/{header}"\nnamespace sm70attn {{\ntemplate <class KT> struct Probe {{\n'
            f"{kernel_constants(text)}\n{members}}};\n}}\n"
        )
        exprs = [
            f"sm70attn::Probe<{traits}>::value_{i}" if i in mine else None
            for i in range(len(loops))
        ]
        for i, v in enumerate(constants(arch, prelude, exprs)):
            if i in mine:
                out[i] = v
    return out


def disassemble(args):
    """Build one kernel (a torch_sm70attn.nvrtc.Kernel) for the arch as the runtime does, or
    with `nvcc` and its flags when args carries them, and disassemble it; r["regs"] from ptxas."""
    kernel, arch, nvdisasm, *nvcc = args
    name, header, traits = kernel.name, kernel.header, kernel.traits
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        if nvcc:  # [nvcc, flags]: taking the kernel's address instantiates it
            path = os.path.join(tmp, name.replace(" ", "_") + ".cu")
            with open(path, "w") as f:
                f.write(
                    f'#include "sm70attn/{header}"\nvoid* probe() {{ return (void*)&{kernel.expr}; }}\n'
                )
            cmd = [nvcc[0], f"-arch={arch}", "-cubin", *nvcc[1], "-Xptxas", "-v", "-I"]
            cmd += [str(_jit.csrc_dir()), path, "-o", cubin]
            log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
            regs = max(map(int, re.findall(r"Used (\d+) registers", log)), default=None)
        else:
            c = nvrtc.compile_kernel(kernel, arch)
            with open(cubin, "wb") as f:
                f.write(c.cubin)
            regs = c.info["regs"]
        sass = subprocess.run(
            [nvdisasm, "-c", "-g", cubin], check=True, capture_output=True, text=True
        )
    kernels = parse(sass.stdout)
    entry = max(kernels, key=lambda k: len(kernels[k]))  # the one entry (plus helpers, if any)
    gaps = missing(kernels[entry])
    if gaps:
        raise RuntimeError(
            f"{name}: {nvdisasm} left out {gaps} instructions of the {arch} listing (nvdisasm "
            "11.8 drops sm_90 opcodes it does not know, such as VIADD): for sm_90 use a newer "
            "one (tools/sm70_sass.py's docstring)"
        )
    r = analyse(kernels[entry], rare_lines(header))
    r["regs"] = regs
    inner = r.get("inner_loops", [])
    # each loop's constants are those of the file its `for` is in (varlen.cuh's kernel runs
    # paged_attention.cuh's tile loop, whose softmax passes are softmax.h's)
    trips = trip_counts(arch, traits, header, [x["for"] for x in inner])
    for x, n in zip(inner, trips, strict=True):
        x["trips"] = None if n is None else -(-n // x["step"])  # trips of the unrolled loop
    if "main_loop" in r and all(x["trips"] is not None for x in inner):
        per = [(r["main_loop"], 1)] + [(x, x["trips"]) for x in inner]
        r["per_tile"] = sum(m["total"] * n for m, n in per)
        # check: the tile's HMMA, over all warps, do the tile's 2 x ROWS x N x D products
        size = traits_sizes(arch, traits)
        if size:
            macs = sum(m.get("hmma_macs", 0) * n for m, n in per) * size["WARPS"]
            r["mac_check"] = macs / (2 * size["ROWS"] * size["N"] * size["D"])
    return name, r


def traits_sizes(arch, traits):
    """D, ROWS, N and WARPS of an AttnTraits type (None for other kernels)."""
    if not traits or "AttnTraits" not in traits:
        return None
    names = ("D", "ROWS", "N", "WARPS")
    prelude = '#include "sm70attn/traits.h"\n'
    values = constants(arch, prelude, [f"{traits}::{n}" for n in names])
    return None if None in values else dict(zip(names, values, strict=True))


def table(results) -> str:
    """Static counts per class; main_loop rows: one iteration outside its inner loops; the last
    column: the inner loops' body sizes x trip counts, and the instructions of one tile."""
    cols = ["total", *COLUMNS]
    head = f"{'kernel':<22} {'where':<10}" + "".join(f"{c:>8}" for c in cols) + "   inner"
    lines = [head, "-" * len(head)]
    for name, r in results:
        for where in ("kernel", "main_loop"):
            if where in r:
                loops = r.get("inner_loops", [])
                sizes = "+".join(f"{x['total']}x{x.get('trips') or '?'}" for x in loops) or "-"
                tile = r.get("per_tile", "?")
                check = f" (HMMA/products {r['mac_check']:.2f})" if "mac_check" in r else ""
                inner = f"   {sizes} = {tile} a tile{check}" if where == "main_loop" else ""
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
    todo = [k for k in nvrtc.kernels() if re.search(args.kernels, k.name)]
    jobs = [(k, args.arch, args.nvdisasm) for k in todo]
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
