"""The CUDA kernels of csrc/sm70attn/, compiled by NVRTC at their first use, for the GPU's own
architecture, with no CUDA toolkit.

NVRTC and the CUDA headers come from pip packages of the CUDA major of torch's build, found among
the installed packages (never through CUDA_HOME): for CUDA 12 (torch 2.10 from PyPI, cu126 builds)
`nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-runtime-cu12` (torch's own dependencies) and
`nvidia-cuda-nvcc-cu12` (the `crt/` headers; its ptxas is not used), the extra `cuda12`; for CUDA
13 `nvidia-cuda-nvrtc`, `nvidia-cuda-runtime` and `nvidia-cuda-crt`, the extra `cuda13`.
cuda-bindings, which torch's CUDA builds depend on, drives NVRTC; the binding loads the cubins
and launches them through the driver API (nothing of this module runs on a launch: the binding
keeps each kernel's CUfunction).

A kernel is a family and its integer parameters (`Kernel`); every one the launcher can pick is
listed by `kernels()`, from the registration list csrc/sm70attn/registry.h (its families and
their instances), which the launcher dispatches through. `cubin()` compiles one kernel alone (0.1-1 s; NVRTC releases the GIL, so
threads compile in parallel) and caches it on disk under the build directory of the source
digest, one folder per architecture and NVRTC version; `fetch()` is what the binding calls for a
kernel it has not loaded yet on a device. `gate()` holds a build to the SM70 rules (no spills, 96
KB of shared memory, the register file, no instruction SM70 lacks): `python -m torch_sm70attn
build` runs it for every kernel.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import torch

from . import _jit, toolchain
from ._jit import NVRTC_OPTIONS
from .toolchain import check as _check

log = logging.getLogger("torch_sm70attn")

SMEM_LIMIT = 96 * 1024  # shared memory per block on SM70 (static + dynamic)
REGFILE = 64 * 1024  # registers per SM
# PTX that SM70 lacks (NVRTC's ptxas for sm_70 refuses it too; belt and braces).
FORBIDDEN = re.compile(
    r"\b(cp\.async\S*|ldmatrix\S*|mma\.sync\.aligned\.m16n8k\S*|\S+\.bf16\S*|\S+\.e4m3\S*|\S+\.e5m2\S*)"
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One entry of the registration list (csrc/sm70attn/registry.h: SM70ATTN_FAMILIES)."""

    id: str  # its enumerator (sm70attn::Family)
    name: str  # the loader's family name
    kind: str  # the attention kernel kind it is ("" for the others)
    header: str
    kernel: str  # C++ name in namespace sm70attn; {t}: the traits type
    traits: str  # traits template
    display: str  # {0}..: the parameters; {atom}: the MMA atom's name
    instances: str  # the X-list macro of its instances


ATOM_NAMES = {884: "m8n8k4", 8844: "m8n8k4 row.row", 16816: "m16n8k16"}  # (display names only)

_ENTRY = re.compile(
    r'X\(\s*(\w+),\s*"([^"]*)",\s*"([^"]*)",\s*"([^"]*)",\s*"([^"]*)",\s*(\w+),\s*"([^"]*)",\s*(\w+)\)'
)


def _registry_text() -> str:
    return (_jit.csrc_dir() / "sm70attn" / "registry.h").read_text()


def _macro_body(text: str, macro: str) -> str:
    m = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*)", text)
    if not m:
        raise RuntimeError(f"{macro} not found in registry.h")
    return m.group(1).replace("\\\n", " ")


@functools.cache
def families() -> dict[str, Family]:
    """The registration list's families, by loader name, in the list's order."""
    entries = _ENTRY.findall(_macro_body(_registry_text(), "SM70ATTN_FAMILIES"))
    if not entries:
        raise RuntimeError("no X(...) entry read from SM70ATTN_FAMILIES in registry.h")
    return {e[1]: Family(*e) for e in entries}


FAMILIES = families()


def switch_entries(macro: str) -> list[tuple[int, ...]]:
    """The X(...) entries of one instance list of registry.h, as int tuples: (D, MB, VEC) of
    SM70ATTN_ATTN_KERNELS and SM70ATTN_RF_KERNELS, (D, WPR) of SM70ATTN_COMBINE_KERNELS, () of
    store_kv's."""
    body = _macro_body(_registry_text(), macro)
    return [
        tuple(int(v) for v in e.split(",") if v.strip())
        for e in re.findall(r"X\(([\d,\s]*)\)", body)
    ]


