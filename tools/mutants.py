"""Shows that CPU tests fail when the code they guard is wrong: runs pytest over a copy of this
checkout with one bug written into it (a mutant), and reports which tests failed. A mutant that
no selected test kills is a hole in the tests. Also runs them with the float16 GEMMs emulated to
round with the number of rows (`--row-gemms`), as oneDNN's do on CPUs with AVX512-FP16 or AMX,
to show which tests hold on such a CPU.

    python tools/mutants.py -k "beam or assistant" tests/test_transformers_batch.py
    python tools/mutants.py --row-gemms tests/test_transformers_batch.py
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (file, text, replacement); each text must occur exactly once.
MUTANTS = {
    "no-beam-reorder": (
        "torch_sm70attn/integrations/transformers.py",
        "self.slot_table.reorder(beam_idx, pools)",
        "pass",
    ),
    "k-scale-2%-off": (
        "torch_sm70attn/paging.py",
        "scale=scale, k_scale=ks, v_scale=vs)",
        "scale=scale, k_scale=ks * 1.02, v_scale=vs)",
    ),
    "mask-one-short": (
        "torch_sm70attn/paging.py",
        "sa.paged_attention(query, kc, vc, table, lens,",
        "sa.paged_attention(query, kc, vc, table, lens - (query.shape[2] > 1),",
    ),
    "accept-one-more": (
        "torch_sm70attn/integrations/speculative.py",
        ".int().cumprod(1).sum(1)",
        ".int().cumprod(1).sum(1).add(1).clamp(max=rows - 1)",
    ),
    "accept-one-fewer": (
        "torch_sm70attn/integrations/speculative.py",
        ".int().cumprod(1).sum(1)",
        ".int().cumprod(1).sum(1).sub(1).clamp(min=0)",
    ),
}

ROW_GEMMS = """
import torch, torch.nn.functional as F
_plain = F.linear
def _linear(x, w, b=None):  # float16 partial sums over K blocks whose size depends on the rows
    rows = x.numel() // max(x.shape[-1], 1)
    if rows <= 1 or x.dtype != torch.float16:
        return _plain(x, w, b)
    c = 16 + (rows % 4) * 8
    out = sum(_plain(x[..., s : s + c], w[:, s : s + c]) for s in range(0, x.shape[-1], c))
    return out if b is None else out + b
F.linear = _linear
"""


def run(tree: Path, pytest_args: list[str]) -> tuple[list[str], str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", p.stdout, re.M)
    tail = (p.stdout.strip().splitlines() or [""])[-1]
    return failed, tail


def copy_tree(dst: Path) -> None:
    ignore = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT, dst, ignore=ignore, dirs_exist_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=sorted(MUTANTS), help="these mutants")
    ap.add_argument("--row-gemms", action="store_true", help="no mutant: emulated GEMMs")
    args, pytest_args = ap.parse_known_args(argv)
    pytest_args = pytest_args or ["tests/test_transformers_batch.py"]
    survivors = 0
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(tree)
        if args.row_gemms:
            (tree / "tests" / "conftest.py").write_text(
                ROW_GEMMS + (ROOT / "tests" / "conftest.py").read_text()
            )
            failed, tail = run(tree, pytest_args)
            print(f"row-dependent float16 GEMMs: {tail}")
            for f in failed:
                print(f"  failed {f}")
            return 1 if failed else 0
        for name in args.only or MUTANTS:
            path, old, new = MUTANTS[name]
            src = (ROOT / path).read_text()
            if src.count(old) != 1:
                sys.exit(f"mutant {name}: {old!r} occurs {src.count(old)} times in {path}")
            (tree / path).write_text(src.replace(old, new))
            try:
                failed, tail = run(tree, pytest_args)
            finally:
                (tree / path).write_text(src)
            survivors += not failed
            print(f"{name}: {'killed' if failed else 'SURVIVED'} ({tail})")
            for f in failed:
                print(f"  failed {f}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
