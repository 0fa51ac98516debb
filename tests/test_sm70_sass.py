"""tools/sm70_sass.py's reading of an nvdisasm listing (no nvdisasm needed): instructions,
labels, the loop a backward branch closes, and the instruction classes."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sm70_sass  # noqa: E402

LISTING = """
//--------------------- .text._Z1kv --------------------------
.text._Z1kv:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0020*/                   LDG.E.128.SYS R4, [R2] ;
        /*0030*/                   HMMA.884.F32.F32.STEP0 R8, R4.ROW, R6.COL, R8 ;
        /*0040*/                   FFMA R9, R9, R10, R11 ;
        /*0050*/                   IADD3 R2, R2, 0x10, RZ ;
        /*0060*/                   ISETP.GE.AND P1, PT, R2, R3, PT ;
        /*0070*/              @!P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0080*/                   STG.E.SYS [R12], R8 ;
        /*0090*/                   EXIT ;
"""


def test_listing_loops_and_classes():
    kernels = sm70_sass.parse(LISTING)
    assert list(kernels) == ["_Z1kv"]
    insns = kernels["_Z1kv"]
    blocks, succ = sm70_sass.blocks(insns)
    loops = sm70_sass.natural_loops(succ)
    spans = [sorted(x[0] for b in body for x in blocks[b]) for body in loops.values()]
    assert [(s[0], s[-1]) for s in spans] == [(0x20, 0x70)]  # the loop the back edge closes
    r = sm70_sass.analyse(insns)
    k, loop = r["kernel"], r["main_loop"]
    assert k["total"] == 10 and k["ldg"] == 1 and k["stg"] == 1 and k["tensor"] == 1
    assert (loop["total"], loop["ldg"], loop["tensor"], loop["fp32"], loop["int"]) == (
        6,
        1,
        1,
        1,
        2,
    )
    assert loop["control"] == 1 and loop["stg"] == 0 and r["inner_loops"] == []


def test_unroll_step_of_a_loop_counter():
    loop = [
        (0x10, "IADD3", "R123, R123, 0x4, RZ ", False, None, None),
        (0x20, "ISETP", "P0, PT, R123, 0x8, PT ", False, None, ".NE.AND"),
        (0x30, "IADD3", "R5, R5, 0x10, RZ ", False, None, None),  # not compared: an address
    ]
    assert sm70_sass._unroll(loop) == 4
    assert sm70_sass._unroll(loop[1:]) == 1  # no counter found: one iteration a trip


def test_trip_counts_evaluated_in_the_kernels_scope():
    """The bounds of the tile loop's inner loops, for D128 MB4 (NVRTC of the runtime route, the
    extra cuda12), each in the constants of the file its loop is in: KT::DPK = 8 D slices (the
    QK^T tile, paged_attention.cuh), PASSES = 2 softmax passes (a constexpr of softmax.h's
    softmax_tile)."""

    from torch_sm70attn import toolchain

    try:
        major = toolchain.toolkit().version[0]
    except RuntimeError as e:
        pytest.skip(f"no NVRTC (extra cuda12): {e}")
    if major != 12:
        pytest.skip(f"NVRTC {major} does not target sm_70 (extra cuda12)")
    loops = [
        "paged_attention.cuh:78 for (int i = 0; i < KT::DPK; ++i) {",
        "softmax.h:77 for (int k = 0; k < PASSES; ++k) {",
        "paged_attention.cuh:1 while (true) {",
    ]
    traits = "sm70attn::AttnTraits<128, 4, 16>"
    got = sm70_sass.trip_counts("sm_70", traits, "paged_attention.cuh", loops)
    assert got == [8, 2, None]


def test_sm90_loop_counter_and_dropped_instructions():
    """sm_90 steps its counters with VIADD (no RZ operand), and a listing whose addresses jump
    has lost instructions: nvdisasm 11.8 leaves out sm_90 opcodes it cannot decode, which made
    the rolled QK^T loops' counters invisible (checks of 2.50 and 4.50 before)."""
    loop = [
        (0x10, "VIADD", "R77, R77, 0x4 ", False, None, None),
        (0x20, "ISETP", "P0, PT, R77, 0x8, PT ", False, None, ".NE.AND"),
        (0x30, "VIADD", "R85, R79, 0x20 ", False, None, None),  # not a counter: R79 + 32
    ]
    assert sm70_sass._unroll(loop) == 4
    assert sm70_sass.CLASS_OF["VIADD"] == "int"
    assert sm70_sass.missing(loop) == 0
    assert sm70_sass.missing([loop[0], (0x40, "EXIT", "", False, None, None)]) == 2


@pytest.mark.parametrize(
    "op, mods, nbytes",
    [
        ("LDS", ".U.128", 512),
        ("LDS", ".U.64", 256),
        ("LDS", "", 128),
        ("STS", ".U8", 32),
        ("STS", ".128", 512),
        ("LDSM", ".16.M88.4", 512),
        ("LDSM", ".16.MT88.2", 256),
        ("LDG", ".E.128", 0),
    ],
)
def test_shared_memory_bytes_per_warp_instruction(op, mods, nbytes):
    assert sm70_sass.smem_bytes(op, mods) == nbytes
