"""MAD (Mechanistic Architecture Design) synthetic tasks: the six instance generators, the task
settings of the benchmark and the dataset builder (as defined by MAD-lab, Poli et al. 2024).

Every generator takes a ``numpy.random.Generator`` and draws from it in a fixed order, so a
dataset is a pure function of its setting and seed: training examples are drawn first, then the
test examples continue the same generator (train and test differ). Selective copying also draws
the blank positions from a legacy ``numpy.random.RandomState(seed)`` (the global numpy RNG that
MAD-lab's ``train()`` seeds). Targets equal to :data:`IGNORE` (-100) are not scored.

An instance is ``(inputs, targets)``, two 1-D integer arrays of equal length:

=========================  ====  ================================================================
task                       abbr  vocabulary (V = ``vocab_size``)
=========================  ====  ================================================================
in-context-recall          CR    keys ``0..V/2-1``, values ``V/2..V-1``
noisy-in-context-recall    NR    keys/values as CR within the first ``V-16``; noise ``V-16..V-1``
fuzzy-in-context-recall    FR    keys ``0..(V-1)//2-1``, values ``..V-2`` (motifs of 1-3), pad ``V-1``
selective-copying          SC    content ``0..V-3``, blank ``V-2``, copy ``V-1``
compression                C     content ``0..V-2``, compression token ``V-1``
memorization               M     keys ``0..(V-1)//2-1``, values ``(V-1)//2..V-2``, insert ``V-1``
=========================  ====  ================================================================

The recall tasks return different targets for training (every next token) and test (only the
values of keys seen before); the other three ignore ``is_training``.

Details that fix the random stream (all checked to give the same instances, draw for draw, as
the reference generators at MAD-lab commit 0f49a45): choices among ``n`` items are
``rng.integers(0, n)`` (what ``Generator.choice`` draws); recall draws the never-noise slot
index first, even without noise; fuzzy recall re-shuffles the full motif tables (keys, then
values, by motif size) for every instance before drawing the probe sizes, the probe and its
insertion point; memorization also draws an (unused) never-noise slot index first, and its
table comes from its own ``default_rng(seed)`` with the run's seed. About 2 % of fuzzy test
sequences never show the probe pair in the body (the body ends before the insertion point);
their final value is scored all the same.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass, replace

import numpy as np

__all__ = [
    "IGNORE",
    "TASKS",
    "TASK_ABBR",
    "TASK_LABEL",
    "MADSetting",
    "baseline_setting",
    "benchmark_settings",
    "memorization_table",
    "in_context_recall",
    "noisy_in_context_recall",
    "fuzzy_in_context_recall",
    "selective_copying",
    "compression",
    "memorization",
    "generate_instance_pairs",
    "make_dataset",
    "leakage_fraction",
]

IGNORE = -100
SEED = 12345

TASKS = (
    "in-context-recall",
    "fuzzy-in-context-recall",
    "noisy-in-context-recall",
    "selective-copying",
    "compression",
    "memorization",
)
TASK_ABBR = {
    "in-context-recall": "CR",
    "fuzzy-in-context-recall": "FR",
    "noisy-in-context-recall": "NR",
    "selective-copying": "SC",
    "compression": "C",
    "memorization": "M",
}
TASK_LABEL = {
    "in-context-recall": "In-Context Recall",
    "fuzzy-in-context-recall": "Fuzzy Recall",
    "noisy-in-context-recall": "Noisy Recall",
    "selective-copying": "Selective Copy",
    "compression": "Compress",
    "memorization": "Memorize",
}


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class MADSetting:
    """One task setting (the fields of MAD-lab's task config that matter for the data)."""

    task: str
    vocab_size: int
    seq_len: int
    num_train_examples: int = 12_800
    num_test_examples: int = 1_280
    frac_noise: float = 0.0
    noise_vocab_size: int = 0
    num_tokens_to_copy: int = 0
    k_motif_size: int = 1
    v_motif_size: int = 1

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task: expected one of {TASKS}, got {self.task!r}")

    @property
    def id(self) -> str:
        """A short, unique, file-name-safe name, e.g. ``CR-v16-l128-n12800``."""
        parts = [TASK_ABBR[self.task], f"v{self.vocab_size}", f"l{self.seq_len}", f"n{self.num_train_examples}"]
        if self.num_test_examples != 1_280:
            parts.append(f"t{self.num_test_examples}")
        if self.frac_noise:
            parts.append(f"fn{self.frac_noise:g}")
        if self.noise_vocab_size:
            parts.append(f"nv{self.noise_vocab_size}")
        if self.num_tokens_to_copy:
            parts.append(f"c{self.num_tokens_to_copy}")
        if self.k_motif_size != 1 or self.v_motif_size != 1:
            parts.append(f"m{self.k_motif_size}{self.v_motif_size}")
        return "-".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)


