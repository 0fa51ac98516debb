"""The NVRTC route (torch_sm70attn/nvrtc.py) on the CPU: the kernel list, the toolkit found among
the installed packages, the cache, the SM70 gate and the refusal of a torch that cannot drive the
GPU. Tests that compile need NVRTC and the CUDA 12 headers (the extra cuda12, which CI installs
beside torch 2.10) and skip without them; CI's `python -m torch_sm70attn build` compiles every
kernel for sm_70 through the same route."""

import logging
import re

import pytest
import torch

from torch_sm70attn import nvrtc, toolchain
from torch_sm70attn.manifest import MANIFEST


def have_nvrtc() -> bool:
    """An NVRTC that compiles for sm_70: CUDA 12's (CUDA 13 dropped sm_70)."""
    try:
        return toolchain.toolkit().version[0] == 12
    except RuntimeError:
        return False


needs_nvrtc = pytest.mark.skipif(not have_nvrtc(), reason="no CUDA 12 NVRTC (the extra cuda12)")


def test_every_listed_kernel_has_one_name_and_the_manifest_its_kernels():
    ks = nvrtc.kernels()
    names = [k.name for k in ks]
    assert len(names) == len(set(names)) == 82
    assert len({k.expr for k in ks}) == len(ks)
    # what the binding checks at load (init): every admitted head dim has its attention kernels
    # for 1..MB rows blocks in both load widths, and its combine kernels
    for d in MANIFEST.head_dims:
        for vec in (8, 16):
            mbs = sorted(
                k.params[1] for k in ks if k.family == "attn" and k.params[::2] == (d, vec)
            )
            assert mbs == list(range(1, len(mbs) + 1)) and len(mbs) >= 4, (d, vec, mbs)
        assert sorted(k.params[1] for k in ks if k.family == "combine" and k.params[0] == d) == [
            1,
            4,
            16,
        ]
        # and paged_attention_varlen's tile loop (64-row tiles, both widths) and combine
        varlen = {k.params for k in ks if k.family == "attn-varlen" and k.params[0] == d}
        assert varlen == {(d, 4, 8), (d, 4, 16)}, (d, varlen)
        assert nvrtc.Kernel("combine-varlen", (d,)) in ks
        # and its prefill kernel on both atoms (m16n8k16: SM80+; a trap before), both widths
        pf = {(k.family, k.params) for k in ks if k.family.startswith("prefill") and k.params[0] == d}
        assert pf == {(f"prefill-{a}", (d, v)) for a in ("m8n8k4", "m16n8k16") for v in (8, 16)}, pf
    assert nvrtc.Kernel("attn", (256, 3, 16)).expr == (
        "sm70attn::paged_attention_kernel<sm70attn::AttnTraits<256, 3, 16>>"
    )
    assert nvrtc.Kernel("mma", (8844,)).name == "mma atom m8n8k4 row.row"


def test_arch_list_reads_torchs_spellings():
    assert nvrtc.archs_from_env("7.0") == ["sm_70"]
    assert nvrtc.archs_from_env(" 7.0;9.0 8.6+PTX 7.0") == ["sm_70", "sm_90", "sm_86"]
    assert nvrtc.archs_from_env("9.0a") == ["sm_90a"]
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        nvrtc.archs_from_env("volta")


CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU128 = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]


def test_which_torch_builds_drive_which_gpus():
    assert not nvrtc.torch_has_code_for((7, 0), CU130)  # PyPI's torch >= 2.11 on a V100
    assert nvrtc.torch_has_code_for((7, 0), CU128)  # torch 2.10.0
    assert nvrtc.torch_has_code_for((8, 9), ["sm_80"])  # same major, older minor
    assert not nvrtc.torch_has_code_for((8, 0), ["sm_86"])
    assert nvrtc.torch_has_code_for((9, 0), ["compute_80"])  # PTX of an older arch
    assert not nvrtc.torch_has_code_for((7, 0), ["compute_75"])


