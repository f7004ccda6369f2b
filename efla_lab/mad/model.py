"""MAD synthetic benchmark (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures"): the backbone and the metric. One training run is ``training.py``; orchestration
(presets, grid, resume, files) ``run.py``.

Backbone (MAD-lab's ``benchmark.py`` default, width 128): token embedding ``N(0, 0.02)``, no
positional embedding, ``2 x [mixer, SwiGLU]`` pre-norm residual layers ``x = x + f(RMSNorm(x))``,
then

- language model (five tasks): RMSNorm and a biased linear head to ``V`` logits; biases of every
  ``nn.Linear`` zeroed, linear weights left at PyTorch's default;
- auto-encoder (compression): the last position's vector plus a fixed sinusoidal embedding of
  each of the ``L`` output positions, decoded independently by ``RMSNorm -> Linear -> GELU ->
  RMSNorm -> Linear -> GELU -> RMSNorm -> Linear(V)``; every linear weight (the mixer's too)
  ``N(0, 0.02)``, biases 0.

The mixer is our ``EFLA`` (``exact`` / ``euler`` = DeltaNet) or ``GatedEFLA`` (``gated-exact`` /
``gated-euler`` = Gated DeltaNet) layer in chunk mode, so training runs the chunkwise ops.

Metric: MAD-lab's accuracy is torchmetrics' ``MulticlassAccuracy`` (macro): per batch, per class
recall ``tp / (tp + fn)`` averaged over the classes that occur as a target or a prediction;
the epoch value is the batch-size-weighted mean over batches. Perplexity likewise per batch.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla_lab.data.mad_tasks import IGNORE, MADSetting
from efla.layers import EFLA, GatedEFLA, GatedMLP, RMSNorm
from efla.variants import EXPERIMENT_KEYS, Variant

RULES = EXPERIMENT_KEYS
EARLY_STOP = 0.999
STREAMS_PER_DEVICE = 32  # the pool torch.cuda.Stream() cycles through


def swiglu_width(width: int) -> int:
    """MAD-lab's SwiGLU hidden width: ``8 * width / 3`` rounded up to a multiple of 16 (352 at 128)."""
    return 16 * math.ceil(8 * width / 3 / 16)


