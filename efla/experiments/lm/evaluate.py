"""Language-model evaluation: WikiText perplexity, LAMBADA, lm-evaluation-harness and the Table 1 comparison.

Definitions (the functions below return plain dicts; nothing here prints):

* **WikiText** (:func:`evaluate_wikitext`): the raw file is tokenized as one stream (no special
  tokens). A document-start token (:func:`prefix_token_id`: BOS if the tokenizer adds BOS itself,
  else EOS, the separator ``efla train`` packs documents with) is put in front, so every token of
  the text is a target; without one the first token is context only. The stream is cut into windows of at
  most ``context`` tokens (:func:`sliding_windows`): the first window scores its tokens, each later
  window ends ``stride`` tokens further and scores only those new ``stride`` tokens, with the
  ``context - stride`` to ``context - 1`` tokens before them as left context. Every target is
  scored exactly once. Reported: token-level perplexity ``exp(NLL / tokens)``, word-level
  perplexity ``exp(NLL / words)`` (whitespace-separated words of the scored text) and bits per
  byte ``NLL / (ln 2 * UTF-8 bytes)``; the last two do not depend on the tokenizer.
* **LAMBADA** (:func:`evaluate_lambada`), as lm-evaluation-harness's ``lambada_openai``: the
  context is the passage up to its last ``" "`` and the continuation is ``" " + last word``.
  Tokenization as lm-eval's causal models do it (the tokenizer's default special tokens): the
  whole string is encoded, the context is encoded, and the continuation tokens are the whole
  encoding after the context's length. A passage counts as correct when the greedy (argmax)
  prediction equals every continuation token; perplexity is ``exp(-mean log p(continuation))``
  over passages (the perplexity of the last word, lm-eval's ``perplexity`` aggregation).
* **lm-evaluation-harness** (optional extra ``lm-eval``): :func:`harness_evaluate` runs
  ``lm_eval.simple_evaluate`` on an ``HFLM`` wrapping our model instance and tokenizer;
  :func:`write_lambada_task` writes an offline task YAML (``lambada_openai`` over a local JSONL).
  ``python -m efla.experiments.lm.evaluate ARGS`` runs lm-eval's own command line with the ``efla``
  model type registered, e.g.
  ``python -m efla.experiments.lm.evaluate run --model hf --model_args pretrained=DIR --tasks lambada_openai``.
* **Comparison** (:func:`compare`): one Markdown table in the paper's Table 1 layout (mean and
  standard deviation over seeds per variant), a per-model table, the EFLA-minus-DeltaNet
  differences (and the gated pair), and the paper's numbers in a separate block.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from efla.data.eval_text import load_lambada, load_text
from efla.variants import VARIANTS, label

from .. import harness

__all__ = [
    "PAPER_TABLE1",
    "EvalOptions",
    "compare",
    "encode_pair",
    "evaluate_lambada",
    "evaluate_model",
    "evaluate_wikitext",
    "harness_evaluate",
    "lambada_split",
    "load_model",
    "model_info",
    "prefix_token_id",
    "sliding_windows",
    "write_lambada_task",
]

LN2 = math.log(2.0)

# The paper's Table 1: SlimPajama, Mistral tokenizer. "wiki_ppl" is lm-eval's WikiText
# word perplexity; "avg" averages the zero-shot accuracies (PIQA, HellaSwag, WinoGrande, ARC-e, ARC-c,
# BoolQ, OBQA, SciQ).
PAPER_TABLE1 = [
    dict(scale="340M / 8B tokens", model="Mamba-2", wiki_ppl=36.90, lambada_ppl=105.69, lambada_acc=20.7, avg=42.0),
    dict(scale="340M / 8B tokens", model="DeltaNet", wiki_ppl=38.09, lambada_ppl=96.26, lambada_acc=22.5, avg=42.2),
    dict(scale="340M / 8B tokens", model="EFLA", wiki_ppl=35.26, lambada_ppl=79.97, lambada_acc=23.9, avg=44.1),
    dict(scale="340M / 8B tokens", model="Gated DeltaNet", wiki_ppl=34.93, lambada_ppl=72.46, lambada_acc=25.5,
         avg=43.9),
    dict(scale="340M / 8B tokens", model="Gated EFLA", wiki_ppl=34.28, lambada_ppl=69.37, lambada_acc=26.4, avg=44.8),
    dict(scale="1.3B / 50B tokens", model="DeltaNet", wiki_ppl=18.38, lambada_ppl=17.29, lambada_acc=41.8, avg=50.5),
    dict(scale="1.3B / 50B tokens", model="EFLA", wiki_ppl=18.30, lambada_ppl=16.54, lambada_acc=43.2, avg=51.8),
]

VARIANT_ORDER = [v.model_name for v in sorted(VARIANTS, key=lambda v: (v.gated, v.exact))]
PAIRS = [(v.model_name, v.euler_counterpart.model_name) for v in VARIANTS if v.exact]


# ----------------------------------------------------------------------------- data and models


def check_model_dir(path: str, option: str = "--model") -> None:
    """``path`` is a saved model directory: a ``config.json``, weights and tokenizer files.

    Raises:
        ValueError: naming what is missing (and ``option``).
    """
    if not os.path.exists(path):
        raise ValueError(f"no such directory: {path} ({option})")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a directory ({option})")
    names = set(os.listdir(path))
    if "config.json" not in names:
        raise ValueError(f"{path} is not a model directory: no config.json ({option})")
    if not any(n.endswith((".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")) for n in names):
        raise ValueError(f"{path} has a config.json but no weights (*.safetensors) ({option})")
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}
    if not names & tokenizer_files:
        raise ValueError(f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json) ({option})")


def load_model(path: str, device: str = "cpu", dtype: str = "float32"):
    """``(model, tokenizer)`` from a saved model directory (``import efla`` registers the model type)."""
    import efla  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval(), tok


def _torch_dtype(dtype: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: expected one of {', '.join(table)}, got {dtype!r}")
    return table[dtype]


def prefix_token_id(tokenizer, mode: str = "auto") -> int | None:
    """The token put in front of a WikiText stream, so that its first token is scored too.

    ``"auto"``: the token a model sees at the start of a document: BOS when the tokenizer adds BOS
    itself (Llama/Mistral style), else EOS (the document separator of GPT-2 style packing, which
    is how ``efla train`` packs), else BOS, else none. ``"bos"`` / ``"eos"`` force one; ``"none"``:
    no prefix (the first token is then context only).
    """
    if mode == "none":
        return None
    if mode not in ("auto", "bos", "eos"):
        raise ValueError(f"prefix: expected 'auto', 'bos', 'eos' or 'none', got {mode!r}")
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if mode == "bos" and bos is None:
        raise ValueError("prefix: the tokenizer has no BOS token")
    if mode == "eos" and eos is None:
        raise ValueError("prefix: the tokenizer has no EOS token")
    if mode == "eos":
        return eos
    if mode == "bos":
        return bos
    if bos is not None:
        probe = _encode(tokenizer, "a")
        if probe and probe[0] == bos:
            return bos
    return eos if eos is not None else bos


def _encode(tokenizer, text: str, add_special_tokens: bool | None = None) -> list[int]:
    kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    try:
        return list(tokenizer(text, verbose=False, **kw)["input_ids"])
    except TypeError:  # tokenizers without `verbose`
        return list(tokenizer(text, **kw)["input_ids"])


def _recorded_seed(path: str) -> int | None:
    """The seed ``efla train`` recorded in ``<path>/train_args.json``; for other model directories the
    ``-s<N>`` / ``-seed<N>`` ending of the directory name, else ``None``."""
    args_file = os.path.join(path, "train_args.json")
    if os.path.isfile(args_file):
        with open(args_file) as f:
            return json.load(f).get("seed")
    m = re.search(r"(?:^|[-_])s(?:eed)?(\d+)$", os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def model_info(model, path: str | None = None) -> dict:
    cfg = model.config
    variant = getattr(cfg, "variant", None) or getattr(cfg, "model_type", "model")
    seed = _recorded_seed(path) if path else None
    training = None
    if path and os.path.isfile(os.path.join(path, "train_summary.json")):  # written by `efla train`
        with open(os.path.join(path, "train_summary.json")) as f:
            ts = json.load(f)
        training = {k: ts.get(k) for k in ("steps", "tokens", "final_loss", "val_loss")}
    return dict(
        path=os.path.abspath(path) if path else None, name=os.path.basename(os.path.normpath(path)) if path else None,
        training=training,
        variant=variant, label=label(variant, variant), seed=seed,
        parameters=sum(p.numel() for p in model.parameters()),
        config={k: getattr(cfg, k, None) for k in ("model_type", "update_rule", "gated", "vocab_size", "hidden_size",
                                                    "num_hidden_layers", "num_heads", "head_dim",
                                                    "max_position_embeddings")},
    )


# ----------------------------------------------------------------------------- WikiText


def sliding_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over a token sequence of length ``n`` whose targets are positions ``1 .. n-1``.

    Returns ``(begin, end, first)`` triples: the model reads tokens ``[begin, end)`` (at most
    ``context`` of them) and scores targets ``[first, end)``, each predicted from every token of the
    window before it. The first window is ``[0, min(context, n))`` and scores ``[1, end)``; each
    later one scores the next ``stride`` targets (fewer at the end) and starts ``context`` tokens
    before its end. So every target is scored exactly once, and targets after the first window have
    between ``context - stride`` and ``context - 1`` tokens of left context.
    """
    if not isinstance(context, int) or context < 2:
        raise ValueError(f"context: expected an int >= 2, got {context!r}")
    if not isinstance(stride, int) or not 1 <= stride < context:
        raise ValueError(f"stride: expected an int with 1 <= stride < context ({context}), got {stride!r} "
                         "(each window needs at least one token of context before the tokens it scores)")
    if n < 2:
        return []
    end = min(context, n)
    windows = [(0, end, 1)]
    while end < n:
        first, end = end, min(end + stride, n)
        windows.append((end - context, end, first))
    return windows


