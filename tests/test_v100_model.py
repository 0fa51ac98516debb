"""tools/v100_model.py on the committed H200 measurements (docs/data): its replica of the launch
plan and of the occupancy rules against what the GPU runs recorded, the split chunking, and the
calibration that docs/perf.md publishes (every H200 cell within 25%)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import v100_model as vm  # noqa: E402

RUNS = vm.load_runs()
SASS = vm.load_sass()


def test_the_runs_cover_both_geometries_and_grids():
    kinds = {(c["D"], c["G"], c["H_kv"], grid) for c, _, _, grid in RUNS}
    assert kinds == {
        (256, 6, 1, "full"),
        (128, 4, 8, "full"),
        (256, 6, 1, "v100"),
        (128, 4, 8, "v100"),
    }
    assert len(RUNS) == 224 + 32 + 64 and all(ms > 0 for _, ms, _, _ in RUNS)
    # the register-fragment twin's runs: D256 Q8 (MB3) and Q4 (MB2) on both grids, 2 CTAs per SM
    rf = [(c, rec) for c, _, rec, _ in RUNS if vm.kind_of(rec) == "rf"]
    assert len(rf) == 64 and all(rec["ctas_per_sm"] == 2 for _, rec in rf)
    assert sorted((c["Q"], rec["mb"]) for c, rec in rf) == [(4, 2)] * 32 + [(8, 3)] * 32
    # the WMMA kernel's MB2 cells, side by side with the twin's: one CTA per SM on both grids
    mb2 = [rec for c, _, rec, _ in RUNS if vm.kind_of(rec) == "wmma" and c["Q"] == 4]
    assert len(mb2) == 32 and all(rec["mb"] == 2 and rec["ctas_per_sm"] == 1 for rec in mb2)


def test_sass_summary_is_of_these_kernels():
    """docs/data/sass.json, which every V100 figure comes from, was built from today's kernel
    headers (it went stale once: the combine's NaN guard was not in it for a session)."""
    assert SASS["kernel_sources"] == vm.kernel_sources_digest(), (
        "docs/data/sass.json is older than csrc/sm70attn/: rebuild it with "
        "`python tools/v100_model.py --sass ...` (its docstring says where the disassemblers are)"
    )


@pytest.mark.parametrize("grid", ["full", "v100"])
def test_plan_replica_equals_the_plans_the_gpu_made(grid):
    n = 0
    for c, _, rec, g in RUNS:
        if g != grid:
            continue
        cap = vm.cdiv(c["ctx"], c["page"]) * c["page"]
        got = vm.plan(
            c["B"],
            c["G"] * c["H_kv"],
            c["H_kv"],
            c["Q"],
            c["D"],
            cap,
            rec["num_sms"],
            rec["ctas_per_sm"],
        )
        assert got == {k: rec[k] for k in ("mb", "row_groups", "num_splits")}, (c, rec)
        n += 1
    assert n == 112 + 16 + 32  # the calibration grid, the twin's D256 Q8 cells, the MB2 cells


def test_occupancy_rules_equal_the_h200s_and_the_v100_grid_emulation():
    """H200: the occupancy calculator's answer (sm_90 registers, 228 KB) is what the launcher
    measured; the V100-shaped grid holds min(that, 96 KB / the kernel's shared memory)."""
    h200 = vm.GPUS["H200"]
    for c, _, rec, grid in RUNS:
        k = SASS["sm_90"][vm.kernel_name(c["D"], rec["mb"], vm.kind_of(rec), "sm_90")]
        own = vm.occupancy(k["regs"], k["threads"], k["smem"], h200)
        want = own if grid == "full" else min(own, 98304 // k["smem"])
        assert rec["ctas_per_sm"] == want, (c, rec)


def test_v100_occupancy_from_sm70_registers_and_96_kb():
    v100 = vm.GPUS["V100"]
    k = SASS["sm_70"]["attn D256 MB3 VEC16"]  # 93.6 KB of shared memory: one CTA
    assert vm.occupancy(k["regs"], k["threads"], k["smem"], v100) == 1
    k = SASS["sm_70"]["attn-rf D256 MB3 VEC16 m8n8k4"]  # 46 KB and 80 registers: two
    assert vm.occupancy(k["regs"], k["threads"], k["smem"], v100) == 2
    k = SASS["sm_70"]["attn D256 MB1 VEC16"]  # 47 KB: two
    assert vm.occupancy(k["regs"], k["threads"], k["smem"], v100) == 2


def test_combine_grids_equal_the_launches_ncu_recorded():
    """The model's combine CTAs (16 / WPR rows and 64 columns each, WPR from the split count as
    traits.h picks it) are the grids the H200 launched after each attention kernel."""
    import json

    splits, n, wprs = None, 0, set()
    for r in json.load(open(Path(vm.DATA) / "h200_ncu.json")):
        if r["kernel"] == "attn":
            splits = r["grid"][1]
            continue
        c = r["cell"]
        wpr = vm.combine_warps_per_row(splits)
        rows = c["B"] * c["G"] * c["H_kv"] * c["Q"]
        assert r["grid"] == [vm.cdiv(rows, 16 // wpr), c["D"] // vm.COMBINE_CW], (c, splits)
        n, wprs = n + 1, wprs | {wpr}
    assert n >= 10 and wprs == {1, 4, 16}, (n, wprs)


@pytest.mark.parametrize(
    "length, splits, n", [(131072, 396, 32), (8240, 10, 64), (1000, 7, 32), (5, 4, 32)]
)
def test_split_tiles_cover_the_context_like_the_kernel(length, splits, n):
    tiles = vm.splits_tiles(length, splits, n)
    chunk = vm.cdiv(vm.cdiv(length, splits), n) * n
    assert len(tiles) == splits and all(t <= chunk // n for t in tiles)
    assert sum(min(t * n, max(0, length - s * chunk)) for s, t in enumerate(tiles)) == length


def test_rounds_in_launch_order_without_empty_ctas():
    assert vm.rounds((2,) * 10, 1, 5) == [(5, 2), (5, 2)]
    assert vm.rounds((2,) * 11, 1, 5) == [(5, 2), (5, 2), (1, 2)]  # an 11th CTA: a third round
    assert vm.rounds((2, 2), 5, 5) == [(5, 2), (5, 2)]  # 10 CTAs: copies of each split
    assert vm.rounds((3, 3, 1), 2, 4) == [(4, 3), (2, 1)]  # the short last split comes last
    # B1 Q4 32K, the twin on 80 SMs: 85 splits of 13 tiles, the last 6 empty: 79 CTAs, one round
    assert vm.rounds(vm.splits_tiles(32768, 85, 32), 1, 160) == [(79, 13)]
    # B4 Q8 32K, the twin on 80 SMs: 42 splits x 4, 164 with tiles on 160 slots
    assert vm.rounds(vm.splits_tiles(32768, 42, 32), 4, 160) == [(160, 25), (4, 24)]
    assert vm.rounds((0, 0), 3, 4) == []


@pytest.fixture(scope="module")
def fitted():
    dyn = vm.dynamic_scale(SASS)
    return vm.fit(RUNS, SASS, dyn), dyn


def test_calibration_reproduces_the_published_errors(fitted):
    """The fit on every H200 cell (both grids) misses none by more than 25%, nor does a fit on
    the whole-GPU grid alone on the held-out V100-shaped grid: the conditions under which
    docs/perf.md quotes V100 figures; its published medians and worst cases (2.2% / 16.2%,
    held out 2.8% / 17.2%) to their rounding; and the V100 range is ordered. The headline cell
    takes the register-fragment kernel on a V100 (two CTAs per SM), the WMMA kernel on the
    H200; 64 of the cells are the register-fragment kernel's m16n8k16 twin (MB3 and MB2)."""
    prm, dyn = fitted
    assert sum(vm.kind_of(r[2]) == "rf" for r in RUNS) == 64
    assert {"c attn D256 MB2 VEC16", "c attn-rf D256 MB2", "c attn-rf D256 MB3"} <= prm.keys()
    errs = sorted(abs(e) for e, *_ in vm.errors(prm, RUNS, SASS, dyn))
    assert max(errs) <= 0.25
    assert round(100 * errs[len(errs) // 2], 1) == 2.2 and round(100 * errs[-1], 1) == 16.2
    full, v100 = [r for r in RUNS if r[3] == "full"], [r for r in RUNS if r[3] == "v100"]
    held = sorted(abs(e) for e, *_ in vm.errors(vm.fit(full, SASS, dyn), v100, SASS, dyn))
    assert max(held) <= 0.25
    assert round(100 * held[len(held) // 2], 1) == 2.8 and round(100 * held[-1], 1) == 17.2
    cell = dict(B=8, Q=8, ctx=131072, H_kv=1, G=6, D=256, page=1648)
    lo = vm.predict(cell, "V100", SASS, dyn, prm, hmma_latency="lo")
    hi = vm.predict(cell, "V100", SASS, dyn, prm, hmma_latency="hi")
    assert (
        0 < lo["ms"] <= hi["ms"] and lo["plan"]["ctas_per_sm"] == 2 and lo["plan"]["kind"] == "rf"
    )
    assert vm.predict(cell, "H200", SASS, dyn, prm)["plan"]["kind"] == "wmma"
    wm = vm.predict(cell, "V100", SASS, dyn, prm, hmma_latency="hi", kind="wmma")
    assert wm["plan"]["ctas_per_sm"] == 1 and hi["ms"] < wm["ms"]
    # MB2 (Q4) on a V100: the RF kernel from 64K, faster than the WMMA kernel at lo and at hi
    for B in (1, 4, 8, 16):
        for ctx in (8192, 32768, 131072, 262144):
            cell = dict(B=B, Q=4, ctx=ctx, H_kv=1, G=6, D=256, page=1648)
            p = {
                (k, h): vm.predict(cell, "V100", SASS, dyn, prm, hmma_latency=h, kind=k)
                for k in ("wmma", "rf")
                for h in ("lo", "hi")
            }
            want = "rf" if ctx >= 65536 else "wmma"
            assert vm.predict(cell, "V100", SASS, dyn, prm)["plan"]["kind"] == want
            if want == "rf":
                assert all(p["rf", h]["ms"] < 0.9 * p["wmma", h]["ms"] for h in ("lo", "hi"))


def test_uneven_residency(fitted):
    """A round's time is set by its busiest SMs (the scheduler deals CTAs out one an SM at a
    time), and a CTA with no tokens holds no slot. The twin (MB2) on 80 SMs, 2 slots each:
    85 splits whose last 6 are empty (B1 Q4 32K, measured near one CTA's time) run at one CTA
    per SM, well below 160 CTAs of the same 13 tiles; 85 CTAs that all have 12 tiles put two on
    5 SMs, which then take as long as 160 CTAs of 12 tiles. And the twin's B4 Q8 (MB3) 32K,
    164 CTAs on 160 slots: a second round of 4 CTAs alone on their SMs, well below two full
    rounds."""
    prm, dyn = fitted

    def attn(B, Q, ctx):
        cell = dict(B=B, Q=Q, ctx=ctx, H_kv=1, G=6, D=256, page=1648)
        p = vm.predict(cell, "H200", SASS, dyn, prm, num_sms=80, ctas_per_sm=2, kind="rf")
        return p["latency_ms"], p["warps_per_scheduler"], p["plan"]["num_splits"]

    one, w1, s1 = attn(1, 4, 32768)
    full, w2, s2 = attn(1, 4, 66560)
    assert (s1, w1, s2, w2) == (85, 2, 160, 4) and one < 0.8 * full
    assert attn(1, 4, 32640) == pytest.approx((attn(1, 4, 61440)[0], 4, 85))
    two_rounds, one_round = attn(4, 8, 32768)[0], attn(1, 8, 128000)[0]  # 25 tiles a CTA
    assert 1.3 * one_round < two_rounds < 1.8 * one_round


def test_v100_defaults_for_mb2_and_mb3_are_the_models(fitted):
    """default_kind's thresholds on a V100 from the model: from 64K tokens for MB2 (17-32 rows)
    and from 128K for MB3 (33-48) the RF kernel is faster at lo and at hi for every batch and
    length swept; below, a length whose RF plan has a little over one CTA with work per SM loses
    (MB2 B1 33K: 86 on 80 SMs; MB3 B1 64K: 82)."""
    prm, dyn = fitted

    def ratio(B, ctx, Q):
        cell = dict(B=B, Q=Q, ctx=ctx, H_kv=1, G=6, D=256, page=1648)
        return max(
            vm.predict(cell, "V100", SASS, dyn, prm, hmma_latency=h, kind="rf")["ms"]
            / vm.predict(cell, "V100", SASS, dyn, prm, hmma_latency=h, kind="wmma")["ms"]
            for h in ("lo", "hi")
        )

    for Q, start in ((4, 65536), (8, 131072)):
        for B in (1, 2, 3, 4, 8, 16):
            assert all(ratio(B, ctx, Q) < 1 for ctx in range(start, 300000, 4099)), (Q, B)
        assert vm.default_kind("sm_70", 256, Q // 4 + 1, start) == "rf"
        assert vm.default_kind("sm_70", 256, Q // 4 + 1, start - 1) == "wmma"
    assert ratio(1, 32985, 4) > 1.1 and ratio(1, 65536, 8) > 1.3


def test_perf_md_holds_the_tools_tables(fitted):
    """docs/perf.md's calibration / V100 table, the seed table and the register-fragment
    kernel's table are the tool's output on the committed data, row for row."""
    prm, dyn = fitted
    rows = [
        ln
        for ln in vm.report(prm, RUNS, SASS, dyn, markdown=True).splitlines()
        if ln.startswith("| B")
    ]
    doc = (Path(vm.ROOT) / "docs" / "perf.md").read_text().splitlines()
    assert len(rows) == 116 + 16 and all(r in doc for r in rows), [r for r in rows if r not in doc][
        :3
    ]
    rf = [ln for ln in vm.rf_report(prm, RUNS, SASS, dyn).splitlines() if ln.startswith("| B")]
    assert len(rf) == 64 and all(r in doc for r in rf), [r for r in rf if r not in doc][:3]


@pytest.mark.parametrize("sms", [80, 132])
@pytest.mark.parametrize("ctas_per_sm", [1, 2, 3, 5])
def test_sanitizer_cells_reach_every_listed_kernel(sms, ctas_per_sm):
    """tools/sanitize_cells.py (the sanitizers' problem set in tools/gpu_suite.sh) reaches
    every attention kernel with one split and with several, and every combine kernel, by the
    plan replica, on either GPU's SM count and at any occupancy (the GPU run checks the
    binding's own plans too)."""
    import sanitize_cells as sc
    from problems import table_width

    todo, want_attn, want_comb = sc.cells()
    seen, split_ones, comb = set(), set(), set()
    for kind, _, kw, vec, several in todo:
        cap = table_width(kw["lens"], kw["page_size"]) * kw["page_size"]
        H_q = kw["G"] * kw["H_kv"]
        pl = vm.plan(kw["B"], H_q, kw["H_kv"], kw["Q"], kw["D"], cap, sms, ctas_per_sm)
        key = (kind, kw["D"], pl["mb"], vec)
        assert (pl["num_splits"] > 1) == several, (kw, pl)
        (split_ones if pl["num_splits"] == 1 else seen).add(key)
        if pl["num_splits"] > 1:
            comb.add((kw["D"], vm.combine_warps_per_row(pl["num_splits"])))
    assert split_ones >= want_attn and seen >= want_attn
    assert comb == want_comb


def test_the_models_default_kind_is_the_launchers():
    """tools/v100_model.py's default_kind and csrc/sm70attn/traits.h's attn_default_kind (the
    expression it returns, evaluated here) agree on a grid of GPUs, shapes and capacities."""
    import re

    src = (Path(vm.ROOT) / "csrc" / "sm70attn" / "traits.h").read_text()
    m = re.search(
        r"attn_default_kind\(int d, int mb, int cc, long long capacity\) \{\s*return (.*?) \? ATTN_RF_M8N8K4 : ATTN_WMMA;",
        src,
        re.S,
    )
    assert m, "attn_default_kind changed shape: update this test and the model together"
    expr = m.group(1).replace("&&", " and ").replace("||", " or ")
    for arch, cc in (("sm_70", 70), ("sm_90", 90)):
        for d in (64, 128, 256):
            for mb in (1, 2, 3, 4):
                for cap in (8192, 65535, 65536, 131071, 131072, 1 << 18):
                    launcher = (
                        "rf" if eval(expr, {}, dict(d=d, mb=mb, cc=cc, capacity=cap)) else "wmma"
                    )
                    assert vm.default_kind(arch, d, mb, cap) == launcher, (arch, d, mb, cap)
    for cc in (72, 75, 80):  # other GPUs keep the WMMA kernel
        for mb in (2, 3):
            assert not eval(expr, {}, dict(d=256, mb=mb, cc=cc, capacity=1 << 18))


def test_prefill_work_is_the_kernels_tiles():
    """The prefill model's CTAs are varlen.h's: ceil(q G / 64) tiles a KV head, each over the KV
    tiles its last row sees (causal): a D256 G6 chunk of 4096 tokens over 32K, 384 tiles x 4."""
    ctas = vm.prefill_ctas(256, 6, 4, 4096, 32768, 32)
    assert len(ctas) == 384 * 4 and ctas[:4] == [vm.cdiv(32768 + 11, 32)] * 4
    assert ctas[-1] == (32768 + 4096) // 32 and ctas == sorted(ctas)
    assert len(vm.prefill_ctas(128, 4, 8, 17, 0, 32)) == 2 * 8  # 68 rows: two tiles
    assert vm.prefill_flops(128, 1, 1, 2, 3) == 4 * 128 * (2 * 3 + 3)


@pytest.mark.skipif(not vm.load_prefill_runs(), reason="no prefill runs in docs/data")
def test_prefill_model_on_the_measured_cells():
    """Fitted per kernel (the tile loop, the prefill kernel) and head dim on the measured cells
    of over 1 ms: each within 10%; fitted without the no-past and 128K cells, those (of over
    1 ms) within 15%; the V100 rows --json publishes cover both shapes, chunks 512-16384 and pasts
    0-128K, predict the prefill kernel (it has runs), lo no slower than hi."""
    prm = vm.fit(RUNS, SASS, vm.dynamic_scale(SASS))
    runs = vm.load_prefill_runs()
    assert {k for *_, k in runs} == {"varlen", "prefill"}
    fitted, errs, held, rows = vm.prefill_report(prm, SASS, runs)
    for e, (cell, ms, *_) in zip(errs, runs, strict=True):
        if ms > vm.PREFILL_FIT_MS:
            assert abs(e) < 0.10, (cell, ms, e)
    assert held and max(map(abs, held)) < 0.15, held
    assert len(rows) == 2 * 6 * 4 and all(r["lo"]["ms"] <= r["hi"]["ms"] for r in rows)
    assert {r["kernel"] for r in rows} == {"prefill"}
