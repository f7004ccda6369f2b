"""Speculative decoding with exact state rollback.

Each round a drafter proposes up to ``k`` tokens per row; the target model checks them in ONE forward
over each row's unfed tokens (those its recurrent state has not taken in: the last token at least)
followed by its drafts, continuing the row's state in the engine's pool. A row keeps the drafts up to
its first rejection, plus one token of the target's own. The recurrent state must then hold exactly
the kept tokens: where a row kept every draft, the pass left it so; elsewhere the row's state from
before the pass (saved: matrix states, convolution histories, attention lengths) is put back, and the
kept tokens join the row's unfed tokens, which the next round's pass runs ahead of its drafts (no
pass of its own; a row whose unfed tokens would exceed ``k + 1`` runs them at once). Nothing is
approximated: the state is what feeding the kept tokens one by one gives, up to floating-point
rounding of the chunked computation, and at the end every row's state holds all its tokens but the
last, as after plain decoding.

Rows of different draft lengths run as one right-padded batch: padded positions are identity steps
of the recurrence and never enter the convolution histories (``attention_mask``), and attention
layers write no key for them.

Drafters:

- ``"ngram"`` (prompt lookup): the longest suffix of the row's text so far (prompt and generated,
  ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that occurred before proposes the tokens
  that followed its latest earlier occurrence. No second model; its draft distribution is a point
  mass.
- ``"draft_model"``: a smaller EFLA model with the same vocabulary proposes tokens one at a time
  (sampled with the same temperature and filters when sampling), keeping its own state; its state is
  rolled back from per-draft-step copies.

Acceptance is lossless: greedy decoding keeps a draft while it equals the target's argmax; sampling
keeps draft ``x`` with probability ``min(1, p(x) / q(x))`` and on rejection draws from
``norm(max(p - q, 0))`` (after all drafts, a bonus token from ``p``), so every token is distributed as
the target's own sampling would give.

Speculation turns itself down per row where drafts are rejected: ``k`` grows by one after a round that
kept every draft and shrinks by one otherwise; a row whose single draft was rejected stops drafting
for a number of rounds that doubles with every such rejection (up to ``_MAX_PAUSE``).

It also turns itself down per round, where a verification pass would cost more than it gains: a
round whose rows each hold only their last token unfed runs the engine's own decoding step (plain
``generate``'s, captured on CUDA; 1, 2, 4, then 8 steps in a row while rounds keep being turned down,
the tokens read back once per run) instead of a pass when no row has a draft, or when the tokens the
pass is expected to make for a row, ``1 + sum_{i<=n} a^i`` (``n`` drafts of a row
whose recent drafts were kept at rate ``a``), fall below ``verify_cost``, the time of a verification
pass in plain steps, for any of the rows furthest behind (within ``k`` tokens of the row with the
most still to make: a batch finishes with its slowest row, so a pass pays only if it speeds those
up). ``a`` is a decayed count (``_ACCEPTANCE_DECAY`` per round) of the row's checked draft positions,
started at 2 kept in 3; a plain round still scores prompt lookup's first draft against the token the
step made, and without new evidence the rate drifts back to its start, so a turned-down row is tried
again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from efla.models.cache import _map_tensors
from efla.ops.validate import unchecked_values

from .engine import DecodeEngine, engine_for
from .sampling import filter_logits

__all__ = ["SpeculativeConfig", "speculative_config", "speculative_generate"]

METHODS = ("ngram", "draft_model")
_MAX_PAUSE = 32
_LONGEST_PLAIN_RUN = 8  # plain steps between looks at the drafts, while speculation stays turned down
_ACCEPTANCE_DECAY = 0.9  # per round: a row's acceptance rate follows its last few dozen drafts
_PRIOR_KEPT, _PRIOR_CHECKED = 2.0, 3.0  # the rate before any evidence: optimistic, so speculation starts on
# A verification pass's time in plain decoding steps, unless the config gives one: measured on the CPU
# with tiny-efla on one thread (benchmarks/cpu_speculative.py: 2.1 at batch 1, 2.2 at batch 8). On CUDA
# the plain step replays a captured graph while a pass runs eagerly: not yet measured, so the same.
DEFAULT_VERIFY_COST = 2.5


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How ``generate`` speculates (the names are vLLM's ``speculative_config`` keys; ``adaptive`` and
    ``verify_cost`` are this library's own).

    Args:
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"``.
        num_speculative_tokens: draft tokens per round at most (``k``). Default ``4``.
        prompt_lookup_max: the longest suffix the n-gram drafter matches. Default ``3``.
        prompt_lookup_min: the shortest suffix it matches. Default ``2`` (a single token matches by
            chance too often in free text).
        model: the draft model (an ``EFLAForCausalLM`` with the target's vocabulary) for
            ``"draft_model"``.
        adaptive: shrink ``k`` and pause drafting for rows whose drafts are rejected, and take a plain
            decoding step for rounds whose expected gain does not pay for a pass. Default ``True``.
        verify_cost: a verification pass's time in plain decoding steps, for that rule (``None``: the
            ``DEFAULT_VERIFY_COST``; ``1``: verify whenever a row has a draft).
    """

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 2
    model: Any = None
    adaptive: bool = True
    verify_cost: float | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculate: method expected one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculate: {name} expected an int >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculate: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})"
            )
        cost = self.verify_cost
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost >= 1):
            raise ValueError(f"speculate: verify_cost expected a number >= 1 (plain steps), got {self.verify_cost!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculate: a draft model is given with method 'draft_model' and only then (key 'model')")