@torch.no_grad()
def score_windows(model, ids: torch.Tensor, windows, batch_size: int = 8, device: str = "cpu",
                  progress=None) -> torch.Tensor:
    """Negative log-likelihood (float64) of every target: ``nll[t]`` for ``t`` scored by ``windows``
    (``nan`` where nothing scored it, e.g. ``t = 0``)."""
    nll = torch.full((ids.numel(),), float("nan"), dtype=torch.float64)
    ids = ids.long()
    # windows of one length go in one batch (all are `context` long, except a short text's single window)
    order = sorted(range(len(windows)), key=lambda i: windows[i][1] - windows[i][0])
    for i0 in range(0, len(order), batch_size):
        group = [windows[i] for i in order[i0:i0 + batch_size]]
        by_len: dict[int, list] = {}
        for w in group:
            by_len.setdefault(w[1] - w[0], []).append(w)
        for _, ws in by_len.items():
            x = torch.stack([ids[b:e] for b, e, _ in ws]).to(device)
            keep = max(e - f for _, e, f in ws) + 1
            logits = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits.float()
            for j, (_, e, f) in enumerate(ws):
                k = e - f
                lg = logits[j, keep - k - 1: keep - 1]
                nll[f:e] = F.cross_entropy(lg, ids[f:e].to(lg.device), reduction="none").double().cpu()
        if progress:
            progress(len(group))
    return nll


