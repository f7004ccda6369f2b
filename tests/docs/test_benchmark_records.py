"""The GPU benchmarks turn their alternated rounds into records of ``benchmarks/evidence.py``'s shape.
They need a GPU to run; here each one's builder gets a timing table made up by hand, and its
measurements are checked against values worked out by hand (and against ``check_run``)."""

import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield {name: importlib.import_module(name) for name in ("evidence", "gpu_model", "gpu_generate", "gpu_ops", "serve_load")}
    finally:
        sys.path.remove(str(BENCHMARKS))


def _checked(evidence, rounds: int, measurements: list[dict]) -> None:
    run = {
        "schema": evidence.SCHEMA,
        "benchmark": "x",
        "title": "x",
        "date": "2026-12-05 06:00 UTC",
        "device": "NVIDIA H200",
        "versions": {"torch": "2.11"},
        "commit": "abc1234",
        "command": "python benchmarks/x.py",
        "rounds": rounds,
        "rounds_kept": True,
        "notes": [],
        "measurements": measurements,
    }
    evidence.check_run(run, "made-up run")


def _by(measurements, metric, ours):
    return next(m for m in measurements if m["metric"] == metric and m["ours"]["name"] == ours)


def test_gpu_model_keeps_every_step_of_both_models(bench):
    row = dict(size="340m", T=4, B=2, params=1)
    rows = [
        dict(row, model="fla", step_s_all=[0.5, 0.4, 0.25], peak_gib_all=[2.0, 2.0, 2.0]),
        dict(row, model="efla", step_s_all=[0.25, 0.4, 0.5], peak_gib_all=[1.0, 1.5, 1.0]),
        dict(row, model="deltanet", error="failed"),
    ]
    found = bench["gpu_model"].measurements(rows)
    speed = _by(found, "training throughput", "efla")
    assert speed["baseline"]["name"] == "fla DeltaNet"
    assert speed["ours"]["rounds"] == [32.0, 20.0, 16.0] and speed["baseline"]["rounds"] == [16.0, 20.0, 32.0]
    assert bench["evidence"].ratios(speed) == [2.0, 1.0, 0.5]
    memory = _by(found, "peak memory", "efla")
    assert bench["evidence"].ratios(memory) == [2.0, 2.0 / 1.5, 2.0]
    assert len(found) == 2  # the failed model has nothing to compare
    _checked(bench["evidence"], 3, found)


def test_gpu_model_alone_gives_plain_figures(bench):
    rows = [dict(size="1.3b", T=8, B=1, model="efla", step_s_all=[1.0, 2.0, 4.0], peak_gib_all=[3.0, 3.0, 3.0])]
    found = bench["gpu_model"].measurements(rows)
    assert [m["baseline"] for m in found] == [None, None]
    assert found[0]["ours"]["rounds"] == [8.0, 4.0, 2.0]


def test_gpu_generate_pairs_the_rounds_both_methods_ran(bench):
    base = dict(size="340m", stage="speed", batch=2, prompt=16, new_tokens=5)
    rows = [
        dict(base, method="fast", all_s=[1.0, 2.0, 9.0], prefill_s=[0.5, 1.0, 9.0], peak_gib_all=[1.0, 1.0, 1.0]),
        dict(base, method="hf", all_s=[4.0, 3.0], prefill_s=[2.0, 1.0], peak_gib_all=[2.0, 2.5]),
        dict(base, method="fla", error="fla missing"),
    ]
    found = bench["gpu_generate"].measurements(rows, rounds=2)
    decode = _by(found, "decode throughput (prefill taken out)", "efla.generation.generate")
    # decode: B (n - 1) / (all - prefill) = 8 / 0.5, 8 / 1.0 for fast; 8 / 2.0, 8 / 2.0 for hf
    assert decode["ours"]["rounds"] == [16.0, 8.0] and decode["baseline"]["rounds"] == [4.0, 4.0]
    e2e = _by(found, "end-to-end throughput (whole calls)", "efla.generation.generate")
    assert e2e["ours"]["rounds"] == [10.0, 5.0] and e2e["baseline"]["rounds"] == pytest.approx([2.5, 10 / 3])
    assert decode["baseline"]["name"] == "transformers generate, our model"
    assert _by(found, "peak memory", "transformers generate, our model")["ours"]["rounds"] == [2.0, 2.5]
    _checked(bench["evidence"], 2, found)


