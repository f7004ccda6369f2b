"""Language-model evaluation: sliding-window WikiText perplexity, LAMBADA, lm-eval, `efla eval` / `efla compare`.

Every reference value here is computed independently of efla.evaluation: a full forward
over the whole sequence, a forward over exactly one token's window, and greedy decoding with
``model.generate`` (the recurrent cache path) for LAMBADA.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import pytest
import torch

from efla.data.eval_text import load_lambada
from efla_lab.lm.compare import compare
from efla.evaluation import (
    encode_pair,
    evaluate_lambada,
    evaluate_wikitext,
    harness_evaluate,
    lambada_split,
    prefix_token_id,
    sliding_windows,
    write_lambada_task,
)
from efla.models import EFLAConfig, EFLAForCausalLM

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
WIKI = SHARED / "wikitext-2-raw" / "wiki.test.raw"
LAMBADA = SHARED / "lambada" / "lambada_test.jsonl"
needs_wiki = pytest.mark.skipif(not WIKI.is_file(), reason=f"WikiText test file not found at {WIKI}")
needs_lambada = pytest.mark.skipif(not LAMBADA.is_file(), reason=f"LAMBADA file not found at {LAMBADA}")

N_LAMBADA = 8  # passages used by the LAMBADA tests (the first 4 are memorised by the fixture model)


def _corpus_text() -> str:
    """A slice of wiki.test.raw when present, else this repository's own sources (real text, no download)."""
    if WIKI.is_file():
        return WIKI.read_text(encoding="utf-8")[:60_000]
    return "".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "efla").rglob("*.py")))[:60_000]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one thread is faster than two on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE (GPT-2 byte alphabet) trained here with the `tokenizers` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_corpus_text()], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=10**9
    )


def _tiny_model(vocab: int, seed: int = 0, **kw) -> EFLAForCausalLM:
    torch.manual_seed(seed)
    cfg = EFLAConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_heads=2, max_position_embeddings=256, **kw)
    return EFLAForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return _tiny_model(len(tokenizer))


@pytest.fixture(scope="module")
def lambada_texts():
    if not LAMBADA.is_file():
        pytest.skip(f"LAMBADA file not found at {LAMBADA}")
    return load_lambada(str(LAMBADA), N_LAMBADA)