def evaluate_wikitext(model, tokenizer, text: str, context: int = 1024, stride: int | None = None,
                      batch_size: int = 8, device: str = "cpu", prefix: str = "auto", max_tokens: int | None = None,
                      progress_factory=None, return_nll: bool = False) -> dict:
    """Token-level perplexity, word-level perplexity and bits per byte of ``text`` (see module doc).

    ``max_tokens`` keeps only the first tokens of the text (a quick check; the word and byte
    counts are then those of the decoded kept tokens). ``return_nll`` adds the per-target NLL list.
    """
    stride = stride if stride is not None else context // 2
    t0 = time.perf_counter()
    ids = _encode(tokenizer, text, add_special_tokens=False)
    truncated = max_tokens is not None and len(ids) > max_tokens
    if truncated:
        ids = ids[:max_tokens]
    pid = prefix_token_id(tokenizer, prefix)
    full = ([pid] if pid is not None else []) + ids
    seq = torch.tensor(full, dtype=torch.long)
    windows = sliding_windows(len(full), context, stride)
    bar = progress_factory(len(windows), "wikitext") if progress_factory else None
    nll = score_windows(model, seq, windows, batch_size=batch_size, device=device,
                        progress=bar.update if bar else None)
    if bar:
        bar.close()
    scored = nll[1:]
    if torch.isnan(scored).any():  # pragma: no cover - guarded by sliding_windows
        raise RuntimeError("internal error: a target was not scored")
    total = float(scored.sum())
    n_tok = scored.numel()
    # words and bytes of the scored text: everything when there is a prefix, else all but the first token
    scored_text = tokenizer.decode(ids if pid is not None else ids[1:]) if (truncated or pid is None) else text
    n_words = len(scored_text.split())
    n_bytes = len(scored_text.encode("utf-8"))
    out = dict(
        tokens=len(ids), scored_tokens=n_tok, words=n_words, bytes=n_bytes, nll_sum=total,
        token_perplexity=math.exp(total / n_tok), word_perplexity=math.exp(total / max(n_words, 1)),
        bits_per_byte=total / (LN2 * max(n_bytes, 1)),
        context=context, stride=stride, windows=len(windows), prefix_token_id=pid, first_token_scored=pid is not None,
        truncated_to_tokens=max_tokens if truncated else None, seconds=time.perf_counter() - t0,
    )
    if return_nll:
        out["nll"] = scored.tolist()
    return out


