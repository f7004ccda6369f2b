"""MAD benchmark: generator structure, metric, backbone, chunked training, tiny end-to-end run,
resume and the CLI."""

from __future__ import annotations

import csv
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

import efla.ops.api as ops_api
from efla.cli import build_parser, main
from efla_lab.data import mad_tasks as D
from efla_lab.mad import model as E
from efla_lab.mad import report as P
from efla_lab.mad import run as R
from efla_lab.mad import training as T


@pytest.fixture
def seed():
    s = int(np.random.SeedSequence().entropy % (2**31))
    print(f"seed {s}")
    return s


def _sets(setting, seed, n_train=64, n_test=64):
    s = D.MADSetting(**{**setting.to_dict(), "num_train_examples": n_train, "num_test_examples": n_test})
    return D.make_dataset(s, seed=seed)


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("V,L", [(16, 128), (64, 64)])
def test_in_context_recall_structure(V, L, seed):
    d = _sets(D.MADSetting("in-context-recall", V, L), seed)
    xtr, ytr = d["train"]
    assert xtr.shape == (64, L - 1) and ytr.shape == (64, L - 1)
    np.testing.assert_array_equal(ytr[:, :-1], xtr[:, 1:])  # training: next token everywhere
    assert (ytr != D.IGNORE).all()
    x, y = d["test"]
    for xi, yi in zip(x, y):
        seq = np.append(xi, yi[-1])  # the last target is the probe's value
        keys, vals = seq[0::2], seq[1::2]
        assert ((keys >= 0) & (keys < V // 2)).all() and ((vals >= V // 2) & (vals < V)).all()
        table = {}
        for k, v in zip(keys, vals):
            assert table.setdefault(k, v) == v  # one value per key within a sequence
        seen = set()
        for j in range(0, L - 1):
            if j % 2 == 0 and seq[j] in seen:
                assert yi[j] == table[seq[j]]  # scored: value of an earlier key
            else:
                assert yi[j] == D.IGNORE, (j, seq[j])
            if j % 2 == 0:
                seen.add(seq[j])
        assert yi[-1] != D.IGNORE and seq[-2] in set(keys[:-1])  # the probe key was shown before
        assert (yi != D.IGNORE).sum() >= L // 2 - V // 2  # only first occurrences are unscored


def test_noisy_recall_structure(seed):
    V, L, frac = 32, 128, 0.4
    d = _sets(D.MADSetting("noisy-in-context-recall", V, L, frac_noise=frac, noise_vocab_size=16), seed, 32, 200)
    x, y = d["test"]
    noise_slots = slots = 0
    for xi, yi in zip(x, y):
        seq = np.append(xi, yi[-1])
        pairs = seq.reshape(-1, 2)
        table = {}
        for p, (k, v) in enumerate(pairs):
            is_noise = k >= V - 16
            assert is_noise == (v >= V - 16), "a slot is either two noise tokens or a (key, value) pair"
            if is_noise:
                assert p < len(pairs) - 1 and k < V and v < V
                assert 2 * p >= len(yi) or yi[2 * p] == D.IGNORE  # noise is never scored
                noise_slots += 1
            else:
                assert 0 <= k < 8 and 8 <= v < 16
                assert table.setdefault(k, v) == v
                if 2 * p < len(yi) and yi[2 * p] != D.IGNORE:
                    assert yi[2 * p] == table[k]
            slots += p < len(pairs) - 1
    assert abs(noise_slots / slots - frac) < 0.03, noise_slots / slots
    xtr, ytr = d["train"]
    np.testing.assert_array_equal(ytr[:, :-1], xtr[:, 1:])
    assert (ytr >= V - 16).any()  # noise tokens are training targets too


def _runs(mask):
    """(start, length) of the maximal runs of True."""
    out, j = [], 0
    while j < len(mask):
        if mask[j]:
            k = j
            while k < len(mask) and mask[k]:
                k += 1
            out.append((j, k - j))
            j = k
        else:
            j += 1
    return out


def test_fuzzy_recall_structure(seed):
    V, L = 16, 128
    d = _sets(D.MADSetting("fuzzy-in-context-recall", V, L, k_motif_size=3, v_motif_size=3), seed, 64, 128)
    nk = (V - 1) // 2  # keys 0..6, values 7..14, pad 15
    for split in ("train", "test"):
        x, y = d[split]
        assert x.shape == y.shape == (len(x), L)
        probe_in_body = 0
        for xi, yi in zip(x, y):
            seq = np.append(xi, yi[-1])  # the last target is the last token (scored at test)
            pad = seq == V - 1
            n_pad = int(np.argmin(pad))
            assert pad[:n_pad].all() and not pad[n_pad:].any()  # left padding only
            body = seq[n_pad:]
            key_runs, val_runs = _runs(body < nk), _runs(body >= nk)
            assert body[0] < nk and len(key_runs) == len(val_runs)  # key motif, value motif, ...
            motifs = []
            for (s, a), (t, b) in zip(key_runs, val_runs):
                assert 1 <= a <= 3 and 1 <= b <= 3
                if split == "test":
                    assert a == 3  # test keys are always full-size motifs
                k, v = tuple(body[s : s + a]), tuple(body[t : t + b])
                assert len(set(k)) == a and len(set(v)) == b  # distinct letters within a motif
                motifs.append((k, v, t))
            table = {}
            for k, v, _ in motifs:
                assert table.setdefault(k, v) == v  # one value per key within a sequence
            probe_in_body += motifs[-1][:2] in [m[:2] for m in motifs[:-1]]
            if split == "train":
                np.testing.assert_array_equal(yi[:-1], xi[1:])
                continue
            scored = yi != D.IGNORE
            assert ((yi[scored] >= nk) & (yi[scored] < V - 1)).all()  # only value tokens are scored
            shown = set()
            for i, (k, v, t) in enumerate(motifs):
                for j in range(t, t + len(v)):
                    tgt = yi[n_pad + j - 1]
                    # scored: a value of a key shown before, and always the final probe's value
                    assert tgt == (body[j] if (k in shown or i == len(motifs) - 1) else D.IGNORE)
                shown.add(k)
            assert scored.sum() == sum(scored[n_pad + t - 1 : n_pad + t - 1 + len(v)].sum() for _, v, t in motifs)
        assert probe_in_body >= 0.85 * len(x)  # the probe pair is (nearly always) shown in the body first


def test_selective_copying_structure(seed):
    V, L, n = 16, 256, 16
    d = _sets(D.MADSetting("selective-copying", V, L, num_tokens_to_copy=n), seed)
    for split in ("train", "test"):
        x, y = d[split]
        assert x.shape == y.shape == (64, L)
        for xi, yi in zip(x, y):
            assert xi[L - n - 1] == V - 1 and (xi == V - 1).sum() == 1  # one copy token
            assert (xi[L - n :] == V - 2).all()  # answers are not fed back
            assert (yi[: L - n] == D.IGNORE).all()
            head = xi[: L - n - 1]
            content = head[head != V - 2]
            assert len(content) == n and (content < V - 2).all()
            np.testing.assert_array_equal(yi[L - n :], content)  # the content tokens in order
            assert head[-1] != V - 2  # the last content token sits right before the copy token
            assert (head == V - 2).sum() == L - 2 * n - 1


def test_compression_structure(seed):
    V, L = 32, 64
    d = _sets(D.MADSetting("compression", V, L), seed)
    for split in ("train", "test"):
        x, y = d[split]
        np.testing.assert_array_equal(x, y)
        assert (x[:, -1] == V - 1).all() and (x[:, :-1] < V - 1).all() and (x >= 0).all()
    # roughly uniform content tokens
    counts = np.bincount(d["train"][0][:, :-1].ravel(), minlength=V - 1)
    assert counts.min() > 0.7 * counts.mean()


def test_memorization_table_is_fixed(seed):
    V, L = 256, 32
    table = D.memorization_table(V, seed)  # MAD-lab seeds the table with the run's seed (12345)
    assert sorted(table) == list(range(127))
    assert len(set(table.values())) == 127 and all(127 <= v <= 254 for v in table.values())
    assert table == D.memorization_table(V, seed) and table != D.memorization_table(V, seed + 1)
    d = _sets(D.MADSetting("memorization", V, L, num_train_examples=256), seed)
    seen = {}
    for split in ("train", "test"):
        x, y = d[split]
        assert (x[:, 1::2] == V - 1).all() and (y[:, 0::2] == D.IGNORE).all()
        for k, v in zip(x[:, 0::2].ravel(), y[:, 1::2].ravel()):
            assert table[int(k)] == v
            assert seen.setdefault(int(k), int(v)) == v  # same table across sequences and splits
    assert len(seen) > 100


@pytest.mark.parametrize("task", D.TASKS)
def test_datasets_deterministic_and_train_test_differ(task):
    s = R._TINY[task]
    a, b = D.make_dataset(s, seed=3), D.make_dataset(s, seed=3)
    c = D.make_dataset(s, seed=4)
    for split in ("train", "test"):
        for i in range(2):
            np.testing.assert_array_equal(a[split][i], b[split][i])
    assert not np.array_equal(a["train"][0], c["train"][0])
    n = len(a["test"][0])
    assert not np.array_equal(a["train"][0][:n], a["test"][0])
    assert a["leakage"] < 0.05
    if task in ("in-context-recall", "noisy-in-context-recall", "fuzzy-in-context-recall"):
        # training targets are the full next-token stream, test targets only the recalls
        assert (a["train"][1] != D.IGNORE).mean() > 0.99 and (a["test"][1] == D.IGNORE).mean() > 0.3
    else:
        assert (a["train"][1] != D.IGNORE).mean() == pytest.approx((a["test"][1] != D.IGNORE).mean(), abs=0.05)


def test_benchmark_settings():
    counts = {t: len(D.benchmark_settings(t)) for t in D.TASKS}
    assert counts == {
        "in-context-recall": 11,
        "fuzzy-in-context-recall": 11,
        "noisy-in-context-recall": 14,
        "selective-copying": 13,
        "compression": 11,
        "memorization": 6,
    }
    ids = [s.id for t in D.TASKS for s in D.benchmark_settings(t)]
    assert len(set(ids)) == 66
    nr = D.baseline_setting("noisy-in-context-recall")
    assert (nr.vocab_size, nr.noise_vocab_size, nr.frac_noise) == (32, 16, 0.2)
    assert D.baseline_setting("memorization").num_train_examples == 256


# ----------------------------------------------------------------------------- metric and model


def _naive_macro(logits, targets, V):
    p = logits.argmax(-1).ravel().tolist()
    t = targets.ravel().tolist()
    pairs = [(a, b) for a, b in zip(p, t) if b != D.IGNORE]
    scores = []
    for c in range(V):
        tp = sum(1 for a, b in pairs if a == c and b == c)
        fn = sum(1 for a, b in pairs if a != c and b == c)
        fp = sum(1 for a, b in pairs if a == c and b != c)
        if tp + fp + fn:
            scores.append(tp / (tp + fn) if tp + fn else 0.0)
    return sum(scores) / len(scores)


def test_macro_accuracy_matches_definition(seed):
    g = torch.Generator().manual_seed(seed)
    V = 12
    targets = torch.randint(0, V - 3, (4, 50), generator=g)  # some classes never targets
    targets[torch.rand(4, 50, generator=g) < 0.4] = D.IGNORE
    logits = torch.randn(4, 50, V, generator=g)
    logits[..., 0] += 1.0  # class 0 over-predicted
    got = float(E.macro_accuracy(logits, targets, V))
    assert got == pytest.approx(_naive_macro(logits, targets, V), abs=1e-12)
    perfect = torch.nn.functional.one_hot(targets.clamp_min(0), V).float()
    assert float(E.macro_accuracy(perfect, targets, V)) == 1.0
    try:
        from torchmetrics.classification import MulticlassAccuracy
    except ImportError:
        return
    ref = MulticlassAccuracy(num_classes=V, average="macro", ignore_index=D.IGNORE)
    assert got == pytest.approx(float(ref(logits.reshape(-1, V), targets.reshape(-1))), abs=1e-6)


def test_backbone_shapes_and_init():
    s = D.MADSetting("in-context-recall", 16, 64)
    m = E.build_model(s, "exact", seed=0)
    assert E.swiglu_width(128) == 352
    assert [type(layer.layer).__name__ for layer in m.layers] == ["Mixer", "GatedMLP", "Mixer", "GatedMLP"]
    assert m.layers[1].layer.intermediate_size == 352
    assert m.embed.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert m.head.bias.abs().max() == 0
    x = torch.randint(0, 16, (3, 63))
    assert m(x).shape == (3, 63, 16)
    # causal: changing a later token leaves earlier logits untouched
    x2 = x.clone()
    x2[:, 40] = (x2[:, 40] + 1) % 16
    with torch.no_grad():
        a, b = m(x), m(x2)
    assert torch.allclose(a[:, :40], b[:, :40], atol=1e-5) and not torch.allclose(a[:, 40:], b[:, 40:])

    c = D.MADSetting("compression", 16, 32)
    ae = E.build_model(c, "euler", seed=0)
    assert ae.autoencoder
    w = torch.cat([mod.weight.ravel() for mod in ae.modules() if isinstance(mod, torch.nn.Linear)])
    assert w.std().item() == pytest.approx(0.02, rel=0.05)  # all linear weights N(0, 0.02), mixer's too
    xc = torch.randint(0, 15, (2, 32))
    out = ae(xc)
    assert out.shape == (2, 32, 16)
    xc2 = xc.clone()
    xc2[:, 0] = (xc2[:, 0] + 1) % 15
    with torch.no_grad():  # every output position depends on the first token (through the last state)
        assert (ae(xc) - ae(xc2)).abs().amax(dim=-1).min() > 0
    pe = E.sinusoidal_positions(32, 128)
    assert pe.shape == (32, 128) and torch.allclose(pe[0, :64], torch.zeros(64)) and torch.allclose(pe[0, 64:], torch.ones(64))


@pytest.mark.parametrize("rule", E.RULES)
def test_training_uses_chunked_ops(rule, monkeypatch):
    calls = []
    real = ops_api.chunk_generic

    def chunk_spy(q, k, *args, **kw):
        calls.append(k.shape[1])
        return real(q, k, *args, **kw)

    def no_scan(*args, **kw):
        raise AssertionError("per-token recurrence used during training")

    monkeypatch.setattr(ops_api, "chunk_generic", chunk_spy)
    monkeypatch.setattr(ops_api, "recurrent_generic", no_scan)
    s = D.MADSetting("selective-copying", 16, 512, 8, 8, num_tokens_to_copy=8)
    cfg = T.RunConfig(setting=s, rule=rule, lr=1e-3, epochs=1, batch_size=8, width=32, num_heads=2)
    res = T.train_run(cfg)
    assert res["steps"] == 1 and calls and min(calls) == 512  # every mixer call ran the chunked form on T=512
    assert len(calls) == 2 * 2  # 2 mixers x (1 training step + 1 eval batch)


def test_learns_memorization():
    """A small fixed table is learned in a few dozen steps (catches broken heads, targets, optimizers)."""
    s = D.MADSetting("memorization", 16, 16, 256, 64)  # 7 facts
    cfg = T.RunConfig(setting=s, rule="exact", lr=3e-3, epochs=12, batch_size=32, width=32, num_heads=2)
    res = T.train_run(cfg)
    assert res["test_acc"] > 0.95, res["history"][-1]
    assert res["history"][-1]["train_loss"] < res["history"][0]["train_loss"] / 2


def test_cuda_graph_steps_need_a_cuda_device():
    cfg = T.RunConfig(setting=D.MADSetting("memorization", 16, 16, 256, 64), epochs=1, batch_size=32, width=32, num_heads=2)
    with pytest.raises(ValueError, match="cuda_graph: needs a CUDA device"):
        T.train_run(cfg, cuda_graph=True)


def test_a_resumed_optimizer_steps_in_the_form_of_the_run():
    # a state saved by a graphed run (capturable AdamW, tensor lr) resumed eagerly, and back: the
    # schedule and the updates go on as in a run that never changed form
    def fresh():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4))
        opt = torch.optim.AdamW([w], lr=3e-3, weight_decay=0.1)
        return w, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-6)

    def train(w, opt, sched, epochs):
        for _ in range(epochs):
            opt.zero_grad()
            (w**2).sum().backward()
            opt.step()
            sched.step()

    w_ref, opt_ref, sched_ref = fresh()
    train(w_ref, opt_ref, sched_ref, 4)
    w, opt, sched = fresh()
    train(w, opt, sched, 2)
    T._set_step_form(opt, sched, True, torch.device("cpu"))  # as a graphed run holds it (and saves it)
    group = opt.param_groups[0]
    assert group["capturable"] and isinstance(group["lr"], torch.Tensor)
    w2, opt2, sched2 = fresh()
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    with torch.no_grad():
        w2.copy_(w)
    T._set_step_form(opt2, sched2, False, torch.device("cpu"))
    group = opt2.param_groups[0]
    assert not group["capturable"] and isinstance(group["lr"], float)
    assert all(isinstance(x, float) for x in sched2.base_lrs + sched2.get_last_lr())
    train(w2, opt2, sched2, 2)
    assert torch.allclose(w2, w_ref, rtol=1e-6, atol=1e-7) and opt2.param_groups[0]["lr"] == pytest.approx(
        opt_ref.param_groups[0]["lr"], rel=1e-6
    )  # a tensor lr is float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_cuda_graph_steps_train_like_eager_steps(rule):
    # the same run eagerly and replayed from CUDA graphs (warm-up steps, capture, replays, an uneven
    # last batch stepping eagerly, the schedule's lr reaching the graph; test batches graphed too): the
    # same losses and accuracies
    s = D.MADSetting("fuzzy-in-context-recall", 16, 32, 200, 64, k_motif_size=3, v_motif_size=3)
    cfg = T.RunConfig(
        setting=s, rule=rule, lr=3e-3, weight_decay=0.1, epochs=5, batch_size=32, width=32, num_heads=2, early_stop=None
    )
    eager = T.train_run(cfg, device="cuda")
    graphed = T.train_run(cfg, device="cuda", cuda_graph=True)
    assert graphed["cuda_graph"] and graphed["steps"] == eager["steps"] == 5 * 7
    for a, b in zip(eager["history"], graphed["history"]):
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6)
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4), (a, b)
        assert a["test_ppl"] == pytest.approx(b["test_ppl"], rel=1e-3), (a, b)
    assert eager["history"][-1]["train_loss"] < eager["history"][0]["train_loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rule", ["exact", "euler"])