@pytest.fixture(scope="module")
def lambada_model(tokenizer, lambada_texts):
    """A tiny model trained to memorise the first half of the passages, so that some last words are
    predicted correctly and others not (a non-trivial accuracy)."""
    model = _tiny_model(len(tokenizer), seed=1)
    seqs = [tokenizer(t)["input_ids"] for t in lambada_texts[: N_LAMBADA // 2]]
    L = max(map(len, seqs))
    x = torch.zeros(len(seqs), L, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = torch.tensor(s)
        labels[i, : len(s)] = torch.tensor(s)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    torch.manual_seed(0)
    for _ in range(150):
        loss = model(input_ids=x, labels=labels, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    return model.eval()


def _full_forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t = 1..len-1 from one plain forward (no windows, no cache)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


# --------------------------------------------------------------------------- windows


@pytest.mark.parametrize(
    "n,context,stride",
    [(1, 8, 4), (2, 8, 4), (7, 8, 4), (8, 8, 4), (9, 8, 4), (100, 8, 1), (100, 8, 7), (101, 16, 5), (1000, 64, 32)],
)
def test_sliding_windows_score_every_target_exactly_once(n, context, stride):
    wins = sliding_windows(n, context, stride)
    scored = [t for b, e, f in wins for t in range(f, e)]
    assert sorted(scored) == list(range(1, n)), "targets 1..n-1, each exactly once"
    assert len(scored) == len(set(scored)) == max(n - 1, 0)
    for b, e, f in wins:
        assert 0 <= b < f <= e <= n and e - b <= context
        if f > 1:  # after the first window: stride new targets, context - stride .. context - 1 tokens of context
            assert e - f <= stride and f - b >= context - stride
            assert e - b == context  # as much left context as fits


@pytest.mark.parametrize("context,stride", [(8, 8), (8, 0), (1, 1), (8, 9)])
def test_sliding_windows_refuse_strides_that_leave_tokens_without_context(context, stride):
    with pytest.raises(ValueError, match="context|stride"):
        sliding_windows(100, context, stride)


# --------------------------------------------------------------------------- WikiText


@pytest.mark.parametrize("prefix", ["auto", "none"])
def test_wikitext_perplexity_equals_full_forward_when_text_fits_one_window(model, tokenizer, prefix):
    text = _corpus_text()[:1500]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert 300 < len(ids) < 1000
    pid = prefix_token_id(tokenizer, prefix)
    assert pid == (None if prefix == "none" else tokenizer.eos_token_id)  # this tokenizer adds no BOS itself
    seq = ([pid] if pid is not None else []) + ids
    lp = _full_forward_logprobs(model, seq)
    nll = -float(lp.sum())
    res = evaluate_wikitext(model, tokenizer, text, context=1024, stride=512, prefix=prefix)
    assert res["windows"] == 1
    assert res["scored_tokens"] == len(seq) - 1 == len(ids) - (pid is None)
    assert res["nll_sum"] == pytest.approx(nll, rel=1e-6)
    assert res["token_perplexity"] == pytest.approx(math.exp(nll / (len(seq) - 1)), rel=1e-6)
    if pid is not None:  # every token scored: word and byte counts are the text's
        assert res["words"] == len(text.split()) and res["bytes"] == len(text.encode("utf-8"))
    assert res["word_perplexity"] == pytest.approx(math.exp(nll / res["words"]), rel=1e-6)
    assert res["bits_per_byte"] == pytest.approx(nll / math.log(2) / res["bytes"], rel=1e-6)
    # a random model is near-uniform over the vocabulary
    assert 0.5 * len(tokenizer) < res["token_perplexity"] < 2 * len(tokenizer)


def test_wikitext_sliding_window_scores_each_token_once_with_its_window(model, tokenizer):
    text = _corpus_text()[:4000]
    context, stride = 48, 20
    res = evaluate_wikitext(model, tokenizer, text, context=context, stride=stride, batch_size=5, return_nll=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = [tokenizer.eos_token_id] + ids
    n = len(seq)
    wins = sliding_windows(n, context, stride)
    assert res["scored_tokens"] == len(res["nll"]) == len(ids) and res["windows"] == len(wins) > 10
    assert all(math.isfinite(v) for v in res["nll"])
    # independent check: each target's NLL from one forward over exactly the tokens of its window before it
    owner = {t: (b, e, f) for b, e, f in wins for t in range(f, e)}
    torch.manual_seed(0)
    check = sorted({1, 2, context - 1, context, context + 1, n - 1} | set(torch.randint(1, n, (12,)).tolist()))
    for t in check:
        b, _, _ = owner[t]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq[b:t]]), use_cache=False).logits[0, -1].double()
        ref = -float(torch.log_softmax(logits, -1)[seq[t]])
        assert res["nll"][t - 1] == pytest.approx(ref, rel=1e-5, abs=1e-5), f"target {t} (window from {b})"
        assert t - b <= context - 1 and (t < context or t - b >= context - stride)  # its left context
    assert sum(res["nll"]) == pytest.approx(res["nll_sum"], rel=1e-9)
    # the windowed result differs from the unbounded-context one, but only slightly for a random model
    full = -float(_full_forward_logprobs(model, seq).sum())
    assert res["nll_sum"] != full and res["nll_sum"] == pytest.approx(full, rel=0.02)


# --------------------------------------------------------------------------- LAMBADA


def test_lambada_split_is_lm_eval_lambada_openai(tokenizer):
    ctx, cont = lambada_split("he said  hello to the old man")
    assert (ctx, cont) == ("he said  hello to the old", " man")
    c, w = encode_pair(tokenizer, ctx, cont)
    assert c + w == tokenizer(ctx + cont)["input_ids"] and c == tokenizer(ctx)["input_ids"] and w
    # a trailing space of the context moves to the continuation
    c2, w2 = encode_pair(tokenizer, "the old ", "man")
    assert c2 == tokenizer("the old")["input_ids"] and c2 + w2 == tokenizer("the old man")["input_ids"]


@pytest.mark.parametrize("max_length", [256, 40])
def test_lambada_accuracy_equals_direct_greedy_check(lambada_model, tokenizer, lambada_texts, max_length):
    res = evaluate_lambada(lambada_model, tokenizer, lambada_texts, max_length=max_length, batch_size=3)
    assert res["n"] == len(lambada_texts) == N_LAMBADA
    direct = []
    for i, text in enumerate(lambada_texts):
        ctx_text, word = text.rsplit(" ", 1)
        ctx = tokenizer(ctx_text)["input_ids"]
        whole = tokenizer(text)["input_ids"]
        assert whole[: len(ctx)] == ctx
        cont = whole[len(ctx) :]
        inp = (ctx + cont)[-(max_length + 1) :]
        ctx_in = inp[: len(inp) - len(cont)]
        # greedy decoding through the recurrent cache path
        with torch.no_grad():
            gen = lambada_model.generate(
                torch.tensor([ctx_in]),
                attention_mask=torch.ones(1, len(ctx_in), dtype=torch.long),
                max_new_tokens=len(cont),
                do_sample=False,
                pad_token_id=0,
            )
        correct = gen[0, len(ctx_in) :].tolist() == cont
        direct.append(correct)
        logprob = float(_full_forward_logprobs(lambada_model, inp)[-len(cont) :].sum())
        ex = res["examples"][i]
        assert ex["correct"] == correct, f"passage {i}: greedy {tokenizer.decode(gen[0, len(ctx_in) :])!r} vs {word!r}"
        assert ex["n_tokens"] == len(cont)
        assert ex["logprob"] == pytest.approx(logprob, rel=1e-4, abs=1e-4)
    assert res["accuracy"] == sum(direct) / len(direct)
    assert res["perplexity"] == pytest.approx(math.exp(-sum(e["logprob"] for e in res["examples"]) / N_LAMBADA), rel=1e-9)
    if max_length == 256:  # memorised passages are right, the others wrong: the check is not vacuous
        assert direct[: N_LAMBADA // 2] == [True] * (N_LAMBADA // 2) and not any(direct[N_LAMBADA // 2 :])


# --------------------------------------------------------------------------- lm-evaluation-harness


def test_lm_eval_lambada_task_offline_matches_ours(lambada_model, tokenizer, lambada_texts, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed (pip install 'efla[eval]')")
    pytest.importorskip("accelerate", reason="lm-eval's HF model needs accelerate (pip install 'lm-eval[hf]')")
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets", raising=False)

    subset = tmp_path / "lambada_subset.jsonl"
    subset.write_text("".join(json.dumps({"text": t}) + "\n" for t in lambada_texts))
    include = write_lambada_task(str(subset), str(tmp_path / "tasks"))
    ours = evaluate_lambada(lambada_model, tokenizer, lambada_texts, max_length=256)
    assert 0 < ours["accuracy"] < 1

    # 1) our model instance wrapped in lm-eval's HFLM
    res = harness_evaluate(
        lambada_model, tokenizer, ["lambada_openai_local"], include_path=include, batch_size=4, max_length=256
    )["lambada_openai_local"]
    assert res["acc"] == ours["accuracy"]
    assert res["perplexity"] == pytest.approx(ours["perplexity"], rel=1e-4)

    # 2) a saved model directory loaded by lm-eval itself (`--model hf --model_args pretrained=DIR`), after `import efla`
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    d = tmp_path / "model"
    lambada_model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    out = simple_evaluate(
        model="hf",
        model_args=dict(pretrained=str(d), max_length=256, device="cpu", dtype="float32"),
        tasks=["lambada_openai_local"],
        task_manager=TaskManager(include_path=include),
        batch_size=4,
        bootstrap_iters=0,
        log_samples=False,
    )
    r2 = out["results"]["lambada_openai_local"]
    assert r2["acc,none"] == ours["accuracy"]
    assert r2["perplexity,none"] == pytest.approx(ours["perplexity"], rel=1e-4)


# --------------------------------------------------------------------------- CLI and comparison


@needs_wiki
@needs_lambada
def test_efla_eval_and_compare_commands(tokenizer, lambada_model, tmp_path, capsys):
    from efla.cli import main

    wiki = tmp_path / "wiki.raw"
    wiki.write_text(WIKI.read_text(encoding="utf-8")[:3000])
    dirs = {}
    for name, kw in (("efla-s0", {}), ("deltanet-s0", dict(update_rule="euler")), ("efla-s1", {})):
        d = tmp_path / name
        (lambada_model if name == "efla-s0" else _tiny_model(len(tokenizer), seed=len(dirs), **kw)).save_pretrained(d)
        tokenizer.save_pretrained(d)
        dirs[name] = d
    out = tmp_path / "eval-efla-s0"
    assert (
        main(
            [
                "eval",
                "--model",
                str(dirs["efla-s0"]),
                "--wikitext",
                str(wiki),
                "--lambada",
                str(LAMBADA),
                "--limit",
                str(N_LAMBADA),
                "--context",
                "128",
                "--stride",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rec = json.loads((out / "eval.json").read_text())
    assert rec["model"]["variant"] == "efla" and rec["model"]["seed"] == 0
    direct_w = evaluate_wikitext(lambada_model, tokenizer, wiki.read_text(), context=128, stride=64)
    direct_l = evaluate_lambada(lambada_model, tokenizer, load_lambada(str(LAMBADA), N_LAMBADA), max_length=128)
    assert rec["wikitext"]["token_perplexity"] == pytest.approx(direct_w["token_perplexity"], rel=1e-6)
    assert rec["wikitext"]["scored_tokens"] == direct_w["scored_tokens"]
    assert rec["lambada"]["accuracy"] == direct_l["accuracy"] and rec["lambada"]["n"] == N_LAMBADA
    assert rec["lambada"]["perplexity"] == pytest.approx(direct_l["perplexity"], rel=1e-6)
    assert "WikiText" in capsys.readouterr().out

    cmp_out = tmp_path / "cmp"
    assert (
        main(
            [
                "compare",
                str(out / "eval.json"),
                str(dirs["deltanet-s0"]),
                str(dirs["efla-s1"]),
                "--wikitext",
                str(wiki),
                "--lambada",
                str(LAMBADA),
                "--limit",
                str(N_LAMBADA),
                "--context",
                "128",
                "--stride",
                "64",
                "--out",
                str(cmp_out),
            ]
        )
        == 0
    )
    md = (cmp_out / "table.md").read_text()
    summary = json.loads((cmp_out / "eval.json").read_text())
    assert len(summary["records"]) == 3 and "Evaluation commands:" in md and "efla eval --model" in md
    assert summary["variants"]["efla"]["seeds"] == [0, 1] and summary["variants"]["deltanet"]["seeds"] == [0]
    assert "| EFLA | " in md and "| DeltaNet | " in md and "Paper (Table 1" in md and "35.26" in md
    pair = next(p for p in summary["pairs"] if p["metric"] == "lambada_acc")
    assert pair["a"] == "efla" and pair["paired_seeds"] == [0]
    assert (cmp_out / "models" / "deltanet-s0" / "eval.json").is_file()
    # a comparison can be redone from recorded evaluations alone
    assert main(["compare", str(cmp_out / "eval.json"), "--out", str(tmp_path / "cmp2")]) == 0
    assert json.loads((tmp_path / "cmp2" / "eval.json").read_text())["variants"] == summary["variants"]


def test_compare_table_layout_and_pairs():
    def rec(variant, seed, wppl, acc):
        return dict(
            model=dict(name=f"{variant}-s{seed}", variant=variant, seed=seed, parameters=1_000_000),
            wikitext=dict(word_perplexity=wppl, token_perplexity=wppl / 2, bits_per_byte=1.0),
            lambada=dict(perplexity=100.0, accuracy=acc),
        )

    recs = [
        rec("efla", 0, 30.0, 0.20),
        rec("efla", 1, 32.0, 0.22),
        rec("deltanet", 0, 31.0, 0.19),
        rec("deltanet", 1, 35.0, 0.21),
        rec("gated_efla", 0, 29.0, 0.25),
    ]
    md, summary = compare(recs)
    assert summary["variants"]["efla"]["wiki_word_ppl"]["mean"] == 31.0
    assert summary["variants"]["efla"]["wiki_word_ppl"]["std"] == pytest.approx(math.sqrt(2.0))
    assert "31.00 ± 1.41" in md
    p = next(p for p in summary["pairs"] if p["metric"] == "wiki_word_ppl" and p["a"] == "efla")
    assert p["diff"] == pytest.approx(-2.0) and p["paired_diffs"] == [-1.0, -3.0] and p["a_better_in"] == 2
    assert p["a_better_on_mean"]
    assert not any(p["a"] == "gated_efla" for p in summary["pairs"])  # no Gated DeltaNet to pair with
    assert md.index("| DeltaNet |") < md.index("| EFLA |") < md.index("| Gated EFLA |")  # the paper's row order
    (v,) = summary["verdicts"]
    assert v.startswith("EFLA vs DeltaNet") and "Wiki. ppl (word) 31.00 vs 33.00 (EFLA better by 2.00" in v
    assert "EFLA better in 2/2 paired seeds, per-seed EFLA − DeltaNet -1.00, -3.00 (mean -2.00 ± 1.41)" in v
    assert "LMB. acc 21.00 vs 20.00" in v


def test_lambada_task_yaml_is_lambada_openai(tmp_path):
    d = write_lambada_task("/data/x.jsonl", str(tmp_path))
    y = (pathlib.Path(d) / "lambada_openai_local.yaml").read_text()
    assert "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"" in y
    assert "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"" in y
    assert "output_type: loglikelihood" in y and '"/data/x.jsonl"' in y
    assert os.path.basename(d) == tmp_path.name


def test_compare_shows_no_spread_over_runs_of_one_seed():
    def rec(variant, seed, wppl):
        return dict(
            model=dict(name=f"{variant}-{wppl}", variant=variant, seed=seed, parameters=1_000_000),
            wikitext=dict(word_perplexity=wppl, token_perplexity=wppl / 2, bits_per_byte=1.0),
            lambada=dict(perplexity=100.0, accuracy=0.2),
        )

    md, summary = compare([rec("efla", 0, 30.0), rec("efla", 0, 32.0), rec("deltanet", 0, 31.0)])
    assert "## Results (mean over runs)" in md and "±" not in md.split("## Per model")[0]
    assert summary["variants"]["efla"]["wiki_word_ppl"]["mean"] == 31.0
    assert summary["variants"]["efla"]["wiki_word_ppl"]["std"] is None
    md, _ = compare([rec("efla", 0, 30.0), rec("efla", 1, 32.0), rec("deltanet", 0, 31.0)])
    assert "## Results (mean ± sample std over seeds)" in md and "31.00 ± 1.41" in md