# ----------------------------------------------------------------------------- LAMBADA


def lambada_split(text: str) -> tuple[str, str]:
    """lm-eval ``lambada_openai``: context = the words before the last ``" "``, continuation = ``" " + last word``."""
    words = text.split(" ")
    return " ".join(words[:-1]), " " + words[-1]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation token ids the way lm-eval's causal models split them: trailing
    whitespace of the context moves to the continuation; the continuation is the encoding of the
    whole string after the length of the context's encoding (tokenizer's default special tokens)."""
    if not context:
        raise ValueError("context: empty")
    n_sp = len(context) - len(context.rstrip())
    if n_sp:
        context, continuation = context[:-n_sp], context[-n_sp:] + continuation
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context)
    return ctx, whole[len(ctx):]


@torch.no_grad()
def evaluate_lambada(model, tokenizer, texts: list[str], max_length: int = 1024, batch_size: int = 16,
                     device: str = "cpu", progress_factory=None) -> dict:
    """Last-word accuracy and perplexity over ``texts`` (see module doc). Sequences longer than
    ``max_length`` tokens keep their last ``max_length``; batches are right-padded (causal model:
    padding after a sequence never changes its scores)."""
    t0 = time.perf_counter()
    items = []
    for i, text in enumerate(texts):
        ctx, cont = encode_pair(tokenizer, *lambada_split(text))
        if not cont:
            raise ValueError(f"passage {i}: the last word encodes to no tokens")
        whole = (ctx + cont)[-(max_length + 1):]
        items.append((i, whole[:-1], cont))  # input: all but the last token
    examples: list[dict | None] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda j: -len(items[j][1]))
    bar = progress_factory(len(items), "lambada") if progress_factory else None
    for j0 in range(0, len(order), batch_size):
        batch = [items[j] for j in order[j0:j0 + batch_size]]
        L = max(len(inp) for _, inp, _ in batch)
        x = torch.zeros(len(batch), L, dtype=torch.long)
        for r, (_, inp, _) in enumerate(batch):
            x[r, :len(inp)] = torch.tensor(inp)
        # only the last `keep` positions are needed: those predicting each passage's continuation
        keep = min(L, max(L - len(inp) + len(cont) for _, inp, cont in batch))
        logits = model(input_ids=x.to(device), use_cache=False, logits_to_keep=keep).logits.float()
        for r, (i, inp, cont) in enumerate(batch):
            k = len(cont)
            start = len(inp) - k - (L - keep)
            lg = logits[r, start: start + k]
            tgt = torch.tensor(cont, device=lg.device)
            lp = torch.log_softmax(lg, -1).gather(-1, tgt[:, None])[:, 0]
            greedy = lg.argmax(-1)
            examples[i] = dict(index=i, logprob=float(lp.double().sum()), n_tokens=k,
                               correct=bool((greedy == tgt).all()))
        if bar:
            bar.update(len(batch))
    if bar:
        bar.close()
    n = len(examples)
    acc = sum(e["correct"] for e in examples) / n
    mean_lp = sum(e["logprob"] for e in examples) / n
    return dict(
        n=n, accuracy=acc, accuracy_stderr=math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan"),
        perplexity=math.exp(-mean_lp), mean_logprob=mean_lp,
        mean_target_tokens=sum(e["n_tokens"] for e in examples) / n, max_length=max_length,
        seconds=time.perf_counter() - t0, examples=examples,
    )


# ----------------------------------------------------------------------------- lm-evaluation-harness


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise ImportError("lm-evaluation-harness is not installed: pip install 'efla[eval]' (or pip install lm-eval)") from e


def write_lambada_task(jsonl_path: str, out_dir: str, task_name: str = "lambada_openai_local") -> str:
    """Write an lm-eval task YAML ``<out_dir>/<task_name>.yaml``: ``lambada_openai``'s prompt,
    target and metrics over a local OpenAI-format JSONL file (no download). Returns the folder,
    to pass as ``include_path``."""
    os.makedirs(out_dir, exist_ok=True)
    yaml = (
        f"task: {task_name}\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(os.path.abspath(jsonl_path))}\n"
        "output_type: loglikelihood\n"
        "test_split: test\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\n"
        "metric_list:\n"
        "  - metric: perplexity\n"
        "    aggregation: perplexity\n"
        "    higher_is_better: false\n"
        "  - metric: acc\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
        "metadata:\n"
        "  version: 1.0\n"
    )
    with open(os.path.join(out_dir, f"{task_name}.yaml"), "w") as f:
        f.write(yaml)
    return out_dir


def harness_evaluate(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                     batch_size: int = 8, max_length: int | None = None, num_fewshot: int | None = None,
                     device: str = "cpu") -> dict:
    """Run lm-eval's ``simple_evaluate`` on ``tasks`` with an ``HFLM`` wrapping ``model`` and
    ``tokenizer`` (instances, not paths). ``include_path``: a folder of extra task YAMLs.
    Returns ``{task: {metric: value}}`` (lm-eval's ``results`` with ``",none"`` filter suffixes removed)."""
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    tm = TaskManager(include_path=include_path) if include_path else TaskManager()
    res = simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit, num_fewshot=num_fewshot,
                          bootstrap_iters=0, log_samples=False, verbosity="WARNING")
    out = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {k.split(",")[0]: v for k, v in metrics.items()
                     if k != "alias" and isinstance(v, (int, float)) and not k.startswith("sample")}
    return out


