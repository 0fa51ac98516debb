#!/usr/bin/env python3
"""SM70 compile gate: build every kernel the binding can launch for sm_70, on a CPU-only machine.

nvcc 13 no longer targets sm_70, so this uses the CUDA 12.9 NVRTC and ptxas wheels (no torch,
no GPU, no cuda-python):

    pip install "nvidia-cuda-nvrtc-cu12==12.9.*" "nvidia-cuda-nvcc-cu12==12.9.*" \
                "nvidia-cuda-runtime-cu12==12.9.*"      # or: pip install -e '.[sm70check]'
    python tools/sm70_check.py [--arch sm_70] [--jobs 2]

The kernel list is parsed from csrc/sm70attn/static_switch.h, whose X(...) lists are also what
the launcher dispatches through, plus store_kv. Each kernel is compiled alone with NVRTC to PTX
and assembled with `ptxas -v`. The dynamic shared memory the launcher requests is read from the
traits (compiled into the PTX as a constant). Exit status 1 on a compile error (ptxas rejects
instructions the arch lacks), any spill or stack frame, shared memory (static + dynamic) over
96 KB per block, or registers x threads over the 64K register file.
"""

import argparse
import concurrent.futures
import ctypes
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
SWITCH = os.path.join(CSRC, "sm70attn", "static_switch.h")
SMEM_LIMIT = 96 * 1024
REGFILE = 64 * 1024
# Belt and braces: PTX that SM70 lacks (ptxas for sm_70 rejects it too).
FORBIDDEN = re.compile(
    r"\b(cp\.async\S*|ldmatrix\S*|mma\.sync\.aligned\.m16n8k\S*|\S+\.bf16\S*|\S+\.e4m3\S*|\S+\.e5m2\S*)"
)
ATTN = "template __global__ void sm70attn::paged_attention_kernel<{}>(sm70attn::PagedAttnParams);"
ATTN_RF = (
    "template __global__ void sm70attn::paged_attention_rf_kernel<{}, sm70attn::{}>"
    "(sm70attn::PagedAttnParams);"
)
COMBINE = "template __global__ void sm70attn::combine_kernel<{}>(sm70attn::PagedAttnParams);"
MMA_CHECK = (
    "template __global__ void sm70attn::mma_check_kernel<{}>"
    "(const __half*, const __half*, const float*, float*);"
)


def wheel_paths():
    """libnvrtc, ptxas and the include dirs from the installed nvidia-*-cu12 wheels."""
    try:
        import nvidia  # namespace package of the CUDA wheels
    except ImportError:
        sys.exit("the CUDA 12.9 wheels are not installed: see the top of tools/sm70_check.py")
    for base in nvidia.__path__:
        nvrtc = os.path.join(base, "cuda_nvrtc", "lib", "libnvrtc.so.12")
        ptxas = os.path.join(base, "cuda_nvcc", "bin", "ptxas")
        incs = [
            os.path.join(base, "cuda_runtime", "include"),
            os.path.join(base, "cuda_nvcc", "include"),
        ]
        if os.path.exists(nvrtc) and os.path.exists(ptxas) and all(map(os.path.isdir, incs)):
            return nvrtc, ptxas, incs
    sys.exit(f"libnvrtc.so.12, ptxas or the CUDA headers not found under {list(nvidia.__path__)}")


def switch_entries(macro: str) -> list[tuple[int, ...]]:
    """The X(...) entries of one kernel list of static_switch.h, as int tuples: (D, MB, VEC) of
    SM70ATTN_ATTN_KERNELS and SM70ATTN_RF_KERNELS, (D, WPR) of SM70ATTN_COMBINE_KERNELS."""
    text = open(SWITCH).read()
    m = re.search(rf"#define {macro}\(X\)((?:.*\\\n)*.*)", text)
    if not m:
        sys.exit(f"{macro} not found in {SWITCH}")
    return [tuple(map(int, e.split(","))) for e in re.findall(r"X\(([\d,\s]+)\)", m.group(1))]


def kernel_list():
    """[(name, header, explicit instantiation, traits type or None)] of every launchable kernel."""
    out = []
    for d, mb, vec in switch_entries("SM70ATTN_ATTN_KERNELS"):
        kt = f"sm70attn::AttnTraits<{d}, {mb}, {vec}>"
        out.append((f"attn D{d} MB{mb} VEC{vec}", "paged_attention.cuh", ATTN.format(kt), kt))
    # The register-fragment kernels on SM70's atom; the binding builds their m16n8k16 twins for
    # every arch too, so before SM80 those must compile (to a trap).
    for d, mb, vec in switch_entries("SM70ATTN_RF_KERNELS"):
        kt = f"sm70attn::AttnRfTraits<{d}, {mb}, {vec}>"
        for atom, tag in (("MmaM8N8K4", "m8n8k4"), ("MmaM16N8K16", "m16n8k16")):
            inst = ATTN_RF.format(kt, atom)
            out.append((f"attn-rf D{d} MB{mb} VEC{vec} {tag}", "paged_attention_rf.cuh", inst, kt))
    for d, wpr in switch_entries("SM70ATTN_COMBINE_KERNELS"):
        ct = f"sm70attn::CombineTraits<{d}, {wpr}>"
        out.append((f"combine D{d} WPR{wpr}", "combine.cuh", COMBINE.format(ct), ct))
    out.append(("store_kv", "store_kv.cuh", "", None))
    out.append(("mma atom m8n8k4", "mma_check.cuh", MMA_CHECK.format("sm70attn::MmaM8N8K4"), None))
    out.append(
        (
            "mma atom m8n8k4 row.row",
            "mma_check.cuh",
            MMA_CHECK.format("sm70attn::MmaM8N8K4RowRow"),
            None,
        )
    )
    # the binding builds this one for every arch: before SM80 it must compile (to a trap)
    out.append(
        ("mma atom m16n8k16", "mma_check.cuh", MMA_CHECK.format("sm70attn::MmaM16N8K16"), None)
    )
    return out


