"""Speculative decoding's benchmark cases, shared by ``cpu_speculative.py`` and ``gpu_generate.py``'s
``speculative`` stage: the prompt kinds, the alternated measurement of ``generate(...,
speculate=ngram)`` against plain ``generate`` on the same model, and the batch-1 step against its
floor.

Kinds (a random-weight model at its default initialisation: its greedy text falls into loops, so it
copies text only where it loops; that is the stand-in for a trained model copying from its prompt):

- ``copying`` (summarisation-like): the prompt ends in the text the output reproduces: 32 random
  tokens and their 96-token greedy continuation, whose loop the output continues. Greedy.
- ``code editing``: the same prompt with one token in 8 of the continuation replaced by a random
  one (a snippet to be written out again with small edits): lookup's drafts from the prompt are
  wrong near the edits until the output's own text supplies them. Greedy.
- ``free``: 32 random tokens, sampled at temperature 1 (per-row seeds): lookup finds few drafts and
  nearly all are rejected, so speculation has to turn itself down to stay at the plain speed.

Greedy output is checked equal to plain greedy before timing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from evidence import measurement

from efla.generation import engine_for, generate
from efla.generation import speculative as speculative_module

KINDS = ("copying", "code editing", "free")
SPECULATE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
ALWAYS = dict(SPECULATE, verify_cost=1)  # no turn-down: every round with a draft verifies (the control)
OURS, PLAIN, ALWAYS_NAME = "speculative (ngram)", "plain generate", "speculative, every draft verified (verify_cost=1)"
PROMPT, CONTINUATION, EDIT_EVERY = 32, 96, 8


def prompts(model, kind: str, batch: int, device) -> torch.Tensor:
    """The ``[batch, T]`` prompt ids of a kind (see the module's doc), the same for a batch every time."""
    g = torch.Generator().manual_seed(1_000 + batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, PROMPT), generator=g).to(device)
    if kind == "free":
        return ids
    ids = generate(model, ids, max_new_tokens=CONTINUATION, eos_token_id=[])
    if kind == "code editing":
        edited = torch.arange(PROMPT, ids.shape[1]) % EDIT_EVERY == EDIT_EVERY - 1
        noise = torch.randint(3, model.config.vocab_size, (batch, int(edited.sum())), generator=g).to(device)
        ids[:, PROMPT:][:, edited.to(device)] = noise
    return ids


def call(model, ids, new_tokens: int, kind: str, speculate, stats=None, clock=time.perf_counter, sync=lambda: None):
    """One ``generate`` call of the kind's decoding: (seconds on ``clock``, output)."""
    sampling = dict(temperature=1.0, seed=list(range(len(ids)))) if kind == "free" else {}
    sync()
    t0 = clock()
    out = generate(
        model, ids, max_new_tokens=new_tokens, eos_token_id=[], speculate=speculate, speculation_stats=stats, **sampling
    )
    sync()
    return clock() - t0, out


def measure_case(model, kind: str, batch: int, new_tokens: int, rounds: int, clock, sync, device) -> dict:
    """Warm-up (each method), the greedy check, then ``rounds`` rounds of one speculative call, one with
    every draft verified (no turn-down: the control) and one plain call: each round's tokens/s of the
    three and the speculative call's counts."""
    ids = prompts(model, kind, batch, device)
    plain_out = call(model, ids, new_tokens, kind, None, sync=sync)[1]
    fast_out = call(model, ids, new_tokens, kind, SPECULATE, {}, sync=sync)[1]
    if kind != "free" and not torch.equal(plain_out, fast_out):
        raise SystemExit(f"{kind}, batch {batch}: speculative greedy output differs from plain greedy")
    call(model, ids, new_tokens, kind, ALWAYS, sync=sync)
    found = {"ours": [], "always": [], "plain": [], "stats": []}
    for _ in range(rounds):
        stats = {}
        found["ours"].append(batch * new_tokens / call(model, ids, new_tokens, kind, SPECULATE, stats, clock, sync)[0])
        found["always"].append(batch * new_tokens / call(model, ids, new_tokens, kind, ALWAYS, None, clock, sync)[0])
        found["plain"].append(batch * new_tokens / call(model, ids, new_tokens, kind, None, None, clock, sync)[0])
        found["stats"].append(stats)
    return found


