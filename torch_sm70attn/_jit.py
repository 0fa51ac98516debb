"""JIT build of the torch binding (csrc/binding.cpp) with the host C++ compiler and ninja, keyed
by a digest of the sources. No CUDA toolkit: the binding includes the CUDA headers of the pip
packages (torch_sm70attn.toolchain) and links torch's libraries only; the kernels themselves
are compiled by NVRTC at their first use (torch_sm70attn/nvrtc.py) into the same directory.

The digest covers every file under csrc/, the compiler flags and the torch/CUDA versions. It
names the module and its build directory, is compiled into the library, and is compared on
load: a library built from other sources is refused.

The build compiles a copy of csrc/ kept in the build directory (`src/`, made once per digest),
not the installed files: every install of the same sources (two venvs, two checkouts) then
hands torch's builder the same paths and flags, so they share one build instead of rebuilding
it for each other. A build killed half way leaves torch's `lock` file behind, which would make
every later build wait forever: an old one is reported with what to delete.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import torch

from . import toolchain

log = logging.getLogger("torch_sm70attn")

# The C++ standard is torch's own choice (C++17 or later). SM70ATTN_HOST: the kernel headers
# the binding includes (params, traits, plan) are read by a host compiler (params.h).
CXX_FLAGS = ["-O3", "-DSM70ATTN_HOST"]
# What each NVRTC program is compiled with, besides the architecture and include paths. The
# line table (as the nvcc build had: profilers and compute-sanitizer name source lines) changes
# no instruction.
NVRTC_OPTIONS = ("-std=c++17", "-lineinfo", "-Xptxas=-v")


def csrc_dir() -> Path:
    """csrc/ of a source checkout (editable install) or of an installed wheel."""
    here = Path(__file__).resolve().parent
    for d in (here.parent / "csrc", here / "csrc"):
        if (d / "binding.cpp").is_file():
            return d
    raise FileNotFoundError(f"CUDA sources not found next to {here}")


SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")


def _sources(root: Path) -> list[Path]:
    """The files the digest covers, relative to root (a csrc/ tree), in a fixed order."""
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES)


def source_files() -> list[Path]:
    root = csrc_dir()
    return [root / f for f in _sources(root)]


def source_digest() -> str:
    """Sources, flags (the binding's and NVRTC's) and torch's version: the kernels' cubins are
    kept per architecture and NVRTC version below the directory this names."""
    h = hashlib.sha256()
    root = csrc_dir()
    for p in source_files():
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(CXX_FLAGS + list(NVRTC_OPTIONS)).encode())
    h.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return h.hexdigest()[:16]


def module_name(digest: str) -> str:
    return f"sm70attn_{digest}"


def build_dir(digest: str) -> Path:
    base = os.environ.get("TORCH_SM70ATTN_BUILD_DIR")
    if not base:
        try:
            base = Path.home() / ".cache" / "torch_sm70attn"
        except RuntimeError as e:  # no HOME and no passwd entry
            raise RuntimeError(
                f"torch_sm70attn: no home directory for the CUDA build ({e}): set "
                "TORCH_SM70ATTN_BUILD_DIR to a writable directory"
            ) from None
    return Path(base) / module_name(digest)


def make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}-{threading.get_ident()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise RuntimeError(
            f"torch_sm70attn: cannot write the CUDA build directory {path} ({e}): set "
            "TORCH_SM70ATTN_BUILD_DIR to a writable directory"
        ) from None


def same_tree(a: Path, b: Path) -> bool:
    """Whether b holds a's sources (the files the digest covers), byte for byte."""
    files = _sources(a)
    return files == _sources(b) and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def stage_sources(out: Path) -> Path:
    """out/src: a copy of csrc/'s sources (what the digest covers), made once and by one
    process: a copy under a private name is renamed into place, and a loser of the race drops
    its own. Plain file copies (no mode bits: a read-only install's must stay deletable)."""
    src, root = out / "src", csrc_dir()
    if src.is_dir() and same_tree(root, src):
        return src
    if src.exists():  # a partial copy of an older version of this code can be here
        shutil.rmtree(src, ignore_errors=True)
    tmp = out / f"src.tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for f in _sources(root):
        (tmp / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f, tmp / f)
    try:
        os.rename(tmp, src)
    except OSError:  # another process put its copy first
        shutil.rmtree(tmp, ignore_errors=True)
    if not same_tree(root, src):
        raise RuntimeError(f"torch_sm70attn: the staged sources in {src} differ from {root}")
    return src