# ----------------------------------------------------------------------------- one model


@dataclass
class EvalOptions:
    wikitext: str | None = None
    lambada: str | None = None
    context: int | None = None  # None: the model's max_position_embeddings (at most 2048)
    stride: int | None = None  # None: context // 2
    batch_size: int = 8
    limit: int | None = None  # LAMBADA passages
    wikitext_max_tokens: int | None = None
    prefix: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    harness: list | None = None
    harness_include: str | None = None
    harness_limit: int | None = None
    num_fewshot: int | None = None


def versions() -> dict:
    return harness.versions("transformers", "lm_eval")


def evaluate_model(path: str, opts: EvalOptions, progress_factory=None, model=None, tokenizer=None) -> dict:
    """Everything ``efla eval`` reports for one model directory (``model``/``tokenizer`` instances
    may be passed instead of loading them from ``path``)."""
    t0 = time.perf_counter()
    if model is None or tokenizer is None:
        model, tokenizer = load_model(path, device=opts.device, dtype=opts.dtype)
    context = opts.context or min(int(getattr(model.config, "max_position_embeddings", 2048) or 2048), 2048)
    rec = dict(model=model_info(model, path), options=asdict(opts), resolved_context=context, versions=versions())
    rec["options"]["harness"] = list(opts.harness) if opts.harness else None
    if opts.wikitext:
        text, source = load_text(opts.wikitext)
        w = evaluate_wikitext(model, tokenizer, text, context=context, stride=opts.stride, batch_size=opts.batch_size,
                              device=opts.device, prefix=opts.prefix, max_tokens=opts.wikitext_max_tokens,
                              progress_factory=progress_factory)
        rec["wikitext"] = dict(w, source=source)
    if opts.lambada:
        texts = load_lambada(opts.lambada, opts.limit)
        lam = evaluate_lambada(model, tokenizer, texts, max_length=context, batch_size=opts.batch_size * 2,
                               device=opts.device, progress_factory=progress_factory)
        lam.pop("examples")
        rec["lambada"] = dict(lam, source=os.path.abspath(opts.lambada), limit=opts.limit,
                              passages_in_file=_count_lines(opts.lambada))
    if opts.harness:
        include = opts.harness_include
        tasks = list(opts.harness)
        if "lambada_openai_local" in tasks and not include:
            if not opts.lambada:
                raise ValueError("--harness lambada_openai_local needs --lambada FILE")
            import tempfile

            include = write_lambada_task(opts.lambada, tempfile.mkdtemp(prefix="efla-lm-eval-"))
        rec["harness"] = harness_evaluate(model, tokenizer, tasks, include_path=include,
                                          limit=opts.harness_limit if opts.harness_limit is not None else opts.limit,
                                          batch_size=opts.batch_size, max_length=context,
                                          num_fewshot=opts.num_fewshot, device=opts.device)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _count_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