def test_a_torch_without_code_for_the_gpu_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU130)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    with pytest.raises(RuntimeError) as e:
        nvrtc.check_torch_arch(0)
    assert re.search(
        r"this torch \(2\.13\.0\+cu130\) has no code for sm_70 \(Tesla V100.*install "
        r"torch==2\.10\.0 or a cu126 build",
        str(e.value),
    ), e.value
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU128)
    nvrtc.check_torch_arch(0)  # 2.10.0's build: no error


def test_a_missing_header_names_its_package_and_the_extra(monkeypatch, tmp_path):
    (tmp_path / "cuda_runtime" / "include").mkdir(parents=True)
    for h in ("cuda.h", "cuda_runtime_api.h", "cuda_fp16.h", "mma.h"):
        (tmp_path / "cuda_runtime" / "include" / h).write_text("")
    monkeypatch.setattr(toolchain, "_nvidia_dirs", lambda: [tmp_path])
    with pytest.raises(RuntimeError, match=r"crt/mma\.h .*nvidia-cuda-nvcc-cu12.*\[cuda12\]"):
        toolchain.header_dirs(12)
    (tmp_path / "cu13" / "include" / "crt").mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"cuda\.h .*nvidia-cuda-runtime\).*\[cuda13\]"):
        toolchain.header_dirs(13)


def test_fetch_refuses_a_kernel_the_lists_do_not_hold():
    with pytest.raises(RuntimeError, match="registry.h does not list"):
        nvrtc.fetch("attn", (96, 1, 16), 0)


@needs_nvrtc
def test_a_kernel_compiles_once_then_comes_from_the_cache(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TORCH_SM70ATTN_BUILD_DIR", str(tmp_path))
    k = nvrtc.Kernel("store_kv")
    with caplog.at_level(logging.INFO, logger="torch_sm70attn"):
        c = nvrtc.cubin(k, "sm_70")
    assert c.cubin[:4] == b"\x7fELF" and c.seconds > 0 and c.lowered.startswith("_Z")
    assert c.info["regs"] > 0 and c.info["entries"] == 1 and not c.info["spill_st"]
    assert "compiling store_kv for sm_70" in caplog.text  # the progress line of a first use
    caplog.clear()
    again = nvrtc.cubin(k, "sm_70")
    assert again.seconds == 0 and again.cubin == c.cubin and not caplog.text
    files = sorted(p.name for p in nvrtc.cache_dir("sm_70").iterdir())
    assert files == ["store_kv.cubin", "store_kv.json"]  # no temporary file left
    # a cubin cut short (a disk full, a copy interrupted) is compiled again, not loaded
    path = nvrtc.cache_dir("sm_70") / "store_kv.cubin"
    path.write_bytes(c.cubin[:100])
    assert nvrtc.cubin(k, "sm_70").seconds > 0 and path.read_bytes() == c.cubin


@needs_nvrtc
def test_an_unwritable_kernel_cache_names_the_variable(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_SM70ATTN_BUILD_DIR", str(blocker / "builds"))
    with pytest.raises(RuntimeError, match="set TORCH_SM70ATTN_BUILD_DIR to a writable"):
        nvrtc.cubin(nvrtc.Kernel("store_kv"), "sm_70")


@needs_nvrtc
def test_a_compile_error_shows_nvrtcs_log():
    with pytest.raises(RuntimeError, match=r"could not compile for sm_70.*\n.*error"):
        nvrtc.compile_program("__global__ void k() { undeclared(); }\n", "sm_70")


@needs_nvrtc
def test_the_gate_reports_what_breaks_the_sm70_rules(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_SM70ATTN_BUILD_DIR", str(tmp_path))
    ok = nvrtc.compile_kernel(nvrtc.Kernel("attn", (256, 3, 16)), "sm_70")
    assert nvrtc.gate([ok]) == [] and ok.info["smem_dyn"] > 90 * 1024  # 94 KB: within 96
    bad = nvrtc.Compiled(
        ok.kernel,
        "sm_70",
        ok.cubin,
        ok.lowered,
        dict(ok.info, spill_st=8, smem_static=8192, regs=255),
        ["ldmatrix.sync.aligned.m8n8.x4.shared.b16"],
        1.0,
    )
    errors = "\n".join(nvrtc.gate([bad]))
    for what in ("spills (8 B stored", "shared memory", "registers x threads", "ldmatrix"):
        assert what in errors, errors
