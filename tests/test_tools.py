"""tools/ncu_phases.py on synthetic profiler and disassembler output (no GPU, no nvcc)."""

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import ncu_phases  # noqa: E402

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_barrier","stall_wait","stall_barrier (Not Issued)"'
)


def csv_text(rows):
    lines = [
        '"Kernel Name","void sm70attn::paged_attention_kernel<sm70attn::AttnTraits<(int)256, (int)1, (int)16>>(x)"'
    ]
    lines.append(HEADER)
    lines += [f'"{a}","{s}","{st}","0","{n}","{b}","{w}","0"' for a, s, st, n, b, w in rows]
    return "\n".join(lines)


def test_anchors_of_the_kernel_source_are_found_once_and_in_order():
    starts = ncu_phases.source_starts()  # paged_attention.cuh: its pieces, then attend_cta
    assert [name for _, name in starts["paged_attention.cuh"]] == (
        ["prologue", "prologue", "qk", "pv", "epilogue"]
        + ["prologue", "loop", "qk", "softmax", "pv", "epilogue"]
    )
    assert [name for _, name in starts["softmax.h"]][1:] == ["prologue", "softmax", "epilogue"]
    assert [name for _, name in starts["epilogue.h"]][1:] == ["epilogue", "prologue", "epilogue"]
    assert {n for s in starts.values() for _, n in s} == set(ncu_phases.PHASES)


def test_instructions_are_summed_by_phase_with_inlined_headers_following_the_kernel_line():
    source = "\n".join(
        ["x"] * 9
        + [
            "for (int t0 = t_begin; ...)",
            "// S = Q K^T",
            "y",
            "// Online softmax",
            "// O = alpha * O + P V",
        ]
        + ["// Epilogue"]
    )
    anchors = [
        ("loop", "for (int t0 = t_begin"),
        ("qk", "// S = Q K^T"),
        ("softmax", "// Online softmax"),
        ("pv", "// O = alpha * O + P V"),
        ("epilogue", "// Epilogue"),
    ]
    starts = ncu_phases.phase_starts(
        source, anchors
    )  # loop 10, qk 11, softmax 13, pv 14, epilogue 15
    k = "paged_attention.cuh"
    disasm = "\n".join(
        [
            f'\t//## File "/x/{k}", line 3',
            "        /*0000*/                   IMAD R1, R2, R3, RZ ;",
            f'\t//## File "/x/{k}", line 12',
            "        /*0010*/                   LDSM.16.M88.4 R4, [R5] ;",
            '\t//## File "/usr/include/crt/mma.hpp", line 91',  # inlined: counts with qk
            "        /*0020*/                   HMMA.16816.F32 R8, R4, R6, R8 ;",
            '\t//## File "/x/e4m3.h", line 17',
            "        /*0030*/               @P0 LOP3.LUT R9, R9, 0x3f803f80, RZ, 0xc0, !PT ;",
            f'\t//## File "/x/{k}", line 13',
            "        /*0040*/                   SHFL.BFLY PT, R1, R1, 0x4, 0x1f ;",
        ]
    )
    rows = [
        ("0x7f0000000000", "IMAD R1, R2, R3, RZ", 1, 2, 0, 1),
        ("0x7f0000000010", "LDSM.16.M88.4 R4, [R5]", 2, 20, 1, 0),
        ("0x7f0000000020", "HMMA.16816.F32 R8, R4, R6, R8", 3, 20, 0, 3),
        ("0x7f0000000030", "@P0 LOP3.LUT R9, R9, 0x3f803f80, RZ, 0xc0, !PT", 0, 40, 0, 0),
        ("0x7f0000000040", "SHFL.BFLY PT, R1, R1, 0x4, 0x1f", 4, 10, 4, 0),
    ]
    (kernel,) = ncu_phases.read_ncu_csv(csv_text(rows))
    instr, stalls, mismatch = ncu_phases.attribute(kernel, ncu_phases.read_disasm(disasm), starts)
    assert mismatch == 0
    assert instr == Counter({"prologue": 2, "qk": 40, "convert": 40, "softmax": 10})
    assert stalls == Counter({"prologue": 1, "qk": 5, "softmax": 4})
    assert ncu_phases.stall_reasons(kernel) == Counter({"barrier": 5, "wait": 4})
    assert ncu_phases.traits_of(kernel["name"]) == (256, 1, 16)


def test_a_different_build_is_detected():
    rows = [("0x10", "IMAD R1, R2, R3, RZ", 0, 1, 0, 0)]
    (kernel,) = ncu_phases.read_ncu_csv(csv_text(rows))
    disasm = '\t//## File "/x/paged_attention.cuh", line 1\n        /*0000*/                   IADD3 R1, R2, R3, RZ ;'
    *_, mismatch = ncu_phases.attribute(kernel, ncu_phases.read_disasm(disasm), [(0, "prologue")])
    assert mismatch == 1


def test_missing_anchor_is_an_error():
    with pytest.raises(SystemExit, match="found 0 times"):
        ncu_phases.phase_starts("no anchors here")