# ----------------------------------------------------------------------------- comparison (Table 1 layout)


def _metrics(rec: dict) -> dict:
    m = {}
    if "wikitext" in rec:
        w = rec["wikitext"]
        m.update(wiki_word_ppl=w["word_perplexity"], wiki_token_ppl=w["token_perplexity"], wiki_bpb=w["bits_per_byte"])
    if "lambada" in rec:
        m.update(lambada_ppl=rec["lambada"]["perplexity"], lambada_acc=100 * rec["lambada"]["accuracy"])
    for task, vals in rec.get("harness", {}).items():
        key = "acc_norm" if "acc_norm" in vals and task in ("hellaswag", "arc_challenge", "openbookqa", "piqa") else "acc"
        if key in vals:
            m[f"h:{task}"] = 100 * vals[key]
    return m


# (key, header, higher is better, format)
_COLUMNS = [
    ("wiki_word_ppl", "Wiki. ppl ↓ (word)", False, "{:.2f}"),
    ("wiki_token_ppl", "Wiki. ppl ↓ (token)", False, "{:.2f}"),
    ("wiki_bpb", "Wiki. bits/byte ↓", False, "{:.4f}"),
    ("lambada_ppl", "LMB. ppl ↓", False, "{:.2f}"),
    ("lambada_acc", "LMB. acc ↑", True, "{:.2f}"),
]


def _fmt(fmt: str, v: float) -> str:
    """``fmt`` for ordinary values; scientific notation for huge ones (perplexities of untrained models)."""
    return fmt.format(v) if abs(v) < 1e5 else f"{v:.3e}"


def _fmt_stats(vals: list[float], fmt: str, spread: bool = True) -> str:
    """The mean, with ``± sample std`` when ``spread`` (runs of different seeds) and there are several."""
    if not vals:
        return "–"
    if len(vals) == 1 or not spread:
        return _fmt(fmt, statistics.mean(vals))
    return _pm(fmt, statistics.mean(vals), statistics.stdev(vals))


def _seeds_differ(seeds: list) -> bool:
    return len({s for s in seeds if s is not None}) > 1


def _pm(fmt: str, mean: float, std: float) -> str:
    if abs(mean) >= 1e5:  # both in the mean's scientific notation
        return f"{mean:.3e} ± {std:.3e}"
    return f"{_fmt(fmt, mean)} ± {_fmt(fmt, std)}"