def verify_cost(config: SpeculativeConfig) -> float:
    """A verification pass's time in plain decoding steps: the config's, else ``DEFAULT_VERIFY_COST``."""
    return DEFAULT_VERIFY_COST if config.verify_cost is None else float(config.verify_cost)


def speculative_config(value) -> SpeculativeConfig | None:
    """``generate``'s ``speculate`` argument as a :class:`SpeculativeConfig` (``None``: no speculation);
    a dict takes the dataclass's field names."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"speculate: expected None, a dict or a SpeculativeConfig, got {type(value).__name__}")
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(SpeculativeConfig)})
    if unknown or "method" not in value:
        raise ValueError(f"speculate: unknown keys {unknown} or no 'method' (got {sorted(value)})")
    return SpeculativeConfig(**value)


# -- the pool rows' state: saved, put back, continued ------------------------------------------------------


def _saved_rows(engine: DecodeEngine, slots: torch.Tensor) -> list:
    """Copies of the pool rows ``slots`` of every layer's state (attention layers: their lengths; the
    keys beyond a length are never read, so the length alone rolls them back)."""
    return [
        None
        if state is None
        else {name: _map_tensors(v, lambda t: t.index_select(0, slots)) for name, v in state.items() if name != "kv_pool"}
        for state in engine.cache.states
    ]


def _restore_rows(engine: DecodeEngine, saved: list, slots: torch.Tensor, picked: torch.Tensor) -> None:
    """Put the saved rows ``picked`` (indices into ``saved``, whose rows are pool rows ``slots``) back."""
    for state, rows in zip(engine.cache.states, saved):
        if state is None:
            continue
        for name, value in rows.items():
            if value is None:
                continue
            pairs = zip(state[name], value) if isinstance(value, tuple) else [(state[name], value)]
            for pool, copy in pairs:
                pool.index_copy_(0, slots[picked], copy.index_select(0, picked))


def _continue_rows(engine: DecodeEngine, rows: list[list[int]], slots: list[int], logits: bool = True) -> torch.Tensor | None:
    """Run ``rows`` (token lists, right-padded into one batch) from the states of pool rows ``slots``,
    leaving each row's state after its last token there; the logits ``[n, L, V]`` float32."""
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long)
    lengths = torch.tensor([len(row) for row in rows])
    mask = (torch.arange(width) < lengths[:, None]).long()
    cache = engine.cache
    saved = cache.slots, cache.fresh_rows
    first_rows = list(slots) == list(range(len(slots)))  # views of the pool's first rows: no gather and scatter
    cache.slots, cache.fresh_rows = (None if first_rows else torch.tensor(slots, dtype=torch.long, device=engine.device)), None
    try:
        with unchecked_values():
            hidden = engine.decoder(
                input_ids=ids.to(engine.device),
                attention_mask=None if bool(mask.all()) else mask.to(engine.device),
                past_key_values=cache.first_rows(len(slots)) if first_rows else cache,
                use_cache=True,
            ).last_hidden_state
    finally:
        cache.slots, cache.fresh_rows = saved
    return engine.head(hidden).float() if logits else None