_BASELINES = {
    "in-context-recall": MADSetting("in-context-recall", 16, 128),
    "fuzzy-in-context-recall": MADSetting("fuzzy-in-context-recall", 16, 128, k_motif_size=3, v_motif_size=3),
    "noisy-in-context-recall": MADSetting("noisy-in-context-recall", 32, 128, frac_noise=0.2, noise_vocab_size=16),
    "selective-copying": MADSetting("selective-copying", 16, 256, num_tokens_to_copy=16),
    "compression": MADSetting("compression", 16, 32),
    "memorization": MADSetting("memorization", 256, 32, num_train_examples=256),
}
_TRAIN_SIZES = [6400, 3200, 1600, 800]
_CHANGES = {
    "in-context-recall": {"vocab_size": [32, 64, 128], "seq_len": [256, 512, 1024], "num_train_examples": _TRAIN_SIZES},
    "fuzzy-in-context-recall": {"vocab_size": [32, 64, 128], "seq_len": [256, 512, 1024], "num_train_examples": _TRAIN_SIZES},
    "noisy-in-context-recall": {
        "vocab_size": [48, 80, 144],
        "seq_len": [256, 512, 1024],
        "num_train_examples": _TRAIN_SIZES,
        "frac_noise": [0.4, 0.6, 0.8],
    },
    "selective-copying": {
        "vocab_size": [32, 64, 128],
        "seq_len": [512, 1024],
        "num_train_examples": _TRAIN_SIZES,
        "num_tokens_to_copy": [32, 64, 96],
    },
    "compression": {"vocab_size": [32, 64, 128], "seq_len": [64, 128, 256], "num_train_examples": _TRAIN_SIZES},
    "memorization": {"vocab_size": [512, 1024, 2048, 4096, 8192]},
}


def baseline_setting(task: str) -> MADSetting:
    if task not in _BASELINES:
        raise ValueError(f"task: expected one of {TASKS}, got {task!r}")
    return _BASELINES[task]


def benchmark_settings(task: str) -> list[MADSetting]:
    """The baseline setting followed by each one-variable change (11, 11, 14, 13, 11, 6)."""
    base = baseline_setting(task)
    out = [base]
    for field, values in _CHANGES[task].items():
        out += [replace(base, **{field: v}) for v in values]
    return out


# ----------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=64)
def _motifs(start: int, stop: int, size: int) -> np.ndarray:
    arr = np.array(list(itertools.permutations(range(start, stop), size)), dtype=np.int64).reshape(-1, size)
    arr.flags.writeable = False
    return arr


