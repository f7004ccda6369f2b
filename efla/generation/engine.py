"""``DecodeEngine``: a model's decoding state allocated once, prefill into it, and a decoding step
that runs as one CUDA graph per batch bucket.

The state is an ``EFLACache`` pool (``EFLACache.for_model``): every layer's recurrent state,
convolution histories (and, for softmax-attention layers, key/value buffers) for ``capacity``
rows plus one scratch row, updated in place. A batch of ``B`` rows decodes in the bucket of the
next size up (8, 16, 32, ..., 256, then multiples of 256; see ``SMALLEST_GRAPH_BUCKET``; without
graphs exactly ``B``); bucket rows point at pool rows through
``cache.slots``, padding rows at the scratch row. One step (embedding, every layer, head, the
choice of the next token, the stop-token bookkeeping) reads and writes only the bucket's static
tensors, so on CUDA it is captured once per bucket (greedy and sampling apart) and replayed:
one launch per token instead of a few hundred, nothing allocated after capture, nothing read
back to the host.

A server prefills the same way: ``prefill_rows`` runs pieces of prompts as the rows of a
``PrefillBucket`` (padded on the right, each row continuing its pool row's state or starting
from zero), one CUDA graph per bucket shape, so a prefill call costs its GPU time instead of
Python launching a few hundred kernels (tens of milliseconds that every decoding request waits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from efla.cuda_graphs import capture
from efla.layers.single_step import refresh_stacked_weights
from efla.models.cache import EFLACache
from efla.ops.validate import unchecked_values

from .sampling import choose_tokens

__all__ = ["DecodeEngine", "Bucket", "PrefillBucket", "bucket_size", "engine_for", "release"]

MAX_STOP_TOKENS = 16
_POSITION_GRAIN = 1024  # attention buffers grow in steps of this many positions
_ENGINE_ATTR = "_efla_decode_engine"


# On an H200 cuBLAS multiplies 8 rows by a 1024 x 1024 bf16 weight in half the time it takes for
# one row (its one-row kernels use few SMs), so a captured 340M step is faster for 8 padded rows.
SMALLEST_GRAPH_BUCKET = 8


def bucket_size(batch: int, smallest: int = SMALLEST_GRAPH_BUCKET) -> int:
    """The padded batch a captured step runs at: the next power of two from ``smallest`` up to 256,
    then multiples of 256."""
    if batch < 1:
        raise ValueError(f"batch: expected at least one row, got {batch}")
    batch = max(batch, smallest)
    return 1 << (batch - 1).bit_length() if batch <= 256 else 256 * -(-batch // 256)


@dataclass
class Bucket:
    """The static tensors of one batch size: what a captured step reads and writes."""

    size: int
    slots: torch.Tensor  # [size] pool row of each batch row (the scratch row for padding)
    tokens: torch.Tensor  # [size] the last token of each row; the step replaces it with the next
    finished: torch.Tensor  # [size] rows that produced a stop token (they emit the pad token since)
    temperature: torch.Tensor  # [size] 0: greedy
    top_k: torch.Tensor  # [size] 0: off
    top_p: torch.Tensor  # [size] 1: off
    noise: torch.Tensor  # [size, vocab] Exp(1) draws of this step (sampling)
    graphs: dict = field(default_factory=dict)  # sampling (bool) -> captured step
    first_rows: bool = False  # slots are 0 .. size-1: an eager step may use the pool's rows as views


# Prefill buckets pad a piece to a power of two of at least this many tokens (fewer shapes to capture).
SMALLEST_PREFILL_LENGTH = 32


@dataclass
class PrefillBucket:
    """The static tensors of one prefill shape: ``rows`` pieces of prompts of at most ``length``
    tokens each, padded on the right."""

    rows: int
    length: int
    ids: torch.Tensor  # [rows, length] each row's tokens, then padding
    lengths: torch.Tensor  # [rows] real tokens of each row (unused rows: 1, on the scratch slot)
    slots: torch.Tensor  # [rows] pool row each row continues
    fresh: torch.Tensor  # [rows] rows that start from a zero state (a prompt's first piece)
    logits: torch.Tensor  # [rows, vocab] float32, each row's last real token's
    graph: torch.cuda.CUDAGraph | None = None


class DecodeEngine:
    """Decoding state and step of one model (see the module's doc). ``use_cuda_graph``: capture the
    step on CUDA (default: whenever the model is on CUDA); elsewhere the same step runs eagerly."""

    def __init__(self, model: torch.nn.Module, use_cuda_graph: bool | None = None):
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        weight = next(model.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        on_cuda = self.device.type == "cuda"
        self.use_graphs = on_cuda if use_cuda_graph is None else bool(use_cuda_graph) and on_cuda
        self.vocab = self.head.out_features
        self.smallest_bucket = SMALLEST_GRAPH_BUCKET
        self.needs_positions = bool(getattr(model.config, "attn", None))
        self.cache: EFLACache | None = None
        self.capacity, self.max_length = 0, None
        self.buckets: dict[int, Bucket] = {}
        self.prefill_buckets: dict[tuple[int, int], PrefillBucket] = {}
        self.stop_tokens = torch.full((MAX_STOP_TOKENS,), -1, dtype=torch.long, device=self.device)
        self.pad_token = torch.zeros((), dtype=torch.long, device=self.device)
        self.memory_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._weights = self._weights_key()
        self._views = None  # (rows, cache over the pool's first rows) of the eager step

    # -- the pool and the buckets -------------------------------------------------------------------
    @property
    def scratch_slot(self) -> int:
        return self.capacity

    def reserve(self, slots: int, max_length: int | None = None) -> None:
        """Make room for ``slots`` rows (and, with attention layers, ``max_length`` positions each);
        a larger pool replaces the old one, whose states and captured steps are dropped."""
        length = max_length if self.needs_positions else None
        if self.cache is not None and slots <= self.capacity and (length is None or length <= self.max_length):
            return
        capacity = max(slots, self.capacity)
        if length is not None:
            length = _POSITION_GRAIN * -(-max(length, self.max_length or 0) // _POSITION_GRAIN)
        self.cache, self.buckets, self.prefill_buckets, self._views = None, {}, {}, None
        self._new_graph_pool()
        self.cache = EFLACache.for_model(self.model, capacity + 1, length)
        self.capacity, self.max_length = capacity, length

    def bucket_size(self, batch: int) -> int:
        """The rows of the bucket that runs ``batch`` rows: padded (``bucket_size``) with graphs,
        exactly ``batch`` without (no padding to compute)."""
        return bucket_size(batch, self.smallest_bucket) if self.use_graphs else batch

    def bucket(self, batch: int) -> Bucket:
        """The bucket that runs ``batch`` rows (made on first use, every row on the scratch slot)."""
        size = self.bucket_size(batch)
        if size not in self.buckets:
            dev = self.device
            self.buckets[size] = Bucket(
                size=size,
                slots=torch.full((size,), self.scratch_slot, dtype=torch.long, device=dev),
                tokens=torch.zeros(size, dtype=torch.long, device=dev),
                finished=torch.zeros(size, dtype=torch.bool, device=dev),
                temperature=torch.zeros(size, device=dev),
                top_k=torch.zeros(size, dtype=torch.long, device=dev),
                top_p=torch.ones(size, device=dev),
                noise=torch.ones(size, self.vocab, device=dev),
            )
        return self.buckets[size]

    def assign(self, bucket: Bucket, slots: torch.Tensor) -> None:
        """Bucket rows ``0 .. len(slots)-1`` decode pool rows ``slots``; the rest of the bucket pads
        on the scratch row (and counts as finished, so it never holds up the stop check)."""
        n = len(slots)
        bucket.slots.fill_(self.scratch_slot)
        bucket.slots[:n] = slots
        bucket.finished.fill_(True)
        bucket.first_rows = not self.use_graphs and n == bucket.size and torch.equal(slots.cpu(), torch.arange(n))
        self._views = None

    def set_stop_tokens(self, stop_tokens: list[int], pad_token: int) -> None:
        if len(stop_tokens) > MAX_STOP_TOKENS:
            raise ValueError(f"eos_token_id: at most {MAX_STOP_TOKENS} stop tokens, got {len(stop_tokens)}")
        self.stop_tokens.fill_(-1)
        if stop_tokens:
            self.stop_tokens[: len(stop_tokens)] = torch.tensor(stop_tokens, dtype=torch.long)
        self.pad_token.fill_(int(pad_token))

    def is_stop_token(self, tokens: torch.Tensor) -> torch.Tensor:
        # a comparison, not torch.isin, which cannot be captured in a CUDA graph
        return (tokens[..., None] == self.stop_tokens).any(-1)

    def check_weights(self) -> None:
        """Captured steps read the weights where they were: drop them if a weight moved, and
        refill the stacked projection weights of any weight changed in place."""
        key = self._weights_key()
        if key != self._weights:
            self._weights = key
            for bucket in self.buckets.values():
                bucket.graphs.clear()
            for prefill_bucket in self.prefill_buckets.values():
                prefill_bucket.graph = None
            self._new_graph_pool()
        refresh_stacked_weights(self.model)

    def _new_graph_pool(self) -> None:
        # a pool whose graphs are all gone is freed: new captures need a new one
        self.memory_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _weights_key(self) -> tuple:
        return tuple(p.data_ptr() for p in self.model.parameters())

    # -- prefill of whole prompts ----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """Run the prompts (1-D token tensors) packed in one sequence (``cu_seqlens``: the chunk
        kernels, no padding), write their final states into pool rows ``slots``, and return the
        logits of each prompt's last token, ``[N, vocab]`` float32."""
        lengths = torch.tensor([len(p) for p in prompts])
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(self.device)
        packed = torch.cat(list(prompts)).to(self.device)[None]
        out = self.decoder(input_ids=packed, cu_seqlens=cu_seqlens, use_cache=True)
        self.cache.write_slots(slots, _cache_of(out))
        last = out.last_hidden_state[0, cu_seqlens[1:] - 1]
        return self.head(last).float()

    # -- prefill of pieces of prompts into pool rows ---------------------------------------------------
    def prefill_shape(self, rows: int, length: int) -> tuple[int, int]:
        """The ``(rows, length)`` of the bucket that runs ``rows`` pieces of at most ``length`` tokens:
        powers of two (length at least ``SMALLEST_PREFILL_LENGTH``) with graphs, exact without."""
        if not self.use_graphs:
            return rows, length
        return 1 << (rows - 1).bit_length(), 1 << (max(length, SMALLEST_PREFILL_LENGTH) - 1).bit_length()

    def prefill_bucket(self, rows: int, length: int) -> PrefillBucket:
        """The bucket that runs ``rows`` pieces of at most ``length`` tokens (with graphs made on first
        use and kept with its graph; without, made for the call)."""
        if self.needs_positions:
            raise ValueError("prefill_rows: a model with softmax-attention layers prefills through prefill()")
        shape = self.prefill_shape(rows, length)
        bucket = self.prefill_buckets.get(shape)
        if bucket is None:
            r, n, dev = *shape, self.device
            bucket = PrefillBucket(
                r,
                n,
                ids=torch.zeros(r, n, dtype=torch.long, device=dev),
                lengths=torch.ones(r, dtype=torch.long, device=dev),
                slots=torch.full((r,), self.scratch_slot, dtype=torch.long, device=dev),
                fresh=torch.ones(r, dtype=torch.bool, device=dev),
                logits=torch.zeros(r, self.vocab, device=dev),
            )
            if self.use_graphs:
                self.prefill_buckets[shape] = bucket
        return bucket

    @torch.no_grad()
    def prefill_rows(self, pieces: list[list[int]], slots: list[int], fresh: list[bool]) -> torch.Tensor:
        """Run ``pieces`` (token ids) as the rows of one prefill bucket: piece ``i`` continues the state
        of pool row ``slots[i]`` (from zero where ``fresh[i]``) and leaves its new state there. Returns
        the logits of each piece's last token, ``[len(pieces), vocab]`` float32."""
        bucket = self.prefill_bucket(len(pieces), max(map(len, pieces)))
        if self.use_graphs and bucket.graph is None:  # before the inputs go in: capturing overwrites them
            bucket.graph = self._capture_prefill(bucket)
        n, scratch, padding_rows = len(pieces), self.scratch_slot, bucket.rows - len(pieces)
        rows = [piece + [0] * (bucket.length - len(piece)) for piece in pieces] + [[0] * bucket.length] * padding_rows
        for static, values in (
            (bucket.ids, torch.tensor(rows, dtype=torch.long)),
            (bucket.lengths, torch.tensor([len(p) for p in pieces] + [1] * padding_rows)),
            (bucket.slots, torch.tensor(list(slots) + [scratch] * padding_rows)),
            (bucket.fresh, torch.tensor(list(fresh) + [True] * padding_rows)),
        ):
            static.copy_(values.pin_memory() if self.device.type == "cuda" else values, non_blocking=True)
        if self.use_graphs:
            bucket.graph.replay()
        else:
            self._prefill_step(bucket)
        return bucket.logits[:n].clone()

    def capture_prefill(self, max_tokens: int, max_length: int) -> None:
        """Capture every prefill bucket of at most ``max_tokens`` tokens (rows times length) and rows of
        at most ``max_length`` tokens now; nothing without graphs."""
        if not self.use_graphs or self.needs_positions:
            return
        length = SMALLEST_PREFILL_LENGTH
        while length <= self.prefill_shape(1, max_length)[1]:
            rows = 1
            while rows == 1 or rows * length <= max_tokens:
                bucket = self.prefill_bucket(rows, length)
                if bucket.graph is None:
                    bucket.graph = self._capture_prefill(bucket)
                rows *= 2
            length *= 2

    def _prefill_step(self, bucket: PrefillBucket) -> None:
        cache = self.cache
        saved = cache.slots, cache.fresh_rows
        cache.slots, cache.fresh_rows = bucket.slots, bucket.fresh
        try:
            with unchecked_values():  # the model's own inputs: no value read back (none can be while captured)
                positions = torch.arange(bucket.length, device=self.device)
                mask = (positions < bucket.lengths[:, None]).long()
                hidden = self.decoder(
                    input_ids=bucket.ids, attention_mask=mask, past_key_values=cache, use_cache=True
                ).last_hidden_state
                rows = torch.arange(bucket.rows, device=self.device)
                last = hidden[rows, (bucket.lengths - 1).clamp(min=0)]
                bucket.logits.copy_(self.head(last).float())
        finally:
            cache.slots, cache.fresh_rows = saved

    def _capture_prefill(self, bucket: PrefillBucket) -> torch.cuda.CUDAGraph:
        """Warm the bucket's prefill up on a side stream with one token per row, every row on the
        scratch slot (so no live state moves and the padding path runs), then capture it."""
        bucket.slots.fill_(self.scratch_slot)
        bucket.lengths.fill_(1)
        bucket.fresh.fill_(True)
        return self._captured(lambda: self._prefill_step(bucket))

    def _captured(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph:
        with torch.no_grad(), torch.cuda.device(self.device):
            return capture(run, warmup=2, pool=self.memory_pool)[0]

    # -- decoding -------------------------------------------------------------------------------------
    @torch.no_grad()
    def start(
        self,
        bucket: Bucket,
        logits: torch.Tensor,
        generator: torch.Generator | None,
        fill_noise: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """Choose the first new token of the bucket's first ``len(logits)`` rows from the prefill's
        logits (the rows' slots and sampling settings already set); the noise as in ``step``."""
        n = logits.shape[0]
        noise = bucket.noise[:n]
        if bool((bucket.temperature[:n] > 0).any()):
            if fill_noise is not None:
                fill_noise(bucket.noise)
            else:
                noise.exponential_(generator=generator)
        tokens = choose_tokens(logits, bucket.temperature[:n], bucket.top_k[:n], bucket.top_p[:n], noise)
        bucket.tokens[:n] = tokens
        bucket.finished[:n] = self.is_stop_token(tokens)

    def step(
        self,
        bucket: Bucket,
        sampling: bool,
        generator: torch.Generator | None = None,
        fill_noise: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """One decoding step of the whole bucket: ``bucket.tokens`` becomes the next token. When
        sampling, the step's ``Exp(1)`` noise ``[size, vocab]`` is drawn from ``generator``, or by
        ``fill_noise(bucket.noise)`` (a server draws each request's row from its own generator, so a
        seeded request's tokens do not depend on its neighbours)."""
        if sampling and fill_noise is not None:
            fill_noise(bucket.noise)
        elif sampling:
            bucket.noise.exponential_(generator=generator)
        if not self.use_graphs:
            with torch.no_grad(), unchecked_values():  # the model's own activations (a GPU skips them too)
                self._step(bucket, sampling)
            return
        graph = bucket.graphs.get(sampling)
        if graph is None:
            graph = bucket.graphs[sampling] = self._capture(bucket, sampling)
        graph.replay()

    def capture_all(self, max_batch: int) -> None:
        """Capture the greedy and sampling steps of every bucket up to ``max_batch`` rows now (so no
        request of a server waits for a capture); nothing without graphs."""
        if not self.use_graphs:
            return
        for size in sorted({self.bucket_size(n) for n in range(1, max_batch + 1)}):
            bucket = self.bucket(size)
            for sampling in (False, True):
                if sampling not in bucket.graphs:
                    bucket.graphs[sampling] = self._capture(bucket, sampling)

    def _step(self, bucket: Bucket, sampling: bool) -> None:
        hidden = self.decoder(
            input_ids=bucket.tokens[:, None], past_key_values=self._step_cache(bucket), use_cache=True
        ).last_hidden_state
        logits = self.head(hidden[:, 0]).float()
        if sampling:
            tokens = choose_tokens(logits, bucket.temperature, bucket.top_k, bucket.top_p, bucket.noise)
        else:
            tokens = logits.argmax(-1)
        tokens = torch.where(bucket.finished, self.pad_token, tokens)
        bucket.finished |= self.is_stop_token(tokens)
        bucket.tokens.copy_(tokens)

    def _step_cache(self, bucket: Bucket) -> EFLACache:
        if not bucket.first_rows:
            self.cache.slots = bucket.slots
            return self.cache
        if self._views is None or self._views[0] != bucket.size:
            self._views = (bucket.size, self.cache.first_rows(bucket.size))
        return self._views[1]

    def _capture(self, bucket: Bucket, sampling: bool) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream (kernels compiled and tuned) with every row on the
        scratch slot, so no live state moves, then capture it."""
        saved = [t.clone() for t in (bucket.slots, bucket.tokens, bucket.finished)]
        bucket.slots.fill_(self.scratch_slot)
        graph = self._captured(lambda: self._step(bucket, sampling))
        for tensor, value in zip((bucket.slots, bucket.tokens, bucket.finished), saved):
            tensor.copy_(value)
        return graph


def _cache_of(out):
    return out.cache if hasattr(out, "cache") and out.cache is not None else out.past_key_values


def engine_for(model: torch.nn.Module, use_cuda_graph: bool | None = None) -> DecodeEngine:
    """The model's engine, made on first use and kept on the model (its state pool and captured
    steps stay allocated until ``release(model)``); a new one when the device, dtype or graph
    setting changed."""
    engine = model.__dict__.get(_ENGINE_ATTR)
    weight = next(model.parameters())
    wanted = weight.device.type == "cuda" if use_cuda_graph is None else bool(use_cuda_graph)
    if (
        engine is None
        or engine.device != weight.device
        or engine.dtype != weight.dtype
        or engine.use_graphs != (wanted and weight.device.type == "cuda")
    ):
        release(model)
        engine = model.__dict__[_ENGINE_ATTR] = DecodeEngine(model, use_cuda_graph)
    return engine


def release(model: torch.nn.Module) -> None:
    """Free the decoding state and captured steps that ``efla.generation`` keeps on ``model``."""
    model.__dict__.pop(_ENGINE_ATTR, None)