def nvrtc_ptx(nvrtc_path, incs, arch, name, source, extra=()):
    """PTX of one program (`extra`: more NVRTC options); RuntimeError with the log on a
    compile error."""
    lib = ctypes.CDLL(nvrtc_path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def check(res, what):
        if res != 0:
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(res).decode()}")

    check(
        lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
        "create",
    )
    opts = [f"--gpu-architecture=compute_{arch[3:]}", "-std=c++17", "-I" + CSRC] + [
        "-I" + i for i in incs
    ]
    opts += list(extra)
    res = lib.nvrtcCompileProgram(
        prog, len(opts), (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    )
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    try:
        check(res, "NVRTC\n" + log.value.decode())
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetPTX(prog, ptx), "PTX")
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def check_kernel(args):
    """Compile and assemble one kernel (in a worker process); returns a result dict."""
    (name, header, inst, traits), arch, nvrtc_path, ptxas, incs = args
    t0 = time.time()
    r = {"name": name, "errors": [], "smem_dyn": 0, "threads": 0}
    src = f'#include "sm70attn/{header}"\n{inst}\n'
    if traits:  # what the launcher requests, straight from the traits
        src += f'extern "C" __device__ int sm70attn_smem_dyn = {traits}::SMEM_BYTES;\n'
        src += f'extern "C" __device__ int sm70attn_threads = {traits}::THREADS;\n'
    try:
        ptx = nvrtc_ptx(nvrtc_path, incs, arch, name.replace(" ", "_") + ".cu", src)
    except RuntimeError as e:
        r["errors"].append(str(e))
        return r
    bad = sorted({m.group(0) for m in FORBIDDEN.finditer(ptx)})
    if bad:
        r["errors"].append(f"instructions {arch} lacks: {', '.join(bad)}")
    for key, var in (("smem_dyn", "sm70attn_smem_dyn"), ("threads", "sm70attn_threads")):
        m = re.search(rf"{var}\s*=\s*(\d+)", ptx)
        r[key] = int(m.group(1)) if m else 0
    if not r["threads"]:
        m = re.search(r"\.maxntid\s+(\d+)", ptx)
        r["threads"] = int(m.group(1)) if m else 0
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [ptxas, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "k.cubin")]
        p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        r["errors"].append("ptxas:\n" + p.stderr)
        return r
    info = p.stderr
    n_entries = len(re.findall(r"Compiling entry function", info))
    if n_entries != 1:
        r["errors"].append(f"expected one entry function, ptxas saw {n_entries}")

    def num(pattern):
        m = re.search(pattern, info)
        return int(m.group(1)) if m else 0

    r["regs"] = num(r"Used (\d+) registers")
    r["smem_static"] = num(r"(\d+) bytes smem")
    r["stack"] = num(r"(\d+) bytes stack frame")
    r["spill_st"] = num(r"(\d+) bytes spill stores")
    r["spill_ld"] = num(r"(\d+) bytes spill loads")
    if r["spill_st"] or r["spill_ld"] or r["stack"]:
        r["errors"].append("register spills / stack frame")
    smem = r["smem_static"] + r["smem_dyn"]
    if smem > SMEM_LIMIT:
        r["errors"].append(f"shared memory {smem} > {SMEM_LIMIT}")
    if r["regs"] * r["threads"] > REGFILE:
        r["errors"].append(f"registers x threads {r['regs'] * r['threads']} > {REGFILE}")
    r["seconds"] = time.time() - t0
    return r


def main():
    ap = argparse.ArgumentParser(description="SM70 compile gate for the sm70attn kernels (no GPU).")
    ap.add_argument("--arch", default="sm_70", help="ptxas target, default sm_70")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    args = ap.parse_args()
    if not re.fullmatch(r"sm_\d+a?", args.arch):
        sys.exit("--arch must look like sm_70")
    nvrtc, ptxas, incs = wheel_paths()
    kernels = kernel_list()
    print(f"{len(kernels)} kernels for {args.arch}, {args.jobs} jobs, NVRTC {nvrtc}", flush=True)
    t0 = time.time()
    results = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(check_kernel, (k, args.arch, nvrtc, ptxas, incs)) for k in kernels]
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            r = fut.result()
            results[r["name"]] = r
            took = f"({r['seconds']:.1f}s)" if "seconds" in r else ""
            print(
                f"[{i:2d}/{len(kernels)}] {r['name']:<22} {'FAIL' if r['errors'] else 'ok'} {took}",
                flush=True,
            )

    cols = ("threads", "regs", "smem_static", "smem_dyn", "stack", "spill_st", "spill_ld")
    head = f"{'kernel':<22}" + "".join(f"{c:>12}" for c in cols)
    print("\n" + head + "\n" + "-" * len(head))
    errors = 0
    for name, *_ in kernels:
        r = results[name]
        row = "".join(f"{r[c]:>12}" for c in cols) if "regs" in r else "  compile error"
        print(f"{name:<22}{row}")
        for e in r["errors"]:
            errors += 1
            print("    ERROR: " + e.replace("\n", "\n    "))
    verdict = "FAIL" if errors else "PASS"
    print(
        f"\n{verdict}: {len(kernels)} kernels for {args.arch}, {errors} errors, {time.time() - t0:.0f} s"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