def sinusoidal_positions(n: int, dim: int) -> torch.Tensor:
    """Fixed ``[n, dim]`` embedding: ``[sin(p * f_i), cos(p * f_i)]`` with ``f_i = 10000^(-i/(dim/2-1))``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) / max(half - 1, 1) * torch.arange(half, dtype=torch.float32))
    ang = torch.arange(n, dtype=torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat([ang.sin(), ang.cos()], dim=1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros(n, 1)], dim=1)
    return emb


class Mixer(nn.Module):
    """Token mixer wrapper returning only the output tensor."""

    def __init__(self, rule: str, width: int, num_heads: int):
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, got {rule!r}")
        if width % num_heads:
            raise ValueError(f"num_heads: must divide width {width}, got {num_heads}")
        variant = Variant.parse(rule)
        update = variant.update_rule
        if variant.gated:
            self.layer = GatedEFLA(
                hidden_size=width, head_dim=width // num_heads, num_heads=num_heads, expand_v=1, mode="chunk", update_rule=update
            )
        else:
            self.layer = EFLA(hidden_size=width, num_heads=num_heads, mode="chunk", update_rule=update)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


class PreNorm(nn.Module):
    def __init__(self, width: int, layer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(width, eps=1e-5)
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer(self.norm(x))


class MADModel(nn.Module):
    """``[mixer, SwiGLU] x blocks`` with a language-model or auto-encoder head.

    ``forward(input_ids [B, T]) -> logits [B, T, V]`` (auto-encoder: ``T`` = ``seq_len``).
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        rule: str = "exact",
        width: int = 128,
        num_heads: int = 8,
        blocks: int = 2,
        autoencoder: bool = False,
    ):
        super().__init__()
        self.vocab_size, self.seq_len, self.rule, self.autoencoder = vocab_size, seq_len, rule, autoencoder
        self.embed = nn.Embedding(vocab_size, width)
        layers = []
        for _ in range(blocks):
            layers.append(PreNorm(width, Mixer(rule, width, num_heads)))
            layers.append(PreNorm(width, GatedMLP(width, intermediate_size=swiglu_width(width))))
        self.layers = nn.ModuleList(layers)
        if autoencoder:
            self.register_buffer("dec_pos", sinusoidal_positions(seq_len, width), persistent=False)
            self.decoder = nn.Sequential(
                RMSNorm(width),
                nn.Linear(width, width),
                nn.GELU(),
                RMSNorm(width),
                nn.Linear(width, width),
                nn.GELU(),
                RMSNorm(width),
                nn.Linear(width, vocab_size),
            )
        else:
            self.norm = RMSNorm(width)
            self.head = nn.Linear(width, vocab_size)
        self._init()

    @torch.no_grad()
    def _init(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if self.autoencoder:
                    nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.encode(input_ids)
        if self.autoencoder:
            z = x[:, -1:, :] + self.dec_pos[: self.seq_len].to(x.dtype)  # [B, L, D]
            return self.decoder(z)
        return self.head(self.norm(x))


def build_model(
    setting: MADSetting, rule: str, width: int = 128, num_heads: int = 8, blocks: int = 2, seed: int | None = None
) -> MADModel:
    if seed is not None:
        torch.manual_seed(seed)
    return MADModel(
        setting.vocab_size,
        setting.seq_len,
        rule=rule,
        width=width,
        num_heads=num_heads,
        blocks=blocks,
        autoencoder=setting.task == "compression",
    )


# ----------------------------------------------------------------------------- metrics


def _class_counts(classes: torch.Tensor, weights: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``weights`` summed per class (float64), without reading anything back to the host."""
    return torch.zeros(num_classes, dtype=torch.float64, device=classes.device).scatter_add_(0, classes, weights)


def macro_accuracy(logits: torch.Tensor, targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """torchmetrics' ``MulticlassAccuracy(average="macro", ignore_index=-100)`` of one batch:
    per-class recall averaged over the classes with ``tp + fp + fn > 0``. No device sync: scored
    positions are weighted 1, ignored ones 0 (counted in class 0 with no weight)."""
    scored = (targets != IGNORE).reshape(-1).double()
    t = targets.reshape(-1).clamp_min(0)
    p = logits.argmax(-1).reshape(-1)
    tp = _class_counts(t, scored * (p == t).double(), num_classes)
    support = _class_counts(t, scored, num_classes)
    predicted = _class_counts(p, scored, num_classes)
    fp, fn = predicted - tp, support - tp
    recall = torch.where(support > 0, tp / support.clamp_min(1), torch.zeros_like(tp))
    w = ((tp + fp + fn) > 0).double()
    return (recall * w).sum() / w.sum().clamp_min(1)


def batch_loss_sums(model: MADModel, xb: torch.Tensor, yb: torch.Tensor, autocast: bool) -> torch.Tensor:
    """One test batch's ``[macro accuracy * b, perplexity * b, correct tokens, scored tokens]`` (float64)."""
    with torch.autocast(device_type=xb.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(xb)
    logits = logits.float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), ignore_index=IGNORE)
    b = len(xb)
    scored = yb != IGNORE
    return torch.stack(
        [
            macro_accuracy(logits, yb, model.vocab_size) * b,
            torch.exp(nll.double().clamp(max=700.0)) * b,
            ((logits.argmax(-1) == yb) & scored).sum().double(),
            scored.sum().double(),
        ]
    )


@torch.no_grad()
def test_sums(
    model: MADModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 128, autocast: bool = False, batch_sums=None
) -> torch.Tensor:
    """``batch_loss_sums`` summed over the test set on the device, nothing read back (``scores`` reads
    them). ``batch_sums(xb, yb)``: ``batch_loss_sums`` of the model, or a stand-in for it (``GraphedBatches``)."""
    batch_sums = batch_sums or functools.partial(batch_loss_sums, model, autocast=autocast)
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=x.device)
    for i in range(0, len(x), batch_size):
        sums += batch_sums(x[i : i + batch_size], y[i : i + batch_size])
    model.train()
    return sums


def scores(sums: torch.Tensor, n: int) -> dict:
    """Batch-size-weighted means of the per-batch macro accuracy and perplexity over ``n`` test
    sequences, and the plain fraction of correct scored tokens. On a GPU, call it in the stream
    ``sums`` was made in (reading waits for that stream only)."""
    acc_sum, ppl_sum, correct, total = sums.tolist()
    return {"acc": acc_sum / n, "ppl": ppl_sum / n, "token_acc": correct / max(total, 1)}
