"""The command line: `efla demo` runs and writes its results."""

from __future__ import annotations

import json

from efla.cli import main


def test_demo_quick_writes_results(tmp_path, capsys):
    assert main(["demo", "--quick", "--epochs", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "demo.json").read_text())
    rows = data["one_step"]
    assert [r["euler_expands"] for r in rows] == [r["beta_lambda"] > 2 for r in rows]
    small = [r for r in rows if r["beta_lambda"] <= 1e-2]
    # one-step difference ~ (beta lambda)^2: a 10x smaller step gives ~100x smaller difference
    ratio = small[0]["one_step_rel_diff"] / small[-1]["one_step_rel_diff"]  # x = 1e-3 vs 1e-2
    assert 0.009 < ratio < 0.011
    assert all(t["chunk_fwd_bwd_ms"] > 0 and t["recurrent_fwd_bwd_ms"] > 0 for t in data["cpu_timings"])
    assert "One step" in capsys.readouterr().out
    rb = data["robustness"]["rules"]
    assert set(rb) == {"exact", "euler"}
    for r in rb.values():
        assert 0 <= r["eval"]["clean"] <= 1 and len(r["eval"]["scale"]["accuracy"]) == 5
    for name in ("one_step.png", "robustness.png", "report.md"):
        assert (tmp_path / name).stat().st_size > 200, name
    assert 0 <= data["mad"]["exact"] <= 1 and 0 <= data["mad"]["euler"] <= 1
    report = (tmp_path / "report.md").read_text()
    assert "MAD in-context recall" in report
    assert "![one step](one_step.png)" in report and "| metric | EFLA | DeltaNet |" in report
