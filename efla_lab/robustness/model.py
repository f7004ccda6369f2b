"""Pixel-sequence robustness (paper Fig. 1) and the learning-rate sweep (Fig. 2).

The classifier is the paper's one-layer linear-attention model: pixel -> Linear(1, d) + learned
position embedding -> GELU -> q, k, v projections and ``beta = sigmoid(Linear(d, H))`` (bias -2)
-> the recurrence over the whole sequence (chunked op) -> read-out with the last query ->
LayerNorm -> Linear(d, 10). EFLA uses raw keys and an L2-normalised query; DeltaNet normalises
both. Functions here return plain results; printing and files are the CLI's business.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla import ops
from efla.variants import EXPERIMENT_KEYS, VARIANTS, Variant

RULES = EXPERIMENT_KEYS
PAPER_LR = {v.key: 3e-3 if v.exact else 1e-3 for v in VARIANTS}  # the authors' script


def _op(rule: str, mode: str):
    name = Variant.parse(rule).op_name
    return getattr(ops, f"{mode}_{name}")


class PixelSequenceClassifier(nn.Module):
    """One-layer (gated) delta-rule classifier over a sequence of scalar pixels."""

    def __init__(
        self,
        rule: str = "exact",
        seq_len: int = 784,
        width: int = 64,
        num_heads: int = 1,
        num_classes: int = 10,
        authors_model: bool = False,
    ):
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")
        if width % num_heads:
            raise ValueError(f"num_heads: must divide width {width}, got {num_heads}")
        self.rule, self.seq_len, self.width, self.num_heads = rule, seq_len, width, num_heads
        # the authors' script: no bias on the pixel projection, xavier-uniform q/k/v weights
        self.inp = nn.Linear(1, width, bias=not authors_model)
        self.pos = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, width, bias=False)
        self.v_proj = nn.Linear(width, width, bias=False)
        if authors_model:
            for proj in (self.q_proj, self.k_proj, self.v_proj):
                nn.init.xavier_uniform_(proj.weight)
        self.b_proj = nn.Linear(width, num_heads)
        nn.init.constant_(self.b_proj.bias, -2.0)
        self.gated = Variant.parse(rule).gated
        if self.gated:
            self.g_proj = nn.Linear(width, num_heads)
            nn.init.constant_(self.g_proj.bias, 4.0)  # gate exp(g) ~ 0.98 at init
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor):
        """x [B, L] pixels -> q, k, v [B, L, H, D], beta [B, L, H], g or None."""
        B, L = x.shape
        if self.seq_len < L:
            raise ValueError(f"x: sequence length {L} exceeds the model's {self.seq_len}")
        h = F.gelu(self.inp(x.unsqueeze(-1)) + self.pos[:L])
        H, D = self.num_heads, self.width // self.num_heads
        q = F.normalize(self.q_proj(h).view(B, L, H, D), dim=-1)
        k = self.k_proj(h).view(B, L, H, D)
        if not Variant.parse(self.rule).exact:
            k = F.normalize(k, dim=-1)
        v = self.v_proj(h).view(B, L, H, D)
        beta = torch.sigmoid(self.b_proj(h))
        g = F.logsigmoid(self.g_proj(h)) if self.gated else None
        return q, k, v, beta, g

    def forward(self, x: torch.Tensor, mode: str = "chunk") -> torch.Tensor:
        q, k, v, beta, g = self.features(x)
        fn = _op(self.rule, mode)
        args = (q, k, v, g, beta) if self.gated else (q, k, v, beta)
        o, _ = fn(*args)
        last = o[:, -1].reshape(x.shape[0], self.width)  # read-out with the last query
        return self.head(self.norm(last))

    @torch.no_grad()
    def stiffness(self, x: torch.Tensor) -> torch.Tensor:
        """beta * ||k||^2 per token and head, [B, L, H]."""
        _, k, _, beta, _ = self.features(x)
        return beta * (k.float() ** 2).sum(-1)


# ----------------------------------------------------------------------------- perturbations


def perturb(x: torch.Tensor, kind: str, level: float, generator: torch.Generator) -> torch.Tensor:
    """``scale``: x * level; ``noise``: x + N(0, level^2); ``dropout``: each pixel zeroed with
    probability ``level`` (no rescaling of the kept pixels)."""
    if kind == "scale":
        return x * level
    if kind == "noise":
        return x + level * torch.randn(x.shape, generator=generator).to(x)
    if kind == "dropout":
        keep = torch.rand(x.shape, generator=generator) >= level
        return x * keep.to(x)
    raise ValueError(f"kind: expected scale, noise or dropout, got {kind!r}")


FULL_LEVELS = {
    "scale": [float(s) for s in range(1, 11)],
    "noise": [round(0.1 * i, 1) for i in range(11)],
    "dropout": [round(0.1 * i, 1) for i in range(11)],
}
QUICK_LEVELS = {"scale": [1.0, 2.0, 5.0, 10.0], "noise": [0.0, 0.3, 0.6, 1.0], "dropout": [0.0, 0.3, 0.6, 0.9]}


# ----------------------------------------------------------------------------- training


@dataclass
class TrainConfig:
    rule: str = "exact"
    lr: float = 1e-3
    epochs: int = 1
    batch_size: int = 128
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    width: int = 64
    num_heads: int = 1
    authors_model: bool = False  # the authors' initialisation (see PixelSequenceClassifier)
    train_limit: int | None = None  # use only the first N training examples
    device: str = "cpu"


@dataclass
class TrainResult:
    config: dict
    losses: list = field(default_factory=list)  # per step
    final_train_loss: float = float("nan")  # mean over the last 10% of steps
    seconds: float = 0.0
    diverged: bool = False


def train_classifier(data, cfg: TrainConfig, progress=None):
    """Train one classifier; returns (model, TrainResult). ``progress(n)`` is called per step."""
    torch.manual_seed(cfg.seed)
    dev = torch.device(cfg.device)
    model = PixelSequenceClassifier(cfg.rule, data.seq_len, cfg.width, cfg.num_heads, authors_model=cfg.authors_model).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    x_all, y_all = data.x_train, data.y_train
    if cfg.train_limit:
        x_all, y_all = x_all[: cfg.train_limit], y_all[: cfg.train_limit]
    gen = torch.Generator().manual_seed(cfg.seed)
    res = TrainResult(config=asdict(cfg))
    t0 = time.perf_counter()
    model.train()
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(x_all), generator=gen)
        for i in range(0, len(perm), cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            xb, yb = x_all[idx].to(dev), y_all[idx].to(dev)
            loss = F.cross_entropy(model(xb), yb)
            if not torch.isfinite(loss):
                res.diverged = True
                res.losses.append(float("nan"))
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            res.losses.append(loss.item())
            if progress:
                progress(1)
        if res.diverged:
            break
    tail = [v for v in res.losses[-max(1, len(res.losses) // 10) :] if math.isfinite(v)]
    res.final_train_loss = sum(tail) / len(tail) if tail else float("nan")
    res.seconds = time.perf_counter() - t0
    return model, res


@torch.no_grad()
def evaluate(model, x, y, batch_size: int = 500, device: str = "cpu") -> float:
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size].to(device))
        correct += (logits.argmax(-1).cpu() == y[i : i + batch_size]).sum().item()
    return correct / len(x)


def evaluate_perturbations(
    model, data, levels: dict, eval_seed: int = 1234, test_limit: int | None = None, device: str = "cpu", progress=None
) -> dict:
    """Accuracy on the clean test set and under every perturbation level (fixed seed)."""
    x, y = data.x_test, data.y_test
    if test_limit:
        x, y = x[:test_limit], y[:test_limit]
    out = {"clean": evaluate(model, x, y, device=device)}
    for kind, lv in levels.items():
        accs = []
        for level in lv:
            gen = torch.Generator().manual_seed(eval_seed)
            accs.append(evaluate(model, perturb(x, kind, level, gen), y, device=device))
            if progress:
                progress(1)
        out[kind] = {"levels": list(lv), "accuracy": accs}
    return out


def summarize_degradation(per_rule: dict, kind: str) -> dict:
    """Mean accuracy over the levels of one perturbation (area under the curve / number of
    levels), per rule: one number saying which rule degrades more slowly."""
    return {rule: sum(v[kind]["accuracy"]) / len(v[kind]["accuracy"]) for rule, v in per_rule.items()}