def compare(records: list[dict]) -> tuple[str, dict]:
    """Markdown and JSON summary of several ``evaluate_model`` records (see module doc).
    Spread is the sample standard deviation over seeds (``±``), shown only for a variant whose runs
    have different seeds (runs of one seed, or of unknown seeds, show their mean alone)."""
    cols = list(_COLUMNS)
    harness_keys = sorted({k for r in records for k in _metrics(r) if k.startswith("h:")})
    cols += [(k, f"{k[2:]} acc ↑", True, "{:.2f}") for k in harness_keys]
    present = [c for c in cols if any(c[0] in _metrics(r) for r in records)]
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["model"]["variant"], []).append(r)
    variants = [v for v in VARIANT_ORDER if v in groups] + sorted(v for v in groups if v not in VARIANT_ORDER)

    summary: dict = {"variants": {}, "models": [], "pairs": [], "paper": PAPER_TABLE1}
    spread = {v: _seeds_differ([r["model"]["seed"] for r in groups[v]]) for v in variants}
    lines = ["## Results (" + ("mean ± sample std over seeds" if any(spread.values()) else "mean over runs") + ")", ""]
    head = ["Model", "Params", "Seeds"] + [c[1] for c in present] + (["Avg. (harness) ↑"] if harness_keys else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join([":---"] + ["---:"] * (len(head) - 1)) + "|"]
    for v in variants:
        rs = sorted(groups[v], key=lambda r: (r["model"]["seed"] is None, r["model"]["seed"]))
        seeds = [r["model"]["seed"] for r in rs]
        entry = {"label": label(v, v), "seeds": seeds, "n": len(rs),
                 "parameters": rs[0]["model"]["parameters"]}
        cells = [entry["label"], f"{entry['parameters'] / 1e6:.2f}M",
                 ", ".join("?" if s is None else str(s) for s in seeds)]
        for key, _, _, fmt in present:
            vals = [_metrics(r)[key] for r in rs if key in _metrics(r)]
            entry[key] = dict(values=vals, mean=statistics.mean(vals) if vals else None,
                              std=statistics.stdev(vals) if len(vals) > 1 and spread[v] else None)
            cells.append(_fmt_stats(vals, fmt, spread[v]))
        if harness_keys:
            avg_keys = [k for k in harness_keys if not k.startswith("h:lambada")] or harness_keys
            avgs = [statistics.mean(_metrics(r)[k] for k in avg_keys) for r in rs
                    if all(k in _metrics(r) for k in avg_keys)]
            entry["harness_avg"] = dict(values=avgs, mean=statistics.mean(avgs) if avgs else None)
            cells.append(_fmt_stats(avgs, "{:.2f}", spread[v]))
        summary["variants"][v] = entry
        lines.append("| " + " | ".join(cells) + " |")

    settings = sorted({_settings(r) for r in records})
    lines += ["", "Settings: " + ("; ".join(settings) if len(settings) == 1 else
                                  "**the models were not evaluated alike**: " + " / ".join(settings))]
    summary["settings"] = settings
    if harness_keys:
        lines += ["", "Avg. (harness) averages the lm-eval task accuracies other than LAMBADA (acc_norm for "
                  "HellaSwag, ARC-c, OBQA, PIQA), as the paper's zero-shot average."]

    lines += ["", "## Per model", ""]
    head2 = ["Model dir", "Variant", "Seed"] + [c[1] for c in present]
    lines += ["| " + " | ".join(head2) + " |", "|" + "|".join([":---", ":---"] + ["---:"] * (len(head2) - 2)) + "|"]
    for v in variants:
        for r in sorted(groups[v], key=lambda r: (r["model"]["seed"] is None, r["model"]["seed"])):
            m = _metrics(r)
            summary["models"].append(dict(name=r["model"]["name"], variant=v, seed=r["model"]["seed"], **m))
            lines.append("| " + " | ".join([str(r["model"]["name"]), label(v, v), str(r["model"]["seed"])]
                                          + [_fmt(fmt, m[k]) if k in m else "–" for k, _, _, fmt in present]) + " |")

    pair_lines = []
    for a, b in PAIRS:
        if a not in groups or b not in groups:
            continue
        pa = {r["model"]["seed"]: _metrics(r) for r in groups[a]}
        pb = {r["model"]["seed"]: _metrics(r) for r in groups[b]}
        common = sorted(s for s in pa if s in pb and s is not None)
        for key, header, higher, fmt in present:
            ma, mb = summary["variants"][a][key]["mean"], summary["variants"][b][key]["mean"]
            if ma is None or mb is None:
                continue
            diffs = [pa[s][key] - pb[s][key] for s in common if key in pa[s] and key in pb[s]]
            wins = sum((d > 0) if higher else (d < 0) for d in diffs)
            p = dict(a=a, b=b, metric=key, higher_is_better=higher, mean_a=ma, mean_b=mb, diff=ma - mb,
                     paired_seeds=common, paired_diffs=diffs, a_better_in=wins,
                     diff_std=statistics.stdev(diffs) if len(diffs) > 1 else None,
                     a_better_on_mean=(ma > mb) if higher else (ma < mb), tie=ma == mb)
            summary["pairs"].append(p)
            la, lb = label(a, a), label(b, b)
            per_seed = ", ".join(f"s{s}: {_fmt(fmt, d)}" for s, d in zip(common, diffs)) or "no paired seeds"
            pair_lines.append(f"| {la} − {lb} | {header} | {_fmt(fmt, ma)} | {_fmt(fmt, mb)} | "
                              f"{'+' if ma - mb >= 0 else ''}{_fmt(fmt, ma - mb)} | {per_seed} | "
                              f"{wins}/{len(diffs)} | {'tie' if p['tie'] else 'yes' if p['a_better_on_mean'] else 'no'} |")
    if pair_lines:
        lines += ["", "## EFLA vs DeltaNet (same seeds paired)", "",
                  "| Pair | Metric | A (mean) | B (mean) | A − B | A − B per seed | A better in | A better on mean |",
                  "|:---|:---|---:|---:|---:|:---|---:|:---:|"] + pair_lines

    verdict = _verdicts(summary)
    if verdict:
        lines += ["", "In words:", ""] + [f"- {v}" for v in verdict]
    summary["verdicts"] = verdict
    commands = sorted({r["command"] for r in records if r.get("command")})
    if commands:
        lines += ["", "Evaluation commands:", "", "```"] + commands + ["```"]

    lines += ["", "## Paper (Table 1; SlimPajama, Mistral tokenizer; for reference, not comparable in scale)", "",
              "| Scale | Model | Wiki. ppl ↓ | LMB. ppl ↓ | LMB. acc ↑ | Avg. zero-shot ↑ |",
              "|:---|:---|---:|---:|---:|---:|"]
    for p in PAPER_TABLE1:
        lines.append(f"| {p['scale']} | {p['model']} | {p['wiki_ppl']:.2f} | {p['lambada_ppl']:.2f} | "
                     f"{p['lambada_acc']:.1f} | {p['avg']:.1f} |")
    lines += ["", "Paper's Wiki. ppl is lm-eval's WikiText word perplexity (the column \"Wiki. ppl (word)\" above is "
              "the same normalisation over the raw test file); LMB. = LAMBADA (OpenAI), acc in %."]
    return "\n".join(lines) + "\n", summary


