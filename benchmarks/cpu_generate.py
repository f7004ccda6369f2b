"""CPU generation speed: ``efla.generation.generate`` against transformers' ``generate`` (with its
cache) on the same tiny model, float32, greedy, no early stop.

For each preset and batch, both methods make a warm-up call, then take turns (ours, transformers,
ours, ...) for ``--rounds`` rounds; a round times a call making ``--new-tokens`` tokens and a call
making one (the prefill). Each round gives decode tokens/s ``B (n - 1) / (t_all - t_pre)`` and
end-to-end new tokens/s ``B n / t_all``; every round is recorded. Alternating means a busy machine
slows both alike.

Usage: python benchmarks/cpu_generate.py [--presets tiny-efla,tiny-gated-efla,tiny-hybrid-efla]
           [--batches 1,8] [--prompt 64] [--new-tokens 64] [--rounds 7] [--threads 2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial

import evidence
import torch
import transformers
from alternate import alternate, default_out, load_average, seconds, spread

from efla.generation import generate
from efla.models import EFLAForCausalLM, get_preset_config


OURS, THEIRS = "efla.generation.generate", "transformers generate (same model)"


def ours(model, ids, n):
    return generate(model, ids, max_new_tokens=n, eos_token_id=[])


def theirs(model, ids, n):
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
    )


def measure(model, ids, n, rounds) -> dict:
    """Each method's ``(seconds for n new tokens, seconds for 1)`` of every alternated round."""
    methods = {OURS: partial(ours, model, ids), THEIRS: partial(theirs, model, ids)}
    per_round, _ = alternate({name: partial(both_calls, fn, n) for name, fn in methods.items()}, rounds)
    return per_round


def both_calls(fn, n) -> tuple[float, float]:
    """Seconds of a call making ``n`` new tokens, then of one making one (the prefill)."""
    return seconds(fn, n), seconds(fn, 1)


def records(per_round: dict, batch: int, n: int, case: str) -> list[dict]:
    """Decode and end-to-end tokens/s round by round: ``B (n - 1) / (t_n - t_1)`` and ``B n / t_n``."""

    def rates(name, decode):
        return name, [batch * (n - 1) / (t_n - t_1) if decode else batch * n / t_n for t_n, t_1 in per_round[name]]

    return [
        evidence.measurement(case, metric, "tokens/s", "higher", rates(OURS, decode), rates(THEIRS, decode))
        for metric, decode in (("decode", True), ("end to end", False))
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny-efla,tiny-gated-efla,tiny-hybrid-efla")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7, help="alternated rounds (every one is recorded)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=default_out("cpu_generate"), help="the JSON record (benchmarks/evidence.py's shape)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    load_before = load_average()
    measurements = []
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        model = EFLAForCausalLM(get_preset_config(preset)).eval()
        for B in map(int, args.batches.split(",")):
            ids = torch.randint(3, model.config.vocab_size, (B, args.prompt))
            found = records(measure(model, ids, args.new_tokens, args.rounds), B, args.new_tokens, f"{preset}, batch {B}")
            for m in found:
                print(f"{m['case']}, {m['metric']}: {_medians(m)}, speed-up {spread(m)}", flush=True)
            measurements += found
    notes = [
        f"float32, {args.threads} torch threads, greedy, no early stop; random prompt of {args.prompt} tokens, "
        f"{args.new_tokens} new tokens; models built from the presets with seed 0.",
        f"One warm-up call ({args.new_tokens} new tokens) per method, then {args.rounds} rounds alternating the "
        "methods in one process; a round times a call making all new tokens, then one making one (the prefill).",
        f"decode = B ({args.new_tokens} - 1) / (t_all - t_one), per round (prefill excluded); end to end = "
        f"B {args.new_tokens} / t_all (prefill included).",
        "Both methods run the same model and step (transformers' generate of our model uses our in-place cache and "
        "fused one-token step): the difference is the generation loop's own per-step work.",
        f"load average before: {load_before}",
    ]
    title = "CPU generation: efla.generation.generate vs transformers' generate of the same tiny model, float32"
    evidence.write_run(args.out, "cpu_generate", title, args.rounds, measurements, notes)
    print(f"wrote {os.path.relpath(args.out)}")


def _medians(m: dict) -> str:
    return ", ".join(f"{m[side]['name']} {statistics.median(m[side]['rounds']):,.0f}" for side in ("ours", "baseline"))


if __name__ == "__main__":
    main()