def test_gpu_ops_compares_what_ran_every_round(bench):
    tf = {"dn": [1.0, 2.0, 3.0], "efla": [0.5, 1.0, 1.0], "gdn": [], "gefla": [1.0, 1.0, 1.0]}
    tf |= {"efla_fusedfwd": [0.25, 1.0, 1.5], "gefla_fusedfwd": [1.0, 1.0, 1.0]}
    tb = {"dn": [4.0, 4.0, 4.0], "efla": [2.0, 2.0, 2.0], "gdn": [], "gdn_ours": [3.0, 3.0, 3.0], "gefla": [2.0, 3.0, 6.0]}
    tb |= {"floor": [1.0, 1.5, 2.0], "efla_fusedfwd": [2.0, 2.0, 2.0], "gefla_fusedfwd": [2.0, 2.0, 2.0]}
    found = bench["gpu_ops"].chunk_measurements("[8, 2048, 16]", tf, tb, ("fusedfwd",))
    ev = bench["evidence"]
    fwd = [m for m in found if m["metric"] == "forward time" and m["ours"]["name"] == "EFLA"]
    assert [ev.ratios(m) for m in fwd] == [[2.0, 2.0, 3.0]]
    assert not [m for m in found if m["baseline"] and m["baseline"]["name"] == "fla Gated DeltaNet"]  # fla's gated op failed
    gated = next(m for m in found if m["ours"]["name"] == "Gated EFLA" and m["metric"] == "forward and backward time")
    assert ev.ratios(gated) == [1.5, 1.0, 0.5]
    variant = [m for m in found if m["ours"]["name"] == "EFLA, EFLA_FUSED_FORWARD=1" and m["metric"] == "forward time"]
    assert {m["baseline"]["name"]: ev.ratios(m) for m in variant} == {"fla DeltaNet": [4.0, 2.0, 2.0], "EFLA": [2.0, 1.0, 2 / 3]}
    assert next(m for m in found if m["baseline"] is None)["ours"]["rounds"] == [1.0, 1.5, 2.0]
    _checked(ev, 3, found)


def test_serve_load_pairs_each_server_side_with_the_faster_static_order_round_by_round(bench):
    import types

    def static(kind, tps, prefill, decode):
        return dict(kind=kind, tokens_per_s=tps, prefill_tokens_per_s=prefill, decode_tokens_per_s=decode)

    def server(kind, tps, itl, deliver):
        phases = dict(decode=1.0, deliver=deliver, admit=0.0, prefill=2.0, rebuild=0.5, total=3.5 + deliver)
        latency = dict(ttft_ms=[1.0, 2.0], itl_ms=itl, itl_p99_over_p50=itl[1] / itl[0], tpot_ms=[3.0, 4.0])
        return dict(kind=kind, tokens_per_s=tps, loop_ms_per_step=phases, **latency)

    arrival, ordered, closed, http = [50.0, 40.0, 100.0], [60.0, 30.0, 80.0], [100.0, 120.0, 50.0], [30.0, 40.0, 50.0]
    rounds = [
        [
            static("static-arrival", arrival[r], 1000.0 + r, 10.0),
            static("static-sorted", ordered[r], 900.0, 20.0 + r),
            server("server", closed[r], [1.0, [5.0, 4.0, 3.0][r]], 4.0 + r),
            server("http", http[r], [2.0, 4.0], 8.0),
        ]
        + ([dict(kind="rates", tokens_per_s=7.0)] if r == 0 else [])
        for r in range(3)
    ]
    serve_load, ev = bench["serve_load"], bench["evidence"]
    found = serve_load.measurements(rounds, types.SimpleNamespace(concurrency=8, waves=2))
    assert found[0]["case"] == "16 requests, 8 streams against batches of 8"
    in_process = _by(found, "output throughput", "efla serve's scheduler (in process)")
    # the faster order each round: 60 (sorted), 40 (arrival), 100 (arrival)
    assert in_process["baseline"] == {"name": "static generate, the faster order of the round", "rounds": [60.0, 40.0, 100.0]}
    assert ev.ratios(in_process) == pytest.approx([100 / 60, 3.0, 0.5])
    assert ev.ratios(_by(found, "output throughput", "efla serve over HTTP (streaming clients)")) == pytest.approx(
        [0.5, 1.0, 0.5]
    )
    assert ev.ratios(_by(found, "output throughput", "static generate, sorted by output length")) == [1.2, 0.75, 0.8]
    assert _by(found, "decode throughput (prefill and first tokens taken out)", "static generate, sorted by output length")[
        "ours"
    ]["rounds"] == [20.0, 21.0, 22.0]
    assert _by(found, "inter-token latency, p99 / p50", "efla serve's scheduler (in process)")["ours"]["rounds"] == [
        5.0,
        4.0,
        3.0,
    ]
    deliver = _by(found, "scheduler loop per decoding step, deliver", "efla serve's scheduler (in process)")
    assert deliver["ours"]["rounds"] == [4.0, 5.0, 6.0] and deliver["baseline"] is None
    lines, checks = serve_load.targets(rounds)
    assert checks["server"]["throughput_vs_static"] == {
        "value": 100 / 60,
        "rounds": pytest.approx([100 / 60, 3.0, 0.5]),
        "pass": True,
    }
    assert checks["http"]["throughput_vs_static"]["value"] == 0.5 and not checks["http"]["throughput_vs_static"]["pass"]
    assert checks["server"]["itl_p99_over_p50"] == {"value": 4.0, "rounds": [5.0, 4.0, 3.0], "pass": False}
    assert checks["http"]["itl_p99_over_p50"]["pass"]  # 2.0 <= 3
    assert lines[0].startswith("- efla serve's scheduler (in process): 1.67x (0.50-3.00x over 3 rounds)") and lines[0].endswith(
        "PASS"
    )
    _checked(ev, 3, found)
