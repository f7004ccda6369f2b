"""Speculative decoding inside the scheduler: with ``Scheduler(speculate=...)`` every decoding
iteration is one speculative round over the running requests (``efla.generation.speculative`` has
the method, its drafters and its acceptance rules; this module keeps their per-slot state).

A round drafts up to ``k`` tokens per request (prompt lookup over the request's prompt and tokens so
far, or a draft model decoding in its own pool, one row per slot), runs every request's unfed
tokens and drafts through the target model in ONE pass continuing its slot's state, keeps each
request's drafts up to the first rejection plus one token of the target's own, and puts the state
from before the pass back into the slots of requests that rejected a draft (their kept tokens
become unfed tokens that the next pass runs ahead of its drafts). A request thus receives one to
``k + 1`` tokens per round, all through the scheduler's usual acceptance (stop tokens, stop strings,
``max_tokens``: tokens after the end are dropped).

Requests with logit processors (penalties, ``logit_bias``, ``min_tokens``, ``ignore_eos``, a
grammar) take part with no drafts: their processors depend on every token before, so only the
pass's first position is theirs, a plain decoding step inside the same pass. Log-probabilities come
from the pass's logits at each kept token's position, the distribution the plain step reports.
A round with drafts runs eagerly (no CUDA graphs).

Speculation turns itself down where a verification pass would not pay, by ``generate``'s rule and
estimate (``_RowSchedule``): a request whose recent drafts were kept at rate ``a`` is expected to
make ``1 + sum_{i<=n} a^i`` tokens in a pass with ``n`` drafts (a request without drafts: 1), a pass
costs ``verify_cost`` plain steps, and a round verifies only when every request furthest behind
(within ``k`` tokens of the most ``max_tokens`` still to go) expects ``verify_cost`` tokens. A pass
slows every request in it, and the requests that gain least set when the running ones finish (a
request ending sooner frees a slot, but that pays only where one waits for it). A throughput rule
(the expected tokens summed over the requests against ``verify_cost`` times their number, while
requests wait) was tried and measured slower on the CPU: a pass's rejections cost feeding passes
of their own, and requests ending at different iterations break their successors' prefill into
smaller batches.

Otherwise, and where no request drafted, the round is the scheduler's plain decoding step (one per
iteration, so admitting and prefilling go on between steps); a slot still holding kept tokens of a
rejection first runs them through its state (one pass over those slots alone, no logits), instead
of forcing a verification pass on every request. A plain step still scores prompt lookup's first
draft of each request against the token the step made, so a turned-down request's rate keeps
following its text and it verifies again where the text repeats; with a draft model, a round the
estimate turns down drafts nothing (its drafts cost passes of their own).
"""

from __future__ import annotations

import torch

from efla.generation.engine import DecodeEngine
from efla.generation.sampling import filter_logits
from efla.generation.speculative import (
    SpeculativeConfig,
    _accept_greedy,
    _accept_sampled,
    _check_draft_model,
    _continue_rows,
    _draw,
    _feed_all_but_last,
    _ModelDrafter,
    _NgramIndex,
    _restore_rows,
    _RowSchedule,
    _saved_rows,
    _slowest_rows_gain,
    verify_cost,
)

from .logprobs import logprobs_of
from .processors import RowProcessors, SlotHistory, uses_processors
from .requests import Request

__all__ = ["SpeculativeRounds", "RoundResult"]

RoundResult = tuple[list[int], list[tuple] | None]  # a request's new tokens and, when asked, their logprob rows


class _SlotDraftModel(_ModelDrafter):
    """``_ModelDrafter`` whose rows are the scheduler's slots: each admitted prompt is prefilled into
    its slot of the draft model's own pool when the request joins."""

    def __init__(self, config: SpeculativeConfig, slots: int, max_length: int, choose):
        self.engine = DecodeEngine(config.model)  # a pool of its own, apart from any generate() on the model
        self.engine.check_weights()
        self.engine.reserve(slots, max_length)
        self.choose = choose
        self.pending: list[list[int]] = [[] for _ in range(slots)]
        self.round: dict = {}

    def join(self, slot: int, prompt: list[int], first_token: int) -> None:
        rows = torch.tensor([slot], device=self.engine.device)
        self.engine.prefill([torch.tensor(prompt, dtype=torch.long)], rows)
        self.pending[slot] = [first_token]


