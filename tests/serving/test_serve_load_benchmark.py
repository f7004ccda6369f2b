"""``benchmarks/serve_load.py`` rehearsed on the CPU with the tiny preset and a few requests: every stage
of the GPU visit runs (static batching in both orders, the scheduler in process, ``efla serve``'s app
over HTTP with client processes, the rates stage, the profile stage) for three rounds, and what it
records must hold together: every stage makes each request's max_tokens, the same tokens (or text) as
static batching, and the run record's numbers are the rows' numbers. No time is asserted."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
import torch

from .conftest import http_stack

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
ROUNDS, STREAMS, WAVES = 3, 4, 2
COMPARED = ("static-arrival", "static-sorted", "server", "http")

http_stack()


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import evidence
        import serve_load

        yield serve_load, evidence
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def ran(bench, tmp_path_factory):
    serve_load, evidence = bench
    out = tmp_path_factory.mktemp("serve_load")
    argv = [
        *("--device", "cpu", "--preset", "tiny-efla", "--threads", "1", "--rounds", str(ROUNDS)),
        *("--concurrency", str(STREAMS), "--waves", str(WAVES), "--rates", "inf", "--requests", "5"),
        *("--prompt-min", "3", "--prompt-max", "20", "--output-min", "2", "--output-max", "9"),
        *("--http-clients", "2", "--profile-steps", "2,3", "--out", str(out)),
    ]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evidence, "library_versions", lambda: {"torch": torch.__version__})  # importing fla is slow
        try:
            assert serve_load.main(argv) == 0
        finally:
            torch.set_num_threads(threads)
    record = json.loads((out / "serve_load.json").read_text())
    assert record["failures"] == []
    return record, evidence.load_run(str(out / "serve_load_run.json")), out


def _rows(record, kind):
    return [r for r in record["rows"] if r["kind"] == kind]


def test_every_stage_ran_every_round_and_made_each_requests_max_tokens(ran):
    record, _, _ = ran
    for kind in COMPARED:
        assert [r["round"] for r in _rows(record, kind)] == list(range(ROUNDS)), kind
    assert [r["round"] for r in _rows(record, "rates")] == [0]
    requests = STREAMS * WAVES
    expected = {r["expected_tokens"] for r in record["rows"] if r["kind"] in COMPARED}
    assert len(expected) == 1  # the same requests in every stage and round
    assert requests * 2 <= expected.pop() <= requests * 9
    for row in record["rows"]:
        assert row["failed"] == 0 and row["output_tokens"] == row["expected_tokens"], row["stage"]
        assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
    for row in _rows(record, "server") + _rows(record, "http") + _rows(record, "rates"):
        assert row["token_events"] == row["output_tokens"]  # one event (or SSE chunk) per token, none lost


def test_sorted_static_batching_the_server_and_http_give_static_batchings_tokens(ran):
    record, _, _ = ran
    assert record["differing_outputs"] == [{"static-sorted": 0, "server": 0, "http": 0}] * ROUNDS


def test_static_batching_times_prefill_and_decoding_apart(ran):
    record, _, _ = ran
    for row in _rows(record, "static-arrival") + _rows(record, "static-sorted"):
        assert row["prefill_seconds"] + row["decode_seconds"] == pytest.approx(row["seconds"])
        assert row["prefill_tokens_per_s"] == pytest.approx(row["prompt_tokens"] / row["prefill_seconds"])
        decoded = row["output_tokens"] - row["requests"]
        assert row["decode_tokens_per_s"] == pytest.approx(decoded / row["decode_seconds"])
        assert row["padded_tokens_per_s"] >= row["tokens_per_s"]


def test_the_server_rows_split_the_loop_and_their_latencies_are_ordered(ran):
    record, _, _ = ran
    for row in _rows(record, "server") + _rows(record, "http"):
        # a step decodes at most one token per slot; each request's first token comes from its prefill
        assert row["steps"] * STREAMS >= row["output_tokens"] - row["requests"] > 0
        assert 1 <= row["prefill_calls"] <= row["requests"]
        split = row["loop_ms_per_step"]
        assert split["total"] == pytest.approx(sum(split[p] for p in ("decode", "deliver", "admit", "prefill", "rebuild")))
        for key in ("ttft_ms", "itl_ms", "tpot_ms"):
            p50, p99 = row[key]
            assert 0 <= p50 <= p99, (row["stage"], key)
    for row in _rows(record, "http"):
        assert len(row["client_cpu_share"]) == 2 and all(0 <= share <= 1.5 for share in row["client_cpu_share"])


def test_the_run_record_pairs_each_round_with_the_faster_static_order(ran, bench):
    record, run, _ = ran
    _, evidence = bench
    assert run["rounds"] == ROUNDS and run["benchmark"] == "serve_load"
    found = {(m["metric"], m["ours"]["name"]): m for m in run["measurements"]}
    arrival, ordered = ([r["tokens_per_s"] for r in _rows(record, kind)] for kind in ("static-arrival", "static-sorted"))
    best = [max(pair) for pair in zip(arrival, ordered)]
    for kind, name in (("server", "efla serve's scheduler (in process)"), ("http", "efla serve over HTTP (streaming clients)")):
        m = found[("output throughput", name)]
        assert m["baseline"] == {"name": "static generate, the faster order of the round", "rounds": pytest.approx(best)}
        ours = [r["tokens_per_s"] for r in _rows(record, kind)]
        assert m["ours"]["rounds"] == pytest.approx(ours)
        target = record["targets"][kind]["throughput_vs_static"]
        assert target["rounds"] == pytest.approx([o / b for o, b in zip(ours, best)])
        assert target["pass"] == (target["value"] >= 0.8)
        phases = found[("scheduler loop per decoding step, deliver", name)]
        assert phases["ours"]["rounds"] == pytest.approx([r["loop_ms_per_step"]["deliver"] for r in _rows(record, kind)])
    sorted_gain = found[("output throughput", "static generate, sorted by output length")]
    assert evidence.ratios(sorted_gain) == pytest.approx([o / a for o, a in zip(ordered, arrival)])


def test_the_profile_names_the_schedulers_own_functions_and_torch_ops(ran):
    record, _, out = ran
    profile = json.loads((out / "serve_profile.json").read_text())
    assert profile == record["profile"]
    assert profile["output_tokens"] == profile["expected_tokens"] and profile["steps"] > 0
    functions = [r["function"] for r in profile["python"]["by_total_time"]]
    assert any(f.startswith("efla/serving/scheduler.py") and "_iterate" in f for f in functions), functions
    # the torch profiler's own parsing at its window's end is left out of the scheduler's profile
    assert not any("profiler" in r["function"] for r in profile["python"]["by_self_time"])
    assert profile["torch_window"] == {"skipped": 2, "recorded": 3, "reached": True, "error": None}
    host = profile["torch_ops"]["by_host_time"]
    assert any(r["op"].startswith("aten::") for r in host) and all(math.isfinite(r["self_host_ms_per_step"]) for r in host)
    assert profile["torch_ops"]["by_device_time"] == []  # on the CPU nothing runs on a device
    report = (out / "serve_load.md").read_text()
    assert "## Profile of the server in process" in report and "target >= 0.80" in report


@pytest.mark.parametrize(
    "options, named",
    [
        (["--stages", "static,bogus"], "--stages"),
        (["--profile-steps", "0,3"], "--profile-steps"),
        (["--http-clients", "0"], "--http-clients"),
    ],
)
def test_a_wrong_option_stops_before_the_model_loads(bench, capsys, options, named):
    serve_load, _ = bench
    with pytest.raises(SystemExit) as stopped:
        serve_load.parse_args(["--device", "cpu", *options])
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err
