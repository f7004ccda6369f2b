"""``Scheduler``: continuous batching over the decoding engine's pool of recurrent states.

One background thread owns the model. Each request holds one pool row (a *slot*) from admission to
its end. Every iteration of the loop

1. launches one decoding step of every decoding request (one CUDA graph per batch bucket on the
   GPU) and queues the copy of its tokens to the host;
2. hands out the tokens of the step before (read one step late, so the host's work overlaps the
   device's): text, stop strings, ends; an ended request's slot is free again;
3. drops cancelled requests (their clients went away) and admits waiting ones into free slots,
   starting from the prefix cache's state when it holds a prefix of the prompt;
4. prefills at most ``prefill_chunk`` prompt tokens, continuing each prompt from its slot's state
   (so a long prompt delays the running requests by one chunk per step, never by all of it), and
   picks the first token of every prompt that is complete (``efla.serving.prefill``: pieces of up
   to ``ROW_TOKENS`` tokens of several prompts as the rows of one call, captured on the GPU);
5. rebuilds the decoding batch when requests ended or joined: the bucket's rows point at their
   slots through ``bucket.slots``, so the same captured step serves any assignment.

``n`` choices of one prompt are forked: the first request prefills, and the others' slots get a copy
of its state (fixed-size for a linear-attention model) before each picks its own first token; a
hybrid model prefills each choice on its own. A request with ``max_tokens = 0`` only scores its
prompt (``prompt_logprobs``) and holds no slot.

Requests end at ``max_tokens``, at a stop token (the tokenizer's end of sequence), at a stop string,
or when cancelled. A request with a grammar (``response_format``) has its tokens masked by it and
ends when the grammar allows only the end-of-sequence token; its bucket's steps wait for the tokens
of the step before, which its grammar must see first. A seeded sampling request draws its noise
from its own generator (see ``DecodeEngine.step``'s ``fill_noise``), so it gives the same tokens
whatever runs beside it; greedy requests give ``efla.generation.generate``'s tokens.

With ``speculate``, step 1 is a speculative round instead (``efla.serving.speculation``): drafts
checked in one pass, one to ``k + 1`` tokens per request handed out at once, through the same ends;
a round in which no request drafted, or whose drafts are not expected to pay for a pass, is the plain
step. Step 5 then only adds the requests that joined.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from efla.generation import choose_tokens
from efla.generation.speculative import speculative_config

from .logprobs import ServingEngine, logprobs_of, prompt_logprobs, token_logprob
from .prefill import ROW_TOKENS, plan_rounds, plan_rows, run_round, run_rows, to_device
from .prefix_cache import PrefixCache
from .processors import RowProcessors, uses_processors
from .speculation import SpeculativeRounds
from .requests import ErrorEvent, FinishEvent, QueueFull, Request, SamplingParams, ShuttingDown, TokenEvent, TokenLogprob
from .states import copy_row, has_attention_layers, restore_row, snapshot_row
from .structured import new_matcher
from .completion_text import CompletionText

__all__ = ["Scheduler", "prefill_defaults"]

logger = logging.getLogger("efla.serving")


class _HostCopy:
    """A device tensor's copy to the host, queued behind the work before it and read later."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.is_cuda:
            self.tensor = tensor.to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.tensor, self.event = tensor.clone(), None

    def values(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.tolist()


class _HostLogprobs:
    """The log-probabilities of a step's rows (``logprobs_of``'s three tensors), copied to the host."""

    def __init__(self, chosen: torch.Tensor, top_values: torch.Tensor, top_ids: torch.Tensor):
        self.copies = [_HostCopy(t) for t in (chosen, top_values, top_ids)]

    def rows(self) -> list[tuple[float, list[float], list[int]]]:
        return list(zip(*(copy.values() for copy in self.copies)))


def _wants_logprobs(requests: list[Request]) -> bool:
    return any(r.params.logprobs is not None for r in requests)


@dataclass
class _Read:
    rows: list[Request]  # the bucket's requests when the step ran
    tokens: _HostCopy
    logprobs: _HostLogprobs | None = None  # when some row asked for them
    joined: list[Request] = field(default_factory=list)  # requests whose first token comes first
    first_tokens: _HostCopy | None = None
    first_logprobs: _HostLogprobs | None = None


class _PhaseClock:
    """Host seconds of the loop's phases, added to ``totals`` (waits for the device included)."""

    def __init__(self, totals: dict[str, float]):
        self.totals, self.last = totals, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self.last
        self.last = now


def _start_cpu_threads_here(device: torch.device) -> None:
    """Run one operation split across torch's CPU threads on the calling thread, so that thread holds
    OpenMP worker threads of its own before the scheduler's thread makes its team.

    libgomp lets idle workers spin (about 300,000 iterations) between parallel regions while the
    process has no more OpenMP threads than CPUs, and waits for the next region passively once it has
    more. With the scheduler's team alone, its workers spin beside the server's other threads (the
    HTTP event loop) and other processes: on a busy 2-core machine every matrix product of a decoding
    step then waits for a descheduled worker (the tiny preset's ``aten::mm`` 73 ms instead of 1 ms,
    0.3 to 0.7 s a step). Which case a server was in depended on its slot count: a state pool large
    enough for its zero-fill to be split (16 slots or more of the tiny preset) had made the main
    thread's team by accident."""
    if device.type == "cpu" and torch.get_num_threads() > 1:
        torch.ones(1 << 20).add_(1)  # far above ATen's grain (32,768 elements), so it is split


def prefill_defaults(device: torch.device) -> tuple[int, int]:
    """``(prefill_chunk, prefill_every)`` for a model on ``device``: small prefills between every two
    decoding steps, so the running requests wait a short while often rather than long and seldom
    (a captured 2,048-token prefill of a 340M model takes a few milliseconds on an H200; without
    graphs, a hybrid model's eager call about 90 ms whatever its size)."""
    return (2048, 1) if device.type == "cuda" else (512, 1)


class Scheduler:
    """Continuous batching of generation requests over ``max_batch`` state slots (see the module's doc).

    Args:
        model: an ``EFLAForCausalLM`` in eval mode (any variant; hybrid models bypass the prefix cache).
        tokenizer: a fast tokenizer (text and stop strings); ``None``: token counts only.
        max_batch: state slots, the most requests decoding at once.
        max_queue: requests that may wait for a slot beyond those holding one (``QueueFull`` past it).
        max_context: the most tokens (prompt and new ones) of a request.
        prefill_chunk: the most prompt tokens prefilled between two decoding steps (``None``:
            ``prefill_defaults`` of the model's device).
        prefill_every: while at least half the slots decode, prefill only once every this many
            decoding steps (a prefill call has a fixed cost, tens of milliseconds on a GPU, that every
            decoding request waits through: spacing the calls keeps most gaps between tokens at one
            step's time and lets one call take many prompts); 1: between every two steps (``None``:
            ``prefill_defaults`` of the model's device).
        prefix_cache: states after recent prompt prefixes (``None``: off).
        stop_tokens: tokens that end a request.
        pad_token: what a finished row emits.
        seed: seeds the noise of unseeded sampling requests.
        use_cuda_graph: replay captured steps on CUDA (default: on CUDA); all buckets are captured
            when the scheduler starts.
        speculate: speculative decoding, as ``efla.generation.generate``'s ``speculate`` (a dict of
            ``SpeculativeConfig``'s fields or one; ``None``: off): each decoding iteration is then one
            speculative round (``efla.serving.speculation``), a plain step where its ``verify_cost``
            rule turns the pass down.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        max_batch: int = 64,
        max_queue: int = 256,
        max_context: int = 2048,
        prefill_chunk: int | None = None,
        prefill_every: int | None = None,
        prefix_cache: PrefixCache | None = None,
        stop_tokens=(),
        pad_token: int | None = None,
        seed: int | None = None,
        use_cuda_graph: bool | None = None,
        speculate=None,
    ):
        default_chunk, default_every = prefill_defaults(next(model.parameters()).device)
        prefill_chunk = default_chunk if prefill_chunk is None else prefill_chunk
        prefill_every = default_every if prefill_every is None else prefill_every
        for name, value, least in (
            ("max_batch", max_batch, 1),
            ("max_queue", max_queue, 0),
            ("max_context", max_context, 2),
            ("prefill_chunk", prefill_chunk, 1),
            ("prefill_every", prefill_every, 1),
        ):
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_queue, self.max_context = max_batch, max_queue, max_context
        self.prefill_chunk, self.prefill_every = prefill_chunk, prefill_every
        self._last_prefill_step = 0
        self.engine = ServingEngine(model, use_cuda_graph)
        self.engine.check_weights()
        speculation = speculative_config(speculate)
        room = 2 if speculation is None else 2 * speculation.num_speculative_tokens + 2  # a finished row's step, or drafts
        self.engine.reserve(max_batch, max_context + room)
        self.speculation = (
            None if speculation is None else SpeculativeRounds(speculation, model, self.engine, max_batch, max_context + room)
        )
        self.stop_tokens = [int(t) for t in stop_tokens]
        self._stop_set = set(self.stop_tokens)
        self.engine.set_stop_tokens(
            self.stop_tokens, pad_token if pad_token is not None else (self.stop_tokens[0] if self.stop_tokens else 0)
        )
        self.hybrid = has_attention_layers(self.engine.cache)
        self.prefix_cache = None if self.hybrid else prefix_cache
        self.vocab = self.engine.vocab
        self._generator = torch.Generator(device=self.engine.device)
        self._generator.manual_seed(int(seed) if seed is not None else int(torch.randint(2**62, ()).item()))

        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._holding = 0  # requests holding a slot
        self._accepting, self._stopping = True, False
        self._ending: str | None = None  # end_all's reason, until the loop has ended them
        self._cancellations = False  # some request was cancelled since the last look
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._prefilling: list[Request] = []
        self._forked: list[Request] = []  # holding a slot until their first request's prefill ends
        self._rows: list[Request] = []
        self._bucket = None
        # speculating: the requests the bucket was last assigned for a plain step, and whether its
        # tokens are still theirs (no verification pass since that step)
        self._stepping: list[Request] = []
        self._stepped_last = False
        self._pending: _Read | None = None
        self._joined: tuple[list[Request], _HostCopy, _HostLogprobs | None] | None = None
        self.phase_seconds = dict.fromkeys(("decode", "deliver", "admit", "prefill", "rebuild"), 0.0)
        self.prefill_calls = 0
        self.steps = self.peak_batch = self.served = self.cancelled = self.generated = self.prompt_tokens_prefilled = 0
        self._thread: threading.Thread | None = None

    # -- the outside: submit, cancel, start, stop, status --------------------------------------------
    def submit(
        self, prompts: list[list[int]], params: SamplingParams, on_event: Callable[[Request, object], None], choices: int = 1
    ) -> list[Request]:
        """Queue ``choices`` requests per prompt (token ids), prompt by prompt (``index``: ``prompt *
        choices + choice``); choice ``j`` of a seeded request samples with seed ``seed + j``. Raises
        ``ValueError`` naming a wrong field, ``QueueFull`` or ``ShuttingDown``."""
        self._check(prompts, params, choices)
        requests = []
        for i, prompt in enumerate(prompts):
            group = [self._new_request(prompt, params, on_event, i * choices + j, j) for j in range(choices)]
            if not self.hybrid and params.max_tokens > 0:
                first = group[0]
                first.forks = group[1:]
                for fork in first.forks:
                    fork.fork_of = first
            requests += group
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) + self._holding + len(requests) > self.max_batch + self.max_queue:
                raise QueueFull(
                    f"{len(self._waiting)} requests are waiting for one of {self.max_batch} slots "
                    f"(at most {self.max_queue} may wait)"
                )
            self._waiting.extend(requests)
            self._cond.notify()
        return requests

    def _new_request(self, prompt: list[int], params: SamplingParams, on_event, index: int, choice: int) -> Request:
        if choice and params.seed is not None:
            params = replace(params, seed=(params.seed + choice) % 2**63)
        text = CompletionText(self.tokenizer, list(params.stop)) if self.tokenizer else None
        return Request(list(prompt), params, on_event, index=index, text=text)

    def _check(self, prompts, params: SamplingParams, choices: int) -> None:
        if params.max_tokens < 0:
            raise ValueError(f"max_tokens: expected >= 0, got {params.max_tokens}")
        if not 1 <= choices <= self.max_batch:
            raise ValueError(f"n: expected 1 to {self.max_batch} choices (this server's slots), got {choices}")
        if not params.temperature >= 0 or params.top_k < 0 or not 0 < params.top_p <= 1:
            raise ValueError("temperature, top_k, top_p: expected temperature >= 0, top_k >= 0, 0 < top_p <= 1")
        if not prompts or len(prompts) * choices > self.max_batch + self.max_queue:
            raise ValueError(
                f"prompt: expected 1 to {self.max_batch + self.max_queue} prompts (times n), got {len(prompts)} (times {choices})"
            )
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(not 0 <= t < self.vocab for t in tokens):
                raise ValueError(f"{name}: token ids must be in [0, {self.vocab})")
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise ValueError(f"min_tokens: expected 0 to max_tokens ({params.max_tokens}), got {params.min_tokens}")
        if not params.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: expected > 0, got {params.repetition_penalty}")
        if params.grammar is not None and (params.ignore_eos or params.min_tokens):
            # the grammar ends with the end-of-sequence token, which these two hold back
            raise ValueError("response_format: not with ignore_eos or min_tokens")
        for ids in prompts:
            if not ids:
                raise ValueError("prompt: a prompt has no tokens")
            if min(ids) < 0 or max(ids) >= self.vocab:
                raise ValueError(f"prompt: token ids must be in [0, {self.vocab})")
            if len(ids) + params.max_tokens > self.max_context:
                raise ValueError(
                    f"max_tokens: the prompt's {len(ids)} tokens and max_tokens = {params.max_tokens} "
                    f"exceed the context of {self.max_context} tokens"
                )

    def cancel(self, requests: list[Request]) -> None:
        """End these requests soon (their slots are freed at the next step); ended ones are left alone."""
        for request in requests:
            request.cancelled = True
        with self._cond:
            self._cancellations = True
            self._cond.notify()

    def start(self) -> None:
        if self._thread is None:
            self.engine.capture_all(self.max_batch)
            if not self.hybrid:
                self.engine.capture_prefill(self.prefill_chunk, min(ROW_TOKENS, self.prefill_chunk))
            _start_cpu_threads_here(self.engine.device)
            self._thread = threading.Thread(target=self._run, name="efla-scheduler", daemon=True)
            self._thread.start()

    def stop_accepting(self) -> None:
        """Refuse new requests (``ShuttingDown``); queued and running ones go on."""
        with self._cond:
            self._accepting = False

    @property
    def accepting(self) -> bool:
        return self._accepting

    def end_all(self, reason: str = "length") -> None:
        """End every queued and running request at its next step with ``reason``, as a request that
        reached its end does (its text so far, then a ``FinishEvent``); for a shutdown's end."""
        with self._cond:
            self._ending = reason
            self._cancellations = True  # wakes the loop as a cancellation does
            self._cond.notify()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, end every queued and running one (an error event: the server is
        shutting down) and stop the thread."""
        with self._cond:
            self._accepting, self._stopping = False, True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict:
        with self._cond:
            waiting, holding = len(self._waiting), self._holding
        cache = (
            self.prefix_cache.stats()
            if self.prefix_cache is not None
            else {"enabled": False, "reason": "hybrid model (attention layers)" if self.hybrid else "off"}
        )
        return {
            "slots_total": self.max_batch,
            "slots_free": self.max_batch - holding,
            "waiting": waiting,
            "max_queue": self.max_queue,
            "decoding": len(self._rows),
            "steps": self.steps,
            "peak_batch": self.peak_batch,
            "requests_served": self.served,
            "requests_cancelled": self.cancelled,
            "tokens_generated": self.generated,
            "prompt_tokens_prefilled": self.prompt_tokens_prefilled,
            "prefill_calls": self.prefill_calls,
            "prefix_cache": cache,
            "speculation": {"enabled": False} if self.speculation is None else {"enabled": True, **self.speculation.stats()},
            "loop_seconds": {k: round(v, 3) for k, v in self.phase_seconds.items()},
        }

    # -- the loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        while self._wait_for_work():
            try:
                with torch.no_grad():
                    self._iterate()
            except Exception:  # a failed step must not take the server down: its requests end with an error
                logger.exception("efla serve: a scheduler step failed; its requests end with an error")
                self._fail_active("internal error while generating (see the server log)")
        self._shut_down()

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not (self._stopping or self._waiting or self._rows or self._prefilling or self._pending or self._cancellations):
                self._cond.wait()
            return not self._stopping

    def _iterate(self) -> None:
        clock = _PhaseClock(self.phase_seconds)
        read = None
        if self.speculation is not None:
            self._speculative_round()  # its tokens are handed out at once: nothing read one step late
        elif self._rows:
            read = self._launch_step()
        clock.lap("decode")
        if self._pending is not None:
            self._deliver(self._pending)
        self._pending = read
        clock.lap("deliver")
        self._end_all_now()
        self._drop_cancelled()
        self._admit()
        clock.lap("admit")
        joined, first_tokens = self._prefill() if self._prefill_due() else ([], None)
        clock.lap("prefill")
        if self.speculation is not None:
            self._join_speculating(joined, first_tokens)
        elif joined or any(r.done for r in self._rows):
            self._rebuild(joined, first_tokens)
        clock.lap("rebuild")

    def _launch_step(self) -> _Read:
        bucket, n = self._bucket, len(self._rows)
        sampling = any(r.params.temperature > 0 for r in self._rows)
        if bucket.processors is not None:  # the grammars see the tokens of the step before (a wait for them)
            bucket.processors.constrain(self.vocab, self.engine.device, bucket.tokens, bucket.finished)
        self.engine.step(bucket, sampling, fill_noise=self._fill_noise)
        self.steps += 1
        self.peak_batch = max(self.peak_batch, n)
        read = _Read(list(self._rows), _HostCopy(bucket.tokens[:n]))
        if _wants_logprobs(self._rows):
            read.logprobs = _HostLogprobs(*(t[:n] for t in bucket.logprobs))
        if self._joined is not None:
            read.joined, read.first_tokens, read.first_logprobs = self._joined
            self._joined = None
        return read

    def _speculative_round(self) -> None:
        """One speculative round of the decoding requests, their tokens handed out at once; a plain
        decoding step when none of them drafted or a pass is not expected to pay."""
        # in slot order: where the slots are the pool's first rows, the eager step and the pass use
        # them in place, without gathering and scattering the states
        requests = sorted((r for r in self._rows if not r.done), key=lambda r: r.slot)
        if not requests:
            return
        drafts, q_rows, verify = self.speculation.propose(requests, self._generator)
        if not verify:
            self._plain_round(requests)
            return
        processors = self._processors(requests, len(requests))
        results = self.speculation.verify(requests, drafts, q_rows, processors, self.engine.history)
        self._stepped_last = False
        self.steps += 1
        self.peak_batch = max(self.peak_batch, len(requests))
        for request, (tokens, logprob_rows) in zip(requests, results):
            for token, row in zip(tokens, logprob_rows or [None] * len(tokens)):
                wanted = row is not None and not request.done
                self._accept(request, token, token_logprob(token, *row, request.params.logprobs) if wanted else None)

    def _plain_round(self, requests: list[Request]) -> None:
        """The decoding step of the plain scheduler over ``requests`` (captured on the GPU), its
        tokens handed out at once. The bucket stays assigned while the same requests step (as the
        plain scheduler's does between rebuilds), its tokens while no pass ran between steps."""
        n = len(requests)
        same = len(requests) == len(self._stepping) and all(a is b for a, b in zip(requests, self._stepping))
        if not same:
            bucket = self.engine.bucket(n)
            self.engine.assign(bucket, self._device_long([r.slot for r in requests]))
            bucket.temperature[:n], bucket.top_k[:n], bucket.top_p[:n] = self._sampling_rows(requests)
            self._bucket, self._stepping = bucket, list(requests)
        if not (same and self._stepped_last):
            self._bucket.tokens[:n] = self._device_long(self.speculation.last_tokens(requests))
        self._bucket.finished[:n] = False
        self._bucket.processors = self._processors(requests, self._bucket.size)
        self._rows = requests
        read = self._launch_step()
        self._stepped_last = True
        self.speculation.stepped(requests, read.tokens.values())
        self._accept_all(read.rows, read.tokens, read.logprobs)

    def _join_speculating(self, joined: list[Request], first_tokens) -> None:
        """Hand out the first tokens of the requests that joined; those still going decode from now on."""
        if joined:
            tokens, logprobs = first_tokens
            self._accept_all(joined, _HostCopy(tokens), logprobs)
            for request, token in zip(joined, tokens.tolist()):
                if not request.done:
                    self.speculation.join(request, token)
        self._rows = [r for r in self._rows + joined if not r.done]

    def _fill_noise(self, noise: torch.Tensor) -> None:
        noise.exponential_(generator=self._generator)
        for row, request in enumerate(self._rows):
            if request.generator is not None:
                noise[row].exponential_(generator=request.generator)

    # -- tokens to text and ends --------------------------------------------------------------------
    def _deliver(self, read: _Read) -> None:
        if read.first_tokens is not None:
            self._accept_all(read.joined, read.first_tokens, read.first_logprobs)
        self._accept_all(read.rows, read.tokens, read.logprobs)

    def _accept_all(self, requests: list[Request], tokens: _HostCopy, logprobs: _HostLogprobs | None) -> None:
        rows = logprobs.rows() if logprobs is not None else itertools.repeat(None)
        for request, token, row in zip(requests, tokens.values(), rows):
            wanted = row is not None and request.params.logprobs is not None
            self._accept(request, token, token_logprob(token, *row, request.params.logprobs) if wanted else None)

    def _accept(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> None:
        if request.done:
            return
        if request.cancelled:
            self._finish(request, "cancelled")
            return
        request.tokens.append(token)
        self.generated += 1
        logprobs = [logprob] if logprob is not None else []
        try:
            reason = self._end_reason(request, token)
            if reason is not None:
                self._finish(request, reason, logprobs)
            else:
                request.on_event(request, TokenEvent(request.text.ready() if request.text else "", logprobs=logprobs))
        except Exception:  # one request's text (a tokenizer that cannot decode a token) must not end the others
            logger.exception("efla serve: a request's text failed")
            self._fail(request, "internal error while decoding the text (see the server log)")

    def _end_reason(self, request: Request, token: int) -> str | None:
        if (token in self._stop_set and not request.params.ignore_eos) or token in request.params.stop_token_ids:
            return "stop"
        if request.text is not None:
            request.text.add(token)
            if request.text.stopped:
                return "stop"
        return "length" if len(request.tokens) >= request.params.max_tokens else None

    def _finish(self, request: Request, reason: str, logprobs: list[TokenLogprob] | None = None) -> None:
        rest = request.text.finish(self._text_tokens(request)) if request.text is not None and reason != "cancelled" else ""
        self._release(request)
        if reason == "cancelled":
            self.cancelled += 1
        else:
            self.served += 1
        event = FinishEvent(rest, reason, len(request.prompt), len(request.tokens), logprobs or [])
        request.on_event(request, event)

    @staticmethod
    def _text_tokens(request: Request) -> list[int]:
        """The tokens whose text the request returns: a stop token of its own is not shown."""
        if request.tokens and request.tokens[-1] in request.params.stop_token_ids:
            return request.tokens[:-1]
        return request.tokens

    def _fail(self, request: Request, message: str) -> None:
        self._release(request)
        request.on_event(request, ErrorEvent(message))

    def _release(self, request: Request) -> None:
        """The request is done; its slot takes the next request (a device step still using it is
        queued before anything the next request writes there)."""
        request.done = True
        if request.slot is not None:
            if self.speculation is not None:
                self.speculation.leave(request.slot)
            self._free_slots.append(request.slot)
            request.slot = None
            with self._cond:
                self._holding -= 1

    # -- admission and prefill ----------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        if not self._cancellations:
            return
        with self._cond:
            self._cancellations = False
            waiting = [r for r in self._waiting if r.cancelled]
            if waiting:
                self._waiting = deque(r for r in self._waiting if not r.cancelled)
        for request in itertools.chain(waiting, self._prefilling, self._forked, self._rows):
            if request.cancelled and not request.done:
                self._finish(request, "cancelled")
        for request in self._forked:  # their state would come from a cancelled request's prefill
            if request.fork_of.done and not request.done:
                self._finish(request, "cancelled")
        self._prefilling = [r for r in self._prefilling if not r.done]
        self._forked = [r for r in self._forked if not r.done]

    def _end_all_now(self) -> None:
        if self._ending is None:
            return
        with self._cond:
            reason, self._ending = self._ending, None
            waiting, self._waiting = list(self._waiting), deque()
        for request in itertools.chain(waiting, self._prefilling, self._forked, self._rows):
            if not request.done:
                self._finish(request, reason)
        self._prefilling, self._forked = [], []

    def _admit(self) -> None:
        """Waiting requests into free slots, first come first served: a request with its forks when
        there is a slot for each; one of ``max_tokens = 0`` scored and ended at once."""
        while True:
            with self._cond:
                if not self._waiting:
                    return
                first = self._waiting[0]
                group = [first, *(f for f in first.forks if not f.done)] if first.params.max_tokens else []
                if len(group) > len(self._free_slots):
                    return
                admitted = [self._waiting.popleft() for _ in range(1 + sum(r.fork_of is first for r in self._waiting))]
                self._holding += len(group)
            for request in group:
                request.slot = self._free_slots.pop()
                if request.params.seed is not None and request.params.temperature > 0:
                    request.generator = torch.Generator(device=self.engine.device)
                    request.generator.manual_seed(request.params.seed)
                if uses_processors(request.params):
                    self.engine.slot_history().start(request.slot, request.prompt, request.params.logit_bias)
                if request.params.grammar is not None:
                    request.matcher = new_matcher(request.params.grammar)
            if not self._score_prompt(first, admitted):
                continue
            if not group:
                self._finish(first, "length")
                continue
            self._start_from_prefix(first)
            self._prefilling.append(first)
            self._forked += group[1:]

    def _score_prompt(self, first: Request, admitted: list[Request]) -> bool:
        """The prompt's log-probabilities for ``admitted`` (a request and its forks), when asked for;
        ``False``: scoring failed and they ended with an error."""
        if first.params.prompt_logprobs is None:
            return True
        try:
            scored = prompt_logprobs(self.engine, first.prompt, first.params.prompt_logprobs)
        except Exception:  # one prompt (too long for the memory left) must not end the others
            logger.exception("efla serve: scoring a prompt failed")
            for request in admitted:
                self._fail(request, "internal error while scoring the prompt (see the server log)")
            return False
        for request in admitted:
            request.prompt_logprobs = scored
        return True

    def _start_from_prefix(self, request: Request) -> None:
        if self.prefix_cache is None:
            return
        request.block_keys = self.prefix_cache.block_keys(request.prompt)
        hit = self.prefix_cache.lookup(request.prompt, request.block_keys)
        if hit.length:
            restore_row(self.engine.cache, request.slot, hit.state)
            request.prefilled = hit.length
        request.save_points = self.prefix_cache.save_points(request.block_keys, request.prefilled)

    def _prefill_due(self) -> bool:
        """Whether this iteration prefills: when prompts wait and nothing decodes, fewer than half the
        slots decode, or ``prefill_every`` decoding steps passed since the last prefill."""
        if not self._prefilling:
            return False
        return 2 * len(self._rows) < self.max_batch or self.steps - self._last_prefill_step >= self.prefill_every

    def _prefill(self) -> tuple[list[Request], tuple[torch.Tensor, _HostLogprobs | None] | None]:
        """Run this iteration's prefill; the requests whose prompt is complete and their first tokens."""
        self._last_prefill_step, self.prefill_calls = self.steps, self.prefill_calls + 1
        complete, logits = [], []
        if self.hybrid:
            rounds, run = plan_rounds(self._prefilling, self.prefill_chunk), run_round
        else:
            rounds, run = [plan_rows(self._prefilling, self.engine, self.prefill_chunk)], run_rows
        for pieces in rounds:
            for piece, piece_logits in zip(pieces, run(self.engine, pieces)):
                request = piece.request
                request.prefilled = piece.end
                self.prompt_tokens_prefilled += piece.end - piece.start
                if piece.end in request.save_points:
                    self._save_prefix(request, piece.end)
                if piece_logits is not None:
                    for joining in (request, *self._start_forks(request)):
                        complete.append(joining)
                        logits.append(piece_logits)
        if not complete:
            return [], None
        self._prefilling = [r for r in self._prefilling if r.prefilled < len(r.prompt)]
        return complete, self._first_tokens(complete, torch.stack(logits))

    def _start_forks(self, request: Request) -> list[Request]:
        """The forks of ``request``, whose prompt is prefilled, each with a copy of its state."""
        forks = [f for f in self._forked if f.fork_of is request]
        for fork in forks:
            copy_row(self.engine.cache, request.slot, fork.slot)
            fork.prefilled = len(fork.prompt)
        self._forked = [f for f in self._forked if f.fork_of is not request]
        return forks

    def _save_prefix(self, request: Request, length: int) -> None:
        key = request.block_keys[length // self.prefix_cache.block - 1]
        self.prefix_cache.put(request.prompt[:length], key, snapshot_row(self.engine.cache, request.slot))

    def _first_tokens(self, requests: list[Request], logits: torch.Tensor) -> tuple[torch.Tensor, _HostLogprobs | None]:
        """The first new token of each request, and their log-probabilities when some request asked."""
        processors = self._processors(requests, len(requests))
        if processors is not None:
            slots = self._device_long([r.slot for r in requests])
            processors.constrain(self.vocab, self.engine.device)
            chosen_from = processors.apply(logits, self.engine.history, slots)
        else:
            chosen_from = logits
        if not any(r.params.temperature > 0 for r in requests):
            tokens = chosen_from.argmax(-1)
        else:
            temperature, top_k, top_p = self._sampling_rows(requests)
            noise = torch.empty_like(logits).exponential_(generator=self._generator)
            for row, request in enumerate(requests):
                if request.generator is not None:
                    noise[row].exponential_(generator=request.generator)
            tokens = choose_tokens(chosen_from, temperature, top_k, top_p, noise)
        if processors is not None:
            self.engine.history.record(slots, tokens, processors.active)
        return tokens, _HostLogprobs(*logprobs_of(logits, tokens)) if _wants_logprobs(requests) else None

    def _processors(self, requests: list[Request], rows: int) -> RowProcessors | None:
        """The logit processors of ``requests`` as the first of ``rows`` rows (``None``: none has any)."""
        if not any(uses_processors(r.params) for r in requests):
            return None
        return RowProcessors.of(requests, rows, self.vocab, self.stop_tokens, self.engine.device)

    # -- the decoding batch -------------------------------------------------------------------------
    def _rebuild(self, joined: list[Request], first_tokens: tuple[torch.Tensor, _HostLogprobs | None] | None) -> None:
        """The bucket of the requests still decoding (their last tokens and stop flags carried over on
        the device) followed by those that joined (their first tokens)."""
        kept = [r for r in self._rows if not r.done]
        rows = kept + joined
        if kept:
            old_rows = self._device_long([r.row for r in kept])
            carried_tokens, carried_finished = self._bucket.tokens[old_rows], self._bucket.finished[old_rows]
        self._rows, self._bucket = rows, None
        if not rows:
            return
        bucket = self.engine.bucket(len(rows))
        self.engine.assign(bucket, self._device_long([r.slot for r in rows]))
        k, n = len(kept), len(rows)
        if kept:
            bucket.tokens[:k] = carried_tokens
            bucket.finished[:k] = carried_finished
        if joined:
            tokens, logprobs = first_tokens
            bucket.tokens[k:n] = tokens
            keeps_going = self._device([r.params.ignore_eos for r in joined], torch.bool)
            bucket.finished[k:n] = self.engine.is_stop_token(tokens) & ~keeps_going
            self._joined = (joined, _HostCopy(tokens), logprobs)
        temperature, top_k, top_p = self._sampling_rows(rows)
        bucket.temperature[:n], bucket.top_k[:n], bucket.top_p[:n] = temperature, top_k, top_p
        for row, request in enumerate(rows):
            request.row = row
        bucket.processors = self._processors(rows, bucket.size)
        self._bucket = bucket

    def _sampling_rows(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        params = [r.params for r in requests]
        return (
            self._device([p.temperature for p in params], torch.float32),
            self._device_long([p.top_k for p in params]),
            self._device([p.top_p for p in params], torch.float32),
        )

    def _device_long(self, values: list[int]) -> torch.Tensor:
        return to_device(values, torch.long, self.engine.device)

    def _device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.engine.device)

    # -- failures and shutdown ----------------------------------------------------------------------
    def _fail_active(self, message: str) -> None:
        pending = self._pending.rows + self._pending.joined if self._pending else []
        joined = self._joined[0] if self._joined else []
        for request in itertools.chain(self._prefilling, self._forked, self._rows, pending, joined):
            if not request.done:
                self._fail(request, message)
        self._prefilling, self._forked, self._rows, self._bucket, self._pending, self._joined = [], [], [], None, None, None
        self._stepping, self._stepped_last = [], False

    def _shut_down(self) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            request.done = True
            request.on_event(request, ErrorEvent("the server is shutting down"))
        self._fail_active("the server is shutting down")
