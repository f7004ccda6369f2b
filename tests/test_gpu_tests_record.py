"""``scripts/gpu_tests_record.py``: a junit file of the GPU suite becomes a record with each test's
outcome, the counts, and the collected tests that never reported (stopped by the call's limit)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts/gpu_tests_record.py"
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="1"
 skipped="2" tests="5" time="12.5" timestamp="2026-12-05T13:13:14.25+00:00">
<testcase classname="tests.ops.test_a" name="test_ok[efla]" time="1.25"/>
<testcase classname="tests.ops.test_a" name="test_bad" time="2.0"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="tests.ops.test_a" name="test_two_gpus" time="0.0"><skipped message="needs two CUDA devices"/></testcase>
<testcase classname="" name="tests.serving.test_chat" time="0.0"><skipped message="collection skipped"/></testcase>
<testcase time="0.001"/>
</testsuite></testsuites>"""


def test_a_junit_file_becomes_a_record_with_the_unfinished_tests(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    (tmp_path / "ids.txt").write_text(
        "tests/ops/test_a.py::test_ok[efla]\ntests/ops/test_a.py::test_ok[gated_efla]\ntests/serving/test_chat.py::test_x\n"
    )
    out = tmp_path / "r.json"
    args = ["--device", "H200", "--versions", "torch=2.11 triton=3.6", "--commit", "abc1234", "--command", "c"]
    collected = ["--collected", str(tmp_path / "ids.txt")]
    subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "j.xml"), *args, *collected, "--out", str(out)], check=True)
    record = json.loads(out.read_text())
    assert record["date"] == "2026-12-05 13:13 UTC" and record["versions"] == {"torch": "2.11", "triton": "3.6"}
    assert record["counts"] == {"passed": 1, "failure": 1, "error": 0, "skipped": 2, "unfinished": 1}
    assert record["unfinished"] == ["tests/ops/test_a.py::test_ok[gated_efla]"]
    bad = next(t for t in record["tests"] if t["test"] == "tests/ops/test_a.py::test_bad")
    assert bad == {"test": "tests/ops/test_a.py::test_bad", "outcome": "failure", "seconds": 2.0, "reason": "assert 1 == 2"}
