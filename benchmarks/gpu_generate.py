"""Generation speed and memory on one GPU: our fast path (``efla.generation.generate``) vs transformers'
``generate`` on our model and on flash-linear-attention's DeltaNet, and vs a softmax-attention Llama.

All models of one size and stage live in one process; bf16 weights, eval mode, greedy decoding, random
prompt tokens (ids 3..vocab), no early stop (every call makes exactly ``--new-tokens`` tokens). Methods:

* ``fast``: ``efla.generation.generate`` on the ``<size>-efla`` preset (its engine is kept on the model:
  the warm-up call captures the batch's CUDA graph, the timed calls replay it);
  with its default settings (on the GPU: one product over a stacked copy of the input projections' weights,
  and of the MLP's gate and up);
* ``fast-separate``: the same on a copy of the model under ``merged_projections(False)`` (one product per
  projection, no stacked copies; batches 1 and 64 only, a control);
* ``hf``: ``EFLAForCausalLM.generate(do_sample=False, max_new_tokens=n, min_new_tokens=n)``;
* ``fla``: ``fla.models.DeltaNetForCausalLM`` at our preset's sizes through the same ``.generate``.

Stages (``--stages``):

1. ``speed``: batches ``--batches`` at prompt length ``--prompt``. Per batch every method first makes a
   warm-up call (not timed; ``hf`` and ``fla`` make 4 new tokens), then the methods take turns, round by
   round (A, B, C, A, B, C, ...), so they see the same machine state: ``--rounds`` rounds for ``fast``
   and ``fast-separate``, ``--slow-rounds`` for ``hf`` and ``fla``. A round times the whole call
   (``t_all``: prompt and n new tokens) and a prefill-only call (``t_pre``: one new token); from the
   medians: decode tokens/s ``B (n - 1) / (t_all - t_pre)``, ms/token ``1000 (t_all - t_pre) / (n - 1)``,
   prefill tokens/s ``B prompt / t_pre``, end-to-end new tokens/s ``B n / t_all``. Then the targets
   (340M: fast at batch 1 >= 1,000 tokens/s and <= 1.0 ms/token, at batch 64 >= 40,000 tokens/s, fast /
   fla at batch 1 >= 20x; 1.3B: fast at batch 1 <= 1.5 ms/token), PASS or MISS as measured.
2. ``long``: one prompt of ``--long-prompt`` tokens at batch 1 through ``fast`` and ``hf``.
3. ``memory``: peak memory against the context length at batch 1: ``fast`` at prompts ``--curve``
   and transformers' ``LlamaForCausalLM`` of the same sizes (sdpa attention, its default dynamic key/value
   cache, random init); working memory = peak - weights; our decoding state per sequence (MiB); and
   ``fast`` after a ``--prompt`` prompt making ``--new-tokens`` vs ``--long-generation`` tokens (the
   claim: the same peak).
4. ``profile``: kernels per captured decoding step and their GPU time, at each of ``--batches``.
5. ``kernel``: one token mixer's decoding step (input projections, the fused kernel, output
   projection), captured 24 times in a row, by blocks of value columns per head (1, 2, 4, 8), beside
   the state's read-and-write traffic at the H200's nominal bandwidth.
6. ``prefill``: one eager prefill call at a few shapes: wall time at a shape seen before and at new
   lengths, kernels launched and their GPU time, host waits for the device, and the Python functions
   with the most time of their own.
7. ``speculative``: ``generate(..., speculate=ngram)`` against plain ``generate`` (alternated, ``--rounds``
   rounds) at ``--spec-batches`` on the text kinds of ``benchmarks/speculation.py`` (copying and code
   editing, where prompt lookup helps; free text, where it does not): tokens/s and their ratio,
   acceptance rate, tokens per verification pass, the share of target passes that verified; a verification
   pass of ``k + 1`` positions in plain steps; the batch-1 step against its floor, (weight bytes +
   state bytes) / ``--bandwidth-gbs`` (the H200's nominal 4.8 TB/s). Its record:
   ``DIR/gpu_generate_speculative.json``.

Peak memory of a call is what the method would peak at alone in the process: its model's weights, plus
what it keeps allocated between calls (on our model: the stacked projection weights of the decoding
step; ``fast`` also: the engine's state pool and bucket tensors), plus the most the call allocated above
the level before it (``reset_peak_memory_stats`` before, ``max_memory_allocated`` after). The scratch
memory of a captured step (in the CUDA graph's pool, reserved, not allocated) is not counted.

Every measurement that fails (an OOM, fla missing) is that row's error, and the run goes on.

Usage (GPU machine):
    python benchmarks/gpu_generate.py --sizes 340m --stages speed
    python benchmarks/gpu_generate.py --sizes 340m,1.3b --stages speed,long,memory --out DIR
    python benchmarks/gpu_generate.py --batches 1,64 --skip fla:256,hf:long --rounds 3 --slow-rounds 1
    python benchmarks/gpu_generate.py --sizes 340m --stages speculative --rounds 5
Writes ``DIR/gpu_generate.md`` (Markdown, appended as it goes), ``DIR/gpu_generate.json`` (raw rows) and
the speed and long stages' rounds in the shape of ``benchmarks/evidence.py``, ``DIR/gpu_generate_run.json``
(both rewritten after every row; the last is the raw file for ``benchmarks/results/generate/``);
``DIR`` defaults to ``$OUT`` or the current directory.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import efla.layers.single_step as decode
from efla.generation import generate, release
from efla.generation.engine import bucket_size, engine_for
from efla.layers.modules import mlp_intermediate_size
from efla.models import EFLAForCausalLM, get_preset_config
from gpu_model import build_fla  # the fla model the training benchmark compares against

GIB, MIB = 2**30, 2**20
DEVICE = "cuda"
METHODS = ("fast", "fast-separate", "hf", "fla")
CONTROL_BATCHES = (1, 64)  # fast-separate runs only at these batches
SLOW_WARMUP_TOKENS = 4  # new tokens of an hf / fla warm-up call: every kernel runs, a fraction of the time
START = time.perf_counter()
TARGETS = {
    "340m": [
        ("fast, batch 1: decode tokens/s", ("fast", 1, "decode_tokens_per_s"), None, ">=", 1000),
        ("fast, batch 1: ms/token", ("fast", 1, "ms_per_token"), None, "<=", 1.0),
        ("fast, batch 64: decode tokens/s", ("fast", 64, "decode_tokens_per_s"), None, ">=", 40000),
        ("fast / fla, batch 1: decode", ("fast", 1, "decode_tokens_per_s"), ("fla", 1, "decode_tokens_per_s"), ">=", 20),
    ],
    "1.3b": [("fast, batch 1: ms/token", ("fast", 1, "ms_per_token"), None, "<=", 1.5)],
}


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:8.1f} s] {message}", flush=True)


class Report:
    """The Markdown file (appended line by line) and the JSON file (rewritten after every row)."""

    def __init__(self, out_dir: str):
        self.md = os.path.join(out_dir, "gpu_generate.md")
        self.json = os.path.join(out_dir, "gpu_generate.json")
        self.result = dict(info={}, rows=[])
        open(self.md, "w").close()

    def emit(self, line: str = "") -> None:
        print(line, flush=True)
        with open(self.md, "a") as fh:
            fh.write(line + "\n")

    def record(self, row: dict) -> dict:
        self.result["rows"].append(row)
        with open(self.json, "w") as fh:
            json.dump(self.result, fh, indent=1)
        write_record(os.path.join(os.path.dirname(self.json), "gpu_generate_run.json"), self.result)
        return row


def per_round(row: dict, rounds: int) -> dict[str, list[float]]:
    """A speed row's first ``rounds`` rounds: decode tokens/s, end-to-end new tokens/s, peak GiB."""
    B, n = row["batch"], row["new_tokens"]
    calls = list(zip(row["all_s"], row["prefill_s"]))[:rounds]
    return dict(
        decode=[B * (n - 1) / (t_all - t_pre) for t_all, t_pre in calls],
        e2e=[B * n / t_all for t_all, _ in calls],
        peak=row["peak_gib_all"][:rounds],
    )