def test_runs_side_by_side_on_a_gpu_train_as_alone(rule):
    # graphed runs of two settings (one the fuzzy-recall baseline, whose graphs once shared a cuBLAS
    # workspace and raced on it) and an eager run, each in its own stream: each as it trains alone
    tiny = T.RunConfig(
        setting=D.MADSetting("fuzzy-in-context-recall", 16, 32, 200, 64, k_motif_size=3, v_motif_size=3),
        rule=rule,
        lr=3e-3,
        weight_decay=0.1,
        epochs=5,
        batch_size=32,
        width=32,
        num_heads=2,
        early_stop=None,
    )
    full = T.RunConfig(setting=D.baseline_setting("fuzzy-in-context-recall"), rule=rule, lr=1e-3, epochs=1)
    cases = [
        (tiny, True),
        (dataclasses.replace(tiny, lr=1e-3), True),
        (tiny, False),
        (full, True),
        (dataclasses.replace(full, lr=5e-4), True),
        (full, False),
    ]
    data = {cfg.setting: D.make_dataset(cfg.setting, seed=cfg.seed) for cfg in (tiny, full)}  # made once
    runs = [T.MADRun(cfg, data[cfg.setting], device="cuda", cuda_graph=graphed) for cfg, graphed in cases]
    captured_in = {}
    real_capture = T.GraphedBatches._capture

    def capture(graphed, xb, yb):  # each graph (training step, test batch) captured in its run's stream
        captured_in[id(graphed)] = torch.cuda.current_stream()
        real_capture(graphed, xb, yb)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(T.GraphedBatches, "_capture", capture)
        T.train_side_by_side(runs)
    graphed_runs = [r for r, (_, graphed) in zip(runs, cases) if graphed]
    for part in ("train_step", "test_batch"):
        assert [captured_in[id(getattr(r, part))] for r in graphed_runs] == [r.stream for r in graphed_runs]
        assert all(getattr(r, part).graph is None for r in graphed_runs)  # released as each run ended
    assert len({r.stream for r in runs}) == len(runs)
    for run, (cfg, graphed) in zip(runs, cases):
        alone = T.train_run(cfg, data[cfg.setting], device="cuda", cuda_graph=graphed)
        assert len(alone["history"]) == len(run.result()["history"]) == cfg.epochs
        for a, b in zip(alone["history"], run.result()["history"]):
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4), (cfg.key, a, b)
            assert a["test_ppl"] == pytest.approx(b["test_ppl"], rel=1e-3), (cfg.key, a, b)
    # the full epoch graphed and eager: 100 steps apart from AdamW's capturable form (a race is far larger)
    for a, b in zip(runs[3].result()["history"], runs[5].result()["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3) and a["test_ppl"] == pytest.approx(
            b["test_ppl"], rel=1e-2
        )


def test_early_stop_and_best_checkpoint(monkeypatch):
    s = D.MADSetting("memorization", 16, 16, 256, 64)
    cfg = T.RunConfig(setting=s, rule="euler", lr=3e-3, epochs=40, batch_size=32, width=32, num_heads=2)
    res = T.train_run(cfg)
    assert res["stopped_early"] and res["epochs_run"] < 40 and res["history"][-1]["test_acc"] > E.EARLY_STOP
    best = min(res["history"], key=lambda h: h["test_ppl"])
    assert res["test_acc"] == best["test_acc"] and res["best_epoch"] == best["epoch"]
    lrs = [h["lr"] for h in res["history"]]
    assert lrs[0] == pytest.approx(3e-3) and all(a > b for a, b in zip(lrs, lrs[1:]))  # per-epoch cosine


def test_a_killed_run_resumes_to_the_same_result(tmp_path):
    """A run killed part-way continues from its last saved epoch (same weights, optimizer, schedule
    and data order): the result equals the uninterrupted run's."""
    s = D.MADSetting("memorization", 16, 16, 256, 64)
    cfg = T.RunConfig(setting=s, rule="exact", lr=3e-3, epochs=6, batch_size=32, width=32, num_heads=2, early_stop=None)
    whole = T.train_run(cfg)

    class Kill(Exception):
        pass

    class KillingBar:  # stops the run in its fourth epoch, after three saved ones
        def __init__(self):
            self.steps = 0

        def update(self, n):
            self.steps += n
            if self.steps > 3 * whole["steps"] // 6:
                raise Kill

        def set_postfix(self, **kw):
            pass

    ckpt = str(tmp_path / "partial" / "run.pt")
    with pytest.raises(Kill):
        T.train_run(cfg, bar=KillingBar(), checkpoint=ckpt, checkpoint_every=0.0)
    assert os.path.exists(ckpt)
    resumed = T.train_run(cfg, checkpoint=ckpt, checkpoint_every=0.0)
    for key in ("train_loss", "test_acc", "test_ppl", "lr"):
        assert [h[key] for h in resumed["history"]] == [h[key] for h in whole["history"]], key
    assert resumed["steps"] == whole["steps"] and resumed["test_acc"] == whole["test_acc"]
    other = dataclasses.replace(cfg, lr=1e-3)  # a state saved by another run is not used
    T._save_state(ckpt, cfg, *_fresh(cfg), dict(history=[{"epoch": 1}], best=None, steps=1, seconds=0.0))
    assert T._resume_state(ckpt, other, *_fresh(other)) is None
    assert T._resume_state(ckpt, cfg, *_fresh(cfg))["steps"] == 1
    wrong_model = dataclasses.replace(cfg, width=16)  # same key format, other shapes: refused, not raised
    T._save_state(ckpt, wrong_model, *_fresh(wrong_model), dict(history=[], best=None, steps=0, seconds=0.0))
    torch.save({**torch.load(ckpt, weights_only=True), "key": cfg.key}, ckpt)
    assert T._resume_state(ckpt, cfg, *_fresh(cfg)) is None
    with open(ckpt, "w") as f:
        f.write("not a checkpoint")
    assert T._resume_state(ckpt, cfg, *_fresh(cfg)) is None
    again = T.train_run(cfg, checkpoint=ckpt)  # a damaged file: the run starts over, same result
    assert [h["train_loss"] for h in again["history"]] == [h["train_loss"] for h in whole["history"]]


def _fresh(cfg):
    model = E.build_model(cfg.setting, cfg.rule, cfg.width, cfg.num_heads, cfg.blocks)
    opt = torch.optim.AdamW(model.parameters())
    return model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2), torch.Generator()