# -- acceptance ---------------------------------------------------------------------------------------------


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator, device=generator.device))


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A draw from ``probs`` by the exponential race, as ``choose_tokens`` draws (half multinomial's time)."""
    return int(
        (probs / torch.empty_like(probs).exponential_(generator=generator).clamp(min=torch.finfo(probs.dtype).tiny)).argmax()
    )


def _accept_sampled(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling's rule for one row: ``p [n + 1, V]`` the target's probabilities at the
    row's positions, ``q [n, V]`` the drafter's (``None``: each draft a point mass). Returns the
    number of drafts kept and the token that follows them."""
    for j, x in enumerate(drafts):
        q_x = 1.0 if q is None else float(q[j, x])
        if _uniform(generator) * q_x < float(p[j, x]):
            continue
        residual = p[j].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[j]).clamp(min=0)
        total = float(residual.sum())
        return j, _draw(residual / total if total > 0 else p[j], generator)
    return len(drafts), _draw(p[len(drafts)], generator)


def _accept_greedy(predicted: list[int], drafts: list[int]) -> tuple[int, int]:
    j = 0
    while j < len(drafts) and drafts[j] == predicted[j]:
        j += 1
    return j, predicted[j]


# -- drafters -----------------------------------------------------------------------------------------------


class _NgramIndex:
    """One row's text and, for every n-gram of it, where the tokens after its latest occurrence start
    (registered once a token follows it, so the text's own suffix never matches itself)."""

    def __init__(self, tokens: list[int], sizes: range):
        self.tokens: list[int] = []
        self.sizes = sizes
        self.follows: dict[tuple, int] = {}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        end = len(self.tokens)
        for n in self.sizes:
            if end >= n:
                self.follows[tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        for n in reversed(self.sizes):
            start = self.follows.get(tuple(self.tokens[-n:])) if len(self.tokens) >= n else None
            if start is not None:
                return self.tokens[start : start + k]
        return []


class _NgramDrafter:
    def __init__(self, config: SpeculativeConfig, prompts: list[list[int]]):
        sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)
        self.rows = [_NgramIndex(prompt, sizes) for prompt in prompts]

    def start(self, first_tokens: list[int]) -> None:
        for row, token in zip(self.rows, first_tokens):
            row.append(token)

    def propose(self, rows: list[int], lengths: list[int]) -> tuple[list[list[int]], list | None]:
        return [self.rows[r].propose(n) if n else [] for r, n in zip(rows, lengths)], None

    def commit(self, rows: list[int], accepted: list[int], tokens: list[list[int]]) -> None:  # noqa: ARG002 (the drafters' interface)
        for row, new in zip(rows, tokens):
            for token in new:
                self.rows[row].append(token)


class _ModelDrafter:
    """A draft model decoding in its own engine's pool, rows ``0 .. B-1``. Each row holds ``pending``
    tokens the draft model has not seen yet (at least the row's last token); a round feeds them,
    then drafts one token at a time, keeping a copy of the rows' states after each fed token, so the
    round's accepted prefix is rolled back to by a copy (and at most one draft fed again later)."""

    def __init__(self, config, prompts, max_new_tokens, choose: Callable):
        self.engine = engine_for(config.model)
        self.engine.check_weights()
        batch = len(prompts)
        self.engine.reserve(batch, max(map(len, prompts)) + max_new_tokens + 2 * config.num_speculative_tokens + 2)
        rows = torch.arange(batch, device=self.engine.device)
        self.engine.prefill([torch.tensor(p) for p in prompts], rows)
        self.choose = choose  # (logits [n, V], rows) -> (tokens, probabilities or None)
        self.pending: list[list[int]] = [[] for _ in prompts]
        self.round: dict = {}

    def start(self, first_tokens: list[int]) -> None:
        self.pending = [[t] for t in first_tokens]

    def propose(self, rows: list[int], lengths: list[int]) -> tuple[list[list[int]], list | None]:
        drafting = [r for r, n in zip(rows, lengths) if n]
        wanted = dict(zip(rows, lengths))
        drafts = {r: [] for r in rows}
        probs = {r: [] for r in rows}
        self.round = {"rows": drafting, "saved": [], "drafts": drafts}
        if drafting:
            logits = _continue_rows(self.engine, [self.pending[r] for r in drafting], drafting)
            last = torch.tensor([len(self.pending[r]) - 1 for r in drafting])
            logits = logits[torch.arange(len(drafting)), last]
            slots = torch.tensor(drafting, device=self.engine.device)
            for step in range(max(wanted[r] for r in drafting)):
                self.round["saved"].append(_saved_rows(self.engine, slots))
                tokens, q = self.choose(logits, drafting)
                for i, r in enumerate(drafting):
                    if step < wanted[r]:
                        drafts[r].append(tokens[i])
                        probs[r].append(None if q is None else q[i])
                if step + 1 < max(wanted[r] for r in drafting):
                    logits = _continue_rows(self.engine, [[t] for t in tokens], drafting)[:, 0]
        q_rows = [torch.stack(probs[r]) if probs[r] and probs[r][0] is not None else None for r in rows]
        return [drafts[r] for r in rows], q_rows

    def commit(self, rows: list[int], accepted: list[int], tokens: list[list[int]]) -> None:
        """``tokens``: each row's new tokens of the round (its ``accepted`` drafts, then the target's)."""
        drafting = {r: i for i, r in enumerate(self.round.get("rows", ()))}
        by_copy: dict[int, list[int]] = {}
        for row, kept_drafts, new in zip(rows, accepted, tokens):
            if row not in drafting:
                self.pending[row] = self.pending[row] + new
                continue
            drafts = self.round["drafts"][row]
            kept = min(kept_drafts, len(drafts) - 1)  # the copy after the last draft fed, or the accepted prefix
            by_copy.setdefault(kept, []).append(drafting[row])
            self.pending[row] = drafts[kept:kept_drafts] + new[kept_drafts:]
        slots = torch.tensor(self.round.get("rows", []), device=self.engine.device)
        for kept, picked in by_copy.items():
            _restore_rows(self.engine, self.round["saved"][kept], slots, torch.tensor(picked, device=self.engine.device))


# -- the decoding loop --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _RowSchedule:
    """A row's draft length (adapted to its acceptance), its pause from drafting, and its recent
    acceptance rate (decayed counts of draft positions kept and checked)."""

    k: int
    pause: int = 0
    backoff: int = 1
    kept: float = 0.0
    checked: float = 0.0

    def update(self, drafted: int, accepted: int, limit: int) -> None:
        if drafted == 0:
            self.pause = max(0, self.pause - 1)
            return
        if accepted == drafted:
            self.k, self.backoff = min(limit, self.k + 1), 1
        elif accepted == 0 and self.k == 1:
            self.pause, self.backoff = self.backoff, min(_MAX_PAUSE, 2 * self.backoff)
        else:
            self.k = max(1, self.k - 1)

    def observe(self, drafted: int, accepted: int) -> None:
        """One round's evidence (none: ``drafted == 0``): the kept drafts and the first rejected one
        were checked; the drafts after a rejection were not."""
        self.kept = _ACCEPTANCE_DECAY * self.kept + accepted
        self.checked = _ACCEPTANCE_DECAY * self.checked + accepted + (accepted < drafted)

    def score_first_draft(self, drafts: list[int], token: int) -> None:
        """A plain step's evidence: the row's first draft (if any) checked against the token the step made."""
        self.observe(min(1, len(drafts)), int(bool(drafts) and drafts[0] == token))

    def expected_kept(self, drafts: int) -> float:
        """The drafts of ``drafts`` a pass is expected to keep (each kept at the row's rate, given the
        ones before it were)."""
        rate = (self.kept + _PRIOR_KEPT) / (self.checked + _PRIOR_CHECKED)
        return sum(rate**i for i in range(1, drafts + 1))


class _Rows:
    """Every row's new tokens, last token (not yet run through the target) and stop state."""

    def __init__(self, batch: int, max_new_tokens: int, stop_tokens: list[int]):
        self.new: list[list[int]] = [[] for _ in range(batch)]
        self.done = [False] * batch
        self.max_new_tokens, self.stop_tokens = max_new_tokens, set(stop_tokens)

    def add(self, row: int, tokens: list[int]) -> list[int]:
        """Append ``tokens`` to the row up to its budget and first stop token; the ones appended."""
        tokens = tokens[: self.max_new_tokens - len(self.new[row])]
        for i, token in enumerate(tokens):
            if token in self.stop_tokens:
                tokens = tokens[: i + 1]
                self.done[row] = True
                break
        self.new[row] += tokens
        if len(self.new[row]) >= self.max_new_tokens:
            self.done[row] = True
        return tokens

    def active(self) -> list[int]:
        return [r for r, done in enumerate(self.done) if not done]

    def room(self, row: int) -> int:
        return self.max_new_tokens - len(self.new[row])


class _Sampler:
    """Token choice with generate's settings: argmax at temperature 0, else draws from the filtered
    distribution with each row's own generator."""

    def __init__(self, temperature, top_k, top_p, generators, device):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generators = generators
        self.device = device

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``softmax(filter(logits))`` of ``logits [..., V]``."""
        flat = logits.reshape(-1, logits.shape[-1])
        n = flat.shape[0]
        settings = (
            torch.full((n,), float(self.temperature), device=flat.device),
            torch.full((n,), int(self.top_k or 0), dtype=torch.long, device=flat.device),
            torch.full((n,), 1.0 if self.top_p is None else float(self.top_p), device=flat.device),
        )
        return filter_logits(flat, *settings).softmax(-1).reshape(logits.shape)

    def choose(self, logits: torch.Tensor, rows: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """One token per row of ``logits [n, V]``, and the probabilities drawn from (``None`` greedy)."""
        if self.greedy:
            return logits.argmax(-1).tolist(), None
        probs = self.probs(logits)
        return [_draw(probs[i], self.generators[r]) for i, r in enumerate(rows)], probs


def _put_columns(streamer, rows: _Rows, streamed: int, pad_token: int) -> int:
    """Stream the columns every row has reached (a finished row's are its padding); the new count."""
    active = rows.active()
    reached = min(len(rows.new[r]) for r in active) if active else max(map(len, rows.new))
    for column in range(streamed, reached):
        streamer.put(torch.tensor([row[column] if column < len(row) else pad_token for row in rows.new]))
    return max(streamed, reached)


class _PlainSteps:
    """The engine's own decoding step (plain ``generate``'s, a captured graph on CUDA) for the rounds
    that verify nothing: each active row's one unfed token in, then ``steps`` steps in a row with the
    tokens kept on the device and read back once (sampled with each row's generator from the same
    filtered distribution). A row that stops inside the run steps on to its end, as plain ``generate``'s
    finished rows do; the tokens after its stop are dropped."""

    def __init__(self, engine: DecodeEngine, sampler: _Sampler, pad_token: int):
        self.engine, self.sampler = engine, sampler
        self.rows: list[int] | None = None
        self.bucket = None
        engine.set_stop_tokens([], pad_token)  # no row is finished on the device: the host counts stops

    def __call__(self, active: list[int], unfed: list[list[int]], steps: int) -> list[list[int]]:
        n = len(active)
        if active != self.rows:  # the same rows as last time: the bucket (and the step's row views) stay
            self._assign(active)
        bucket, sampling = self.bucket, not self.sampler.greedy
        bucket.tokens[:n] = torch.tensor([unfed[r][-1] for r in active])
        made = torch.empty(n, steps, dtype=torch.long, device=self.engine.device)
        for i in range(steps):
            self.engine.step(bucket, sampling, fill_noise=self._noise if sampling else None)
            made[:, i] = bucket.tokens[:n]
        return made.tolist()

    def _assign(self, active: list[int]) -> None:
        self.rows, self.bucket = list(active), self.engine.bucket(len(active))
        self.engine.assign(self.bucket, torch.tensor(active, device=self.engine.device))
        self.bucket.finished[: len(active)] = False
        sampler = self.sampler
        self.bucket.temperature.fill_(float(sampler.temperature))
        self.bucket.top_k.fill_(int(sampler.top_k or 0))
        self.bucket.top_p.fill_(1.0 if sampler.top_p is None else float(sampler.top_p))

    def _noise(self, noise: torch.Tensor) -> None:
        for i, r in enumerate(self.rows):
            noise[i].exponential_(generator=self.sampler.generators[r])


def _verification_pays(schedules, active, unfed, lengths, cost: float, adaptive: bool, room=None, k_max: int = 0) -> bool:
    """Whether this round runs a verification pass rather than a plain step (the module's doc): always
    where a row has more than its last token unfed (a pass runs anyway), else ``_slowest_rows_gain``."""
    if any(len(unfed[r]) > 1 for r in active):
        return True
    return _slowest_rows_gain(schedules, active, lengths, cost, adaptive, room, k_max)


def _slowest_rows_gain(schedules, active, lengths, cost: float, adaptive: bool, room=None, k_max: int = 0) -> bool:
    """Whether a pass with ``lengths`` drafts per row pays where the batch ends with its slowest row:
    never where no row drafts, else when every row furthest behind (``room``: new tokens each row may
    still make; the rows within ``k_max`` of the most) is expected to make at least ``cost`` tokens."""
    if not any(lengths):
        return False
    if not adaptive:
        return True
    rooms = [room(r) for r in active] if room is not None else [0] * len(active)
    behind = max(rooms) - k_max
    expected = [1 + schedules[r].expected_kept(n) for r, n, left in zip(active, lengths, rooms) if left >= behind]
    return min(expected) >= cost


@torch.no_grad()
def speculative_generate(
    model,
    engine: DecodeEngine,
    prompts: list[torch.Tensor],
    config: SpeculativeConfig,
    max_new_tokens: int,
    sampler: _Sampler,
    stop_tokens: list[int],
    pad_token: int,
    streamer=None,
    stats: dict | None = None,
) -> list[list[int]]:
    """Each row's new tokens (up to and including its stop token); see the module's doc. ``stats``,
    when given, gets ``rounds`` (target passes: verification passes and plain steps), ``verified``
    (verification passes), ``verified_rows`` and ``verified_tokens`` (the rows those passes ran and
    the new tokens they made), ``drafted`` and ``accepted`` (draft tokens verified) and ``tokens``
    (new tokens)."""
    if config.method == "draft_model":
        _check_draft_model(model, config.model)
    batch = len(prompts)
    k_max = config.num_speculative_tokens
    engine.reserve(batch, max(len(p) for p in prompts) + max_new_tokens + 2 * k_max + 2)  # room for unfed tokens and drafts
    logits = engine.prefill(prompts, torch.arange(batch, device=engine.device))
    prompt_lists = [p.tolist() for p in prompts]
    if config.method == "ngram":
        drafter = _NgramDrafter(config, prompt_lists)
    else:
        drafter = _ModelDrafter(config, prompt_lists, max_new_tokens, sampler.choose)
    rows = _Rows(batch, max_new_tokens, stop_tokens)
    first, _ = sampler.choose(logits, list(range(batch)))
    unfed = [[t] for t in first]  # per row, tokens its target state has not taken in yet (the last at least)
    for r, token in enumerate(first):
        rows.add(r, [token])
    drafter.start(first)
    loop = _Loop(engine, sampler, config, drafter, rows, unfed, pad_token)
    streamed = _put_columns(streamer, rows, 0, pad_token) if streamer is not None else 0
    while rows.active():
        loop.round(rows.active())
        if streamer is not None:
            streamed = _put_columns(streamer, rows, streamed, pad_token)
    _feed_all_but_last(engine, unfed, list(range(batch)))  # each row's state after all but its last token
    if stats is not None:
        stats.update(loop.counts, tokens=sum(map(len, rows.new)))
    return rows.new


class _Loop:
    """The rounds of one ``speculative_generate`` call: per round, drafts, then one verification pass
    or a run of plain steps, then each row's new tokens and acceptance."""

    def __init__(self, engine, sampler, config, drafter, rows: _Rows, unfed: list[list[int]], pad_token: int):
        self.engine, self.sampler, self.config, self.drafter = engine, sampler, config, drafter
        self.rows, self.unfed = rows, unfed
        self.k_max = config.num_speculative_tokens
        self.schedules = [_RowSchedule(self.k_max) for _ in rows.new]
        self.cost = verify_cost(config)
        self.plain_steps = _PlainSteps(engine, sampler, pad_token)
        self.plain_run = 1
        self.counts = dict.fromkeys(("rounds", "verified", "verified_rows", "verified_tokens", "drafted", "accepted"), 0)

    def round(self, active: list[int]) -> None:
        lengths = self._draft_lengths(active)
        verify = self._pays(active, lengths)
        if self.config.method == "draft_model" and not verify:
            lengths = [0] * len(active)  # a draft model's drafts cost passes of their own: none unless verified
        drafts, q_rows = self.drafter.propose(active, lengths)
        if verify and self._pays(active, [len(d) for d in drafts]):
            self._verified_round(active, drafts, q_rows)
        else:
            self._plain_round(active, drafts)

    def _verified_round(self, active, drafts, q_rows) -> None:
        outcome = _verify(self.engine, self.sampler, active, self.unfed, drafts, q_rows, self.k_max + 1)
        new_tokens = [d[:accepted] + [token] for d, (accepted, token) in zip(drafts, outcome)]
        self.drafter.commit(active, [accepted for accepted, _ in outcome], new_tokens)
        made = sum(len(self.rows.add(r, new)) for r, new in zip(active, new_tokens))
        for r, d, (accepted, _) in zip(active, drafts, outcome):
            self.schedules[r].update(len(d), accepted, self.k_max)
            self.schedules[r].observe(len(d), accepted)
            self.counts["drafted"] += len(d)
            self.counts["accepted"] += accepted
        for key, value in (("rounds", 1), ("verified", 1), ("verified_rows", len(active)), ("verified_tokens", made)):
            self.counts[key] += value
        self.plain_run = 1

    def _plain_round(self, active, drafts) -> None:
        """A run of plain steps, twice as long as the last (up to ``_LONGEST_PLAIN_RUN``) while rounds
        keep being turned down; prompt lookup's first draft is scored against the run's first token."""
        steps = min(self.plain_run, min(self.rows.room(r) for r in active))
        new_tokens = self.plain_steps(active, self.unfed, steps)
        self.drafter.commit(active, [0] * len(active), new_tokens)
        for r, d, new in zip(active, drafts, new_tokens):
            self.rows.add(r, new)
            self.unfed[r] = new[-1:]
            self.schedules[r].update(0, 0, self.k_max)
            self.schedules[r].score_first_draft(d, new[0])
        self.counts["rounds"] += steps
        self.plain_run = min(_LONGEST_PLAIN_RUN, 2 * self.plain_run)

    def _draft_lengths(self, active: list[int]) -> list[int]:
        k = lambda r: self.schedules[r].k if self.config.adaptive else self.k_max  # noqa: E731
        return [0 if self.schedules[r].pause else min(k(r), self.rows.room(r) - 1) for r in active]

    def _pays(self, active: list[int], lengths: list[int]) -> bool:
        return _verification_pays(
            self.schedules, active, self.unfed, lengths, self.cost, self.config.adaptive, self.rows.room, self.k_max
        )


def _check_draft_model(model, draft) -> None:
    if draft is model:
        raise ValueError("speculate: the draft model is the target model itself (pass a separate copy)")
    vocab, draft_vocab = model.get_output_embeddings().out_features, draft.get_output_embeddings().out_features
    if vocab != draft_vocab:
        raise ValueError(f"speculate: the draft model's vocabulary ({draft_vocab}) differs from the model's ({vocab})")
    if next(draft.parameters()).device != next(model.parameters()).device:
        raise ValueError("speculate: the draft model is on another device than the model")


def _verify(engine, sampler, active, unfed, drafts, q_rows, most_unfed: int) -> list[tuple[int, int]]:
    """One target pass over every active row's unfed tokens and drafts; per row ``(drafts kept, next
    token)``. A row that kept every draft is left after them; a row that rejected one gets its state
    from before the pass back, and its unfed tokens become the old ones, the kept drafts and the next
    token (run by the next pass), unless they would exceed ``most_unfed``: then all but the next token
    run now."""
    drafting = [i for i, d in enumerate(drafts) if d]  # only these can reject a draft: only they are saved
    slots = torch.tensor([active[i] for i in drafting], device=engine.device)
    saved = _saved_rows(engine, slots) if drafting else None
    logits = _continue_rows(engine, [unfed[r] + d for r, d in zip(active, drafts)], active)
    starts = [len(unfed[r]) - 1 for r in active]  # the position whose logits score the first draft
    if sampler.greedy:
        predicted = logits.argmax(-1).tolist()
        outcome = [_accept_greedy(predicted[i][start:], d) for i, (start, d) in enumerate(zip(starts, drafts))]
    else:
        probs = sampler.probs(logits)
        outcome = [
            _accept_sampled(probs[i, start : start + len(d) + 1], q_rows[i] if q_rows else None, d, sampler.generators[r])
            for i, (r, start, d) in enumerate(zip(active, starts, drafts))
        ]
    rejected = [j for j, i in enumerate(drafting) if outcome[i][0] < len(drafts[i])]
    if rejected:
        _restore_rows(engine, saved, slots, torch.tensor(rejected, device=engine.device))
    for i, (r, (accepted, token)) in enumerate(zip(active, outcome)):
        unfed[r] = (unfed[r] + drafts[i][:accepted] if accepted < len(drafts[i]) else []) + [token]
    _feed_all_but_last(engine, unfed, [r for r in active if len(unfed[r]) > most_unfed])
    return outcome


def _feed_all_but_last(engine, unfed: list[list[int]], rows: list[int]) -> None:
    """Run the ``rows``' unfed tokens but their last into their states (one pass)."""
    rows = [r for r in rows if len(unfed[r]) > 1]
    if rows:
        _continue_rows(engine, [unfed[r][:-1] for r in rows], rows, logits=False)
        for r in rows:
            unfed[r] = unfed[r][-1:]
