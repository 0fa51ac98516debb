"""The CUDA attention and combine kernels of csrc/, emulated on the CPU (tests/emu/kernels.cpp):
every traits configuration the shapes below reach, against an FP64 reference, with random
thread schedules between barriers and AddressSanitizer on the global buffers; and the host
launch plan (plan.h) over a grid of shapes.

One build serves every case: the kernels compile in one shard per core (kernel_shard.cpp) beside
kernels.cpp, all at once; then the cases run as processes, one per core, and each test checks
its own case's output. Every family of the registration list (csrc/sm70attn/registry.h) is
launched by one of the cases at least."""

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torch_sm70attn import nvrtc

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "emu"
# Cases of kernels.cpp that take seconds each, slowest first (they start first); the slower ones
# (splits, manysplits, allcfg, padwarps, fuzz) run by hand: see the head of kernels.cpp.
CASES = [
    "prefill",
    "rfkinds",
    "varlen",
    "rffuzz",
    "rfrescale",
    "tinyv",
    "determinism",
    "qmis",
    "big",
    "bigpage",
    "edge",
    "verify",
    "rowgroups",
    "decode",
    "odd",
    "d64",
    "vec8",
    "combine",
    "atoms",
    "storekv",
    "nanrow",
    "plan",
]
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SHARDS = min(CORES, 8)  # each shard repeats a second or two of parsing
# -Og: the kernels build in under half the time of -O1 and run about as fast (-O0: twice as slow).
FLAGS = ["-std=c++17", "-Og", "-fsanitize=address", f"-I{EMU}", f"-I{ROOT / 'csrc'}"]


def run(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def build(cxx: str, out: Path) -> Path:
    """Compiles kernels.cpp and every kernel shard at once, then links them."""
    units = {"kernels.o": [str(EMU / "kernels.cpp")]}
    for i in range(SHARDS):
        shard = [f"-DEMU_SHARDS={SHARDS}", f"-DEMU_SHARD={i}", str(EMU / "kernel_shard.cpp")]
        units[f"shard{i}.o"] = shard
    compiles = [[cxx, *FLAGS, "-c", *args, "-o", str(out / obj)] for obj, args in units.items()]
    with ThreadPoolExecutor(len(compiles)) as pool:
        for res in pool.map(run, compiles):
            assert res.returncode == 0, res.stderr[-4000:]
    exe = out / "kernels"
    res = run([cxx, "-fsanitize=address", *(str(out / obj) for obj in units), "-o", str(exe)])
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def emulator_runs(request, tmp_path_factory):
    """Builds the emulator and starts the selected cases; maps each case to its pending run."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ to build the kernel emulator")
    exe = build(cxx, tmp_path_factory.mktemp("emu"))
    selected = {
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    pool = ThreadPoolExecutor(CORES)
    yield {case: pool.submit(run, [str(exe), case]) for case in CASES if case in selected}
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("case", CASES)
def test_emulated_kernels_match_the_fp64_reference(emulator_runs, case):
    res = emulator_runs[case].result()
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "ALL OK" in res.stdout, out[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    checked = [ln for ln in lines if ln.endswith(" ok") or ln.startswith("determinism:")]
    assert checked, out[-4000:]  # the case ran something


def test_the_cases_launch_every_family_of_the_registration_list(emulator_runs):
    """Each run prints the families it launched ("families: ..."); together the cases launch
    every family registry.h lists (a new family needs its emulator launcher and a case)."""
    if set(emulator_runs) != set(CASES):
        pytest.skip("needs every case of CASES selected")
    ran = set()
    for res in (run.result() for run in emulator_runs.values()):
        m = re.search(r"^families:(.*)$", res.stdout, re.M)
        ran |= set(m.group(1).split()) if m else set()
    assert ran == set(nvrtc.FAMILIES), sorted(set(nvrtc.FAMILIES) - ran)