def instances(family: str) -> list[tuple[int, ...]]:
    """The parameters of every listed instance of a family."""
    return switch_entries(FAMILIES[family].instances)


@dataclasses.dataclass(frozen=True)
class Kernel:
    family: str
    params: tuple[int, ...] = ()

    @property
    def header(self) -> str:
        return FAMILIES[self.family].header

    @property
    def traits(self) -> str:
        """The traits type (the launcher's THREADS and SMEM_BYTES)."""
        f = FAMILIES[self.family]
        return f"sm70attn::{f.traits}<{', '.join(map(str, self.params))}>"

    @property
    def expr(self) -> str:
        """The kernel's C++ name, as NVRTC instantiates it."""
        return "sm70attn::" + FAMILIES[self.family].kernel.format(t=self.traits)

    @property
    def name(self) -> str:
        f = FAMILIES[self.family]
        atom = ATOM_NAMES.get(self.params[0], "") if self.params else ""
        return f.display.format(*self.params, atom=atom)


@functools.cache
def kernels() -> tuple[Kernel, ...]:
    """Every kernel the launcher can pick (csrc/launch.h): every instance of every family of the
    registration list, in its order. The m16n8k16 RF kernels and atom check are built for every
    arch: before SM80 they compile to a trap."""
    return tuple(Kernel(name, e) for name in FAMILIES for e in instances(name))


