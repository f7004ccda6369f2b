"""`efla generate`: JSON lines equal to efla.generation.generate prompt by prompt, streaming prints the same
text, seeded sampling repeats, and every user mistake is one line with exit status 2."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from efla.cli import main

REPO = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = ["def main(", "import torch", "The model"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny-efla model with random weights and a byte-level BPE trained on this repository's sources."""
    from efla.data.tokenizer import train_bpe_tokenizer
    from efla.models import EFLAForCausalLM, get_preset_config

    path = tmp_path_factory.mktemp("generate") / "model"
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "efla").rglob("*.py")))[:20_000]
    tokenizer = train_bpe_tokenizer([text], vocab_size=320, save_dir=str(path))
    cfg = get_preset_config("tiny-efla")
    cfg.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    EFLAForCausalLM(cfg).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    import efla  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _alone(loaded, prompt: str, n: int) -> list[int]:
    """The new tokens of efla.generation.generate for this prompt alone (greedy)."""
    from efla.generation import generate

    model, tokenizer = loaded
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = generate(model, ids, max_new_tokens=n, eos_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


def test_json_lines_match_generate_prompt_by_prompt(model_dir, loaded, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"\n{PROMPTS[2]}\n\n", encoding="utf-8")  # blank lines skipped
    assert (
        main(["generate", str(model_dir), *PROMPTS[:2], "--prompts-file", str(prompts_file), "--max-new-tokens", "10", "--json"])
        == 0
    )
    captured = capsys.readouterr()
    assert captured.err == ""
    rows = _json_lines(captured.out)
    assert [r["prompt"] for r in rows] == PROMPTS
    tokenizer = loaded[1]
    for r in rows:
        assert set(r) >= {"prompt", "text", "new_tokens", "finish_reason"}
        new = _alone(loaded, r["prompt"], 10)
        assert r["text"] == tokenizer.decode(new, skip_special_tokens=True)
        assert r["new_tokens"] == len(new) == 10 and r["finish_reason"] == "length"


def test_a_row_that_stops_early_counts_no_padding(model_dir, loaded, monkeypatch, capsys):
    """A stop token made in the third step of the first prompt: that row stops there, the other runs on."""
    import efla.commands.generate as command

    first, second = (_alone(loaded, p, 6) for p in PROMPTS[:2])
    stop = first[2]
    if stop in first[:2] or stop in second:
        pytest.skip("the chosen stop token also occurs elsewhere")
    monkeypatch.setattr(command, "stop_tokens_of", lambda model, tokenizer: [stop])
    assert main(["generate", str(model_dir), *PROMPTS[:2], "--max-new-tokens", "6", "--json"]) == 0
    rows = _json_lines(capsys.readouterr().out)
    tokenizer = loaded[1]
    assert rows[0]["new_tokens"] == 3 and rows[0]["finish_reason"] == "stop"
    assert rows[0]["text"] == tokenizer.decode(first[:3], skip_special_tokens=True)
    assert rows[1]["new_tokens"] == 6 and rows[1]["finish_reason"] == "length"


def test_streaming_prints_the_json_text(model_dir, capsys):
    assert main(["generate", str(model_dir), *PROMPTS[:2], "--max-new-tokens", "12", "--json"]) == 0
    texts = [r["text"] for r in _json_lines(capsys.readouterr().out)]
    assert main(["generate", str(model_dir), *PROMPTS[:2], "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{PROMPTS[0]}{texts[0]}\n\n{PROMPTS[1]}{texts[1]}\n"
    assert captured.err == ""


def test_seeded_sampling_repeats(model_dir, capsys):
    def sample(seed: int) -> list[dict]:
        assert (
            main(
                [
                    "generate",
                    str(model_dir),
                    PROMPTS[0],
                    "--temperature",
                    "1.0",
                    "--top-k",
                    "50",
                    "--top-p",
                    "0.95",
                    "--seed",
                    str(seed),
                    "--max-new-tokens",
                    "12",
                    "--json",
                ]
            )
            == 0
        )
        return _json_lines(capsys.readouterr().out)

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first  # 12 tokens sampled from ~300 at temperature 1: a different seed differs


def test_each_prompt_samples_with_its_own_seed_in_both_modes(model_dir, capsys):
    """Prompt i samples with --seed + i: the same text streamed one by one and in one --json batch, and
    a prompt given twice gets two samples."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    sampling = ["--temperature", "1.0", "--seed", "5", "--max-new-tokens", "12"]
    assert main(["generate", str(model_dir), *prompts, *sampling, "--json"]) == 0
    texts = [r["text"] for r in _json_lines(capsys.readouterr().out)]
    assert main(["generate", str(model_dir), *prompts, *sampling]) == 0
    assert capsys.readouterr().out == "\n\n".join(p + t for p, t in zip(prompts, texts)) + "\n"
    assert texts[0] != texts[2]  # 12 tokens at temperature 1 from ~300: two seeds differ


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_prints_the_same_greedy_text(method, model_dir, tmp_path, capsys):
    """--speculate leaves greedy text as it is, streamed and in --json (the draft model: a copy of the
    model with its weights moved a little, so some drafts are kept and some rejected)."""
    from efla.models import EFLAForCausalLM

    speculate = ["--speculate", method, "--num-speculative-tokens", "3"]
    if method == "draft_model":
        draft = EFLAForCausalLM.from_pretrained(model_dir)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.1 * p.std().nan_to_num(0) * torch.randn(p.shape, generator=g))
        draft.save_pretrained(tmp_path / "draft")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, tmp_path / "draft" / name)
        speculate += ["--draft-model", str(tmp_path / "draft")]
    for mode in (["--json"], []):
        assert main(["generate", str(model_dir), *PROMPTS, "--max-new-tokens", "24", *mode]) == 0
        plain = capsys.readouterr()
        assert main(["generate", str(model_dir), *PROMPTS, "--max-new-tokens", "24", *mode, *speculate]) == 0
        fast = capsys.readouterr()
        assert fast.out == plain.out and fast.err == ""


def test_help_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "efla", "generate", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "MODEL_DIR" in result.stdout and "--prompts-file" in result.stdout


def _other_model_type(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    other = tmp_path / "llama"
    shutil.copytree(model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    return other


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing-dir", "no such directory: {tmp}/no-such-model (MODEL_DIR)"),
        ("no-config", "{tmp}/empty is not a model directory: no config.json (MODEL_DIR)"),
        ("other-model-type", "{tmp}/llama/config.json: model_type 'llama' is not an efla model"),
        ("no-prompt", "no prompt given (PROMPT or --prompts-file)"),
        ("top-p-0", "(--top-p)"),
        ("temperature-negative", "expected a value >= 0, got -1 (--temperature)"),
        ("max-new-tokens-0", "expected a value >= 1, got 0 (--max-new-tokens)"),
        ("prompts-file-missing", "no such file: {tmp}/no-such-prompts.txt (--prompts-file)"),
        ("prompts-file-not-utf8", "{tmp}/bad.txt:3: not UTF-8 text (byte 0xff at column 4) (--prompts-file)"),
        ("prompts-file-blank", "no prompt given: {tmp}/blank.txt has no prompt lines (--prompts-file)"),
        ("float16-on-cpu", "(--dtype)"),
        ("unknown-device", "(--device)"),
        ("draft-model-missing", "--speculate draft_model needs a draft model directory (--draft-model)"),
        ("draft-model-without-speculate", "(--draft-model)"),
        ("draft-model-not-a-dir", "no such directory: {tmp}/no-draft (--draft-model)"),
        ("speculative-tokens-0", "expected a value >= 1, got 0 (--num-speculative-tokens)"),
        ("lookup-without-speculate", "a speculative setting without --speculate (--prompt-lookup-max)"),
        ("unknown-method", "expected ngram or draft_model, got 'medusa' (--speculate)"),
    ],
)
def test_user_mistakes_are_one_line_with_status_2(case, expected, model_dir, tmp_path, capsys):
    model = str(model_dir)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.txt").write_bytes(b"first prompt\n\nabc\xff def\n")
    (tmp_path / "blank.txt").write_text("\n  \n")
    argv = {
        "missing-dir": [str(tmp_path / "no-such-model"), "hi"],
        "no-config": [str(tmp_path / "empty"), "hi"],
        "other-model-type": [str(_other_model_type(model_dir, tmp_path)) if case == "other-model-type" else "", "hi"],
        "no-prompt": [model],
        "top-p-0": [model, "hi", "--top-p", "0"],
        "temperature-negative": [model, "hi", "--temperature", "-1"],
        "max-new-tokens-0": [model, "hi", "--max-new-tokens", "0"],
        "prompts-file-missing": [model, "--prompts-file", str(tmp_path / "no-such-prompts.txt")],
        "prompts-file-not-utf8": [model, "--prompts-file", str(tmp_path / "bad.txt")],
        "prompts-file-blank": [model, "--prompts-file", str(tmp_path / "blank.txt")],
        "float16-on-cpu": [model, "hi", "--device", "cpu", "--dtype", "float16"],
        "unknown-device": [model, "hi", "--device", "tpu"],
        "draft-model-missing": [model, "hi", "--speculate", "draft_model"],
        "draft-model-without-speculate": [model, "hi", "--draft-model", model],
        "draft-model-not-a-dir": [model, "hi", "--speculate", "draft_model", "--draft-model", str(tmp_path / "no-draft")],
        "speculative-tokens-0": [model, "hi", "--speculate", "ngram", "--num-speculative-tokens", "0"],
        "lookup-without-speculate": [model, "hi", "--prompt-lookup-max", "2"],
        "unknown-method": [model, "hi", "--speculate", "medusa"],
    }[case]
    assert main(["generate", *argv]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("efla generate: ") and expected.format(tmp=tmp_path) in lines[0], lines[0]
