"""The comparison of several ``efla eval`` records (``efla compare``): one Markdown table in the
paper's Table 1 layout (mean and standard deviation over seeds per variant), a per-model table, the
EFLA-minus-DeltaNet differences (and the gated pair), and the paper's numbers in a separate block."""

from __future__ import annotations

import os
import statistics

from efla.variants import VARIANTS, label

__all__ = ["PAPER_TABLE1", "compare"]

# The paper's Table 1: SlimPajama, Mistral tokenizer. "wiki_ppl" is lm-eval's WikiText
# word perplexity; "avg" averages the zero-shot accuracies (PIQA, HellaSwag, WinoGrande, ARC-e, ARC-c,
# BoolQ, OBQA, SciQ).
PAPER_TABLE1 = [
    dict(scale="340M / 8B tokens", model="Mamba-2", wiki_ppl=36.90, lambada_ppl=105.69, lambada_acc=20.7, avg=42.0),
    dict(scale="340M / 8B tokens", model="DeltaNet", wiki_ppl=38.09, lambada_ppl=96.26, lambada_acc=22.5, avg=42.2),
    dict(scale="340M / 8B tokens", model="EFLA", wiki_ppl=35.26, lambada_ppl=79.97, lambada_acc=23.9, avg=44.1),
    dict(scale="340M / 8B tokens", model="Gated DeltaNet", wiki_ppl=34.93, lambada_ppl=72.46, lambada_acc=25.5, avg=43.9),
    dict(scale="340M / 8B tokens", model="Gated EFLA", wiki_ppl=34.28, lambada_ppl=69.37, lambada_acc=26.4, avg=44.8),
    dict(scale="1.3B / 50B tokens", model="DeltaNet", wiki_ppl=18.38, lambada_ppl=17.29, lambada_acc=41.8, avg=50.5),
    dict(scale="1.3B / 50B tokens", model="EFLA", wiki_ppl=18.30, lambada_ppl=16.54, lambada_acc=43.2, avg=51.8),
]