def arch_of(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def archs_from_env(value: str) -> list[str]:
    """TORCH_CUDA_ARCH_LIST's entries ("7.0", "7.0;9.0", "8.6+PTX", "9.0a") as sm_XY names."""
    out = []
    for e in re.split(r"[;\s,]+", value.strip()):
        m = re.fullmatch(r"(\d+)\.(\d+)(a?)(\+PTX)?", e)
        if e and not m:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot read {e!r} (expected e.g. 7.0 or 9.0)")
        if m and f"sm_{m[1]}{m[2]}{m[3]}" not in out:
            out.append(f"sm_{m[1]}{m[2]}{m[3]}")
    return out


# --- Compiling one kernel ------------------------------------------------------------------------
@dataclasses.dataclass
class Compiled:
    kernel: Kernel
    arch: str
    cubin: bytes
    lowered: str  # the kernel's symbol in the cubin
    info: dict  # ptxas: regs, smem_static, stack, spill_st, spill_ld, entries; threads (PTX)
    forbidden: list  # PTX instructions SM70 lacks (checked for sm_70 only)
    seconds: float  # compile time (0 when read from the cache)


def _log_text(nvrtc, prog) -> str:
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = b" " * size
    _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    text = buf.rstrip(b"\0 ").decode(errors="replace")
    # NVRTC 12 warns on every sm_70 compile that the target is deprecated: not news here.
    return "\n".join(ln for ln in text.splitlines() if "are deprecated" not in ln)


def ptxas_info(log_text: str) -> dict:
    """Registers, shared memory, stack and spills from ptxas -v (NVRTC's log)."""

    def num(pattern):
        m = re.search(pattern, log_text)
        return int(m.group(1)) if m else 0

    return {
        "regs": num(r"Used (\d+) registers"),
        "smem_static": num(r"(\d+) bytes smem"),
        "stack": num(r"(\d+) bytes stack frame"),
        "spill_st": num(r"(\d+) bytes spill stores"),
        "spill_ld": num(r"(\d+) bytes spill loads"),
        "entries": len(re.findall(r"Compiling entry function", log_text)),
    }


def compile_program(source: str, arch: str, name_exprs=(), cubin=True):
    """NVRTC: (PTX, cubin or b"", {expr: lowered name}, log) of one program for `arch` (sm_XY:
    PTX and machine code; compute_XY: PTX only). RuntimeError with NVRTC's log on an error."""
    nvrtc, tk = toolchain.nvrtc_module(), toolchain.toolkit()
    src = _jit.staged_sources()
    prog = _check(
        nvrtc.nvrtcCreateProgram(source.encode(), b"k.cu", 0, [], []), "nvrtcCreateProgram"
    )
    try:
        for e in name_exprs:
            _check(nvrtc.nvrtcAddNameExpression(prog, e.encode()), "nvrtcAddNameExpression")
        opts = [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, f"-I{src}"]
        opts += [f"-I{d}" for d in tk.includes]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        text = _log_text(nvrtc, prog)
        if int(res[0]) != 0:
            raise RuntimeError(
                f"torch_sm70attn: NVRTC {tk.version[0]}.{tk.version[1]} could not compile for "
                f"{arch} ({res[0]!r}):\n{text}"
            )
        size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        ptx = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        code = b""
        if cubin and arch.startswith("sm_"):
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            code = b" " * size
            _check(nvrtc.nvrtcGetCUBIN(prog, code), "nvrtcGetCUBIN")
        names = {}
        for e in name_exprs:
            names[e] = _check(nvrtc.nvrtcGetLoweredName(prog, e.encode()), "nvrtcGetLoweredName")
            names[e] = names[e].decode() if isinstance(names[e], bytes) else names[e]
        return ptx.rstrip(b"\0").decode(), code, names, text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_kernel(kernel: Kernel, arch: str) -> Compiled:
    """Compile one kernel alone (its header and one instantiation) to a cubin for `arch`."""
    t0 = time.perf_counter()
    ptx, code, names, text = compile_program(
        f'#include "sm70attn/{kernel.header}"\n', arch, [kernel.expr]
    )
    info = ptxas_info(text)
    m = re.search(r"\.maxntid\s+(\d+)", ptx)
    info["threads"] = int(m.group(1)) if m else 32  # (the atom check: one warp, no bound)
    bad = sorted({m.group(0) for m in FORBIDDEN.finditer(ptx)}) if arch == "sm_70" else []
    return Compiled(kernel, arch, code, names[kernel.expr], info, bad, time.perf_counter() - t0)


# --- The cache -----------------------------------------------------------------------------------
def cache_dir(arch: str) -> Path:
    """<build dir of the source digest>/kernels/<arch>-nvrtc<major.minor>."""
    return _jit.build_dir(_jit.source_digest()) / "kernels" / f"{arch}-{toolchain.toolkit().tag}"


def _file_name(kernel: Kernel) -> str:
    return "_".join([kernel.family, *map(str, kernel.params)])


def _write(path: Path, data: bytes) -> None:
    """Atomically: a reader sees the old file, none, or the whole new one."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cached(kernel: Kernel, arch: str) -> Compiled | None:
    base = cache_dir(arch) / _file_name(kernel)
    try:
        meta = json.loads(base.with_suffix(".json").read_text())
        code = base.with_suffix(".cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("expr") != kernel.expr or len(code) != meta.get("bytes"):
        return None
    return Compiled(kernel, arch, code, meta["lowered"], meta["info"], meta["forbidden"], 0.0)


def cubin(kernel: Kernel, arch: str, *, quiet: bool = False) -> Compiled:
    """The kernel's cubin for `arch`: from the cache, else compiled (with a progress line) and
    cached (the metadata first, then the cubin: a cubin on disk is complete). Two processes that
    compile the same kernel at once write the same bytes."""
    hit = cached(kernel, arch)
    if hit is not None:
        return hit
    out = cache_dir(arch)
    _jit.make_dir(out)
    if not quiet:
        log.warning(
            "torch_sm70attn: compiling %s for %s (NVRTC %d.%d, first use of this kernel, about a second; "
            "cached in %s)",
            kernel.name,
            arch,
            *toolchain.toolkit().version,
            out,
        )
    c = compile_kernel(kernel, arch)
    meta = dict(
        expr=kernel.expr,
        lowered=c.lowered,
        info=c.info,
        forbidden=c.forbidden,
        bytes=len(c.cubin),
        seconds=round(c.seconds, 3),
    )
    base = out / _file_name(kernel)
    _write(base.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    _write(base.with_suffix(".cubin"), c.cubin)
    if not quiet:
        log.info("torch_sm70attn: compiled %s in %.1f s", kernel.name, c.seconds)
    return c


def build(arch: str, jobs: int | None = None, progress=None) -> list[Compiled]:
    """Every kernel for `arch`, compiled (in `jobs` threads) or read from the cache."""
    todo = kernels()
    jobs = jobs or min(8, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(cubin, k, arch, quiet=True): k for k in todo}
        done = {}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            c = fut.result()
            done[c.kernel] = c
            if progress:
                progress(i, len(todo), c)
    return [done[k] for k in todo]


# --- The SM70 gate -------------------------------------------------------------------------------
def dynamic_smem(todo: list[Kernel], arch: str) -> dict[Kernel, int]:
    """The dynamic shared memory the launcher asks for each kernel (its traits' SMEM_BYTES),
    evaluated by NVRTC in one program and read back from its PTX."""
    with_traits = [k for k in todo if k.traits]
    headers = sorted({k.header for k in with_traits})
    src = "".join(f'#include "sm70attn/{h}"\n' for h in headers)
    src += "".join(
        f'extern "C" __device__ long long smem_{i} = {k.traits}::SMEM_BYTES;\n'
        for i, k in enumerate(with_traits)
    )
    ptx, *_ = compile_program(src, "compute_" + arch.removeprefix("sm_"), cubin=False)
    out = dict.fromkeys(todo, 0)
    for i, k in enumerate(with_traits):  # (a zero is declared without an initialiser)
        m = re.search(rf"\bsmem_{i}\s*=\s*(\d+)", ptx)
        out[k] = int(m.group(1)) if m else 0
    return out


def gate(built: list[Compiled]) -> list[str]:
    """The SM70 rules over a build: one entry each, no spill or stack frame, static + dynamic
    shared memory within 96 KB a block, registers x threads within the register file, no PTX
    instruction SM70 lacks. Returns the violations, one line each; records each kernel's dynamic
    shared memory in its info["smem_dyn"] (the CLI's table reads it)."""
    smem = dynamic_smem([c.kernel for c in built], built[0].arch) if built else {}
    errors = []
    for c in built:
        i, name = c.info, c.kernel.name
        if i["entries"] != 1:
            errors.append(f"{name}: ptxas saw {i['entries']} entry functions, expected 1")
        if i["spill_st"] or i["spill_ld"] or i["stack"]:
            errors.append(
                f"{name}: spills ({i['spill_st']} B stored, {i['spill_ld']} B loaded) or a "
                f"{i['stack']} B stack frame"
            )
        if i["smem_static"] + smem[c.kernel] > SMEM_LIMIT:
            errors.append(
                f"{name}: shared memory {i['smem_static'] + smem[c.kernel]} > {SMEM_LIMIT}"
            )
        if i["regs"] * i["threads"] > REGFILE:
            errors.append(f"{name}: registers x threads {i['regs'] * i['threads']} > {REGFILE}")
        if c.forbidden:
            errors.append(f"{name}: instructions {c.arch} lacks: {', '.join(c.forbidden)}")
        c.info["smem_dyn"] = smem[c.kernel]
    return errors


# --- For the binding ------------------------------------------------------------------------------
@functools.cache
def device_arch(device: int) -> str:
    """The architecture NVRTC compiles for on this device (its own: sm_70 on a V100, sm_90 on
    the H200); refuses a torch that cannot drive it."""
    check_torch_arch(device)
    return arch_of(torch.cuda.get_device_capability(device))


def torch_has_code_for(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build with these archs (torch.cuda.get_arch_list()) runs on a GPU of this
    capability: machine code of its major and a minor up to its own, or PTX of an older arch."""
    major, minor = capability
    for a in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)a?", a)
        if not m:
            continue
        M, mi = int(m[2]), int(m[3])
        if m[1] == "sm" and M == major and mi <= minor:
            return True
        if m[1] == "compute" and (M, mi) <= (major, minor):
            return True
    return False


def check_torch_arch(device: int) -> None:
    cap = torch.cuda.get_device_capability(device)
    archs = torch.cuda.get_arch_list()
    if torch_has_code_for(cap, archs):
        return
    name = torch.cuda.get_device_name(device)
    fix = (
        "install torch==2.10.0 or a cu126 build"
        if cap < (7, 5)
        else f"install a torch build whose torch.cuda.get_arch_list() covers {arch_of(cap)}"
    )
    raise RuntimeError(
        f"torch_sm70attn: this torch ({torch.__version__}) has no code for {arch_of(cap)} "
        f"({name}; its archs: {' '.join(archs) or 'none'}); {fix}"
    )


def fetch(family: str, params: tuple, device: int) -> tuple[bytes, str]:
    """(cubin, symbol) of a kernel for `device`'s architecture, compiled at its first use (or
    read from the cache). The binding calls this for a kernel it has not loaded on `device`
    yet, and loads it itself."""
    kernel = Kernel(family, tuple(int(p) for p in params))
    if kernel not in kernels():
        raise RuntimeError(
            f"torch_sm70attn: the binding asked for {kernel}, which registry.h does not list"
        )
    with _compile_lock:  # two threads' first calls compile a kernel once
        c = cubin(kernel, device_arch(device))
    return c.cubin, c.lowered


_compile_lock = threading.Lock()