# ----------------------------------------------------------------------------- end to end


def _without_times(res: dict) -> dict:
    out = {k: v for k, v in res.items() if k != "seconds"}
    out["history"] = [{k: v for k, v in h.items() if k != "seconds"} for h in res["history"]]
    return out


def test_runs_side_by_side_equal_runs_alone():
    # interleaved step by step (a short last batch, an early stop, a time limit among them), each run
    # gives exactly its result alone
    s = D.MADSetting("memorization", 16, 16, 200, 64)
    base = dict(setting=s, lr=3e-3, epochs=6, batch_size=32, width=32, num_heads=2)
    cfgs = [
        T.RunConfig(rule="exact", early_stop=None, **base),
        T.RunConfig(rule="euler", **{**base, "epochs": 40}),
        T.RunConfig(rule="exact", weight_decay=0.1, early_stop=None, **base),
    ]
    data = D.make_dataset(s, seed=12345)
    alone = [T.train_run(c, data) for c in cfgs]
    runs = [T.MADRun(c, data) for c in cfgs]
    ended = []
    T.train_side_by_side(runs, on_done=lambda run: ended.append((run, [r.done for r in runs])))
    together = [r.result() for r in runs]
    assert alone[1]["stopped_early"] and alone[1]["epochs_run"] < 40
    # each run is handed over as it ends (the early stop while the others go on), timed to its own end
    assert [r for r, _ in ended] == [runs[1], runs[0], runs[2]] and ended[0][1] == [False, True, False]
    assert together[1]["seconds"] == together[1]["history"][-1]["seconds"]
    for a, b in zip(alone, together):
        assert _without_times(a) == _without_times(b)
    cut = T.MADRun(cfgs[0], data, time_limit=0.0)
    T.train_side_by_side([cut, T.MADRun(cfgs[2], data)])
    assert cut.result()["truncated"] and cut.result()["steps"] == 1


