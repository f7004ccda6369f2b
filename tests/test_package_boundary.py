"""The installed package is the library; the paper's lab (``efla_lab``) sits beside it and imports it,
never the other way round."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lab_imports(package: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """``file:line`` of every import of ``efla_lab`` under ``package``, lazy ones inside functions too."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name == "efla_lab" or name.startswith("efla_lab.") for name in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_nothing_in_the_library_imports_the_lab():
    assert lab_imports(ROOT / "efla") == []


def test_the_check_finds_a_lab_import(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from efla_lab.demo import run\n")
    (tmp_path / "b.py").write_text("import efla_lab.harness as h\n")
    (tmp_path / "c.py").write_text("from efla.records import atomic_write  # efla_lab is not imported here\n")
    assert lab_imports(tmp_path, root=tmp_path) == ["a.py:2", "b.py:1"]


def _library_modules() -> list[str]:
    paths = [p for p in (ROOT / "efla").rglob("*.py") if "cuda" not in p.parts and p.name != "__main__.py"]
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in paths)


def _run_blocking(blocked: list[str], body: str) -> subprocess.CompletedProcess:
    script = f"import sys, importlib\nfor name in {blocked!r}:\n    sys.modules[name] = None\n" + body
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_library_module_loads_without_the_lab():
    result = _run_blocking(["efla_lab"], f"for module in {_library_modules()!r}:\n    importlib.import_module(module)\n")
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_command_line_lists_every_command_without_the_lab_extra():
    """The lab's commands parse without matplotlib, scikit-learn and rich (they load them when they run)."""
    body = "from efla.cli import build_parser\nprint(' '.join(sorted(build_parser()._subparsers._group_actions[0].choices)))\n"
    result = _run_blocking(["matplotlib", "sklearn", "rich"], body)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == sorted(
        ["train", "eval", "generate", "serve", "convert", "demo", "robustness", "lr-sweep", "mad", "compare", "lm-report"]
    )


def test_a_lab_command_without_its_extra_names_the_extra():
    from efla.cli import exit_status_and_message

    status, message = exit_status_and_message(ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"))
    assert status == 1 and "pip install 'efla[lab]'" in message
    _, other = exit_status_and_message(ModuleNotFoundError("No module named 'fastapi'", name="fastapi"))
    assert "efla[lab]" not in other
