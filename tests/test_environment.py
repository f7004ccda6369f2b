"""``efla.environment``: the one registry of the environment variables efla reads, and the one reader.

Switches parse in one spelling and refuse anything else by name; values are read once and kept until
``reload()``; ``override()`` switches them for a block; the source of efla names no variable the
registry does not declare and reads the environment nowhere else; docs/environment.md is the
registry's table; the module imports nothing beyond the standard library.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from efla import environment

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / name for name in ("efla", "efla_lab") if (REPO / name).is_dir()]
THE_READER = "efla/environment.py"
ENVIRONMENT_ACCESS = re.compile(r"\bos\.environ\b|\bgetenv\b|\bputenv\b|\benviron\.get\b|from os import [^\n]*\benviron\b")
VARIABLE_NAME = re.compile(r"\bEFLA_[A-Z0-9_]+")


def _sources() -> dict[str, str]:
    return {str(path.relative_to(REPO)): path.read_text() for root in SOURCES for path in sorted(root.rglob("*.py"))}


# ----------------------------------------------------------------------------- spelling
@pytest.mark.parametrize("text", ["1", "true", "on", "yes", "TRUE", "Yes", " on ", "\ttrue\n"])
def test_on_spellings(text):
    assert environment.parse_switch("EFLA_X", text) is True


@pytest.mark.parametrize("text", ["0", "false", "off", "no", "", "   ", "False", "OFF", " No "])
def test_off_spellings(text):
    assert environment.parse_switch("EFLA_X", text) is False


@pytest.mark.parametrize("text", ["2", "-1", "y", "enabled", "1.0", "o n"])
def test_any_other_value_is_refused_naming_the_variable_the_value_and_the_spellings(text):
    with pytest.raises(ValueError) as refused:
        environment.parse_switch("EFLA_DIRECT_LAUNCH", text)
    message = str(refused.value)
    assert message.startswith(f"EFLA_DIRECT_LAUNCH={text!r}: expected on (1, true, on, yes) or off (0, false, off, no, empty)")


def test_a_bad_value_in_the_environment_raises_at_the_first_read(monkeypatch):
    monkeypatch.setenv("EFLA_CHECK_VALUES", "sometimes")
    environment.reload()
    with pytest.raises(ValueError, match="EFLA_CHECK_VALUES='sometimes'"):
        environment.get("EFLA_CHECK_VALUES")
    assert environment.get("EFLA_DIRECT_LAUNCH") is True, "one mistyped variable leaves the others readable"


@pytest.mark.parametrize(
    "text, mode",
    [
        ("later", "later"),
        ("SYNC", "sync"),
        ("off", "off"),
        ("1", "later"),
        ("on", "later"),
        ("0", "off"),
        ("no", "off"),
        ("", "off"),
    ],
)
def test_key_checks_take_their_modes_and_the_switch_spellings(text, mode, monkeypatch):
    monkeypatch.setenv("EFLA_CHECK_KEYS", text)
    environment.reload()
    assert environment.get("EFLA_CHECK_KEYS") == mode


def test_key_checks_refuse_another_mode():
    with (
        pytest.raises(ValueError, match=r"EFLA_CHECK_KEYS='always': expected later, sync or off"),
        environment.override(EFLA_CHECK_KEYS="always"),
    ):
        pass


@pytest.mark.parametrize("text, pieces", [("4", 4), (" 8 ", 8), ("0", 0), ("1", 1), ("", 0), ("off", 0), ("no", 0)])
def test_split_state_takes_a_count_or_off(text, pieces):
    with environment.override(EFLA_SPLIT_STATE=text):
        assert environment.get("EFLA_SPLIT_STATE") == pieces


@pytest.mark.parametrize("text", ["on", "-1", "4.5", "four"])
def test_split_state_refuses_anything_else(text):
    with pytest.raises(ValueError, match="EFLA_SPLIT_STATE"), environment.override(EFLA_SPLIT_STATE=text):
        pass


@pytest.mark.parametrize("name, text", [("WORLD_SIZE", "0"), ("WORLD_SIZE", "two"), ("LOCAL_RANK", "-1")])
def test_torchruns_integers_are_checked(name, text):
    with pytest.raises(ValueError, match=f"{name}={text!r}"), environment.override(**{name: text}):
        pass


def test_empty_text_variables_count_as_unset(monkeypatch):
    monkeypatch.setenv("EFLA_DATA_DIR", "")
    monkeypatch.setenv("EFLA_API_KEY", " ")
    environment.reload()
    assert environment.get("EFLA_DATA_DIR") is None
    assert environment.get("EFLA_API_KEY") == " ", "kept as given: `efla serve` refuses a blank key by name"


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "on", "yes", "y", "Y", "0", "", "false", "no", "2", " 1", "1 "])
def test_triton_interpret_is_read_as_triton_reads_it(text, monkeypatch):
    libtriton = pytest.importorskip("triton._C.libtriton")
    monkeypatch.setenv("TRITON_INTERPRET", text)
    assert environment.variable("TRITON_INTERPRET").read(text) == libtriton.getenv_bool("TRITON_INTERPRET", False)


# ----------------------------------------------------------------------------- read once, reload, override
def test_unset_variables_take_their_defaults(monkeypatch):
    for name in environment.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    environment.reload()
    assert {name: environment.get(name) for name in environment.VARIABLES} == {
        name: variable.default for name, variable in environment.VARIABLES.items()
    }
    assert environment.get("EFLA_DIRECT_LAUNCH") is True and environment.get("EFLA_SPLIT_STATE") == 0


def test_a_value_is_kept_until_reload(monkeypatch):
    monkeypatch.setenv("EFLA_STATE_TUNING", "0")
    environment.reload()
    assert environment.get("EFLA_STATE_TUNING") is False
    monkeypatch.setenv("EFLA_STATE_TUNING", "1")
    assert environment.get("EFLA_STATE_TUNING") is False
    environment.reload()
    assert environment.get("EFLA_STATE_TUNING") is True


def test_override_takes_typed_values_or_text_and_restores_on_exit(monkeypatch):
    monkeypatch.setenv("EFLA_SPLIT_STATE", "2")
    environment.reload()
    with environment.override(EFLA_SPLIT_STATE=4, EFLA_FLA_KERNELS=False):
        assert (environment.get("EFLA_SPLIT_STATE"), environment.get("EFLA_FLA_KERNELS")) == (4, False)
        with environment.override(EFLA_SPLIT_STATE="8"):
            assert environment.get("EFLA_SPLIT_STATE") == 8
        with environment.override(EFLA_SPLIT_STATE=None):  # as if unset
            assert environment.get("EFLA_SPLIT_STATE") == 0
        assert environment.get("EFLA_SPLIT_STATE") == 4
    assert (environment.get("EFLA_SPLIT_STATE"), environment.get("EFLA_FLA_KERNELS")) == (2, True)


def test_override_outlasts_a_reload_inside_it(monkeypatch):
    with environment.override(EFLA_CHECK_VALUES=True):
        monkeypatch.setenv("EFLA_CHECK_VALUES", "0")
        environment.reload()
        assert environment.get("EFLA_CHECK_VALUES") is True
    assert environment.get("EFLA_CHECK_VALUES") is False


def test_blocks_closed_out_of_order_leave_the_others_in_force():
    before = environment.get("EFLA_SPLIT_STATE")
    outer, inner = environment.override(EFLA_SPLIT_STATE=2), environment.override(EFLA_SPLIT_STATE=3)
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert environment.get("EFLA_SPLIT_STATE") == 3
    inner.__exit__(None, None, None)
    assert environment.get("EFLA_SPLIT_STATE") == before


def test_undeclared_names_are_refused():
    with pytest.raises(KeyError, match="EFLA_SPLIT_STATES is not declared"):
        environment.get("EFLA_SPLIT_STATES")
    with pytest.raises(KeyError, match="EFLA_DIRECT_LAUNCHES is not declared"), environment.override(EFLA_DIRECT_LAUNCHES=True):
        pass


def test_override_refuses_a_value_of_another_type():
    with (
        pytest.raises(TypeError, match="EFLA_SPLIT_STATE: expected a str, bool, int, path or None, got float"),
        environment.override(EFLA_SPLIT_STATE=4.0),
    ):
        pass


def test_code_that_torch_compile_traces_reads_a_variable_first_and_follows_overrides(monkeypatch):
    import torch

    monkeypatch.delenv("EFLA_CHECK_VALUES", raising=False)
    environment.reload()

    @torch.compile(backend="eager", fullgraph=True)  # fullgraph: a graph break fails
    def checked(x):
        return x + 1 if environment.get("EFLA_CHECK_VALUES") else x

    x = torch.zeros(2)
    assert checked(x).tolist() == [0.0, 0.0]  # the first read, while tracing
    with environment.override(EFLA_CHECK_VALUES=True):
        assert checked(x).tolist() == [1.0, 1.0]
    assert checked(x).tolist() == [0.0, 0.0]


def test_experimental_switches_are_off_by_default():
    experimental = {name: v.default for name, v in environment.VARIABLES.items() if v.experimental}
    assert experimental == {"EFLA_FUSED_FORWARD": False, "EFLA_SPLIT_STATE": 0, "EFLA_STATE_TUNING": False}


# ----------------------------------------------------------------------------- the source and the docs
def test_every_variable_named_in_the_source_is_declared():
    undeclared = {
        f"{path}: {name}"
        for path, text in _sources().items()
        for name in VARIABLE_NAME.findall(text)
        if name not in environment.VARIABLES
    }
    assert not undeclared, f"declare these in {THE_READER} (or rename them): {sorted(undeclared)}"


def test_only_the_registry_reads_the_environment():
    readers = {path for path, text in _sources().items() if ENVIRONMENT_ACCESS.search(text)}
    assert THE_READER in readers, "the pattern no longer finds the registry's own read"
    others = readers - {THE_READER}
    assert not others, f"read these through efla.environment.get(...): {sorted(others)}"


def test_docs_list_exactly_the_declared_variables():
    text = (REPO / "docs" / "environment.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    listed = [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]
    assert sorted(listed) == sorted(environment.VARIABLES), "docs/environment.md: a variable missing or not declared"
    assert environment.table() in text, "docs/environment.md: its table is not the registry's (python -m efla.environment)"


def test_the_registry_imports_only_the_standard_library():
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('registry', {str(REPO / THE_READER)!r})\n"
        "module = sys.modules['registry'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert module.get('EFLA_DIRECT_LAUNCH') in (True, False)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'triton', 'fla', 'efla'))\n"
        "print(heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
