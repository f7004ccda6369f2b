"""Robustness experiment: the classifier, perturbations, data loaders and a tiny end-to-end run."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from efla.cli import main
from efla_lab.data.pixels import find_mnist_dir, load_digits_sequences, load_mnist_sequences
from efla_lab.robustness.model import PixelSequenceClassifier, perturb
from efla.ops import naive

SHARED_MNIST = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mnist"


NAIVE_RULE = {
    "exact": naive.efla,
    "euler": naive.delta_rule,
    "gated-exact": naive.gated_efla,
    "gated-euler": naive.gated_delta_rule,
}


def naive_classifier_forward(model: PixelSequenceClassifier, x: torch.Tensor) -> torch.Tensor:
    """The same model through the per-token loops of efla.ops.naive, in float64."""
    q, k, v, beta, g = (None if t is None else t.double() for t in model.features(x))
    gate = () if g is None else (g,)
    o, _ = NAIVE_RULE[model.rule](q, k, v, *gate, beta)
    return model.head(model.norm(o[:, -1].reshape(x.shape[0], -1).float()))


@pytest.mark.parametrize("rule", ["exact", "euler", "gated-exact", "gated-euler"])
def test_chunked_classifier_equals_per_token_recurrence(rule):
    torch.manual_seed(0)
    model = PixelSequenceClassifier(rule, seq_len=150, width=16, num_heads=2)
    x = torch.rand(3, 150) * 4  # intensity-scaled pixels, so keys are stiff for EFLA
    with torch.no_grad():
        chunked = model(x)
        naive = naive_classifier_forward(model, x)
        recurrent = model(x, mode="recurrent")
    assert (chunked - naive).abs().max() / naive.abs().max() < 1e-4
    assert (recurrent - chunked).abs().max() / chunked.abs().max() < 1e-4


def test_perturbations():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(200, 784)
    assert torch.equal(perturb(x, "scale", 3.0, gen), x * 3)
    noisy = perturb(x, "noise", 0.5, torch.Generator().manual_seed(1))
    assert abs((noisy - x).std().item() - 0.5) < 0.01
    assert torch.equal(perturb(x, "noise", 0.0, gen), x)
    dropped = perturb(x, "dropout", 0.3, torch.Generator().manual_seed(2))
    frac = ((dropped == 0) & (x != 0)).float().sum() / (x != 0).float().sum()
    assert abs(frac.item() - 0.3) < 0.01
    assert torch.equal(perturb(x, "dropout", 1.0, gen), torch.zeros_like(x))
    with pytest.raises(ValueError, match="kind"):
        perturb(x, "blur", 1.0, gen)


def test_digits_are_embedded():
    d = load_digits_sequences()
    assert d.x_train.shape[1] == 64 and len(d.x_train) + len(d.x_test) == 1797
    assert d.x_train.min() >= 0.0 and d.x_train.max() <= 1.0
    assert set(d.y_train.unique().tolist()) == set(range(10))


@pytest.mark.skipif(find_mnist_dir(SHARED_MNIST) is None, reason=f"MNIST not found at {SHARED_MNIST}")
def test_mnist_idx_loader():
    d = load_mnist_sequences(SHARED_MNIST)
    assert d.x_train.shape == (60000, 784) and d.x_test.shape == (10000, 784)
    assert d.y_train[:5].tolist() == [5, 0, 4, 1, 9]  # the well-known first training labels
    assert d.y_test[:3].tolist() == [7, 2, 1]
    assert d.x_train.min() == 0.0 and d.x_train.max() == 1.0


def test_mnist_loader_rejects_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="data_dir"):
        load_mnist_sequences(tmp_path)


def test_authors_model_has_no_input_bias_and_xavier_projections():
    torch.manual_seed(0)
    ours, theirs = PixelSequenceClassifier(width=64), PixelSequenceClassifier(width=64, authors_model=True)
    assert ours.inp.bias is not None and theirs.inp.bias is None
    xavier_bound, default_bound = (6 / 128) ** 0.5, 1 / 64**0.5
    for name in ("q_proj", "k_proj", "v_proj"):
        assert getattr(ours, name).weight.abs().max() <= default_bound
        assert default_bound < getattr(theirs, name).weight.abs().max() <= xavier_bound


def test_training_learns_on_digits():
    from efla_lab.robustness.model import TrainConfig, evaluate, train_classifier

    d = load_digits_sequences()
    model, res = train_classifier(d, TrainConfig(rule="exact", lr=3e-3, epochs=6, batch_size=64, width=32))
    assert not res.diverged and res.losses[-1] < res.losses[0]
    assert evaluate(model, d.x_test, d.y_test) > 0.5  # chance is 0.1


def test_robustness_and_lr_sweep_commands_tiny(tmp_path):
    out = tmp_path / "rob"
    args = [
        "--dataset",
        "digits",
        "--epochs",
        "2",
        "--train-limit",
        "256",
        "--test-limit",
        "64",
        "--width",
        "16",
        "--device",
        "cpu",
    ]
    assert main(["robustness", "--quick", "--out", str(out), "--paper-lr", *args]) == 0
    res = json.loads((out / "results.json").read_text())
    assert {r["setting"] for r in res["runs"]} == {"same-lr", "paper-lr"}
    assert {r["rule"] for r in res["runs"]} == {"exact", "euler"}
    for r in res["runs"]:
        assert set(r["eval"]) == {"clean", "scale", "noise", "dropout"}
        assert all(0.0 <= a <= 1.0 for a in r["eval"]["scale"]["accuracy"])
    for name in [
        "robustness_same-lr.csv",
        "robustness_paper-lr.csv",
        "robustness_same-lr.png",
        "robustness_paper-lr.png",
        "training_loss.png",
        "summary.md",
    ]:
        assert (out / name).stat().st_size > 100, name
    assert "EFLA" in (out / "summary.md").read_text()
    out2 = tmp_path / "lr"
    assert main(["lr-sweep", "--quick", "--authors-model", "--out", str(out2), *args]) == 0
    sweep = json.loads((out2 / "lr_sweep.json").read_text())
    assert sweep["options"]["authors_model"] is True and res["options"]["authors_model"] is False
    assert sorted({r["lr"] for r in sweep["rows"]}) == [1e-3, 1e-2]
    for name in ["lr_sweep.csv", "lr_sweep.png", "lr_sweep.md"]:
        assert (out2 / name).stat().st_size > 100, name


def test_records_of_separate_seeds_merge_into_one(tmp_path):
    """A device call runs each seed as its own process; scripts/merge_claims.py joins their records
    (sample standard deviation over the seeds) and refuses parts that ran differently."""
    import importlib.util
    import statistics

    spec = importlib.util.spec_from_file_location(
        "merge_claims", pathlib.Path(__file__).resolve().parents[2] / "scripts" / "merge_claims.py"
    )
    merge_claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_claims)
    args = [
        "--quick",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--train-limit",
        "64",
        "--test-limit",
        "32",
        "--width",
        "8",
        "--device",
        "cpu",
    ]
    for seed in (0, 1, 2):
        assert main(["robustness", *args, "--seeds", str(seed), "--out", str(tmp_path / f"s{seed}")]) == 0
    assert main(["robustness", *args, "--seeds", "3", "--lr", "3e-3", "--out", str(tmp_path / "other-lr")]) == 0
    parts = [str(tmp_path / f"s{seed}") for seed in (0, 1, 2)]
    assert merge_claims.main(["robustness", str(tmp_path / "merged"), *parts, "--command", "three seeds"]) == 0
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert merged["options"]["seeds"] == [0, 1, 2] and len(merged["runs"]) == 6
    areas = [statistics.mean(r["eval"]["scale"]["accuracy"]) for r in merged["runs"] if r["rule"] == "exact"]
    assert merged["aggregate"]["same-lr"]["exact"]["scale"]["area_std"] == pytest.approx(statistics.stdev(areas))
    with pytest.raises(SystemExit, match="differ in option 'lr'"):
        merge_claims.main(["robustness", str(tmp_path / "bad"), parts[0], str(tmp_path / "other-lr"), "--command", "x"])
    with pytest.raises(SystemExit, match="appears in two parts"):
        merge_claims.main(["robustness", str(tmp_path / "bad"), parts[0], parts[0], "--command", "x"])


def test_sweep_records_of_separate_lrs_and_seeds_merge_with_spread(tmp_path):
    """The sweep runs one process per (rule, seed, lr); the merged record holds every lr, and its
    table gives mean ± sample std over the seeds."""
    import importlib.util
    import statistics

    spec = importlib.util.spec_from_file_location(
        "merge_claims", pathlib.Path(__file__).resolve().parents[2] / "scripts" / "merge_claims.py"
    )
    merge_claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge_claims)
    args = [
        "--quick",
        "--dataset",
        "digits",
        "--epochs",
        "1",
        "--train-limit",
        "64",
        "--test-limit",
        "32",
        "--width",
        "8",
        "--device",
        "cpu",
        "--rules",
        "exact",
    ]
    parts = []
    for seed in (0, 1):
        for lr in ("1e-3", "1e-2"):
            parts.append(str(tmp_path / f"s{seed}-lr{lr}"))
            assert main(["lr-sweep", *args, "--seeds", str(seed), "--lrs", lr, "--out", parts[-1]]) == 0
    parts.append(str(tmp_path / "s0-lr1e-1"))  # a cell whose other seed did not finish
    assert main(["lr-sweep", *args, "--seeds", "0", "--lrs", "1e-1", "--out", parts[-1]]) == 0
    assert merge_claims.main(["lr-sweep", str(tmp_path / "merged"), *parts, "--command", "two seeds"]) == 0
    merged = json.loads((tmp_path / "merged" / "lr_sweep.json").read_text())
    assert merged["lrs"] == [1e-3, 1e-2, 1e-1] and merged["options"]["seeds"] == [0, 1] and len(merged["rows"]) == 5
    assert merged["wall_seconds"] == max(merged["part_wall_seconds"]) and len(merged["part_wall_seconds"]) == 5
    accs = [r["test_accuracy"] for r in merged["rows"] if r["lr"] == 1e-2]
    table = (tmp_path / "merged" / "lr_sweep.md").read_text()
    assert f"acc {statistics.mean(accs):.4f} ± {statistics.stdev(accs):.4f}" in table
    single = next(r for r in merged["rows"] if r["lr"] == 1e-1)
    assert f"| loss {single['final_train_loss']:.3f} / acc {single['test_accuracy']:.4f} |" in table