def _settings(rec: dict) -> str:
    parts = []
    if "wikitext" in rec:
        w = rec["wikitext"]
        parts.append(f"WikiText {os.path.basename(str(w.get('source', '?')))}: context {w.get('context')}, stride "
                     f"{w.get('stride')}, {w.get('scored_tokens')} tokens / {w.get('words')} words / "
                     f"{w.get('bytes')} bytes scored")
    if "lambada" in rec:
        lam = rec["lambada"]
        parts.append(f"LAMBADA {os.path.basename(str(lam.get('source', '?')))}: {lam.get('n')} passages"
                     + (f" of {lam.get('passages_in_file')} (first {lam.get('n')}, --limit)" if lam.get("limit") else "")
                     + f", max length {lam.get('max_length')}")
    return ", ".join(parts) or "no WikiText/LAMBADA"


def _verdicts(summary: dict) -> list[str]:
    """One sentence per compared pair: which is better on each metric, by how much, against the spread."""
    out = []
    by_pair: dict = {}
    for p in summary["pairs"]:
        by_pair.setdefault((p["a"], p["b"]), []).append(p)
    fmt = {c[0]: c[3] for c in _COLUMNS}
    for (a, b), ps in by_pair.items():
        va, vb = summary["variants"][a], summary["variants"][b]
        la, lb = va["label"], vb["label"]
        parts = []
        for p in ps:
            f = fmt.get(p["metric"], "{:.3f}")
            name = next((c[1] for c in _COLUMNS if c[0] == p["metric"]), p["metric"]).replace(" ↓", "").replace(" ↑", "")
            sa, sb = va[p["metric"]]["std"], vb[p["metric"]]["std"]
            spread = max(x for x in (sa, sb, 0.0) if x is not None)
            if p["tie"]:
                parts.append(f"{name} {_fmt(f, p['mean_a'])} for both (tie)")
                continue
            d = p["paired_diffs"]
            if d:
                paired = (f"{la} better in {p['a_better_in']}/{len(d)} paired seeds, per-seed {la} − {lb} "
                          + ", ".join(_fmt(f, x) for x in d)
                          + (f" (mean {_pm(f, statistics.mean(d), statistics.stdev(d))})" if len(d) > 1 else ""))
            else:
                paired = "no paired seeds"
            if spread > 0:
                rel = "larger" if abs(p["diff"]) > spread else "smaller"
                spread_txt = f"the gap is {rel} than the seed-to-seed std of either model (up to {_fmt(f, spread)})"
            else:
                spread_txt = "one seed each, no spread"
            parts.append(f"{name} {_fmt(f, p['mean_a'])} vs {_fmt(f, p['mean_b'])} "
                         f"({la} {'better' if p['a_better_on_mean'] else 'worse'} by {_fmt(f, abs(p['diff']))}; "
                         f"{paired}; {spread_txt})")
        n = f"{la} seeds {va['seeds']}, {lb} seeds {vb['seeds']}"
        out.append(f"{la} vs {lb} ({n}): " + "; ".join(parts) + ".")
    return out


def write_json(path: str, obj) -> None:
    harness.atomic_write_json(path, obj, indent=2)


def write_text(path: str, text: str) -> None:
    harness.atomic_write(path, text)


def _lm_eval_cli() -> None:  # pragma: no cover - thin wrapper
    """lm-eval's command line with the ``efla`` model type registered (``import efla``)."""
    _require_lm_eval()
    import efla  # noqa: F401
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":  # pragma: no cover
    _lm_eval_cli()
