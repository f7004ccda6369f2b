"""Every reference a documentation page makes resolves, and every recorded result is named by a page.

The pages are the README, CHANGELOG.md and every Markdown file under docs/ (the records' summaries and
docs/results/claims.md included). What a page mentions is read from its inline code, its shell blocks
(```bash, ```sh or untagged) and its links' targets; Python blocks are code, run by test_readme.py.

(a) A repository path a page mentions exists: a path starting with a top-level directory of the
    repository (``efla/``, ``benchmarks/``, ...) is read from the root; any other name ending in
    ``.py``, ``.md``, ``.json``, ``.csv``, ``.yml`` or ``.toml``, and every link, from the page's own
    directory (a bare name also from the root). A file that is gone may be named where the same page
    gives its last version as ``COMMIT:path`` (what ``git show`` takes), which git must hold.
(b) ``efla <command> --option``: the command and each option exist in ``efla.cli.build_parser()``
    (the lab's commands included, through their entry points).
(c) ``python benchmarks/X.py --option`` / ``python scripts/X.py``: the script exists and takes each
    option (its own argparse parser, read in one subprocess).
(d) Every file under ``benchmarks/results/`` and ``docs/results/`` is named by a page, following the
    names from the README, CHANGELOG.md and the topic pages into the records' Markdown: a record's
    Markdown names its own files, a named directory stands for its ``summary.md``; a file named only
    by a JSON record is not named.

Each check is a function of the root directory, so it can be pointed at another checkout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("efla", "efla_lab", "benchmarks", "docs", "scripts", "tests", ".ci")
SUFFIXES = (".py", ".md", ".json", ".csv", ".yml", ".toml")
RAW_DIRS = ("benchmarks/results", "docs/results")
# Files a command writes into its own output directory (efla demo, efla train, efla eval), named in the pages by
# their bare names.
USER_SIDE = frozenset({"demo.json", "report.md", "config.json", "train_args.json", "train_summary.json", "eval.json"})
SHELL_FENCES = {"bash", "sh", "shell", "console", ""}
# a code span opens and closes with the same run of backticks (``a `b` c`` is one span)
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
# A record's line that quotes the command as it ran, with the options of its day (test_results_layout.py)
RECORD_LINE = re.compile(r"^\s*Command as run\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HISTORICAL = re.compile(r"^([0-9a-f]{7,40}):(.+)$")
PLACEHOLDER = re.compile(r"[<>{}$|\\]|\.\.\.")
SEPARATORS = {"&&", "||", ";", "|", "then", "do"}


def pages(root: Path) -> list[Path]:
    found = [root / name for name in ("README.md", "CHANGELOG.md") if (root / name).is_file()]
    return found + sorted((root / "docs").rglob("*.md"))


def _split_fences(text: str) -> tuple[str, list[str]]:
    """The page's prose (fenced blocks left out) and the lines of its shell blocks (continuation
    lines joined)."""
    prose, shell, fence = [], [], None
    for line in text.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("```"):
            fence = line.lstrip()[3:].split(" ")[0].strip() if fence is None else None
        elif fence is None:
            prose.append(line)
        elif fence in SHELL_FENCES:
            shell.append(line)
    return "\n".join(prose), shell


def _snippets(text: str, commands_as_run: bool = True) -> list[str]:
    """The page's inline code spans and the lines of its shell blocks; without those on a record's
    'Command as run' lines if ``commands_as_run`` is false."""
    prose, shell = _split_fences(text)
    spans = []
    for match in INLINE_CODE.finditer(prose):
        line = prose[prose.rfind("\n", 0, match.start()) + 1 : match.start()]
        if commands_as_run or not RECORD_LINE.match(line):
            spans.append(match.group(2).replace("\n", " "))
    return shell + spans


def _links(text: str) -> list[str]:
    prose = _split_fences(text)[0]
    return [target.split("#")[0] for target in LINK.findall(prose) if not re.match(r"[a-z]+:|#", target)]


def _words(snippet: str) -> list[str]:
    snippet = snippet.split(" #")[0]
    try:
        words = shlex.split(snippet)
    except ValueError:
        words = snippet.split()
    return words


def _path_words(snippet: str) -> list[str]:
    """The words of a snippet that could be paths: option values after ``=`` split off, outer
    punctuation stripped."""
    found = []
    for word in _words(snippet):
        for part in word.split("="):
            part = part.strip("()[],;'\"").rstrip(".:")
            if part and not part.startswith(("-", "/", "~", "http")) and not PLACEHOLDER.search(part):
                found.append(part)
    return found


def _in_top_level(word: str) -> bool:
    """``efla/ops`` or ``docs/``, not the bare word ``efla``."""
    return "/" in word and word.split("/")[0] in TOP_LEVEL


def _is_repo_path(word: str) -> bool:
    return _in_top_level(word) or word.endswith(SUFFIXES)


def _resolve(root: Path, page: Path, word: str, link: bool) -> Path:
    if link or "/" in word and not _in_top_level(word):
        return (page.parent / word).resolve()
    if _in_top_level(word):
        return root / word
    return page.parent / word if (page.parent / word).exists() else root / word


def _mentions(root: Path, page: Path) -> list[tuple[str, Path, bool]]:
    """(word as written, where it points, whether it is a link's target) for every path-like word of a
    page; a word with ``*`` points at every file it matches (or at itself, missing, when it matches none)."""
    text = page.read_text(encoding="utf-8")
    words = [(w, False) for snippet in _snippets(text) for w in _path_words(snippet)] + [(t, True) for t in _links(text)]
    found = []
    for word, link in words:
        if HISTORICAL.match(word):
            continue
        target = _resolve(root, page, word, link)
        if "*" in word:
            base = root if _in_top_level(word) else page.parent
            try:
                found += [(word, match, link) for match in sorted(base.glob(word))] or [(word, target, link)]
            except ValueError:  # not a pattern (``**kwargs``)
                continue
        else:
            found.append((word, target, link))
    return found


def _git_holds(root: Path, commit: str, path: str) -> bool:
    shown = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
    return shown.returncode == 0


def missing_paths(root: Path) -> list[str]:
    """(a) Repository paths a page mentions that do not exist (and are not given by commit)."""
    problems = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        historical = {m.group(2): m.group(1) for s in _snippets(text) for w in _words(s) if (m := HISTORICAL.match(w))}
        for path, commit in historical.items():
            if not _git_holds(root, commit, path):
                problems.append(f"{page.relative_to(root)}: {commit}:{path} (git does not hold it)")
        for word, target, link in _mentions(root, page):
            if target.exists() or word in historical or Path(word).name in USER_SIDE and "/" not in word:
                continue
            if link or _is_repo_path(word) or target.suffix in SUFFIXES:
                problems.append(f"{page.relative_to(root)}: {word}")
    return sorted(set(problems))


def _command_lines(root: Path) -> list[tuple[str, list[str]]]:
    """(page, words) for every snippet, cut at shell separators."""
    found = []
    for page in pages(root):
        for snippet in _snippets(page.read_text(encoding="utf-8"), commands_as_run=False):
            words: list[str] = []
            for word in [*_words(snippet), ";"]:
                if word in SEPARATORS:
                    found.append((str(page.relative_to(root)), words))
                    words = []
                else:
                    words.append(word)
    return [(page, words) for page, words in found if words]


def _options(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if re.match(r"--?[A-Za-z]", w)]


def _starts_a_command(before: list[str]) -> bool:
    """Whether the word after ``before`` is the program a command line runs (``efla`` in ``for v in
    efla deltanet`` is a value): first, after ``-m``, or after an assignment or a wrapper's number
    (``nice -n 19``, ``timeout 420``)."""
    return not before or before[-1] == "-m" or re.fullmatch(r"\d+|\w+=\S*", before[-1]) is not None


def unknown_efla_options(root: Path, parser=None) -> list[str]:
    """(b) ``efla <command> --option`` whose command or option the parser does not have."""
    if parser is None:
        from efla.cli import build_parser

        parser = build_parser()
    commands = next(a.choices for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    problems = []
    for page, words in _command_lines(root):
        for i in [i for i, w in enumerate(words[:-1]) if w == "efla" and _starts_a_command(words[:i])]:
            command, rest = words[i + 1], words[i + 2 :]
            if PLACEHOLDER.search(command):
                continue
            if command.startswith("-"):
                known, given = parser._option_string_actions, [command]
            elif command in commands:
                known, given = commands[command]._option_string_actions, _options(rest)
            else:
                problems.append(f"{page}: efla {command} (no such command)")
                continue
            problems += [f"{page}: efla {command} {o} (no such option)" for o in given if o not in known]
    return sorted(set(problems))


SCRIPT = re.compile(r"(benchmarks|scripts)/[\w/]+\.py$")
# Runs each script as __main__ until it asks argparse to parse, and prints the options its parser has.
READ_PARSERS = """
import argparse, json, os, runpy, sys
class Parsed(Exception):
    pass
def stop(parser, *args, **kwargs):
    raise Parsed(sorted(parser._option_string_actions))
argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = stop
found = {}
for script in sys.argv[1:]:
    found[script] = []
    if "ArgumentParser" in open(script, encoding="utf-8").read():
        sys.argv = [script]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` does
        try:
            runpy.run_path(script, run_name="__main__")
        except Parsed as parsed:
            found[script] = parsed.args[0]
print(json.dumps(found))
"""


def script_options(root: Path, scripts: list[str]) -> dict[str, list[str]]:
    """Each script's argparse options ([] for a script without a parser), read in one subprocess."""
    if not scripts:
        return {}
    env = {**os.environ, "PYTHONPATH": str(root)}
    ran = subprocess.run(
        [sys.executable, "-c", READ_PARSERS, *scripts], cwd=root, capture_output=True, text=True, timeout=600, env=env
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    return json.loads(ran.stdout.splitlines()[-1])


def unknown_script_options(root: Path) -> list[str]:
    """(c) ``python benchmarks/X.py`` / ``python scripts/X.py`` naming a missing script or an option it lacks."""
    calls = []
    for page, words in _command_lines(root):
        for i, word in enumerate(words[:-1]):
            if Path(word).name.startswith("python") and SCRIPT.match(words[i + 1]):
                calls.append((page, words[i + 1], _options(words[i + 2 :])))
    problems = [f"{page}: {script} (no such script)" for page, script, _ in calls if not (root / script).is_file()]
    asked = sorted({script for _, script, options in calls if options and (root / script).is_file()})
    known = script_options(root, asked)
    for page, script, options in calls:
        problems += [f"{page}: {script} {o} (no such option)" for o in options if script in known and o not in known[script]]
    return sorted(set(problems))


def unnamed_results(root: Path) -> list[str]:
    """(d) Files under benchmarks/results and docs/results that no page names, following names from
    the pages outside docs/results into the records' Markdown; a named directory stands for its
    summary.md."""
    raw = [p for sub in RAW_DIRS if (root / sub).is_dir() for p in sorted((root / sub).rglob("*")) if p.is_file()]
    results = root / "docs/results"
    start = [p for p in pages(root) if results not in p.parents]
    named: set[Path] = set()
    queue = deque(start)
    while queue:
        page = queue.popleft()
        for _, target, _ in _mentions(root, page):
            if target.is_dir() and (target / "summary.md").is_file():
                target = target / "summary.md"
            if target.is_file() and target.resolve() not in named:
                named.add(target.resolve())
                if target.suffix == ".md" and results in target.resolve().parents:
                    queue.append(target.resolve())
    return [str(p.relative_to(root)) for p in raw if p.resolve() not in named]


def test_every_path_a_page_mentions_exists():
    assert missing_paths(ROOT) == []


def test_every_efla_command_line_in_the_pages_parses():
    assert unknown_efla_options(ROOT) == []


def test_every_script_command_line_in_the_pages_names_real_options():
    assert unknown_script_options(ROOT) == []


def test_every_recorded_result_is_named_by_a_page():
    assert unnamed_results(ROOT) == []


def _fake_tree(root: Path) -> None:
    (root / "docs/results/exp").mkdir(parents=True)
    (root / "benchmarks/results/op").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / "scripts/tool.py").write_text(
        "import argparse\nif __name__ == '__main__':\n    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--rounds')\n    p.parse_args()\n"
    )
    (root / "README.md").write_text(
        "See [the experiment](docs/results/exp/) and `benchmarks/results/op/cited.json`.\n\n"
        "```bash\nefla train --preset tiny-efla --no-such-option 3\npython scripts/tool.py --rounds 3 --colour red\n```\n"
        "Also `docs/gone.md`, `efla trian`, `python scripts/absent.py`, and `runs/lm/efla` (a user's).\n"
    )
    (root / "docs/results/exp/summary.md").write_text("![curve](curve.png) from `runs.csv`; ![gone](gone.png).\n")
    for name in ("curve.png", "runs.csv", "stray.json"):
        (root / "docs/results/exp" / name).write_text("{}")
    (root / "benchmarks/results/op/cited.json").write_text(json.dumps({"raw": "benchmarks/results/op/uncited.json"}))
    (root / "benchmarks/results/op/uncited.json").write_text("{}")  # named only by a JSON record


def test_the_checks_catch_what_they_are_for(tmp_path):
    _fake_tree(tmp_path)
    assert missing_paths(tmp_path) == [
        "README.md: docs/gone.md",
        "README.md: scripts/absent.py",
        "docs/results/exp/summary.md: gone.png",
    ]
    assert unknown_efla_options(tmp_path) == [
        "README.md: efla train --no-such-option (no such option)",
        "README.md: efla trian (no such command)",
    ]
    assert unknown_script_options(tmp_path) == [
        "README.md: scripts/absent.py (no such script)",
        "README.md: scripts/tool.py --colour (no such option)",
    ]
    assert unnamed_results(tmp_path) == ["benchmarks/results/op/uncited.json", "docs/results/exp/stray.json"]


def test_a_directory_counts_only_through_its_summary(tmp_path):
    _fake_tree(tmp_path)
    (tmp_path / "docs/results/exp/summary.md").write_text("Nothing named here.\n")
    assert unnamed_results(tmp_path) == [
        "benchmarks/results/op/uncited.json",
        "docs/results/exp/curve.png",
        "docs/results/exp/runs.csv",
        "docs/results/exp/stray.json",
    ]
