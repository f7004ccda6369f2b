"""The CPU benchmarks' records: the alternation keeps one value per round per side, warm-up left
out, and each script turns its timings into the rates and ratios it claims (fake timings, so no
wall-clock time is asserted)."""

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
