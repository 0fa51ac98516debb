#!/usr/bin/env python3
"""Whether two builds of the kernels hold the same machine code, kernel by kernel, with no
disassembler: the bytes of each kernel's `.text.<symbol>` section in the cubins (ELF) under two
folders. A shared library built by nvcc carries its cubins in a fatbinary: extract them first
with `cuobjdump -xelf all LIB.so` (in an empty folder).

    python tools/sass_diff.py DIR_A DIR_B [--json out.json]

Prints, per kernel symbol found in both, `same` or `DIFFERENT` (with both sizes), then the
symbols found in one only; exit status 1 when a kernel differs. Relocated operands (addresses of
globals) are zero in both, so two builds of the same code compare equal across link layouts.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path


def text_sections(path: Path) -> dict[str, bytes]:
    """{kernel symbol: bytes of its .text section} of one ELF file (a cubin)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only (cubins are)
        return {}
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_off = heads[shstrndx][4]

    def name(off: int) -> str:
        end = data.index(b"\0", names_off + off)
        return data[names_off + off : end].decode()

    out = {}
    for h in heads:
        n = name(h[0])
        if n.startswith(".text."):
            out[n[len(".text.") :]] = data[h[4] : h[4] + h[5]]
    return out


def collect(folder: Path) -> dict[str, bytes]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            out.update(text_sections(p))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--json", help="write {symbol: same|different|only a|only b} here")
    args = ap.parse_args(argv)
    a, b = collect(args.a), collect(args.b)
    if not a or not b:
        sys.exit(f"no kernels found under {args.a if not a else args.b}")
    verdict, differ = {}, 0
    for sym in sorted(set(a) & set(b)):
        same = a[sym] == b[sym]
        differ += not same
        verdict[sym] = "same" if same else "different"
        sizes = "" if same else f" ({len(a[sym])} and {len(b[sym])} bytes)"
        print(f"{'same' if same else 'DIFFERENT':<9} {sym}{sizes}")
    for sym in sorted(set(a) ^ set(b)):
        verdict[sym] = "only a" if sym in a else "only b"
        print(f"{verdict[sym]:<9} {sym}")
    both = len(set(a) & set(b))
    print(f"\n{both - differ} of {both} kernels in both builds have the same machine code")
    if args.json:
        Path(args.json).write_text(json.dumps(verdict, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