_staged: dict[str, Path] = {}


def staged_sources() -> Path:
    """The staged copy of csrc/ for this digest (NVRTC compiles the kernels from it too)."""
    digest = source_digest()
    if digest not in _staged:
        out = build_dir(digest)
        make_dir(out)
        _staged[digest] = stage_sources(out)
    return _staged[digest]


STALE_LOCK_S = 1800  # a build takes minutes: a lock this old outlived the build that made it


def check_lock(out: Path) -> None:
    """torch's builder waits, without a word and without end, while `out/lock` exists."""
    lock = out / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        raise RuntimeError(
            f"torch_sm70attn: {lock} is {age / 60:.0f} minutes old: a build of the CUDA kernels "
            "was probably killed half way. If no other process is building them, delete "
            f"{lock} and retry"
        )
    log.warning(
        "torch_sm70attn: another process is building the CUDA kernels in %s; waiting for it "
        "(if none is, a build was killed: delete %s)",
        out,
        lock,
    )


def is_built(digest: str | None = None) -> bool:
    d = digest or source_digest()
    return any(build_dir(d).glob(f"{module_name(d)}*.so"))


def import_cpp_extension():
    """torch.utils.cpp_extension, without the warning its import logs on a machine with no GPU
    ("No CUDA runtime is found, using CUDA_HOME=..."): harmless here, as the binding is built
    by the host compiler alone and its CUDA headers come from pip packages (toolchain.py)."""
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)
    return cpp_extension


@functools.cache
def load():
    """Build (the first time for these sources and this torch, a minute) and load the binding;
    returns the module. Loading registers the CUDA implementations of the sm70attn:: ops
    (TORCH_LIBRARY_IMPL); torch_sm70attn.ops.load_cuda_kernels then hands it its kernel loader.
    """
    cpp_extension = import_cpp_extension()
    if torch.version.cuda is None:
        raise RuntimeError(
            f"torch_sm70attn: this torch ({torch.__version__}) is a CPU-only build: the CUDA "
            "binding needs a CUDA build of torch (on a V100: torch==2.10.0 from PyPI)"
        )
    tk = toolchain.toolkit()
    digest = source_digest()
    name = module_name(digest)
    out = build_dir(digest)
    make_dir(out)
    src = stage_sources(out)
    check_lock(out)
    fresh = not is_built(digest)
    if fresh:
        log.warning(
            "torch_sm70attn: building the C++ binding in %s (host compiler, once per torch "
            "version, about 20 s)...",
            out,
        )
    t0 = time.perf_counter()
    try:
        mod = cpp_extension.load(
            name=name,
            sources=[str(src / "binding.cpp")],
            extra_include_paths=[str(src), *tk.includes],
            extra_cflags=CXX_FLAGS + [f"-DSM70ATTN_DIGEST={digest}"],
            # c10_cuda: streams and device guards (it brings the CUDA runtime with it); the
            # driver is opened at the first launch, and dlopen needs libdl on older glibc
            extra_ldflags=["-lc10_cuda", "-ldl"],
            with_cuda=False,
            build_directory=str(out),
            verbose=False,
        )
    except ImportError as e:  # a truncated library (a killed link) fails here, not in ninja
        raise RuntimeError(
            f"torch_sm70attn: the CUDA binding in {out} does not load ({e}); if a build was "
            f"killed half way, delete {out} and retry"
        ) from e
    if fresh:
        log.warning("torch_sm70attn: C++ binding built in %.1f s", time.perf_counter() - t0)
    if mod.digest() != digest:
        raise RuntimeError(
            f"torch_sm70attn: the CUDA binding at {out} was built from sources with digest "
            f"{mod.digest()}, but this tree's digest is {digest}; delete that directory to rebuild"
        )
    return mod
