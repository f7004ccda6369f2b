"""The recorded results keep one shape: under ``docs/results/`` each experiment directory has a
``summary.md`` that names the command that ran, the records are JSON / CSV / markdown / figures, and
no raw console output is committed (no ``.log`` files, no carriage-return progress-bar residue, no
temporary paths of the machine that produced them). That every recorded file is named by a page is
``test_references.py``'s check.

Each check is a function of the root directory, so it can be pointed at another checkout."""

from __future__ import annotations

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
BINARY = {".png", ".jpg", ".jpeg", ".pdf", ".gz", ".pt", ".safetensors"}
# Absolute temporary / home paths of the machine a record was made on.
TEMP_PATH = re.compile(r"(?<![\w.])/(tmp|root|home)/")
# What a progress bar leaves in a captured console log.
PROGRESS = re.compile(rb"\r(?!\n)|\d(it/s|s/it)\]|\xe2\x96\x88")  # bare \r, tqdm rate, the block glyph
# Lines that may quote device paths: the command that actually ran.
COMMAND_LINE = re.compile(r"^\s*Command as run\b")
COMMAND_KEYS = {"command", "command_as_run"}


def _files(root: pathlib.Path, sub: str = "docs/results") -> list[pathlib.Path]:
    base = root / sub
    return sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []


def log_files(root: pathlib.Path) -> list[str]:
    """Raw console logs: ``.log`` files under docs/results or benchmarks/."""
    return [str(p.relative_to(root)) for sub in ("docs/results", "benchmarks") for p in _files(root, sub) if p.suffix == ".log"]


def progress_residue(root: pathlib.Path) -> list[str]:
    return [str(p.relative_to(root)) for p in _files(root) if p.suffix not in BINARY and PROGRESS.search(p.read_bytes())]


def _json_strings(obj, key=None):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _json_strings(v, k)
    elif isinstance(obj, list):
        for v in obj:
            yield from _json_strings(v, key)
    elif isinstance(obj, str) and key not in COMMAND_KEYS:
        yield obj


def temporary_paths(root: pathlib.Path) -> list[str]:
    """Temporary paths anywhere but in the record of the command that ran (a summary line starting
    ``Command as run`` or a JSON ``command`` / ``command_as_run`` value)."""
    found = []
    for p in _files(root):
        if p.suffix in BINARY:
            continue
        rel = str(p.relative_to(root))
        text = p.read_text(errors="replace")
        if p.suffix == ".json":
            try:
                hits = [s for s in _json_strings(json.loads(text)) if TEMP_PATH.search(s)]
            except ValueError:
                hits = [text] if TEMP_PATH.search(text) else []
            found += [f"{rel}: {h[:80]!r}" for h in hits]
        else:
            found += [
                f"{rel}:{i}: {line[:80]!r}"
                for i, line in enumerate(text.splitlines(), 1)
                if TEMP_PATH.search(line) and not COMMAND_LINE.match(line)
            ]
    return found


def summary_problems(root: pathlib.Path) -> list[str]:
    """Every experiment directory (a directory directly under docs/results) has ``summary.md``; no
    ``README.md`` stands in for one; every ``summary.md`` has a line ``Command as run...``."""
    base = root / "docs/results"
    if not base.is_dir():
        return ["docs/results is missing"]
    problems = [
        f"{d.relative_to(root)}: no summary.md" for d in sorted(base.iterdir()) if d.is_dir() and not (d / "summary.md").is_file()
    ]
    problems += [f"{p.relative_to(root)}: README.md instead of summary.md" for p in sorted(base.rglob("README.md"))]
    problems += [
        f"{p.relative_to(root)}: no line 'Command as run: ...'"
        for p in sorted(base.rglob("summary.md"))
        if not any(COMMAND_LINE.match(line) for line in p.read_text().splitlines())
    ]
    return problems


def test_no_raw_console_logs():
    assert log_files(ROOT) == []


def test_no_progress_bar_residue():
    assert progress_residue(ROOT) == []


def test_no_temporary_paths_outside_the_command_that_ran():
    assert temporary_paths(ROOT) == []


def test_every_experiment_has_a_summary_naming_the_command():
    assert summary_problems(ROOT) == []


def test_the_checks_catch_a_raw_log(tmp_path):
    exp = tmp_path / "docs/results/exp"
    exp.mkdir(parents=True)
    (exp / "README.md").write_text("# exp\n\nCommand: `efla mad --quick`\n")
    (exp / "run.log").write_bytes(b"step 1\r 10%|\xe2\x96\x88 | 1/10 [00:01<00:09, 1.00it/s]\rdone\n")
    (exp / "run.json").write_text(json.dumps({"out": "/tmp/results/exp", "command": "efla x --out /tmp/x"}))
    (exp / "notes.md").write_text("Model directory: /root/out/exp\nCommand as run: `efla x --out /tmp/x`\n")
    assert log_files(tmp_path) == ["docs/results/exp/run.log"]
    assert progress_residue(tmp_path) == ["docs/results/exp/run.log"]
    hits = temporary_paths(tmp_path)
    assert any(h.startswith("docs/results/exp/run.json") for h in hits)
    assert any(h.startswith("docs/results/exp/notes.md:1") for h in hits)
    assert not any("notes.md:2" in h or "efla x" in h for h in hits)
    assert len(summary_problems(tmp_path)) == 2  # no summary.md; a README.md