DECODE, END_TO_END = "decode throughput (prefill taken out)", "end-to-end throughput (whole calls)"
METHOD_NAMES = {
    "fast": "efla.generation.generate",
    "fast-separate": "efla.generation.generate, one product per projection",
    "hf": "transformers generate, our model",
    "fla": "transformers generate, fla DeltaNet",
}


def measurements(rows: list[dict], rounds: int) -> list[dict]:
    """``fast`` against every other method of the same size, stage and batch, round by round (the
    methods took turns within a round): decode and end-to-end throughput, and each one's peak memory."""
    from evidence import measurement

    timed = [r for r in rows if len(r.get("all_s", ())) >= rounds and "peak_gib_all" in r]
    found = []
    for key in dict.fromkeys((r["size"], r["stage"], r["batch"], r["prompt"], r["new_tokens"]) for r in timed):
        group = {
            METHOD_NAMES[r["method"]]: per_round(r, rounds)
            for r in timed
            if (r["size"], r["stage"], r["batch"], r["prompt"], r["new_tokens"]) == key
        }
        case = f"{key[0]}, batch {key[2]}, prompt {key[3]}, {key[4]} new tokens"
        fast = METHOD_NAMES["fast"]
        ours = group.get(fast)
        for name, other in group.items():
            if ours and name != fast:
                found.append(measurement(case, DECODE, "tokens/s", "higher", (fast, ours["decode"]), (name, other["decode"])))
                found.append(measurement(case, END_TO_END, "new tokens/s", "higher", (fast, ours["e2e"]), (name, other["e2e"])))
        found += [measurement(case, "peak memory", "GiB", "lower", (name, g["peak"]), None) for name, g in group.items()]
    return found


def write_record(path: str, result: dict) -> None:
    """The speed and long stages in the shape of ``benchmarks/evidence.py`` (rewritten after every row)."""
    from evidence import write_run

    info = result["info"]
    rounds = min(info["rounds"], info["slow_rounds"])
    found = measurements(result["rows"], rounds)
    if found:
        notes = [
            f"prompt {info['prompt']} tokens (long stage: {info['long_prompt']}), {info['new_tokens']} new tokens, greedy, bf16",
            "decode throughput: B (n - 1) / (whole call - one-token call) of the same round; end to end: B n / whole call",
            f"fast ran {info['rounds']} rounds, hf and fla {info['slow_rounds']}: "
            f"the first {rounds} of each, taken in the same rounds, are kept",
        ]
        write_run(path, "gpu_generate", f"Generation speed, {', '.join(info['sizes'])}", rounds, found, notes)


def error_line(e: BaseException) -> str:
    """``Type: first line`` of the innermost cause, fit for a table cell."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:160]}".replace("|", "/")


def sync() -> None:
    torch.cuda.synchronize()


# -- models and methods -------------------------------------------------------------------------------


def tensor_bytes(obj, seen: set) -> int:
    """Bytes of the tensors in ``obj`` (nested dicts, lists, tuples), each storage counted once."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o, seen) for o in obj.values())
    return 0