class SpeculativeRounds:
    """The speculative state of every slot (unfed tokens, n-gram index or draft-model row, adaptive
    draft length and acceptance rate) and the round itself; counts ``rounds`` (verification passes
    and plain steps), ``verified`` (verification passes), ``row_rounds`` (a round of ``n`` requests
    adds ``n``), ``drafted`` and ``accepted`` tokens (of verified drafts)."""

    def __init__(self, config: SpeculativeConfig, model, engine: DecodeEngine, slots: int, max_length: int):
        if config.method == "draft_model":
            _check_draft_model(model, config.model)
        self.config, self.engine = config, engine
        self.k_max = config.num_speculative_tokens
        self.cost = verify_cost(config)
        self.unfed: dict[int, list[int]] = {}  # per slot: tokens its target state has not taken in (the last at least)
        self.schedules: dict[int, _RowSchedule] = {}
        self.indexes: dict[int, _NgramIndex] = {}
        self.requests: dict[int, Request] = {}
        self.draft_model = (
            _SlotDraftModel(config, slots, max_length, self._draft_choice) if config.method == "draft_model" else None
        )
        self.rounds = self.verified = self.row_rounds = self.drafted = self.accepted = 0
        self._generator: torch.Generator | None = None
        self._draft_lengths: dict[int, int] = {}  # this round's draft length per slot
        self._drafts: dict[int, list[int]] = {}  # this round's drafts per slot (a plain step scores them)
        self._draft_step = 0  # the draft model's step within this round

    def stats(self) -> dict:
        return {
            "method": self.config.method,
            "rounds": self.rounds,
            "verified": self.verified,  # rounds that ran a verification pass (the rest: plain steps)
            "row_rounds": self.row_rounds,  # requests taken through a round, summed over rounds
            "drafted": self.drafted,
            "accepted": self.accepted,
        }

    def join(self, request: Request, first_token: int) -> None:
        """``request`` decodes from its slot, whose state holds its prompt; ``first_token`` is unfed."""
        slot = request.slot
        self.unfed[slot], self.requests[slot] = [first_token], request
        self.schedules[slot] = _RowSchedule(self.k_max)
        if self.draft_model is not None:
            self.draft_model.join(slot, request.prompt, first_token)
        else:
            sizes = range(self.config.prompt_lookup_min, self.config.prompt_lookup_max + 1)
            self.indexes[slot] = _NgramIndex(request.prompt + [first_token], sizes)

    def leave(self, slot: int) -> None:
        """The slot's request ended: forget it (a draft model's row is overwritten by the next join)."""
        for table in (self.unfed, self.schedules, self.indexes, self.requests):
            table.pop(slot, None)

    # -- one round ------------------------------------------------------------------------------------
    def propose(self, requests: list[Request], generator: torch.Generator) -> tuple[list[list[int]], list, bool]:
        """The round's drafts of ``requests`` (decoding, in slots that joined), the drafter's
        probabilities of them (``None`` per request: prompt lookup's point masses, or greedy) and
        whether the round verifies them (else it is a plain decoding step: the caller's, then
        ``stepped``); ``generator``: the noise of sampling requests without a generator of their own."""
        self._generator = generator
        lengths = [self._draft_length(r) for r in requests]
        slots = [r.slot for r in requests]
        if self.draft_model is not None:
            if not self._pass_pays(requests, lengths):
                lengths = [0] * len(slots)  # a draft model's drafts cost passes of their own: none unless verified
            self._draft_lengths, self._draft_step = dict(zip(slots, lengths)), 0
            drafts, q_rows = self.draft_model.propose(slots, lengths)
        else:
            drafts = [self.indexes[s].propose(n) if n else [] for s, n in zip(slots, lengths)]
            q_rows = [None] * len(slots)
        self._drafts = dict(zip(slots, drafts))
        verify = self._pass_pays(requests, [len(d) for d in drafts])
        if not verify:  # the plain step takes each slot's last token: the kept tokens before it run first
            _feed_all_but_last(self.engine, self.unfed, slots)
        return drafts, q_rows, verify

    def _pass_pays(self, requests: list[Request], lengths: list[int]) -> bool:
        """Whether a verification pass with ``lengths`` drafts per request is expected to pay:
        ``generate``'s rule, every request furthest behind expecting ``verify_cost`` tokens (the
        module's doc); never where no request drafts."""
        room = {r.slot: r.params.max_tokens - len(r.tokens) for r in requests}
        slots = [r.slot for r in requests]
        return _slowest_rows_gain(self.schedules, slots, lengths, self.cost, self.config.adaptive, room.get, self.k_max)

    def last_tokens(self, requests: list[Request]) -> list[int]:
        return [self.unfed[r.slot][-1] for r in requests]

    def stepped(self, requests: list[Request], tokens: list[int]) -> None:
        """A plain decoding step gave each of ``requests`` its next token (after ``propose``, whose
        drafts it scores)."""
        for request, token in zip(requests, tokens):
            self.schedules[request.slot].score_first_draft(self._drafts.get(request.slot, []), token)
        self._settle(requests, [[] for _ in requests], [(0, token) for token in tokens], None, None)

    def verify(
        self,
        requests: list[Request],
        drafts: list[list[int]],
        q_rows: list,
        processors: RowProcessors | None,
        history: SlotHistory | None,
    ) -> list[RoundResult]:
        """The round's pass over every request's unfed tokens and ``drafts`` (``propose``'s); each
        request's new tokens. ``processors``: the requests' logit processors as rows (``None``: none
        has any)."""
        slots = [r.slot for r in requests]
        slot_rows = torch.tensor(slots, device=self.engine.device)
        saved = _saved_rows(self.engine, slot_rows) if any(drafts) else None
        logits = _continue_rows(self.engine, [self.unfed[s] + d for s, d in zip(slots, drafts)], slots)
        starts = [len(self.unfed[s]) - 1 for s in slots]  # the position whose logits score the first draft
        processed = None if processors is None else self._processed_first(logits, starts, slots, processors, history)
        outcome = []
        for i, request in enumerate(requests):
            window = logits[i, starts[i] : starts[i] + len(drafts[i]) + 1]
            if processed is not None and bool(processors.active[i]):
                window = processed[i : i + 1]  # no drafts: one position, processed as a plain step's
            outcome.append(self._accept(request, window, drafts[i], q_rows[i]))
        if processors is not None:
            firsts = torch.tensor(
                [(d[:kept] + [token])[0] for d, (kept, token) in zip(drafts, outcome)], device=self.engine.device
            )
            history.record(slot_rows, firsts, processors.active)  # a processed row's one new token
        for slot, d, (kept, _) in zip(slots, drafts, outcome):
            self.schedules[slot].observe(len(d), kept)
        self.verified += 1
        self._settle(requests, drafts, outcome, saved, slot_rows)
        return [self._result(r, logits[i], starts[i], drafts[i], outcome[i]) for i, r in enumerate(requests)]

    def _processed_first(self, logits, starts, slots, processors: RowProcessors, history: SlotHistory) -> torch.Tensor:
        """Each row's logits at its first position (a processed row has no drafts: its only one),
        processed after the grammars took the rows' newest tokens, as a plain step does."""
        last = torch.tensor([self.unfed[s][-1] for s in slots], device=self.engine.device)
        processors.constrain(self.engine.vocab, self.engine.device, last, torch.zeros(len(slots), dtype=torch.bool))
        first_logits = logits[torch.arange(len(slots)), torch.tensor(starts)]
        return processors.apply(first_logits, history, torch.tensor(slots, device=self.engine.device))

    def _draft_length(self, request: Request) -> int:
        schedule = self.schedules[request.slot]
        if uses_processors(request.params) or schedule.pause:
            return 0
        room = request.params.max_tokens - len(request.tokens)
        return max(0, min(schedule.k if self.config.adaptive else self.k_max, room - 1))

    def _sampling_rows(self, request: Request, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        params, device = request.params, self.engine.device
        return (
            torch.full((n,), float(params.temperature), device=device),
            torch.full((n,), int(params.top_k), dtype=torch.long, device=device),
            torch.full((n,), float(params.top_p), device=device),
        )

    def _accept(self, request: Request, window: torch.Tensor, drafts: list[int], q) -> tuple[int, int]:
        """``(drafts kept, next token)`` of one request from the target's logits ``window [len(drafts) + 1, V]``."""
        if request.params.temperature == 0:
            return _accept_greedy(window.argmax(-1).tolist(), drafts)
        probs = filter_logits(window, *self._sampling_rows(request, window.shape[0])).softmax(-1)
        return _accept_sampled(probs, q, drafts, request.generator or self._generator)

    def _draft_choice(self, logits: torch.Tensor, slots: list[int]) -> tuple[list[int], torch.Tensor]:
        """The draft model's token per slot of ``logits [n, V]``, chosen as its request chooses, and
        the probabilities it was drawn from (a greedy request's are never read). A request draws
        only for the drafts it asked for: its noise must not depend on its neighbours' draft lengths."""
        requests = [self.requests[s] for s in slots]
        settings = [torch.cat(column) for column in zip(*(self._sampling_rows(r, 1) for r in requests))]
        probs = filter_logits(logits, *settings).softmax(-1)
        drawing = [r.params.temperature > 0 and self._draft_step < self._draft_lengths[s] for s, r in zip(slots, requests)]
        tokens = [
            _draw(probs[i], r.generator or self._generator) if drawing[i] else int(logits[i].argmax())
            for i, r in enumerate(requests)
        ]
        self._draft_step += 1
        return tokens, probs

    def _settle(self, requests, drafts, outcome, saved, slot_rows) -> None:
        """Put back the state of the slots that rejected a draft, update the unfed tokens, drafters,
        draft lengths and counts."""
        rejected = [i for i, (kept, _) in enumerate(outcome) if kept < len(drafts[i])]  # none without drafts
        if rejected:
            _restore_rows(self.engine, saved, slot_rows, torch.tensor(rejected, device=self.engine.device))
        slots = [r.slot for r in requests]
        new_tokens = [d[:kept] + [token] for d, (kept, token) in zip(drafts, outcome)]
        for i, slot in enumerate(slots):
            kept = outcome[i][0]
            self.unfed[slot] = (self.unfed[slot] + new_tokens[i][:-1] if kept < len(drafts[i]) else []) + new_tokens[i][-1:]
            self.schedules[slot].update(len(drafts[i]), kept, self.k_max)
            self.drafted, self.accepted = self.drafted + len(drafts[i]), self.accepted + kept
        _feed_all_but_last(self.engine, self.unfed, [s for s in slots if len(self.unfed[s]) > self.k_max + 1])
        if self.draft_model is not None:
            self.draft_model.commit(slots, [kept for kept, _ in outcome], new_tokens)
        else:
            for slot, tokens in zip(slots, new_tokens):
                for token in tokens:
                    self.indexes[slot].append(token)
        self.rounds += 1
        self.row_rounds += len(requests)

    @staticmethod
    def _result(request: Request, logits: torch.Tensor, start: int, drafts: list[int], outcome) -> RoundResult:
        kept, token = outcome
        tokens = drafts[:kept] + [token]
        if request.params.logprobs is None:
            return tokens, None
        ids = torch.tensor(tokens, device=logits.device)
        chosen, values, indices = logprobs_of(logits[start : start + len(tokens)], ids)
        return tokens, list(zip(chosen.tolist(), values.tolist(), indices.tolist()))
