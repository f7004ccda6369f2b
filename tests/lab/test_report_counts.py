"""Reports count what they report: steps and tokens per run, seeds as the runs recorded them, a spread only
over different seeds, and averages named by what they average."""

from __future__ import annotations

import json

from efla_lab.data.mad_tasks import TASK_LABEL
from efla_lab.lm.report import collect_runs, summary_markdown
from efla_lab.mad.report import PAPER_AVERAGE, scores_table
from efla_lab.robustness.report import aggregate, lr_sweep_table, robustness_summary, robustness_tables


def _fake_run(path, seed: int, steps: int, val_loss: float):
    path.mkdir()
    (path / "train_args.json").write_text(
        json.dumps(dict(seed=seed, preset="tiny-efla", resolved=dict(seq_len=32, batch_tokens=128)))
    )
    (path / "train_summary.json").write_text(
        json.dumps(dict(variant="efla", steps=steps, tokens=128 * steps, n_params=1000, val_loss=val_loss))
    )
    (path / "log.jsonl").write_text(
        "".join(json.dumps(dict(step=s, tokens=128 * s, loss=val_loss + 1)) + "\n" for s in range(1, steps + 1))
    )
    return str(path)


def _efla_row(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("| EFLA |"))


def test_lm_report_gives_steps_and_tokens_per_run_when_they_differ(tmp_path):
    runs = [
        _fake_run(tmp_path / name, seed, steps, 3.0 + seed) for name, seed, steps in (("a", 0, 30), ("b", 1, 40), ("c", 2, 40))
    ]
    text = summary_markdown(collect_runs(runs), "t", "", "")
    assert "each: preset `tiny-*`" in text and "30 steps, 3,840 training tokens" not in text
    assert "per run: a 30 steps / 3,840 tokens, b 40 steps / 5,120 tokens, c 40 steps / 5,120 tokens" in text
    assert "| a | 0 | 30 | 3,840 |" in text and "| c | 2 | 40 | 5,120 |" in text
    same = summary_markdown(collect_runs(runs[1:]), "t", "", "")
    assert ", 40 steps, 5,120 training tokens" in same and "per run:" not in same


def test_lm_report_takes_seeds_from_train_args_not_directory_names(tmp_path):
    runs = [_fake_run(tmp_path / "efla-s7", 3, 10, 3.0), _fake_run(tmp_path / "efla-s8", 4, 10, 4.0)]
    rows = collect_runs(runs)
    assert [r["seed"] for r in rows] == [3, 4]
    text = summary_markdown(rows, "t", "", "")
    assert "| EFLA | 3, 4 |" in _efla_row(text) and "3.5000 ± 0.7071" in _efla_row(text)
    assert "mean ± sample standard deviation over seeds" in text


def test_lm_report_shows_no_spread_for_runs_of_one_seed(tmp_path):
    runs = [_fake_run(tmp_path / "x", 0, 10, 3.0), _fake_run(tmp_path / "y", 0, 10, 4.0)]
    text = summary_markdown(collect_runs(runs), "t", "", "")
    assert "±" not in _efla_row(text) and "3.5000" in _efla_row(text)
    assert "over seeds" not in text and "one seed, no spread" in text


def _robustness_results(seeds: list[int]) -> dict:
    levels = {"scale": [1.0, 2.0], "noise": [0.1, 0.2], "dropout": [0.1, 0.2]}

    def run(rule, seed):
        acc = 0.9 - 0.1 * seed - (0.05 if rule == "euler" else 0.0)
        return dict(
            setting="same-lr",
            rule=rule,
            seed=seed,
            lr=1e-3,
            eval=dict(clean=acc, **{k: dict(levels=lv, accuracy=[acc, acc - 0.1]) for k, lv in levels.items()}),
        )

    runs = [run(rule, seed) for rule in ("exact", "euler") for seed in seeds]
    return dict(
        runs=runs,
        levels=levels,
        dataset=dict(name="digits", n_train=10, source="embedded"),
        options=dict(epochs=1, seeds=seeds),
        versions={},
    )


def _table_text(seeds: list[int]) -> str:
    results = _robustness_results(seeds)
    agg = aggregate(results)
    return "\n".join(robustness_tables(results, agg)["same-lr"].markdown()) + robustness_summary(results, agg, "cmd")


def test_a_one_seed_robustness_table_has_no_spread():
    text = _table_text([0])
    assert "±" not in text and "0.8000" in text and "no spread over seeds" in text
    assert "0.7500 ± 0.0707" in _table_text([0, 1])


def test_an_lr_sweep_cell_counts_different_seeds_not_rows():
    rows = [dict(rule="exact", lr=1e-3, seed=0, final_train_loss=loss, test_accuracy=0.9) for loss in (1.0, 2.0)]
    table = lr_sweep_table(dict(rows=rows, lrs=[1e-3], dataset=dict(name="digits"), options=dict(seeds=[0, 0])))
    assert "±" not in "".join(table.markdown()) and "over" not in table.title
    assert "loss 1.500 / acc 0.9000" in table.markdown()[-1]


def _mad_agg(tasks: dict[str, float]) -> dict:
    per_rule = {t: dict(score=score, n_settings=1, settings={}) for t, score in tasks.items()}
    average = sum(tasks.values()) / len(tasks)
    return {rule: dict(per_rule, average=average) for rule in ("exact", "euler")}


def test_a_mad_average_over_fewer_tasks_is_not_labelled_as_the_six_task_average():
    average = scores_table(_mad_agg({"compression": 0.5}), "quick").markdown()[-1]
    assert f"Average of 1 of 6 tasks ({TASK_LABEL['compression']}; not a six-task average)" in average
    assert f"{PAPER_AVERAGE['exact']:.1f}" not in average and "| **42.7** | **43.8** | **+1.1** |" in average
    all_six = dict.fromkeys(
        (
            "compression",
            "fuzzy-in-context-recall",
            "in-context-recall",
            "memorization",
            "noisy-in-context-recall",
            "selective-copying",
        ),
        0.5,
    )
    average = scores_table(_mad_agg(all_six), "quick").markdown()[-1]
    assert "Average (6 tasks)" in average
    assert f"| **{PAPER_AVERAGE['euler']:.1f}** | **{PAPER_AVERAGE['exact']:.1f}** |" in average
