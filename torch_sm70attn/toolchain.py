"""The CUDA toolkit torch_sm70attn uses, from pip packages alone: NVRTC (driven through
cuda-bindings) and the CUDA headers of torch's CUDA major, found among the installed packages
(never through CUDA_HOME). The binding's build (`_jit`) includes the headers; `nvrtc` compiles
the kernels with NVRTC.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from pathlib import Path

import torch

# Headers a kernel or the binding includes, and the packages that ship them, by CUDA major.
HEADERS = (
    "cuda.h",
    "cuda_runtime_api.h",
    "cuda_fp16.h",
    "mma.h",
    "crt/mma.h",
    "crt/host_defines.h",
)
PACKAGES = {
    12: {"": "nvidia-cuda-runtime-cu12", "crt/": "nvidia-cuda-nvcc-cu12", "extra": "cuda12"},
    13: {"": "nvidia-cuda-runtime", "crt/": "nvidia-cuda-crt", "extra": "cuda13"},
}


@dataclasses.dataclass(frozen=True)
class Toolkit:
    version: tuple[int, int]  # NVRTC's (major, minor)
    includes: tuple[str, ...]  # CUDA header folders, in search order

    @property
    def tag(self) -> str:
        return f"nvrtc{self.version[0]}.{self.version[1]}"


def _install_hint(major: int) -> str:
    return install_hint(PACKAGES.get(major, PACKAGES[12])["extra"])


def install_hint(extra: str) -> str:
    """The command that installs an extra: the package installs from its source checkout (it is
    not on the package index), so the extra's own requirements, as this install's metadata
    lists them, and the checkout's command."""
    import importlib.metadata

    try:
        reqs = importlib.metadata.requires("torch-sm70attn") or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        reqs = []
    mine = [r.split(";")[0].strip() for r in reqs if f'extra == "{extra}"' in r]
    checkout = f"pip install -e '.[{extra}]' in the torch_sm70attn checkout"
    return f"pip install {' '.join(repr(r) for r in mine)} (or {checkout})" if mine else checkout


def _nvidia_dirs() -> list[Path]:
    """The `nvidia` folders where the CUDA wheels install, in import order: every one on
    sys.path (some CUDA 12 wheels make `nvidia` a regular package, which would hide the others
    from the import system, e.g. wheels added with pip --target)."""
    spec = importlib.util.find_spec("nvidia")
    found = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    found += [Path(p) / "nvidia" for p in sys.path if p and (Path(p) / "nvidia").is_dir()]
    return list(dict.fromkeys(p.resolve() for p in found))


def header_dirs(major: int) -> list[str]:
    """The include folders of the CUDA `major` wheels, in the order the compilers search them;
    a RuntimeError names the package of a missing header."""
    if major not in PACKAGES:
        raise RuntimeError(f"torch_sm70attn: no CUDA {major} packages known (CUDA 12 or 13)")
    subdirs = ["cuda_runtime", "cuda_nvcc"] if major == 12 else [f"cu{major}"]
    incs = [
        str(base / sub / "include")
        for base in _nvidia_dirs()
        for sub in subdirs
        if (base / sub / "include").is_dir()
    ]
    for h in HEADERS:
        if not any(os.path.isfile(os.path.join(d, h)) for d in incs):
            pkg = PACKAGES[major]["crt/" if h.startswith("crt/") else ""]
            raise RuntimeError(
                f"torch_sm70attn: the CUDA {major} header {h} is not installed (package {pkg}): "
                f"{_install_hint(major)}"
            )
    return incs


def nvrtc_module():
    """cuda-bindings' NVRTC module; a RuntimeError says what to install."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        major = int((torch.version.cuda or "12").split(".")[0])
        raise RuntimeError(
            "torch_sm70attn compiles its kernels with NVRTC through cuda-bindings, which is not "
            f"installed: {_install_hint(major)}"
        ) from None
    return nvrtc


def check(res, what: str):
    """The values of a cuda-bindings call after its error code; RuntimeError on an error."""
    err, *values = res
    if int(err) != 0:
        raise RuntimeError(f"torch_sm70attn: {what} failed: {err!r}")
    return values[0] if len(values) == 1 else values


@functools.cache
def toolkit() -> Toolkit:
    """NVRTC (through cuda-bindings) and the headers of its CUDA major."""
    nvrtc = nvrtc_module()
    try:
        version = tuple(check(nvrtc.nvrtcVersion(), "nvrtcVersion"))
    except RuntimeError as e:  # libnvrtc not found: its wheel is missing
        import cuda.bindings

        major = int(cuda.bindings.__version__.split(".")[0])
        raise RuntimeError(
            f"torch_sm70attn: cuda-bindings {cuda.bindings.__version__} finds no NVRTC ({e}): "
            f"{_install_hint(major)}"
        ) from None
    torch_major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else version[0]
    if version[0] != torch_major:
        raise RuntimeError(
            f"torch_sm70attn: NVRTC is CUDA {version[0]}.{version[1]} but torch {torch.__version__} "
            f"is a CUDA {torch.version.cuda} build: install the cuda-bindings and NVRTC of CUDA "
            f"{torch_major}: {_install_hint(torch_major)}"
        )
    return Toolkit(version=version, includes=tuple(header_dirs(version[0])))
