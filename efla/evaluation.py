"""Language-model evaluation: WikiText perplexity, LAMBADA and lm-evaluation-harness (the Table 1
comparison of several models' records is :mod:`efla_lab.lm.compare`).

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
  ``python -m efla.evaluation ARGS`` runs lm-eval's own command line with the ``efla``
  model type registered, e.g.
  ``python -m efla.evaluation run --model hf --model_args pretrained=DIR --tasks lambada_openai``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from efla.data.eval_text import load_lambada, load_text
from efla.models.configuration_efla import config_file_keys
from efla.variants import label

from efla import records

__all__ = [
    "EvalOptions",
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
    _check_efla_config(os.path.join(path, "config.json"), option)
    if not any(n.endswith((".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")) for n in names):
        raise ValueError(f"{path} has a config.json but no weights (*.safetensors) ({option})")
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}
    if not names & tokenizer_files:
        raise ValueError(f"{path} has no tokenizer files (tokenizer.json or tokenizer_config.json) ({option})")


def _check_efla_config(path: str, option: str) -> None:
    """An efla model's ``config.json`` holds only keys EFLAConfig or transformers read (any other model
    type's config is transformers' to judge)."""
    from efla import arg_checks as check  # noqa: PLC0415 (it raises UsageError, a ValueError like ours)

    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON config ({' '.join(str(error).split())}) ({option})") from None
    if isinstance(cfg, dict) and cfg.get("model_type") == "efla":
        check.known_keys(cfg, config_file_keys(), path, option)


def load_model(path: str, device: str = "cpu", dtype: str = "float32"):
    """``(model, tokenizer)`` from a saved model directory (``import efla`` registers the model type)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (lazy: transformers' auto classes only for a saved model)

    import efla  # noqa: F401, PLC0415

    torch_dtype = _torch_dtype(dtype)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval(), tok


def _torch_dtype(dtype: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
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
        path=os.path.abspath(path) if path else None,
        name=os.path.basename(os.path.normpath(path)) if path else None,
        training=training,
        variant=variant,
        label=label(variant, variant),
        seed=seed,
        parameters=sum(p.numel() for p in model.parameters()),
        config={
            k: getattr(cfg, k, None)
            for k in (
                "model_type",
                "update_rule",
                "gated",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_heads",
                "head_dim",
                "max_position_embeddings",
            )
        },
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
        raise ValueError(
            f"stride: expected an int with 1 <= stride < context ({context}), got {stride!r} "
            "(each window needs at least one token of context before the tokens it scores)"
        )
    if n < 2:
        return []
    end = min(context, n)
    windows = [(0, end, 1)]
    while end < n:
        first, end = end, min(end + stride, n)
        windows.append((end - context, end, first))
    return windows


@torch.no_grad()
def score_windows(model, ids: torch.Tensor, windows, batch_size: int = 8, device: str = "cpu", progress=None) -> torch.Tensor:
    """Negative log-likelihood (float64) of every target: ``nll[t]`` for ``t`` scored by ``windows``
    (``nan`` where nothing scored it, e.g. ``t = 0``)."""
    nll = torch.full((ids.numel(),), float("nan"), dtype=torch.float64)
    ids = ids.long()
    # windows of one length go in one batch (all are `context` long, except a short text's single window)
    order = sorted(range(len(windows)), key=lambda i: windows[i][1] - windows[i][0])
    for i0 in range(0, len(order), batch_size):
        group = [windows[i] for i in order[i0 : i0 + batch_size]]
        by_len: dict[int, list] = {}
        for w in group:
            by_len.setdefault(w[1] - w[0], []).append(w)
        for _, ws in by_len.items():
            x = torch.stack([ids[b:e] for b, e, _ in ws]).to(device)
            keep = max(e - f for _, e, f in ws) + 1
            logits = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits.float()
            for j, (_, e, f) in enumerate(ws):
                k = e - f
                lg = logits[j, keep - k - 1 : keep - 1]
                nll[f:e] = F.cross_entropy(lg, ids[f:e].to(lg.device), reduction="none").double().cpu()
        if progress:
            progress(len(group))
    return nll


def evaluate_wikitext(
    model,
    tokenizer,
    text: str,
    context: int = 1024,
    stride: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    prefix: str = "auto",
    max_tokens: int | None = None,
    progress_factory=None,
    return_nll: bool = False,
) -> dict:
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
    nll = score_windows(model, seq, windows, batch_size=batch_size, device=device, progress=bar.update if bar else None)
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
        tokens=len(ids),
        scored_tokens=n_tok,
        words=n_words,
        bytes=n_bytes,
        nll_sum=total,
        token_perplexity=math.exp(total / n_tok),
        word_perplexity=math.exp(total / max(n_words, 1)),
        bits_per_byte=total / (LN2 * max(n_bytes, 1)),
        context=context,
        stride=stride,
        windows=len(windows),
        prefix_token_id=pid,
        first_token_scored=pid is not None,
        truncated_to_tokens=max_tokens if truncated else None,
        seconds=time.perf_counter() - t0,
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
    return ctx, whole[len(ctx) :]


@torch.no_grad()
def evaluate_lambada(
    model, tokenizer, texts: list[str], max_length: int = 1024, batch_size: int = 16, device: str = "cpu", progress_factory=None
) -> dict:
    """Last-word accuracy and perplexity over ``texts`` (see module doc). Sequences longer than
    ``max_length`` tokens keep their last ``max_length``; batches are right-padded (causal model:
    padding after a sequence never changes its scores)."""
    t0 = time.perf_counter()
    items = []
    for i, text in enumerate(texts):
        ctx, cont = encode_pair(tokenizer, *lambada_split(text))
        if not cont:
            raise ValueError(f"passage {i}: the last word encodes to no tokens")
        whole = (ctx + cont)[-(max_length + 1) :]
        items.append((i, whole[:-1], cont))  # input: all but the last token
    examples: list[dict | None] = [None] * len(items)
    order = sorted(range(len(items)), key=lambda j: -len(items[j][1]))
    bar = progress_factory(len(items), "lambada") if progress_factory else None
    for j0 in range(0, len(order), batch_size):
        batch = [items[j] for j in order[j0 : j0 + batch_size]]
        L = max(len(inp) for _, inp, _ in batch)
        x = torch.zeros(len(batch), L, dtype=torch.long)
        for r, (_, inp, _) in enumerate(batch):
            x[r, : len(inp)] = torch.tensor(inp)
        # only the last `keep` positions are needed: those predicting each passage's continuation
        keep = min(L, max(L - len(inp) + len(cont) for _, inp, cont in batch))
        logits = model(input_ids=x.to(device), use_cache=False, logits_to_keep=keep).logits.float()
        for r, (i, inp, cont) in enumerate(batch):
            k = len(cont)
            start = len(inp) - k - (L - keep)
            lg = logits[r, start : start + k]
            tgt = torch.tensor(cont, device=lg.device)
            lp = torch.log_softmax(lg, -1).gather(-1, tgt[:, None])[:, 0]
            greedy = lg.argmax(-1)
            examples[i] = dict(index=i, logprob=float(lp.double().sum()), n_tokens=k, correct=bool((greedy == tgt).all()))
        if bar:
            bar.update(len(batch))
    if bar:
        bar.close()
    n = len(examples)
    acc = sum(e["correct"] for e in examples) / n
    mean_lp = sum(e["logprob"] for e in examples) / n
    return dict(
        n=n,
        accuracy=acc,
        accuracy_stderr=math.sqrt(acc * (1 - acc) / (n - 1)) if n > 1 else float("nan"),
        perplexity=math.exp(-mean_lp),
        mean_logprob=mean_lp,
        mean_target_tokens=sum(e["n_tokens"] for e in examples) / n,
        max_length=max_length,
        seconds=time.perf_counter() - t0,
        examples=examples,
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


@functools.cache
def task_manager(include_path: str | None = None):
    """lm-eval's index of its tasks and those in ``include_path`` (built once: it reads every task YAML)."""
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path) if include_path else TaskManager()


def check_harness_tasks(tasks: list[str], include_path: str | None, lambada: str | None) -> None:
    """Every task of ``tasks`` is one lm-eval knows (``lambada_openai_local`` needs ``lambada``),
    checked before any model loads.

    Raises:
        ValueError: naming the first unknown task (--harness).
    """
    if "lambada_openai_local" in tasks and not include_path and not lambada:
        raise ValueError("--harness lambada_openai_local needs --lambada FILE (--lambada)")
    known = set(task_manager(include_path).all_tasks) | ({"lambada_openai_local"} if not include_path else set())
    unknown = [task for task in tasks if task not in known]
    if unknown:
        include = f" or in {include_path}" if include_path else ""
        raise ValueError(f"lm-eval has no task {unknown[0]!r}{include} (--harness)")


def harness_evaluate(
    model,
    tokenizer,
    tasks: list[str],
    include_path: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    num_fewshot: int | None = None,
    device: str = "cpu",
) -> dict:
    """Run lm-eval's ``simple_evaluate`` on ``tasks`` with an ``HFLM`` wrapping ``model`` and
    ``tokenizer`` (instances, not paths). ``include_path``: a folder of extra task YAMLs.
    Returns ``{task: {metric: value}}`` (lm-eval's ``results`` with ``",none"`` filter suffixes removed)."""
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    res = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=task_manager(include_path),
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=0,
        log_samples=False,
        verbosity="WARNING",
    )
    out = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {
            k.split(",")[0]: v
            for k, v in metrics.items()
            if k != "alias" and isinstance(v, (int, float)) and not k.startswith("sample")
        }
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
    return records.versions("transformers", "lm_eval")


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
        w = evaluate_wikitext(
            model,
            tokenizer,
            text,
            context=context,
            stride=opts.stride,
            batch_size=opts.batch_size,
            device=opts.device,
            prefix=opts.prefix,
            max_tokens=opts.wikitext_max_tokens,
            progress_factory=progress_factory,
        )
        rec["wikitext"] = dict(w, source=source)
    if opts.lambada:
        texts = load_lambada(opts.lambada, opts.limit)
        lam = evaluate_lambada(
            model,
            tokenizer,
            texts,
            max_length=context,
            batch_size=opts.batch_size * 2,
            device=opts.device,
            progress_factory=progress_factory,
        )
        lam.pop("examples")
        rec["lambada"] = dict(
            lam, source=os.path.abspath(opts.lambada), limit=opts.limit, passages_in_file=_count_lines(opts.lambada)
        )
    if opts.harness:
        include = opts.harness_include
        tasks = list(opts.harness)
        if "lambada_openai_local" in tasks and not include:
            if not opts.lambada:
                raise ValueError("--harness lambada_openai_local needs --lambada FILE")

            include = write_lambada_task(opts.lambada, tempfile.mkdtemp(prefix="efla-lm-eval-"))
        rec["harness"] = harness_evaluate(
            model,
            tokenizer,
            tasks,
            include_path=include,
            limit=opts.harness_limit if opts.harness_limit is not None else opts.limit,
            batch_size=opts.batch_size,
            max_length=context,
            num_fewshot=opts.num_fewshot,
            device=opts.device,
        )
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _count_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def write_json(path: str, obj) -> None:
    records.atomic_write_json(path, obj, indent=2)


def write_text(path: str, text: str) -> None:
    records.atomic_write(path, text)


def _lm_eval_cli() -> None:  # pragma: no cover - thin wrapper
    """lm-eval's command line with the ``efla`` model type registered (``import efla``)."""
    _require_lm_eval()
    from lm_eval.__main__ import cli_evaluate

    import efla  # noqa: F401, PLC0415

    cli_evaluate()


if __name__ == "__main__":  # pragma: no cover
    _lm_eval_cli()