def test_run_mad_side_by_side_stores_the_same_runs(tmp_path, monkeypatch):
    # three at a time: the first group mixes two settings; each dataset is made once
    opts = dict(preset="tiny", tasks=["memorization", "compression"], rules=["exact", "euler"], num_heads=2)
    one = R.run_mad(R.MADOptions(**opts), str(tmp_path / "one"))
    made = []
    real = R.make_dataset
    monkeypatch.setattr(R, "make_dataset", lambda setting, seed: made.append(setting.id) or real(setting, seed=seed))
    three = R.run_mad(R.MADOptions(**opts, together=3), str(tmp_path / "three"))
    assert len(three["runs"]) == 4 and not three["missing"]
    for a, b in zip(one["runs"], three["runs"]):
        assert _without_times(a) == _without_times(b)
    planned = R.plan(R.MADOptions(**opts))
    assert R._side_by_side_groups(planned, 3) == [planned[:3], planned[3:]]
    assert planned[1].setting != planned[2].setting and sorted(made) == sorted({c.setting.id for c in planned})
    with pytest.raises(ValueError, match="at most 32 runs side by side on a GPU"):  # before any training
        R.run_mad(R.MADOptions(**opts, device="cuda", together=33), str(tmp_path / "many"))
    assert not os.listdir(tmp_path / "many" / "runs")


