"""The registration list (csrc/sm70attn/registry.h) on the CPU: every kernel family it lists has a
launcher in csrc/launch.h, an emulator launch (tests/emu; tests/test_emulated_kernels.py checks
that its cases launch every family) and a sanitizer cell (tools/sanitize_cells.py), and the
families' names, kinds and instances are written there only (the launcher, the binding, NVRTC's
loader and the switches read them)."""

import re
import sys
from pathlib import Path

from torch_sm70attn import nvrtc

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def code(path: Path) -> str:
    """A C++ file without its comments."""
    return COMMENT.sub(" ", path.read_text())


def test_the_list_reads_back_whole():
    fams = nvrtc.FAMILIES
    ids = [f.id for f in fams.values()]
    assert len(ids) == len(set(ids)) and len(fams) >= 8
    text = code(CSRC / "sm70attn" / "registry.h")
    macro = text[text.index("#define SM70ATTN_FAMILIES(X)") :].split("\n#define", 1)[0]
    assert macro.count("X(") == len(fams), "an entry nvrtc.py cannot read"
    kinds = [f.kind for f in fams.values()]
    n = sum(1 for k in kinds if k)
    assert all(kinds[:n]) and not any(kinds[n:]), "the attention kinds come first"
    for f in fams.values():
        assert nvrtc.instances(f.name), f"{f.name}: no instances"
        assert (CSRC / "sm70attn" / f.header).is_file(), f.header
    assert [k.family for k in nvrtc.kernels()] == [f for f in fams for _ in nvrtc.instances(f)]


def test_every_family_has_a_launcher_in_launch_h():
    launch = code(CSRC / "launch.h")
    for f in nvrtc.FAMILIES.values():
        assert re.search(rf"\b{f.id}\b", launch), (
            f"{f.name}: csrc/launch.h names no kernel of {f.id}"
        )
    # the loader's names come from the list, none is written here
    for f in nvrtc.FAMILIES.values():
        assert f'"{f.name}"' not in launch, f.name


def test_every_family_has_an_emulator_launch_and_the_emulator_a_case_for_it():
    emu = code(ROOT / "tests" / "emu" / "kernel_shard.cpp") + code(
        ROOT / "tests" / "emu" / "kernels.cpp"
    )
    for f in nvrtc.FAMILIES.values():
        assert re.search(rf"emu_ran\([^;]*\b{f.id}\b", emu), (
            f"{f.name}: tests/emu never launches {f.id}"
        )
    src = (ROOT / "tests" / "test_emulated_kernels.py").read_text()
    assert "def test_the_cases_launch_every_family_of_the_registration_list" in src


def test_every_family_has_a_sanitizer_cell():
    sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests")]
    try:
        import sanitize_cells
    finally:
        del sys.path[:2]
    cov = sanitize_cells.coverage()
    assert set(cov) == set(nvrtc.FAMILIES)
    assert all(cov.values()), sorted(f for f, cells in cov.items() if not cells)


def test_names_kinds_and_instances_are_written_in_registry_h_only():
    strings = {f.name for f in nvrtc.FAMILIES.values()} | {
        f.kind for f in nvrtc.FAMILIES.values() if f.kind
    }
    lists = {f.instances for f in nvrtc.FAMILIES.values()}
    for path in [
        CSRC / "launch.h",
        *sorted((CSRC / "binding").glob("*.h")),
        CSRC / "binding.cpp",
    ] + sorted(p for p in (CSRC / "sm70attn").iterdir() if p.name != "registry.h"):
        text = re.sub(r'\bm\.(impl|def)\("\w+"', "", code(path))  # (the ops' names: store_kv)
        assert not [s for s in strings if f'"{s}"' in text], path
        assert not [m for m in lists if re.search(rf"\b{m}\b", text)], path
    nv = (ROOT / "torch_sm70attn" / "nvrtc.py").read_text()
    assert not [s for s in strings if f'"{s}"' in nv]