def weight_bytes(model) -> int:
    return tensor_bytes(list(model.parameters()) + list(model.buffers()), set())


def stacked_bytes(model, seen: set) -> int:
    """The stacked copies of the layers' projection weights that the decoding step makes (merged projections)."""
    name = getattr(decode, "_STACK", "_decode_stacked_weight")
    return tensor_bytes([m.__dict__[name][2] for m in model.modules() if name in m.__dict__], seen)


def engine_bytes(model, seen: set) -> int:
    """The fast path's engine: its state pool and bucket tensors."""
    engine = model.__dict__.get("_efla_decode_engine")
    if engine is None:
        return 0
    buckets = [{k: v for k, v in vars(b).items() if k != "graphs"} for b in engine.buckets.values()]
    return tensor_bytes([engine.cache.states if engine.cache else [], buckets], seen)


def state_mib_per_sequence(model) -> float:
    """The decoding state of one sequence: the engine pool's bytes over its rows."""
    engine = engine_for(model)
    return tensor_bytes(engine.cache.states, set()) / (engine.capacity + 1) / MIB


@dataclass
class Method:
    name: str
    model: torch.nn.Module
    run: Callable[[torch.Tensor, int], torch.Tensor]  # (prompt ids, new tokens) -> [B, T + n]
    slow: bool = False  # hf / fla: --slow-rounds, short warm-up
    engine: bool = False  # keeps a decoding engine on the model between calls

    def __post_init__(self):
        self.weights = weight_bytes(self.model)

    def kept_bytes(self) -> int:
        """What the method keeps allocated between calls: stacked projection weights (our model's
        decoding step, fast or hf) and, for the fast path, its engine."""
        seen = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        return stacked_bytes(self.model, seen) + (engine_bytes(self.model, seen) if self.engine else 0)


def fast_method(name: str, model, merged: bool | None = None) -> Method:
    """``generate`` on ``model``; ``merged``: stacked projections on or off (``None``: the default)."""

    def run(ids, n):
        if merged is None:
            return generate(model, ids, max_new_tokens=n, eos_token_id=[])
        with decode.merged_projections(merged):
            return generate(model, ids, max_new_tokens=n, eos_token_id=[])

    return Method(name, model, run, engine=True)


def hf_method(name: str, model) -> Method:
    def run(ids, n):
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            eos_token_id=None,
            pad_token_id=0,
        )

    return Method(name, model, run, slow=True)


def on_device(build):
    torch.manual_seed(0)
    with torch.device(DEVICE):  # initialised on the GPU: a 1.3B model's CPU init takes a minute
        model = build()
    return model.to(torch.bfloat16).eval()


def build_ours(size: str):
    return on_device(lambda: EFLAForCausalLM(get_preset_config(f"{size}-efla")))