def case_measurements(name: str, batch: int, found: dict) -> list[dict]:
    """The records of one kind and batch: tokens/s against plain, then speculation's own figures per
    round (acceptance over the drafts verified; tokens per row per verification pass; the share of
    target passes that verified, the rest being plain steps; tokens per row per target pass of either kind)."""
    stats = found["stats"]
    figures = {
        "acceptance rate": ("fraction", [s["accepted"] / max(1, s["drafted"]) for s in stats]),
        "new tokens per row per verification pass": (
            "tokens",
            [s["verified_tokens"] / s["verified_rows"] if s["verified_rows"] else 0.0 for s in stats],
        ),
        "target passes that verified (the rest: plain steps)": ("fraction", [s["verified"] / s["rounds"] for s in stats]),
        "new tokens per row per target pass": ("tokens", [s["tokens"] / batch / s["rounds"] for s in stats]),
    }
    rows = [measurement(name, "new tokens/s", "tokens/s", "higher", (OURS, found["ours"]), (PLAIN, found["plain"]))]
    if found.get("always"):
        rows.append(
            measurement(name, "new tokens/s", "tokens/s", "higher", (ALWAYS_NAME, found["always"]), (PLAIN, found["plain"]))
        )
    rows += [measurement(name, metric, unit, "higher", (OURS, values), None) for metric, (unit, values) in figures.items()]
    return rows


def describe(name: str, found: dict) -> str:
    ratio = [a / b for a, b in zip(found["ours"], found["plain"])]
    s = found["stats"][-1]
    always = statistics.median(a / b for a, b in zip(found["always"], found["plain"])) if found.get("always") else float("nan")
    return (
        f"{name}: {statistics.median(found['ours']):,.0f} vs {statistics.median(found['plain']):,.0f} tokens/s, "
        f"ratio {statistics.median(ratio):.2f}x (min {min(ratio):.2f}, max {max(ratio):.2f}; every draft verified: "
        f"{always:.2f}x), acceptance {s['accepted']}/{s['drafted']}, verified {s['verified']} of {s['rounds']} target passes"
    )


def pass_cost(model, batch: int, width: int, reps: int, clock, sync) -> list[float]:
    """A verification pass's time in plain decoding steps at ``batch`` rows of ``width`` positions
    (``width = k + 1``: the last token and ``k`` drafts), ``reps`` alternated pairs, on pool rows
    ``0 .. batch-1`` (their state is scratch here)."""
    engine = engine_for(model)
    engine.reserve(batch, 4 * width * reps + 64)
    bucket = engine.bucket(batch)
    engine.assign(bucket, torch.arange(batch, device=engine.device))
    rows, tokens = list(range(batch)), [[5] * width] * batch
    step = lambda: engine.step(bucket, False)  # noqa: E731
    verify = lambda: speculative_module._continue_rows(engine, tokens, rows)  # noqa: E731
    step(), verify()
    ratios = []
    for _ in range(reps):
        t_step, t_verify = _timed(step, clock, sync), _timed(verify, clock, sync)
        ratios.append(t_verify / t_step)
    return ratios


def _timed(fn: Callable, clock, sync) -> float:
    sync()
    t0 = clock()
    fn()
    sync()
    return clock() - t0


def step_bytes(model) -> int:
    """Bytes one batch-1 decoding step must move: every weight read once, the state read and written."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 0
    for block in model.get_decoder().layers:
        attn = block.attn
        state += attn.num_v_heads * attn.head_k_dim * attn.head_v_dim * 4  # float32 matrix state
        if attn.use_short_conv:
            state += (2 * attn.key_dim + attn.value_dim) * attn.conv_size * next(model.parameters()).element_size()
    return weights + 2 * state


def floor_measurements(case: str, step_seconds: list[float], floor: float, rounds: int) -> list[dict]:
    return [
        measurement(case, "plain decoding step", "s", "lower", ("plain generate (1 / tokens/s)", step_seconds), None),
        measurement(case, "step floor: bytes moved / bandwidth", "s", "lower", ("floor", [floor] * rounds), None),
    ]
