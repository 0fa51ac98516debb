"""The CUDA attention and combine kernels of csrc/, emulated on the CPU (tests/emu/kernels.cpp):
every traits configuration the shapes below reach, against an FP64 reference, with random
thread schedules between barriers and AddressSanitizer on the global buffers; and the host
launch plan (plan.h) over a grid of shapes."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMU = ROOT / "tests" / "emu"
# Cases of kernels.cpp that take seconds each; the slower ones (splits, manysplits, allcfg,
# padwarps, fuzz) run by hand: see the head of kernels.cpp.
CASES = [
    "plan",
    "decode",
    "verify",
    "rowgroups",
    "d64",
    "vec8",
    "big",
    "odd",
    "bigpage",
    "qmis",
    "edge",
    "determinism",
]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++ to build the kernel emulator")
    exe = tmp_path_factory.mktemp("emu") / "kernels"
    cmd = [cxx, "-std=c++17", "-O1", "-fsanitize=address", f"-I{EMU}", f"-I{ROOT / 'csrc'}"]
    res = subprocess.run(
        [*cmd, str(EMU / "kernels.cpp"), "-o", str(exe)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


@pytest.mark.parametrize("case", CASES)
def test_emulated_kernels_match_the_fp64_reference(emulator, case):
    res = subprocess.run([str(emulator), case], capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "ALL OK" in res.stdout, out[-4000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    checked = [ln for ln in lines if ln.endswith(" ok") or ln.startswith("determinism:")]
    assert checked, out[-4000:]  # the case ran something