def llama_model(size: str, max_positions: int):
    """transformers' Llama at our preset's sizes (heads of ``head_dim``, as many key/value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = get_preset_config(f"{size}-efla")
    cfg = LlamaConfig(
        vocab_size=ours.vocab_size,
        hidden_size=ours.hidden_size,
        num_hidden_layers=ours.num_hidden_layers,
        num_attention_heads=ours.num_heads,
        num_key_value_heads=ours.num_heads,
        head_dim=ours.head_dim,
        intermediate_size=mlp_intermediate_size(ours.hidden_size, ours.hidden_ratio, ours.intermediate_size),
        max_position_embeddings=max_positions,
        rms_norm_eps=ours.norm_eps,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def prompt_ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(1_000_003 * batch + length)
    return torch.randint(3, vocab, (batch, length), generator=gen, device=DEVICE)


def free(models: list) -> None:
    for model in models:
        release(model)
    models.clear()
    gc.collect()
    torch.cuda.empty_cache()


# -- measuring ----------------------------------------------------------------------------------------


def timed_call(method: Method, ids: torch.Tensor, n: int) -> tuple[float, int, int]:
    """One call: (seconds, peak bytes of the method alone, new tokens made)."""
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = method.run(ids, n)
    sync()
    seconds = time.perf_counter() - t0
    peak = method.weights + method.kept_bytes() + torch.cuda.max_memory_allocated() - before
    made = out.shape[1] - ids.shape[1]
    del out
    return seconds, peak, made


def warm_up(method: Method, ids: torch.Tensor, n: int) -> None:
    if method.engine:
        release(method.model)  # a pool of this batch's size (a larger one stays otherwise)
    timed_call(method, ids, min(n, SLOW_WARMUP_TOKENS) if method.slow else n)


def one_round(method: Method, ids: torch.Tensor, n: int, samples: dict) -> None:
    seconds, peak, made = timed_call(method, ids, n)
    prefill, _, _ = timed_call(method, ids, 1)
    samples["all"].append(seconds)
    samples["pre"].append(prefill)
    samples["peak"] = max(samples["peak"], peak)
    samples["peaks"].append(peak / GIB)
    samples["made"] = made
    log(f"  {method.name} B={ids.shape[0]} T={ids.shape[1]}: {seconds:.3f} s all, {prefill:.3f} s prefill")


def attempt(failed: dict, method: Method, fn, *args) -> None:
    """``fn(*args)``; an exception becomes ``failed[method.name]`` and the run goes on."""
    try:
        fn(*args)
        return
    except Exception as e:
        failed[method.name] = error_line(e)
        traceback.print_exc()
    log(f"  {method.name}: failed: {failed[method.name]}")  # the frames of the error are gone: free their memory
    if method.engine:
        release(method.model)
    gc.collect()
    torch.cuda.empty_cache()


def measure(methods: list[Method], ids: torch.Tensor, args, base: dict) -> list[dict]:
    """Warm-up of every method, then the timed rounds, the methods alternated round by round."""
    samples = {m.name: dict(all=[], pre=[], peak=0, peaks=[], made=None) for m in methods}
    failed: dict[str, str] = {}
    for m in methods:
        log(f"  {m.name} B={ids.shape[0]} T={ids.shape[1]}: warm-up")
        attempt(failed, m, warm_up, m, ids, args.new_tokens)
    rounds = {m.name: args.slow_rounds if m.slow else args.rounds for m in methods}
    for r in range(max(rounds.values(), default=0)):
        for m in methods:
            if m.name not in failed and r < rounds[m.name]:
                attempt(failed, m, one_round, m, ids, args.new_tokens, samples[m.name])
    return [speed_row(m, ids, args.new_tokens, samples[m.name], failed.get(m.name), base) for m in methods]


def speed_row(method: Method, ids: torch.Tensor, n: int, samples: dict, error: str | None, base: dict) -> dict:
    B, T = ids.shape
    row = dict(base, method=method.name, batch=B, prompt=T, new_tokens=n, weights_gib=method.weights / GIB)
    if error or not samples["all"]:
        return dict(row, error=error or "no rounds")
    t_all, t_pre = statistics.median(samples["all"]), statistics.median(samples["pre"])
    decode_s = t_all - t_pre
    return dict(
        row,
        all_s=samples["all"],
        prefill_s=samples["pre"],
        all_s_median=t_all,
        prefill_s_median=t_pre,
        decode_tokens_per_s=B * (n - 1) / decode_s if decode_s > 0 else None,
        ms_per_token=1e3 * decode_s / (n - 1),
        prefill_tokens_per_s=B * T / t_pre,
        e2e_new_tokens_per_s=B * n / t_all,
        peak_gib=samples["peak"] / GIB,
        peak_gib_all=samples["peaks"],
        made=samples["made"],
    )


def fmt(value, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def label(row: dict) -> str:
    made = row.get("made")
    return row["method"] if made in (None, row["new_tokens"]) else f"{row['method']} (made {made} new tokens)"


def ratio(row: dict, ref: dict | None) -> str:
    if not ref or not row.get("decode_tokens_per_s") or not ref.get("decode_tokens_per_s"):
        return "-"
    return f"{row['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.1f}x"


# -- stage: speed -------------------------------------------------------------------------------------


def parse_skip(text: str) -> set[str]:
    return {s.strip() for s in text.split(",") if s.strip()}


def skipped(args, name: str, where) -> bool:
    return name in args.skip or f"{name}:{where}" in args.skip


def wanted(args, name: str, batch: int) -> bool:
    return not skipped(args, name, batch) and (name != "fast-separate" or batch in CONTROL_BATCHES)


def speed_methods(size: str, args, report: Report, models: list) -> dict[str, Method]:
    ours = build_ours(size)
    models.append(ours)
    methods = {"fast": fast_method("fast", ours), "hf": hf_method("hf", ours)}
    if any(wanted(args, "fast-separate", b) for b in args.batches):
        separate = build_ours(size)
        separate.load_state_dict(ours.state_dict())
        models.append(separate)
        methods["fast-separate"] = fast_method("fast-separate", separate, merged=False)
    if any(wanted(args, "fla", b) for b in args.batches):
        try:
            models.append(on_device(lambda: build_fla(size)))
            methods["fla"] = hf_method("fla", models[-1])
        except Exception as e:  # fla missing or a build error: its rows are left out, not the table
            report.emit(f"- {size} fla: not built ({error_line(e)})")
            report.emit("")
            report.record(dict(size=size, stage="speed", method="fla", error=error_line(e)))
    return {name: methods[name] for name in METHODS if name in methods}


def speed_stage(size: str, args, report: Report) -> None:
    models: list = []
    try:
        methods = speed_methods(size, args, report, models)
        report.emit(f"## {size}: generation speed, prompt {args.prompt}, {args.new_tokens} new tokens, greedy")
        report.emit("")
        report.emit("- weights: " + ", ".join(f"{m.name} {m.weights / GIB:.2f} GiB" for m in methods.values()))
        report.emit("")
        report.emit(
            "| batch | method | decode tokens/s | ms/token | prefill tokens/s | end-to-end new tokens/s | peak GiB "
            "| decode vs fla | decode vs hf |"
        )
        report.emit("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        rows = []
        for B in args.batches:
            log(f"{size} speed: batch {B}")
            chosen = [m for m in methods.values() if wanted(args, m.name, B)]
            ids = prompt_ids(B, args.prompt, get_preset_config(f"{size}-efla").vocab_size)
            batch_rows = [report.record(r) for r in measure(chosen, ids, args, dict(size=size, stage="speed"))]
            emit_speed_rows(report, batch_rows)
            rows += batch_rows
        report.emit("")
        emit_targets(report, size, rows)
    finally:
        free(models)


def emit_speed_rows(report: Report, rows: list[dict]) -> None:
    by_method = {r["method"]: r for r in rows}
    for r in rows:
        if "error" in r:
            report.emit(f"| {r['batch']} | {r['method']} | failed: {r['error']} | | | | | | |")
            continue
        report.emit(
            f"| {r['batch']} | {label(r)} | {fmt(r['decode_tokens_per_s'])} | {r['ms_per_token']:.3f} "
            f"| {fmt(r['prefill_tokens_per_s'])} | {fmt(r['e2e_new_tokens_per_s'])} | {r['peak_gib']:.2f} "
            f"| {ratio(r, by_method.get('fla'))} | {ratio(r, by_method.get('hf'))} |"
        )


def metric(rows: list[dict], key) -> float | None:
    method, batch, field = key
    row = next((r for r in rows if r["method"] == method and r.get("batch") == batch and "error" not in r), None)
    return row.get(field) if row else None


def emit_targets(report: Report, size: str, rows: list[dict]) -> None:
    for name, key, over, op, bound in TARGETS.get(size, []):
        value, ref = metric(rows, key), (metric(rows, over) if over else 1.0)
        if value is None or not ref:
            report.emit(f"- target {name} {op} {bound:,}: no measurement")
            continue
        value /= ref
        met = value >= bound if op == ">=" else value <= bound
        report.emit(f"- target {name} {op} {bound:,}: measured {number(value)}: {'PASS' if met else 'MISS'}")
    report.emit("")


# -- stage: long prompt -------------------------------------------------------------------------------


def long_stage(size: str, args, report: Report) -> None:
    models = [build_ours(size)]
    try:
        methods = [m for m in (fast_method("fast", models[0]), hf_method("hf", models[0])) if not skipped(args, m.name, "long")]
        log(f"{size} long: prompt {args.long_prompt}")
        ids = prompt_ids(1, args.long_prompt, get_preset_config(f"{size}-efla").vocab_size)
        rows = [report.record(r) for r in measure(methods, ids, args, dict(size=size, stage="long"))]
        report.emit(f"## {size}: one long prompt of {args.long_prompt:,} tokens, batch 1, {args.new_tokens} new tokens")
        report.emit("")
        report.emit("| method | prefill tokens/s | decode tokens/s | ms/token | peak GiB |")
        report.emit("| --- | --- | --- | --- | --- |")
        for r in rows:
            if "error" in r:
                report.emit(f"| {r['method']} | failed: {r['error']} | | | |")
            else:
                report.emit(
                    f"| {label(r)} | {fmt(r['prefill_tokens_per_s'])} | {fmt(r['decode_tokens_per_s'])} "
                    f"| {r['ms_per_token']:.3f} | {r['peak_gib']:.2f} |"
                )
        report.emit("")
    finally:
        free(models)


# -- stage: memory against context --------------------------------------------------------------------


def memory_row(method: Method, ids: torch.Tensor, n: int, warm_tokens: int, base: dict) -> dict:
    row = dict(base, method=method.name, batch=ids.shape[0], prompt=ids.shape[1], new_tokens=n, weights_gib=method.weights / GIB)
    failed: dict[str, str] = {}
    measured: list[tuple] = []
    log(f"  {method.name} prompt {ids.shape[1]}, {n} new tokens")
    attempt(failed, method, timed_call, method, ids, warm_tokens)
    if method.name not in failed:
        attempt(failed, method, lambda: measured.append(timed_call(method, ids, n)))
    if method.name in failed:
        return dict(row, error=failed[method.name])
    seconds, peak, made = measured[0]
    return dict(row, seconds=seconds, made=made, peak_gib=peak / GIB, working_gib=(peak - method.weights) / GIB)


def fast_memory(size: str, args, report: Report, emit_row) -> float | None:
    """Our rows: the context curve, then the short vs long generation; returns our state MiB per sequence."""
    models = [build_ours(size)]
    try:
        fast = fast_method("fast", models[0])
        base = dict(size=size, stage="memory", model="efla fast")
        for length in args.curve:
            ids = prompt_ids(1, length, get_preset_config(f"{size}-efla").vocab_size)
            emit_row(report.record(memory_row(fast, ids, args.new_tokens, args.new_tokens, base)))
        state = state_mib_per_sequence(models[0])
        ids = prompt_ids(1, args.prompt, get_preset_config(f"{size}-efla").vocab_size)
        for n in (args.new_tokens, args.long_generation):
            emit_row(report.record(memory_row(fast, ids, n, 2, dict(base, part="generation length"))))
        return state
    finally:
        free(models)


def llama_memory(size: str, args, report: Report, emit_row) -> None:
    models = [on_device(lambda: llama_model(size, max(args.curve) + args.new_tokens))]
    try:
        llama = hf_method("llama", models[0])
        for length in args.curve:
            ids = prompt_ids(1, length, models[0].config.vocab_size)
            emit_row(
                report.record(memory_row(llama, ids, args.new_tokens, 2, dict(size=size, stage="memory", model="llama sdpa")))
            )
    finally:
        free(models)


def memory_stage(size: str, args, report: Report) -> None:
    report.emit(f"## {size}: peak memory against context, batch 1 (working = peak - weights)")
    report.emit("")
    report.emit("| model | prompt | new tokens | weights GiB | peak GiB | working GiB |")
    report.emit("| --- | --- | --- | --- | --- | --- |")
    rows: list[dict] = []

    def emit_row(r: dict) -> None:
        rows.append(r)
        if "error" in r:
            report.emit(f"| {r['model']} | {r['prompt']} | {r['new_tokens']} | failed: {r['error']} | | |")
        else:
            report.emit(
                f"| {r['model']} | {r['prompt']} | {r['new_tokens']} | {r['weights_gib']:.2f} "
                f"| {r['peak_gib']:.3f} | {r['working_gib']:.3f} |"
            )

    state = None
    try:
        state = fast_memory(size, args, report, emit_row)
    except Exception as e:  # the Llama rows are still worth having
        traceback.print_exc()
        report.emit(f"| efla fast | | | failed: {error_line(e)} | | |")
    try:
        llama_memory(size, args, report, emit_row)
    except Exception as e:  # transformers' Llama failed to build: our rows stand alone
        traceback.print_exc()
        report.emit(f"| llama sdpa | | | failed: {error_line(e)} | | |")
    report.emit("")
    emit_memory_summary(report, args, rows, state)


def emit_memory_summary(report: Report, args, rows: list[dict], state: float | None) -> None:
    report.record(dict(stage="memory", state_mib_per_sequence=state))
    report.emit(f"- our decoding state: {fmt(state, '.2f')} MiB per sequence, whatever the context")
    ok = [r for r in rows if "error" not in r]
    for length in args.curve:
        ours = next((r for r in ok if r["model"] == "efla fast" and r["prompt"] == length and "part" not in r), None)
        llama = next((r for r in ok if r["model"] == "llama sdpa" and r["prompt"] == length), None)
        if ours and llama:
            report.emit(
                f"- prompt {length:,}: working memory llama / ours = {llama['working_gib']:.3f} / "
                f"{ours['working_gib']:.3f} GiB = {llama['working_gib'] / max(ours['working_gib'], 1e-9):.1f}x"
            )
    short, long = (
        next((r for r in ok if r.get("part") and r["new_tokens"] == n), None) for n in (args.new_tokens, args.long_generation)
    )
    if short and long:
        diff = (long["peak_gib"] - short["peak_gib"]) * GIB / MIB
        report.emit(
            f"- fast, prompt {args.prompt}: peak {short['peak_gib']:.3f} GiB making {args.new_tokens} tokens, "
            f"{long['peak_gib']:.3f} GiB making {args.long_generation} (difference {diff:.2f} MiB): "
            f"{'PASS' if abs(diff) < 1 else 'MISS'} (claim: equal)"
        )
    report.emit("")


# -- stage: one decoding step under the profiler -------------------------------------------------------


def step_kernels(model, batch: int, replays: int = 10) -> tuple[float, float, list]:
    """(kernels per step, GPU ms per step, [(name, launches per step, us each)] by total time) of the
    captured step of ``batch`` rows (the engine's bucket for it, captured by a call before)."""
    from torch.profiler import ProfilerActivity, profile

    graph = engine_for(model).bucket(batch).graphs[False]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        sync()
    kernels: dict[str, list] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = kernels.setdefault(event.name[:60], [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time
    count = sum(n for n, _ in kernels.values()) / replays
    gpu_ms = sum(t for _, t in kernels.values()) / replays / 1e3
    table = sorted(((name, n / replays, t / n) for name, (n, t) in kernels.items()), key=lambda r: -r[1] * r[2])
    return count, gpu_ms, table


def profile_stage(size: str, args, report: Report) -> None:
    models = [build_ours(size)]
    try:
        report.emit(f"## {size}: one captured decoding step under the profiler")
        report.emit("")
        for B in args.batches:
            ids = prompt_ids(B, args.prompt, get_preset_config(f"{size}-efla").vocab_size)
            generate(models[0], ids, max_new_tokens=2, eos_token_id=[])
            count, gpu_ms, table = step_kernels(models[0], B)
            report.record(dict(size=size, stage="profile", batch=B, kernels=count, gpu_ms=gpu_ms, top=table[:12]))
            report.emit(
                f"- batch {B} (bucket {engine_for(models[0]).bucket_size(B)}): {count:.0f} kernels, "
                f"{gpu_ms:.3f} ms GPU time per step; by time: "
                + "; ".join(f"{name} {n:.0f} x {us:.2f} us" for name, n, us in table[:6])
            )
        report.emit("")
    finally:
        free(models)


# -- stage: the fused decoding kernel alone, by blocks of value columns -------------------------------

H200_BANDWIDTH = 4.8e12  # bytes/s, the H200's nominal memory bandwidth


def decode_kernel_us(layer, batch: int, blocks: int, calls: int = 24) -> float:
    """GPU microseconds per fused decoding step of ``layer`` for ``batch`` rows with ``blocks`` blocks
    of value columns per head (``calls`` steps on distinct state pools, captured in one CUDA graph,
    as a decoding step runs them one layer after the other)."""
    from efla.models.cache import EFLACache
    from efla.ops.cuda import decode as cuda_decode

    hidden = torch.randn(calls, batch, 1, layer.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    caches = []
    for _ in range(calls):
        cache = EFLACache(1)
        cache.states[0] = layer.empty_state(batch, DEVICE, torch.bfloat16)
        caches.append(cache)

    def steps():
        for x, cache in zip(hidden, caches):
            layer._fused_step(x, cache.states[0], cache)

    with torch.no_grad(), cuda_decode.value_blocks(blocks):
        steps()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            steps()
        graph.replay()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        sync()
    return start.elapsed_time(end) * 1e3 / (10 * calls)


def kernel_stage(size: str, args, report: Report) -> None:
    """The input projections, the fused kernel(s) and the output projection of one token mixer of
    ``size`` per step, at each batch and 1, 2, 4, 8 blocks of value columns; the state's traffic
    (read and written once) at the H200's nominal bandwidth is the floor of the kernel alone."""
    from efla.models.modeling_efla import build_token_mixer

    cfg = get_preset_config(f"{size}-efla")
    layer = build_token_mixer(cfg, 0).to(DEVICE, torch.bfloat16).eval()
    spec = layer.decode_spec()
    state_bytes = spec.num_heads * spec.groups * spec.head_k_dim * spec.head_v_dim * 4
    report.emit(f"## {size}: one token mixer's decoding step (projections + fused kernel), us per step")
    report.emit("")
    report.emit("| batch | 1 block | 2 blocks | 4 blocks | 8 blocks | state traffic floor |")
    report.emit("| --- | --- | --- | --- | --- | --- |")
    for B in args.batches:
        bucket = bucket_size(B)
        times = [decode_kernel_us(layer, bucket, blocks) for blocks in (1, 2, 4, 8)]
        floor = 2 * bucket * state_bytes / H200_BANDWIDTH * 1e6
        report.record(dict(size=size, stage="kernel", batch=B, bucket=bucket, us=times, floor_us=floor))
        report.emit(f"| {B} (bucket {bucket}) | " + " | ".join(f"{t:.1f}" for t in times) + f" | {floor:.1f} |")
    report.emit("")


# -- stage: speculative decoding (prompt lookup) against plain generate -------------------------------

H200_BANDWIDTH_GBS = 4800  # nominal HBM3e bandwidth: the floor of a step that reads every weight once


def speculative_measurements(model, name: str, args, device, sync=lambda: None) -> tuple[list[dict], list[str]]:
    """``benchmarks/speculation.py``'s kinds at ``--spec-batches`` (speculative against plain
    ``generate``, alternated, ``--rounds`` rounds of ``--new-tokens``), a verification pass of ``k + 1``
    positions in plain steps at each batch, and the batch-1 step against its floor: (weight bytes +
    state bytes read and written) / ``--bandwidth-gbs``. Returns the records and console lines; any
    device (the CPU runs it in the tests)."""
    import speculation

    found, lines, step_seconds = [], [], []
    for kind in speculation.KINDS:
        for batch in args.spec_batches:
            timed = speculation.measure_case(model, kind, batch, args.new_tokens, args.rounds, time.perf_counter, sync, device)
            case = f"{name} {kind} batch {batch}"
            found += speculation.case_measurements(case, batch, timed)
            lines.append(speculation.describe(case, timed))
            if batch == 1 and kind == "copying":
                step_seconds = [1 / rate for rate in timed["plain"]]
    width = speculation.SPECULATE["num_speculative_tokens"] + 1
    for batch in args.spec_batches:
        ratios = speculation.pass_cost(model, batch, width, args.rounds, time.perf_counter, sync)
        case = f"{name} batch {batch}, {width} positions"
        found.append(measurement_of("verification pass / plain decoding step", "steps", case, ratios))
        lines.append(f"{case}: a verification pass costs {statistics.median(ratios):.2f} plain steps")
    if step_seconds:
        floor = speculation.step_bytes(model) / (args.bandwidth_gbs * 1e9)
        found += speculation.floor_measurements(f"{name} batch 1", step_seconds, floor, args.rounds)
        lines.append(
            f"{name} batch 1: plain step {statistics.median(step_seconds) * 1e3:.3f} ms (whole calls, prefill included) "
            f"vs floor {floor * 1e6:.1f} us: {statistics.median(step_seconds) / floor:,.1f}x"
        )
    return found, lines


def measurement_of(metric: str, unit: str, case: str, values: list[float]) -> dict:
    from evidence import measurement

    return measurement(case, metric, unit, "lower", ("verification pass", values), None)


def speculative_stage(size: str, args, report: Report) -> None:
    from evidence import write_run

    models = [build_ours(size)]
    try:
        found, lines = speculative_measurements(models[0], size, args, torch.device(DEVICE), sync)
        report.emit(f"## {size}: speculative decoding (prompt lookup) against plain generate, bf16")
        report.emit("")
        for line in lines:
            report.emit(f"- {line}")
        report.emit("")
        notes = [
            "kinds: benchmarks/speculation.py (copying and code editing greedy, checked equal to plain greedy; free "
            "sampled at temperature 1); random weights",
            f"{args.new_tokens} new tokens per call, bf16, wall clock with the device synchronised around each call",
            f"floor: (weight bytes + state bytes read and written) / {args.bandwidth_gbs:g} GB/s "
            f"({'the H200 nominal bandwidth' if args.bandwidth_gbs == H200_BANDWIDTH_GBS else 'given'}); the step: "
            "1 / tokens/s of whole plain calls at batch 1 (prefill included)",
        ]
        path = os.path.join(args.out, "gpu_generate_speculative.json")
        write_run(path, "gpu_generate_speculative", f"Speculative decoding, {size}", args.rounds, found, notes)
        report.record(dict(size=size, stage="speculative", record=path))
    finally:
        free(models)


# -- stage: one eager prefill call, where its time goes -----------------------------------------------

PREFILL_SHAPES = ((1, 32), (1, 512), (8, 512), (64, 512))


def timed_prefill(engine, prompts: list[torch.Tensor]) -> float:
    sync()
    t0 = time.perf_counter()
    engine.prefill(prompts, torch.arange(len(prompts), device=DEVICE))
    sync()
    return time.perf_counter() - t0


def prefill_device_profile(engine, prompts: list[torch.Tensor]) -> tuple[int, float, int]:
    """(kernels launched, their GPU ms, host waits for the device) of one prefill call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_prefill(engine, prompts)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    waits = sum(
        1 for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense")
    )
    return len(kernels), sum(e.device_time for e in kernels) / 1e3, waits - 1  # less the timer's own sync


def prefill_host_profile(engine, prompts: list[torch.Tensor], top: int = 12) -> list[tuple[str, int, float]]:
    """The Python functions of one prefill call with the most time of their own: (where, calls, ms)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    timed_prefill(engine, prompts)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = [
        (f"{os.path.basename(f)}:{line}:{name}", calls, own * 1e3) for (f, line, name), (_, calls, own, _, _) in stats.items()
    ]
    return sorted(rows, key=lambda r: -r[2])[:top]


def prefill_stage(size: str, _args, report: Report) -> None:
    """An eager prefill call (``DecodeEngine.prefill``: packed prompts through the chunk kernels, the
    states written to pool rows) at a few shapes: wall ms at a shape seen before and at new total
    lengths, the kernels it launches and their GPU time, host waits, and the Python functions with the
    most time of their own (cProfile adds to the wall time of that call only)."""
    models = [build_ours(size)]
    try:
        engine = engine_for(models[0])
        engine.reserve(max(b for b, _ in PREFILL_SHAPES))
        vocab = get_preset_config(f"{size}-efla").vocab_size
        report.emit(f"## {size}: one eager prefill call")
        report.emit("")
        report.emit("| prompts x tokens | wall ms (seen shape) | wall ms (new lengths) | kernels | GPU ms | host waits |")
        report.emit("| --- | --- | --- | --- | --- | --- |")
        for batch, length in PREFILL_SHAPES:
            prompts = list(prompt_ids(batch, length, vocab))
            timed_prefill(engine, prompts)
            seen = statistics.median(timed_prefill(engine, prompts) for _ in range(5))
            fresh = statistics.median(timed_prefill(engine, [p[: length - 1 - i] for p in prompts]) for i in range(3))
            kernels, gpu_ms, waits = prefill_device_profile(engine, prompts)
            host = prefill_host_profile(engine, prompts)
            report.record(
                dict(
                    size=size,
                    stage="prefill",
                    batch=batch,
                    prompt=length,
                    seen_ms=seen * 1e3,
                    new_lengths_ms=fresh * 1e3,
                    kernels=kernels,
                    gpu_ms=gpu_ms,
                    host_waits=waits,
                    host=host,
                )
            )
            report.emit(f"| {batch} x {length} | {seen * 1e3:.1f} | {fresh * 1e3:.1f} | {kernels} | {gpu_ms:.2f} | {waits} |")
            log("  own time: " + "; ".join(f"{w} {n} x = {ms:.1f} ms" for w, n, ms in host[:8]))
        report.emit("")
    finally:
        free(models)


# -- main ---------------------------------------------------------------------------------------------

STAGES = {
    "speed": speed_stage,
    "long": long_stage,
    "memory": memory_stage,
    "profile": profile_stage,
    "kernel": kernel_stage,
    "prefill": prefill_stage,
    "speculative": speculative_stage,
}


def header(report: Report, args) -> None:
    import transformers

    versions = {}
    for name in ("triton", "fla"):
        try:
            versions[name] = getattr(__import__(name), "__version__", "?")
        except Exception as e:  # optional here: the row of whatever needs it fails instead
            versions[name] = f"not importable ({error_line(e)})"
    info = dict(
        date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=versions["triton"],
        transformers=transformers.__version__,
        fla=versions["fla"],
        command=" ".join(sys.argv),
        sizes=args.sizes,
        stages=args.stages,
        batches=args.batches,
        prompt=args.prompt,
        new_tokens=args.new_tokens,
        rounds=args.rounds,
        slow_rounds=args.slow_rounds,
        skip=sorted(args.skip),
        long_prompt=args.long_prompt,
        curve=args.curve,
        long_generation=args.long_generation,
        spec_batches=args.spec_batches,
    )
    report.result["info"] = info
    report.emit("# Generation speed and memory")
    report.emit("")
    for k, v in info.items():
        report.emit(f"- {k}: {v}")
    report.emit("")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", default="340m", type=lambda s: [x for x in s.split(",") if x], help="340m,1.3b")
    ap.add_argument("--stages", default="speed,long,memory", type=lambda s: [x for x in s.split(",") if x], help=",".join(STAGES))
    ap.add_argument("--batches", default="1,16,64,256", type=int_list, help="speed stage batches")
    ap.add_argument("--prompt", type=int, default=512, help="prompt length of the speed stage")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per call (at least 2)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of fast and fast-separate")
    ap.add_argument("--slow-rounds", type=int, default=3, help="timed rounds of hf and fla")
    ap.add_argument(
        "--skip",
        default="",
        type=parse_skip,
        help="method:batch pairs (or whole methods) to leave out, e.g. fla:256,hf:long,fast-separate",
    )
    ap.add_argument("--long-prompt", type=int, default=32768, help="prompt length of the long stage")
    ap.add_argument("--curve", default="1024,4096,16384,32768", type=int_list, help="prompt lengths of the memory stage")
    ap.add_argument(
        "--long-generation",
        type=int,
        default=8192,
        help="memory stage: new tokens of the long generation compared with --new-tokens",
    )
    ap.add_argument("--spec-batches", default="1,8", type=int_list, help="speculative stage batches")
    ap.add_argument(
        "--bandwidth-gbs", type=float, default=H200_BANDWIDTH_GBS, help="speculative stage: the bandwidth of the step's floor"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="default: $OUT or the current directory")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens: at least 2 (the decode rate is over the tokens after the first)")
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        ap.error(f"--stages: unknown {unknown}; expected some of {list(STAGES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do")
        return 0
    os.makedirs(args.out, exist_ok=True)
    report = Report(args.out)
    header(report, args)
    for size in args.sizes:
        for stage in args.stages:
            log(f"{size} {stage}: start")
            try:
                STAGES[stage](size, args, report)
            except Exception as e:
                traceback.print_exc()
                report.emit(f"- {size} {stage}: failed ({error_line(e)})")
                report.emit("")
            gc.collect()
            torch.cuda.empty_cache()
            log(f"{size} {stage}: done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
