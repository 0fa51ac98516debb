"""JIT build of the CUDA library (csrc/) with ninja, keyed by a digest of its sources.

The digest covers every file under csrc/, the compiler flags, the target architectures and
the torch/CUDA versions. It names the module and its build directory, is compiled into the
library, and is compared on load: a library built from other sources is refused.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger("torch_sm70attn")

# The C++ standard is torch's own choice (C++17 or later).
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]


def csrc_dir() -> Path:
    """csrc/ of a source checkout (editable install) or of an installed wheel."""
    here = Path(__file__).resolve().parent
    for d in (here.parent / "csrc", here / "csrc"):
        if (d / "binding.cu").is_file():
            return d
    raise FileNotFoundError(f"CUDA sources not found next to {here}")


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set (as torch's builder honours it), else the current GPU."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "none"


def source_files() -> list[Path]:
    root = csrc_dir()
    return sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp"))


def source_digest(arch: str | None = None) -> str:
    h = hashlib.sha256()
    root = csrc_dir()
    for p in source_files():
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CUDA_FLAGS).encode())
    h.update((arch or arch_list()).encode())
    h.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return h.hexdigest()[:16]


def module_name(digest: str) -> str:
    return f"sm70attn_{digest}"


def build_dir(digest: str) -> Path:
    base = os.environ.get("TORCH_SM70ATTN_BUILD_DIR") or Path.home() / ".cache" / "torch_sm70attn"
    return Path(base) / module_name(digest)


def is_built(digest: str | None = None) -> bool:
    d = digest or source_digest()
    return any(build_dir(d).glob(f"{module_name(d)}*.so"))


@functools.cache
def load():
    """Build (first time, about a minute) and load the CUDA library; returns the module.

    Loading registers the CUDA kernels of the sm70attn:: ops (TORCH_LIBRARY_IMPL).
    """
    from torch.utils import cpp_extension

    digest = source_digest()
    name = module_name(digest)
    out = build_dir(digest)
    out.mkdir(parents=True, exist_ok=True)
    fresh = not is_built(digest)
    if fresh:
        log.warning(
            "torch_sm70attn: building the CUDA kernels for arch %s in %s (about a minute)...",
            arch_list(),
            out,
        )
    t0 = time.perf_counter()
    root = csrc_dir()
    mod = cpp_extension.load(
        name=name,
        sources=[str(root / "binding.cu")],
        extra_include_paths=[str(root)],
        extra_cuda_cflags=CUDA_FLAGS + [f"-DSM70ATTN_DIGEST={digest}"],
        build_directory=str(out),
        verbose=False,
    )
    if fresh:
        log.warning("torch_sm70attn: CUDA kernels built in %.1f s", time.perf_counter() - t0)
    if mod.digest() != digest:
        raise RuntimeError(
            f"torch_sm70attn: the CUDA library at {out} was built from sources with digest "
            f"{mod.digest()}, but this tree's digest is {digest}; delete that directory to rebuild"
        )
    return mod
