"""Turn the GPU suite's junit file (``bash scripts/device.sh tests`` leaves ``$OUT/gpu-tests.xml``) into
a record for ``docs/results/gpu_tests/``: date, device, versions, commit, command, the counts, and
every test's outcome and seconds; ``--collected`` (the ids ``pytest --collect-only -q -m gpu`` lists)
adds the tests that had not finished when the call's limit stopped the run.

Usage: python scripts/gpu_tests_record.py JUNIT --device "NVIDIA H200" --versions "torch=2.11.0 ..."
           --commit abc1234 --command "..." [--collected FILE] --out docs/results/gpu_tests/DATE.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import xml.etree.ElementTree as ET


def outcomes(junit_path: str) -> tuple[dict, list[dict]]:
    suite = next(ET.parse(junit_path).getroot().iter("testsuite"))
    tests = []
    for case in suite.iter("testcase"):
        if "classname" not in case.attrib:  # xdist's per-worker placeholders
            continue
        marks = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = marks[0].tag if marks else "passed"
        reason = marks[0].attrib.get("message", "")[:200] if marks else ""
        module = case.attrib["classname"] or case.attrib["name"]  # a module skipped whole has no class name
        test_id = module.replace(".", "/") + ".py" + (f"::{case.attrib['name']}" if case.attrib["classname"] else "")
        tests.append({"test": test_id, "outcome": outcome, "seconds": round(float(case.attrib["time"]), 2), "reason": reason})
    return suite.attrib, tests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit")
    for name in ("--device", "--versions", "--commit", "--command", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--collected", help="a file of the collected test ids, one a line")
    args = ap.parse_args()
    suite, tests = outcomes(args.junit)
    unfinished = []
    if args.collected:
        seen = {t["test"] for t in tests}
        ids = [line.strip() for line in pathlib.Path(args.collected).read_text().splitlines() if "::" in line]
        unfinished = [i for i in ids if i not in seen and i.split("::")[0] not in seen]
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failure", "error", "skipped")}
    record = {
        "date": suite.get("timestamp", "")[:16].replace("T", " ") + " UTC",
        "device": args.device,
        "versions": dict(item.split("=", 1) for item in args.versions.split()),
        "commit": args.commit,
        "command": args.command,
        "seconds": round(float(suite["time"]), 1),
        "counts": {**counts, "unfinished": len(unfinished)},
        "unfinished": unfinished,
        "tests": sorted(tests, key=lambda t: t["test"]),
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
