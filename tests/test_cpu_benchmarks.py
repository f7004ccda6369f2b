"""The CPU benchmarks' records: the alternation keeps one value per round per side, warm-up left
out, and each script turns its timings into the rates and ratios it claims (fake timings, so no
wall-clock time is asserted). The GPU generation benchmark's speculative stage runs here on the CPU
with a tiny model, so its code path is checked before a GPU visit."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import alternate  # noqa: E402
import cpu_compile  # noqa: E402
import cpu_generate  # noqa: E402
import cpu_model  # noqa: E402
import cpu_ops  # noqa: E402
import evidence  # noqa: E402
import speculation  # noqa: E402


def _scripted(log, name, values):
    """A method that logs its calls and returns the next of ``values``."""
    it = iter(values)

    def call():
        log.append(name)
        return next(it)

    return call


def test_alternate_takes_turns_after_the_warm_up_and_keeps_every_round():
    log = []
    methods = {"a": _scripted(log, "a", [100, 101, 1, 2, 3]), "b": _scripted(log, "b", [200, 201, 4, 5, 6])}
    per_round, warm = alternate.alternate(methods, rounds=3, warmup=2)
    assert log == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert warm == {"a": [100, 101], "b": [200, 201]}
    assert per_round == {"a": [1, 2, 3], "b": [4, 5, 6]}


def test_seconds_reads_the_clock_around_the_call():
    ticks = iter([10.0, 10.25])
    calls = []
    assert alternate.seconds(calls.append, "x", clock=lambda: next(ticks)) == pytest.approx(0.25)
    assert calls == ["x"]


def test_cpu_ops_records_each_round_in_ms_and_the_ratio_per_round(tmp_path, monkeypatch):
    log = []
    ours = ("chunk_efla", _scripted(log, "ours", [9.0, 0.010, 0.020, 0.030]))
    theirs = ("hf", _scripted(log, "hf", [9.0, 0.040, 0.050, 0.060]))
    m = cpu_ops.compare("chunk_efla [1, 8, 1, 4]", ours, theirs, rounds=3)
    assert m["ours"] == {"name": "chunk_efla", "rounds": pytest.approx([10.0, 20.0, 30.0])}
    assert m["baseline"] == {"name": "hf", "rounds": pytest.approx([40.0, 50.0, 60.0])}
    assert evidence.ratios(m) == pytest.approx([4.0, 2.5, 2.0])
    assert alternate.spread(m) == "2.50x (2.00-4.00x)"
    monkeypatch.setattr(evidence, "library_versions", lambda: {"torch": torch.__version__})  # importing fla is slow
    run = evidence.write_run(str(tmp_path / "run.json"), "cpu_ops", "t", 3, [m], ["n"], argv=[])
    assert evidence.load_run(str(tmp_path / "run.json"))["measurements"] == run["measurements"]


def test_cpu_ops_time_clears_the_gradients_first():
    x = torch.ones(2, requires_grad=True)
    x.grad = torch.ones(2)
    seen = []
    ticks = iter([1.0, 1.5])
    assert cpu_ops._time(lambda t: seen.append(t.grad), [x], clock=lambda: next(ticks)) == pytest.approx(0.5)
    assert seen == [None]


def test_cpu_model_pairs_each_exact_variant_with_its_euler_one():
    # (train s, forward s, decode s per token) per round; deltanet twice as slow as efla everywhere
    seconds = {
        "efla": [(0.1, 0.05, 0.002), (0.2, 0.04, 0.004)],
        "deltanet": [(0.2, 0.1, 0.004), (0.4, 0.08, 0.008)],
        "gated-efla": [(0.5, 0.5, 0.5), (1.0, 1.0, 1.0)],
        "gated-deltanet": [(0.25, 0.25, 0.25), (0.5, 0.5, 0.5)],
    }
    found = cpu_model.records(seconds, (2048, 2048, 8), "tiny", "batch 8 x 256, 2 threads")
    assert [(m["ours"]["name"], m["baseline"]["name"], m["metric"]) for m in found] == [
        (f"tiny-{a}", f"tiny-{b}", metric) for a, b in cpu_model.PAIRS for metric in cpu_model.METRICS
    ]
    train, fwd, dec = found[:3]
    assert train["ours"]["rounds"] == pytest.approx([20480, 10240])
    assert fwd["baseline"]["rounds"] == pytest.approx([20480, 25600])
    assert dec["ours"]["rounds"] == pytest.approx([4000, 2000])
    assert all(evidence.ratios(m) == pytest.approx([2.0, 2.0]) for m in found[:3])
    assert all(evidence.ratios(m) == pytest.approx([0.5, 0.5]) for m in found[3:])


def test_cpu_generate_rates_per_round_leave_the_prefill_out_of_decode():
    per_round = {cpu_generate.OURS: [(1.0, 0.1), (2.0, 0.2)], cpu_generate.THEIRS: [(1.5, 0.1), (2.0, 0.4)]}
    decode, e2e = cpu_generate.records(per_round, batch=8, n=10, case="tiny-efla, batch 8")
    assert (decode["metric"], e2e["metric"]) == ("decode", "end to end")
    assert decode["ours"]["rounds"] == pytest.approx([8 * 9 / 0.9, 8 * 9 / 1.8])
    assert decode["baseline"]["rounds"] == pytest.approx([8 * 9 / 1.4, 8 * 9 / 1.6])
    assert e2e["ours"]["rounds"] == pytest.approx([80.0, 40.0])
    assert evidence.ratios(e2e) == pytest.approx([1.5, 1.0])


def test_cpu_generate_times_both_methods_every_round_on_a_real_model():
    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config("tiny-efla")).eval()
    per_round = cpu_generate.measure(model, torch.randint(3, 100, (1, 4)), n=3, rounds=3)
    assert set(per_round) == {cpu_generate.OURS, cpu_generate.THEIRS}
    for pairs in per_round.values():
        assert len(pairs) == 3 and all(t_n > 0 and t_1 > 0 for t_n, t_1 in pairs)


def test_cpu_compile_record_puts_the_compiled_model_first():
    per_round = {cpu_compile.COMPILED: [0.5, 0.25], cpu_compile.EAGER: [1.0, 1.0]}
    m = cpu_compile.record(per_round, tokens=1000, case="tiny-efla, batch 8 x 125")
    assert m["ours"] == {"name": cpu_compile.COMPILED, "rounds": pytest.approx([2000, 4000])}
    assert m["baseline"]["rounds"] == pytest.approx([1000, 1000])
    assert evidence.ratios(m) == pytest.approx([2.0, 4.0])


def test_speculation_turns_a_rounds_counts_into_its_columns():
    stats = dict(rounds=10, verified=4, verified_rows=4, verified_tokens=10, drafted=12, accepted=6, tokens=16)
    found = {"ours": [200.0], "plain": [100.0], "stats": [stats]}
    rows = {m["metric"]: m for m in speculation.case_measurements("case", 1, found)}
    assert evidence.ratios(rows["new tokens/s"]) == [2.0] and rows["new tokens/s"]["ours"]["name"] == speculation.OURS
    assert rows["acceptance rate"]["ours"]["rounds"] == [0.5]
    assert rows["new tokens per row per verification pass"]["ours"]["rounds"] == [2.5]
    assert rows["target passes that verified (the rest: plain steps)"]["ours"]["rounds"] == [0.4]
    assert rows["new tokens per row per target pass"]["ours"]["rounds"] == [1.6]


def test_the_code_editing_prompt_is_the_copying_prompt_with_one_token_in_8_changed():
    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config("tiny-efla")).eval()
    copying = speculation.prompts(model, "copying", 2, "cpu")
    editing = speculation.prompts(model, "code editing", 2, "cpu")
    assert copying.shape == editing.shape == (2, speculation.PROMPT + speculation.CONTINUATION)
    changed = (copying != editing).float().mean(0)
    assert not changed[: speculation.PROMPT].any()
    assert 0.05 < float(changed[speculation.PROMPT :].mean()) <= 1 / 8


def test_gpu_generate_speculative_stage_runs_on_the_cpu_with_every_column(tmp_path):
    import argparse

    import gpu_generate

    from efla.models import EFLAForCausalLM, get_preset_config

    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config("tiny-efla")).eval()
    args = argparse.Namespace(spec_batches=[1, 2], new_tokens=6, rounds=3, bandwidth_gbs=4800.0)
    found, lines = gpu_generate.speculative_measurements(model, "tiny-efla", args, torch.device("cpu"))
    for kind in speculation.KINDS:
        for batch in (1, 2):
            metrics = {m["metric"]: m for m in found if m["case"] == f"tiny-efla {kind} batch {batch}"}
            assert set(metrics) == {
                "new tokens/s",
                "acceptance rate",
                "new tokens per row per verification pass",
                "target passes that verified (the rest: plain steps)",
                "new tokens per row per target pass",
            }
            speeds = [m for m in found if m["case"] == f"tiny-efla {kind} batch {batch}" and m["metric"] == "new tokens/s"]
            assert [m["ours"]["name"] for m in speeds] == [speculation.OURS, speculation.ALWAYS_NAME]
            for speed in speeds:
                assert speed["baseline"]["name"] == speculation.PLAIN
                assert len(speed["ours"]["rounds"]) == len(speed["baseline"]["rounds"]) == 3
                assert all(v > 0 for v in speed["ours"]["rounds"] + speed["baseline"]["rounds"])
    costs = [m for m in found if m["metric"] == "verification pass / plain decoding step"]
    assert [m["case"] for m in costs] == ["tiny-efla batch 1, 5 positions", "tiny-efla batch 2, 5 positions"]
    floor = next(m for m in found if m["metric"] == "step floor: bytes moved / bandwidth")["ours"]["rounds"][0]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights < floor * 4800e9 < 2 * weights  # the weights once, and a state far smaller than them
    assert len(lines) == 6 + 2 + 1
    path = str(tmp_path / "run.json")
    evidence.write_run(path, "gpu_generate_speculative", "t", 3, found, [], argv=[])
    assert evidence.load_run(path)["measurements"] == found