VARIANT_ORDER = [v.model_name for v in sorted(VARIANTS, key=lambda v: (v.gated, v.exact))]
PAIRS = [(v.model_name, v.euler_counterpart.model_name) for v in VARIANTS if v.exact]


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
        entry = {"label": label(v, v), "seeds": seeds, "n": len(rs), "parameters": rs[0]["model"]["parameters"]}
        cells = [entry["label"], f"{entry['parameters'] / 1e6:.2f}M", ", ".join("?" if s is None else str(s) for s in seeds)]
        for key, _, _, fmt in present:
            vals = [_metrics(r)[key] for r in rs if key in _metrics(r)]
            entry[key] = dict(
                values=vals,
                mean=statistics.mean(vals) if vals else None,
                std=statistics.stdev(vals) if len(vals) > 1 and spread[v] else None,
            )
            cells.append(_fmt_stats(vals, fmt, spread[v]))
        if harness_keys:
            avg_keys = [k for k in harness_keys if not k.startswith("h:lambada")] or harness_keys
            avgs = [statistics.mean(_metrics(r)[k] for k in avg_keys) for r in rs if all(k in _metrics(r) for k in avg_keys)]
            entry["harness_avg"] = dict(values=avgs, mean=statistics.mean(avgs) if avgs else None)
            cells.append(_fmt_stats(avgs, "{:.2f}", spread[v]))
        summary["variants"][v] = entry
        lines.append("| " + " | ".join(cells) + " |")

    settings = sorted({_settings(r) for r in records})
    lines += [
        "",
        "Settings: "
        + ("; ".join(settings) if len(settings) == 1 else "**the models were not evaluated alike**: " + " / ".join(settings)),
    ]
    summary["settings"] = settings
    if harness_keys:
        lines += [
            "",
            "Avg. (harness) averages the lm-eval task accuracies other than LAMBADA (acc_norm for "
            "HellaSwag, ARC-c, OBQA, PIQA), as the paper's zero-shot average.",
        ]

    lines += ["", "## Per model", ""]
    head2 = ["Model dir", "Variant", "Seed"] + [c[1] for c in present]
    lines += ["| " + " | ".join(head2) + " |", "|" + "|".join([":---", ":---"] + ["---:"] * (len(head2) - 2)) + "|"]
    for v in variants:
        for r in sorted(groups[v], key=lambda r: (r["model"]["seed"] is None, r["model"]["seed"])):
            m = _metrics(r)
            summary["models"].append(dict(name=r["model"]["name"], variant=v, seed=r["model"]["seed"], **m))
            lines.append(
                "| "
                + " | ".join(
                    [str(r["model"]["name"]), label(v, v), str(r["model"]["seed"])]
                    + [_fmt(fmt, m[k]) if k in m else "–" for k, _, _, fmt in present]
                )
                + " |"
            )

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
            p = dict(
                a=a,
                b=b,
                metric=key,
                higher_is_better=higher,
                mean_a=ma,
                mean_b=mb,
                diff=ma - mb,
                paired_seeds=common,
                paired_diffs=diffs,
                a_better_in=wins,
                diff_std=statistics.stdev(diffs) if len(diffs) > 1 else None,
                a_better_on_mean=(ma > mb) if higher else (ma < mb),
                tie=ma == mb,
            )
            summary["pairs"].append(p)
            la, lb = label(a, a), label(b, b)
            per_seed = ", ".join(f"s{s}: {_fmt(fmt, d)}" for s, d in zip(common, diffs)) or "no paired seeds"
            pair_lines.append(
                f"| {la} − {lb} | {header} | {_fmt(fmt, ma)} | {_fmt(fmt, mb)} | "
                f"{'+' if ma - mb >= 0 else ''}{_fmt(fmt, ma - mb)} | {per_seed} | "
                f"{wins}/{len(diffs)} | {'tie' if p['tie'] else 'yes' if p['a_better_on_mean'] else 'no'} |"
            )
    if pair_lines:
        lines += [
            "",
            "## EFLA vs DeltaNet (same seeds paired)",
            "",
            "| Pair | Metric | A (mean) | B (mean) | A − B | A − B per seed | A better in | A better on mean |",
            "|:---|:---|---:|---:|---:|:---|---:|:---:|",
        ] + pair_lines

    verdict = _verdicts(summary)
    if verdict:
        lines += ["", "In words:", ""] + [f"- {v}" for v in verdict]
    summary["verdicts"] = verdict
    commands = sorted({r["command"] for r in records if r.get("command")})
    if commands:
        lines += ["", "Evaluation commands:", "", "```"] + commands + ["```"]

    lines += [
        "",
        "## Paper (Table 1; SlimPajama, Mistral tokenizer; for reference, not comparable in scale)",
        "",
        "| Scale | Model | Wiki. ppl ↓ | LMB. ppl ↓ | LMB. acc ↑ | Avg. zero-shot ↑ |",
        "|:---|:---|---:|---:|---:|---:|",
    ]
    for p in PAPER_TABLE1:
        lines.append(
            f"| {p['scale']} | {p['model']} | {p['wiki_ppl']:.2f} | {p['lambada_ppl']:.2f} | "
            f"{p['lambada_acc']:.1f} | {p['avg']:.1f} |"
        )
    lines += [
        "",
        "Paper's Wiki. ppl is lm-eval's WikiText word perplexity (the column \"Wiki. ppl (word)\" above is "
        "the same normalisation over the raw test file); LMB. = LAMBADA (OpenAI), acc in %.",
    ]
    return "\n".join(lines) + "\n", summary


def _settings(rec: dict) -> str:
    parts = []
    if "wikitext" in rec:
        w = rec["wikitext"]
        parts.append(
            f"WikiText {os.path.basename(str(w.get('source', '?')))}: context {w.get('context')}, stride "
            f"{w.get('stride')}, {w.get('scored_tokens')} tokens / {w.get('words')} words / "
            f"{w.get('bytes')} bytes scored"
        )
    if "lambada" in rec:
        lam = rec["lambada"]
        parts.append(
            f"LAMBADA {os.path.basename(str(lam.get('source', '?')))}: {lam.get('n')} passages"
            + (f" of {lam.get('passages_in_file')} (first {lam.get('n')}, --limit)" if lam.get("limit") else "")
            + f", max length {lam.get('max_length')}"
        )
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
                paired = (
                    f"{la} better in {p['a_better_in']}/{len(d)} paired seeds, per-seed {la} − {lb} "
                    + ", ".join(_fmt(f, x) for x in d)
                    + (f" (mean {_pm(f, statistics.mean(d), statistics.stdev(d))})" if len(d) > 1 else "")
                )
            else:
                paired = "no paired seeds"
            if spread > 0:
                rel = "larger" if abs(p["diff"]) > spread else "smaller"
                spread_txt = f"the gap is {rel} than the seed-to-seed std of either model (up to {_fmt(f, spread)})"
            else:
                spread_txt = "one seed each, no spread"
            parts.append(
                f"{name} {_fmt(f, p['mean_a'])} vs {_fmt(f, p['mean_b'])} "
                f"({la} {'better' if p['a_better_on_mean'] else 'worse'} by {_fmt(f, abs(p['diff']))}; "
                f"{paired}; {spread_txt})"
            )
        n = f"{la} seeds {va['seeds']}, {lb} seeds {vb['seeds']}"
        out.append(f"{la} vs {lb} ({n}): " + "; ".join(parts) + ".")
    return out
