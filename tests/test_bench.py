"""tools/bench.py end to end on the CPU (the logic; timings there mean nothing): the smoke grid
with the V100-grid options, which a CPU run records but cannot apply."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench  # noqa: E402


def test_smoke_grid_with_the_v100_grid_options(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert (
        bench.main(
            ["--device", "cpu", "--smoke", "--v100-grid", "--samples", "1", "--json", str(out)]
        )
        == 0
    )
    run = json.loads(out.read_text())
    assert run["config"]["sms"] == 80 and run["config"]["sm_smem"] == 98304
    assert len(run["cells"]) == 4
    for cell in run["cells"]:
        assert cell["impls"]["op"]["median_ms"] > 0 and len(cell["op_out_sha1"]) == 40
        assert cell["rel_err_vs_eager"]["op"] < 1e-2
    assert "| B | Q | ctx |" in capsys.readouterr().out