def _shuffled_motifs(alphabet: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """All ordered tuples of ``size`` distinct letters of the contiguous ``alphabet``
    (itertools order), shuffled by ``rng``: an array ``[n, size]``. Shuffling the rows of the
    array draws exactly what shuffling the list of tuples draws."""
    perms = _motifs(int(alphabet[0]), int(alphabet[-1]) + 1, size)
    order = np.arange(len(perms))
    rng.shuffle(order)  # the same Fisher-Yates draws as shuffling the rows themselves
    return perms[order]


def _finish_recall(inputs: list, targets: list, is_training: bool):
    x = np.asarray(inputs, dtype=np.int64)
    if is_training:
        return x[:-1], x[1:].copy()
    return x[:-1], np.asarray(targets, dtype=np.int64)[1:]


# ----------------------------------------------------------------------------- generators


def in_context_recall(
    vocab_size: int = 16,
    seq_len: int = 128,
    is_training: bool = True,
    rng: np.random.Generator | None = None,
    frac_noise: float = 0.0,
    noise_vocab_size: int = 0,
):
    """Multi-query associative recall: ``seq_len/2`` (key, value) pairs, the last one a probe of a
    key already shown. Returns ``inputs = seq[:-1]`` and ``seq[1:]`` (training) or the recall
    targets (test: the value at every position holding a key seen before, else -100).

    With ``frac_noise > 0`` each of the first ``seq_len/2 - 1`` slots except one drawn at random
    is, with that probability, two noise tokens from the top ``noise_vocab_size`` tokens."""
    rng = np.random.default_rng() if rng is None else rng
    if seq_len % 2:
        raise ValueError(f"seq_len: must be even, got {seq_len}")
    if not 0 <= frac_noise < 1:
        raise ValueError(f"frac_noise: expected 0 <= frac_noise < 1, got {frac_noise}")
    if frac_noise > 0 and noise_vocab_size <= 0:
        raise ValueError("noise_vocab_size: must be > 0 when frac_noise > 0")
    n_plain = vocab_size - noise_vocab_size
    n_keys, n_values = n_plain // 2, n_plain - n_plain // 2
    if n_keys < 1:
        raise ValueError(f"vocab_size: too small ({vocab_size}) for keys and values")
    n_pairs = seq_len // 2
    keep = int(rng.integers(0, n_pairs))  # this slot is never noise
    kv: dict[int, int] = {}
    shown: dict[int, int] = {}  # keys in order of first appearance
    inputs: list[int] = []
    targets: list[int] = []
    for i in range(n_pairs - 1):
        if frac_noise > 0 and i != keep and rng.random() < frac_noise:
            inputs += (n_plain + rng.integers(0, noise_vocab_size, size=2)).tolist()
            targets += [IGNORE, IGNORE]
            continue
        k = int(rng.integers(0, n_keys))
        if k not in kv:
            kv[k] = n_keys + int(rng.integers(0, n_values))
        v = kv[k]
        inputs += [k, v]
        targets += [IGNORE, v if k in shown else IGNORE]
        shown.setdefault(k, v)
    if not shown:
        raise ValueError("in_context_recall: every slot became noise; no key to probe")
    keys = list(shown)
    k = keys[int(rng.integers(0, len(keys)))]
    inputs += [k, shown[k]]
    targets += [IGNORE, shown[k]]
    return _finish_recall(inputs, targets, is_training)


def noisy_in_context_recall(
    vocab_size: int = 32,
    seq_len: int = 128,
    is_training: bool = True,
    rng: np.random.Generator | None = None,
    frac_noise: float = 0.2,
    noise_vocab_size: int = 16,
):
    """In-context recall with noise slots (see :func:`in_context_recall`)."""
    return in_context_recall(vocab_size, seq_len, is_training, rng, frac_noise=frac_noise, noise_vocab_size=noise_vocab_size)


def fuzzy_in_context_recall(
    vocab_size: int = 16,
    seq_len: int = 128,
    is_training: bool = True,
    rng: np.random.Generator | None = None,
    k_motif_size: int = 3,
    v_motif_size: int = 3,
):
    """Recall with keys and values that are motifs (ordered tuples of 1..k / 1..v distinct letters).

    A probe pair is drawn first and inserted once into a body of pairs, then repeated at the end;
    the sequence is left-padded with ``V-1`` to ``seq_len + 1`` tokens. Test keys are always
    ``k_motif_size`` long. Returns ``seq[:-1]`` and ``seq[1:]`` (training) or the recall targets.
    """
    rng = np.random.default_rng() if rng is None else rng
    pad = vocab_size - 1
    n_plain = vocab_size - 1
    key_alpha = np.arange(n_plain // 2)
    val_alpha = np.arange(n_plain // 2, n_plain)
    if k_motif_size > len(key_alpha) or v_motif_size > len(val_alpha):
        raise ValueError(f"vocab_size: {vocab_size} too small for motifs of {k_motif_size}/{v_motif_size}")
    key_sizes = list(range(1, k_motif_size + 1)) if is_training else [k_motif_size]
    val_sizes = list(range(1, v_motif_size + 1))
    keys = {s: _shuffled_motifs(key_alpha, s, rng) for s in key_sizes}
    vals = {s: _shuffled_motifs(val_alpha, s, rng) for s in val_sizes}

    def draw(table: np.ndarray) -> tuple:
        return tuple(table[int(rng.integers(0, len(table)))].tolist())

    kp_size = key_sizes[int(rng.integers(0, len(key_sizes)))] if is_training else k_motif_size
    vp_size = val_sizes[int(rng.integers(0, len(val_sizes)))]
    k_probe, v_probe = draw(keys[kp_size]), draw(vals[vp_size])
    probe_len = kp_size + vp_size
    if seq_len - 2 * probe_len <= 0:
        raise ValueError(f"seq_len: {seq_len} too short for motifs of {k_motif_size}/{v_motif_size}")
    probe_at = int(rng.integers(0, seq_len - 2 * probe_len))
    probe_in = False
    kv: dict[tuple, tuple] = {}
    shown: set = set()
    inputs: list[int] = []
    targets: list[int] = []
    while len(inputs) < seq_len - probe_len - (k_motif_size + v_motif_size):
        k_size = key_sizes[int(rng.integers(0, len(key_sizes)))] if is_training else k_motif_size
        v_size = val_sizes[int(rng.integers(0, len(val_sizes)))]
        if not probe_in and len(inputs) >= probe_at:
            inputs += k_probe + v_probe
            targets += [IGNORE] * probe_len
            kv[k_probe] = v_probe
            shown.add(k_probe)
            probe_in = True
            continue
        k = draw(keys[k_size])
        if k == k_probe:
            v = v_probe
            probe_in = True
        else:
            if k not in kv:
                kv[k] = draw(vals[v_size])
            v = kv[k]
        inputs += k + v
        targets += [IGNORE] * k_size
        targets += list(v) if k in shown else [IGNORE] * len(v)
        shown.add(k)
    inputs += k_probe + v_probe
    targets += [IGNORE] * kp_size + list(v_probe)
    n_pad = seq_len + 1 - len(inputs)
    inputs = [pad] * n_pad + inputs
    targets = [IGNORE] * n_pad + targets
    return _finish_recall(inputs, targets, is_training)


def selective_copying(
    vocab_size: int = 16,
    seq_len: int = 256,
    num_tokens_to_copy: int = 16,
    rng: np.random.Generator | None = None,
    blank_rng: np.random.RandomState | None = None,
    is_training: bool = True,  # noqa: ARG001 (every task takes the same arguments)
):
    """``n`` content tokens with ``L - 2n - 1`` blanks inserted among them (content order kept,
    never after the last one), the copy token, then ``n`` blanks. Targets: -100 up to and
    including the copy token, then the content tokens in order. ``blank_rng`` (legacy
    ``RandomState``) draws the blank positions."""
    rng = np.random.default_rng() if rng is None else rng
    blank_rng = np.random.RandomState() if blank_rng is None else blank_rng
    n = num_tokens_to_copy
    if n < 1:
        raise ValueError(f"num_tokens_to_copy: expected >= 1, got {n}")
    if seq_len <= 2 * n + 1:
        raise ValueError(f"seq_len: must be > 2 * num_tokens_to_copy + 1 = {2 * n + 1}, got {seq_len}")
    copy_tok, blank = vocab_size - 1, vocab_size - 2
    content = rng.integers(0, vocab_size - 2, size=n)
    n_blank = seq_len - 2 * n - 1
    where = blank_rng.randint(0, n, n_blank)
    body = np.insert(content, where, blank)
    inputs = np.concatenate([body, [copy_tok], np.full(n, blank)]).astype(np.int64)
    targets = np.concatenate([np.full(seq_len - n, IGNORE), content]).astype(np.int64)
    return inputs, targets


def compression(vocab_size: int = 16, seq_len: int = 32, rng: np.random.Generator | None = None, is_training: bool = True):  # noqa: ARG001 (every task takes the same arguments)
    """``L-1`` content tokens then the compression token ``V-1``; the target is the input."""
    rng = np.random.default_rng() if rng is None else rng
    x = np.concatenate([rng.integers(0, vocab_size - 1, size=seq_len - 1), [vocab_size - 1]]).astype(np.int64)
    return x, x.copy()


def memorization_table(vocab_size: int, seed: int = SEED) -> dict[int, int]:
    """The fixed key -> value table (its own ``default_rng(seed)``): keys ``0..(V-1)//2-1``
    paired one-to-one with values drawn from ``(V-1)//2..V-2``, in shuffled-key order."""
    table_rng = np.random.default_rng(seed)
    n = vocab_size - 1  # the insert token is not part of the table
    keys = _shuffled_motifs(np.arange(n // 2), 1, table_rng)[:, 0]
    values = _shuffled_motifs(np.arange(n // 2, n), 1, table_rng)[:, 0]
    return {int(k): int(v) for k, v in zip(keys, values)}


def memorization(
    vocab_size: int = 256,
    seq_len: int = 32,
    rng: np.random.Generator | None = None,
    table: dict[int, int] | None = None,
    is_training: bool = True,  # noqa: ARG001 (every task takes the same arguments)
):
    """``L/2`` (key, insert token) pairs; target -100 at keys and the key's value (from the
    fixed :func:`memorization_table`) at each insert token."""
    rng = np.random.default_rng() if rng is None else rng
    table = memorization_table(vocab_size) if table is None else table
    keys = list(table)
    n_pairs = seq_len // 2
    rng.integers(0, n_pairs)  # the "never noise" slot: unused without noise but drawn all the same
    ks = [keys[int(rng.integers(0, len(keys)))] for _ in range(n_pairs)]
    insert = vocab_size - 1
    inputs = np.array([t for k in ks for t in (k, insert)], dtype=np.int64)
    targets = np.array([t for k in ks for t in (IGNORE, table[k])], dtype=np.int64)
    return inputs, targets


# ----------------------------------------------------------------------------- datasets


def generate_instance_pairs(
    setting: MADSetting,
    n: int,
    is_training: bool,
    rng: np.random.Generator,
    blank_rng: np.random.RandomState | None = None,
    table: dict | None = None,
):
    """``n`` instances of ``setting`` drawn in sequence from ``rng``: arrays ``[n, L]`` (int64)."""
    s = setting
    if s.task in ("in-context-recall", "noisy-in-context-recall"):

        def gen():
            return in_context_recall(s.vocab_size, s.seq_len, is_training, rng, s.frac_noise, s.noise_vocab_size)
    elif s.task == "fuzzy-in-context-recall":

        def gen():
            return fuzzy_in_context_recall(s.vocab_size, s.seq_len, is_training, rng, s.k_motif_size, s.v_motif_size)
    elif s.task == "selective-copying":

        def gen():
            return selective_copying(s.vocab_size, s.seq_len, s.num_tokens_to_copy, rng, blank_rng)
    elif s.task == "compression":

        def gen():
            return compression(s.vocab_size, s.seq_len, rng)
    else:
        table = memorization_table(s.vocab_size) if table is None else table

        def gen():
            return memorization(s.vocab_size, s.seq_len, rng, table)

    pairs = [gen() for _ in range(n)]
    x = np.stack([p[0] for p in pairs])
    y = np.stack([p[1] for p in pairs])
    return x, y


def make_dataset(setting: MADSetting, seed: int = SEED) -> dict:
    """Train and test arrays of a setting: ``{"train": (x, y), "test": (x, y), "leakage": f}``
    where ``f`` is the fraction of distinct test inputs that also occur in the training set
    (MAD-lab warns above 0.001). Train first, then test, from one ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    blank_rng = np.random.RandomState(seed) if setting.task == "selective-copying" else None
    table = memorization_table(setting.vocab_size, seed) if setting.task == "memorization" else None
    train = generate_instance_pairs(setting, setting.num_train_examples, True, rng, blank_rng, table)
    test = generate_instance_pairs(setting, setting.num_test_examples, False, rng, blank_rng, table)
    return {"train": train, "test": test, "leakage": leakage_fraction(train[0], test[0])}


def leakage_fraction(train_inputs: np.ndarray, test_inputs: np.ndarray) -> float:
    """Fraction of the distinct test input rows that also occur as a training input row."""
    train = {r.tobytes() for r in np.ascontiguousarray(train_inputs)}
    test = {r.tobytes() for r in np.ascontiguousarray(test_inputs)}
    return 1.0 - len(test - train) / max(1, len(test))