def test_runs_side_by_side_need_streams_of_their_own():
    class Run:  # what train_side_by_side reads before training
        def __init__(self, stream):
            self.stream, self.done = stream, True

    shared = object()
    with pytest.raises(ValueError, match="share CUDA streams; PyTorch lends at most 32"):
        T.train_side_by_side([Run(shared), Run(object()), Run(shared)])
    T.train_side_by_side([Run(object()), Run(object()), Run(None), Run(None)])  # CPU runs have none


def test_tiny_preset_all_tasks_two_rules(tmp_path):
    opts = R.MADOptions(preset="tiny", rules=["exact", "euler"], num_heads=2)
    res = R.run_mad(opts, str(tmp_path))
    files = P.write_outputs(res, str(tmp_path), "efla mad --preset tiny")
    assert len(res["runs"]) == 12 and not res["missing"]
    for r in res["runs"]:
        assert 0.0 <= r["test_acc"] <= 1.0 and np.isfinite(r["test_ppl"]) and r["epochs_run"] == 2
    agg = P.aggregate(res["runs"])
    assert set(agg) == {"exact", "euler"} and all(len(agg[r]) == 7 for r in agg)  # six tasks + average
    names = {os.path.basename(f) for f in files}
    assert names == {"results.json", "runs.csv", "summary.md", "mad_scores.png"}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["scores"]["exact"]["average"] == pytest.approx(agg["exact"]["average"])
    with open(tmp_path / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 12
    md = (tmp_path / "summary.md").read_text()
    for label in D.TASK_LABEL.values():
        assert f"## {label}" in md
    assert "paper (66-setting protocol)" in md and "EFLA − DeltaNet" in md
    assert (tmp_path / "mad_scores.png").stat().st_size > 10_000


def test_aggregation_max_over_grid_mean_over_settings():
    def run(task, sid, rule, lr, acc):
        return {"task": task, "setting": sid, "rule": rule, "lr": lr, "weight_decay": 0.0, "test_acc": acc, "truncated": False}

    runs = [
        run("compression", "a", "exact", 1e-3, 0.2),
        run("compression", "a", "exact", 1e-4, 0.5),
        run("compression", "b", "exact", 1e-3, 0.9),
        run("memorization", "m", "exact", 1e-3, 0.3),
    ]
    agg = P.aggregate(runs)
    assert agg["exact"]["compression"]["score"] == pytest.approx((0.5 + 0.9) / 2)
    assert agg["exact"]["compression"]["settings"]["a"]["lr"] == 1e-4
    assert agg["exact"]["average"] == pytest.approx(((0.5 + 0.9) / 2 + 0.3) / 2)


def test_resume_skips_finished_runs(tmp_path, monkeypatch):
    opts = R.MADOptions(preset="tiny", tasks=["memorization"], rules=["exact"], num_heads=2)
    first = R.run_mad(opts, str(tmp_path))
    assert len(first["runs"]) == 1
    trained = []
    real = R.MADRun

    def spy(cfg, *a, **kw):
        trained.append(cfg.rule)
        return real(cfg, *a, **kw)

    monkeypatch.setattr(R, "MADRun", spy)
    again = R.run_mad(opts, str(tmp_path))
    assert trained == [] and again["runs"][0]["test_acc"] == first["runs"][0]["test_acc"]
    more = R.run_mad(R.MADOptions(preset="tiny", tasks=["memorization"], rules=["exact", "euler"], num_heads=2), str(tmp_path))
    assert trained == ["euler"] and len(more["runs"]) == 2
    # a run cut by the time limit is redone once more time is allowed
    cut = R.run_mad(
        R.MADOptions(preset="tiny", tasks=["compression"], rules=["exact"], num_heads=2, time_limit=0.0), str(tmp_path)
    )
    assert cut["runs"][0]["truncated"] and cut["runs"][0]["steps"] == 1
    shown = R.run_mad(
        R.MADOptions(preset="tiny", tasks=["compression"], rules=["exact"], num_heads=2, train=False), str(tmp_path)
    )
    assert shown["runs"][0]["truncated"]  # --report-only shows what is stored, cut or not
    trained.clear()
    R.run_mad(R.MADOptions(preset="tiny", tasks=["compression"], rules=["exact"], num_heads=2), str(tmp_path))
    assert trained == ["exact"]
    report = R.run_mad(
        R.MADOptions(preset="tiny", tasks=["compression"], rules=["euler"], num_heads=2, train=False), str(tmp_path)
    )
    assert report["runs"] == [] and len(report["missing"]) == 1


def test_a_record_of_runs_in_one_file_counts_as_stored(tmp_path, monkeypatch):
    """A recorded experiment keeps its runs as lines of runs.jsonl: --report-only over it gives the
    report of the run files, nothing retrains, and a run file of its own wins over its line."""
    from efla_lab import harness

    opts = R.MADOptions(preset="tiny", tasks=["memorization"], rules=["exact", "euler"], num_heads=2)
    stored = R.run_mad(opts, str(tmp_path / "runs_dir"))
    record = tmp_path / "record"
    harness.write_records(str(record / "runs.jsonl"), stored["runs"])
    monkeypatch.setattr(R, "MADRun", lambda *a, **kw: pytest.fail("a recorded run was trained again"))
    shown = R.run_mad(R.MADOptions(**{**opts.__dict__, "train": False}), str(record))
    assert shown["runs"] == stored["runs"] and shown["missing"] == []
    assert R.run_mad(opts, str(record))["runs"] == stored["runs"]
    own = dict(stored["runs"][0], test_acc=-1.0)
    harness.atomic_write_json(str(record / "runs" / (own["key"] + ".json")), own)
    assert R.run_mad(opts, str(record))["runs"][0]["test_acc"] == -1.0


def test_quick_preset_plan():
    cfgs = R.plan(R.MADOptions(preset="quick"))
    assert len(cfgs) == 12 and {c.setting for c in cfgs} == {D.baseline_setting(t) for t in D.TASKS}
    ep = {c.setting.task: c.epochs for c in cfgs}
    assert ep["in-context-recall"] == 3 and ep["memorization"] == 150
    assert all(c.batch_size == 128 and c.width == 128 for c in cfgs)
    assert len(R.plan(R.MADOptions(preset="baseline"))) == 6 * 6 * 2
    assert len(R.plan(R.MADOptions(preset="paper", rules=["exact"]))) == 396
    assert {c.epochs for c in R.plan(R.MADOptions(preset="quick", epochs=200))} == {200}


def test_settings_narrow_the_plan_to_the_named_ids():
    wanted = ["M-v1024-l32-n256", "M-v8192-l32-n256"]
    cfgs = R.plan(R.MADOptions(preset="paper", tasks=["memorization"], settings=wanted))
    assert sorted({c.setting.id for c in cfgs}) == wanted and len(cfgs) == 2 * 6 * 2  # 3 lr x 2 wd x 2 rules each
    with pytest.raises(ValueError, match="M-v999-l32-n256 not among the paper preset's settings"):
        R.plan(R.MADOptions(preset="paper", tasks=["memorization"], settings=["M-v999-l32-n256"]))


def test_cli_refuses_an_unknown_setting_before_writing(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["mad", "--preset", "paper", "--tasks", "M", "--settings", "M-v1024", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("efla mad: settings: M-v1024 not among") and err[0].endswith("(--settings)")
    assert not out.exists()


def test_cli(tmp_path):
    args = build_parser().parse_args(["mad", "--quick", "--out", str(tmp_path)])
    assert args.quick and args.out == str(tmp_path) and args.func.__name__ == "cmd_mad"
    out = tmp_path / "cli"
    rc = main(
        ["mad", "--preset", "tiny", "--tasks", "M", "--rules", "exact", "gated-euler", "--num-heads", "2", "--out", str(out)]
    )
    assert rc == 0
    saved = json.loads((out / "results.json").read_text())
    assert {r["task"] for r in saved["runs"]} == {"memorization"}
    assert {r["rule"] for r in saved["runs"]} == {"exact", "gated-euler"}
    assert "Gated DeltaNet" in (out / "summary.md").read_text()


def test_seed_sets_the_data_and_the_initialization():
    setting = R._TINY["fuzzy-in-context-recall"]
    one, two = (T.MADRun(T.RunConfig(setting, epochs=1, width=32, num_heads=2, seed=s)) for s in (1, 2))
    again = T.MADRun(T.RunConfig(setting, epochs=1, width=32, num_heads=2, seed=1))
    assert not torch.equal(one.data.train_x, two.data.train_x)
    assert torch.equal(one.data.train_x, again.data.train_x) and torch.equal(one.data.test_y, again.data.test_y)
    params = [dict(r.model.named_parameters()) for r in (one, two, again)]
    assert all(torch.equal(params[0][n], params[2][n]) for n in params[0])
    assert not torch.equal(params[0]["embed.weight"], params[1]["embed.weight"])


def test_cli_seed_keys_its_runs_and_reports_its_own(tmp_path):
    out = tmp_path / "seeds"
    common = ["mad", "--preset", "tiny", "--tasks", "M", "--rules", "exact", "--num-heads", "2", "--out", str(out)]
    assert main(common + ["--seed", "1"]) == 0
    assert main(common + ["--seed", "2"]) == 0
    runs = [json.loads(p.read_text()) for p in (out / "runs").glob("*.json")]
    assert sorted(r["config"]["seed"] for r in runs) == [1, 2]
    assert all(r["key"].endswith(f"-s{r['config']['seed']}-fp32") for r in runs)
    saved = json.loads((out / "results.json").read_text())
    assert [r["config"]["seed"] for r in saved["runs"]] == [2]  # the report scores the seed asked for
    assert "seed 2" in (out / "summary.md").read_text()
    with open(out / "runs.csv") as f:
        assert [row["seed"] for row in csv.DictReader(f)] == ["2"]
