"""docs/performance.md and the README's performance table are generated from the raw result files
(``benchmarks/report.py``); these tests regenerate them and check the arithmetic and the record shape."""

import copy
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_report(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


report = _load_report("benchmarks_report")
evidence = report.evidence


def test_the_page_and_the_readme_table_are_what_the_records_give():
    expected = report.outputs(
        str(ROOT / "benchmarks" / "results"), str(ROOT / "README.md"), str(ROOT / "docs" / "performance.md")
    )
    for path, text in expected.items():
        assert pathlib.Path(path).read_text() == text, f"{path} differs from the records: run python benchmarks/report.py"


def test_the_page_names_every_raw_file():
    page = (ROOT / "docs" / "performance.md").read_text()
    results = ROOT / "benchmarks" / "results"
    unnamed = [p for p in sorted(results.rglob("*")) if p.is_file() and f"`{p.relative_to(ROOT)}`" not in page]
    assert unnamed == []


def _run(title: str, rounds: int, measurements: list[dict], kept: bool = True) -> dict:
    return {
        "schema": evidence.SCHEMA,
        "benchmark": "cpu_ops",
        "title": title,
        "date": "2026-12-05 06:00 UTC",
        "device": "CPU: test, 2 cores",
        "versions": {"python": "3.12", "torch": "2.13.0"},
        "commit": "abc1234",
        "command": "python benchmarks/cpu_ops.py",
        "rounds": rounds,
        "rounds_kept": kept,
        "notes": [],
        "measurements": measurements,
    }


def _four_rounds() -> dict:
    times = evidence.measurement("case A", "time", "ms", "lower", ("ours", [1, 2, 4, 5]), ("theirs", [3, 5, 6, 4]))
    rates = evidence.measurement("case B", "rate", "tokens/s", "higher", ("ours", [10, 12, 9, 11]), ("theirs", [5, 6, 6, 4]))
    return _run("four rounds", 4, [times, rates])


def _two_rounds() -> dict:
    m = evidence.measurement("case C", "time", "ms", "lower", ("ours", [1, 1]), ("theirs", [2, 2]))
    return _run("two rounds", 2, [m])


@pytest.fixture
def tree(tmp_path):
    results = tmp_path / "results" / "cpu"
    results.mkdir(parents=True)
    for name, run in (("four.json", _four_rounds()), ("two.json", _two_rounds())):
        (results / name).write_text(json.dumps(run))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Performance\n\n{report.START}\nold\n{report.END}\n\n## Next\n")
    return tmp_path


def _outputs(tree):
    return report.outputs(str(tree / "results"), str(tree / "README.md"), str(tree / "performance.md"))


def test_the_ratio_is_the_median_of_the_per_round_ratios_with_its_spread(tree):
    page = _outputs(tree)[str(tree / "performance.md")]
    # times, lower is better: the rounds' ratios are 3/1, 5/2, 6/4, 4/5 = 3, 2.5, 1.5, 0.8 (median 2.0,
    # not 4.5 / 3 = 1.5 from the sides' medians)
    assert "| case A | 3 | 4.5 | 2.00x | 0.80-3.00x | 4 |" in page
    # rates, higher is better: 10/5, 12/6, 9/6, 11/4 = 2, 2, 1.5, 2.75
    assert "| case B | 10.5 | 5.5 | 2.00x | 1.50-2.75x | 4 |" in page


def test_a_two_round_run_is_under_spread_unknown_and_not_in_the_readme(tree):
    out = _outputs(tree)
    page, readme = out[str(tree / "performance.md")], out[str(tree / "README.md")]
    unknown = page.index(": spread unknown")
    assert page.index("### four rounds") < unknown < page.index("#### two rounds")
    assert "only 2 rounds, fewer than 3" in page
    block = readme[readme.index(report.START) : readme.index(report.END)]
    assert "four rounds" in block and "two rounds" not in block and "old" not in block
    assert readme.endswith(f"{report.END}\n\n## Next\n")


def test_check_names_the_file_that_differs_and_writes_nothing(tree, capsys):
    args = ["--results", str(tree / "results"), "--readme", str(tree / "README.md"), "--page", str(tree / "performance.md")]
    assert report.main(args) == 0
    assert report.main([*args, "--check"]) == 0
    page = tree / "performance.md"
    page.write_text(page.read_text() + "hand edit\n")
    assert report.main([*args, "--check"]) == 1
    assert str(page) in capsys.readouterr().err
    assert page.read_text().endswith("hand edit\n")


def test_a_file_in_another_shape_stops_the_report_naming_it(tree, capsys):
    stray = tree / "results" / "cpu" / "stray.json"
    stray.write_text(json.dumps({"rows": []}))
    args = ["--results", str(tree / "results"), "--readme", str(tree / "README.md"), "--page", str(tree / "performance.md")]
    assert report.main(args) == 2
    assert str(stray) in capsys.readouterr().err
    assert not (tree / "performance.md").exists()


def _broken(change) -> dict:
    run = copy.deepcopy(_four_rounds())
    change(run)
    return run


@pytest.mark.parametrize(
    "change, complaint",
    [
        (lambda r: r.pop("commit"), "missing or unknown"),
        (lambda r: r.update(extra=1), "missing or unknown"),
        (lambda r: r["measurements"][0].update(spread=1), "missing or unknown"),
        (lambda r: r["measurements"][0]["ours"]["rounds"].pop(), "4 values"),
        (lambda r: r["measurements"][1]["baseline"]["rounds"].append(1.0), "4 values"),
        (lambda r: r.update(rounds_kept=False), "1 values"),
    ],
    ids=["no commit", "unknown key", "unknown measurement key", "a round missing", "a round too many", "medians only"],
)
def test_check_run_rejects_a_record_out_of_shape(change, complaint):
    evidence.check_run(_four_rounds(), "fine.json")
    with pytest.raises(ValueError, match=complaint) as caught:
        evidence.check_run(_broken(change), "broken.json")
    assert "broken.json" in str(caught.value)


def test_the_readme_quotes_the_latest_headline_run_and_no_diagnostics(tree):
    older = _four_rounds() | {"title": "older four rounds", "date": "2026-12-04 06:00 UTC"}
    diagnostic = _four_rounds() | {"title": "slot counts", "benchmark": "serve_slots"}
    for name, run in (("older.json", older), ("slots.json", diagnostic)):
        (tree / "results" / "cpu" / name).write_text(json.dumps(run))
    readme = _outputs(tree)[str(tree / "README.md")]
    block = readme[readme.index(report.START) : readme.index(report.END)]
    assert "| four rounds |" in block
    assert "older four rounds" not in block and "slot counts" not in block


def test_a_run_without_a_known_spread_quotes_no_ratio(tree):
    page = _outputs(tree)[str(tree / "performance.md")]
    two_rounds = page[page.index("#### two rounds") :]
    assert "| case C | 1 | 2 |" in two_rounds
    assert "x |" not in two_rounds.split("####")[1]
