"""Context parallelism: one sequence split into contiguous parts over the ranks of a process group.

Every rule's state passes from token to token linearly, so a part of the sequence maps the state
entering it to the state leaving it affinely, ``S_out = P S_in + H`` per head: ``P`` (``K x K``) is
the product of the part's transitions (decays included) and ``H`` the state the part reaches from
zero. Each rank runs the public op on its own part (once, or twice when its first document began
on a lower rank), then exchanges one ``(P, H)`` per head:

1. the op with the documents' own initial states (zero for a document begun on a lower rank)
   gives the outputs ``o_A`` and the states ``H``;
2. only when the rank's first document began on a lower rank: the op on that document's tokens
   with ``v = 0`` (width ``K``) and ``initial_state = I`` gives ``P`` (the write term is linear in
   ``v``, so no write happens: the states are exactly the transition products) and the read-outs
   ``o_P = scale * P_t^T q_t``;
3. ``(P, H)`` of the rank's last document goes to every rank (an autograd-aware all-gather); a rank
   folds those of the lower ranks into its incoming state ``S_in`` (a document boundary inside a
   rank resets the chain: that rank sends ``P = 0``);
4. the first document's outputs and final state become ``o_A + o_P S_in`` and ``H + P S_in``.

Outputs, states and all gradients equal the single-process op's up to rounding. Only the public ops
and ``torch.distributed`` collectives are used, so a CUDA tensor takes the GPU kernels and the same
code runs with NCCL or gloo.

Every rank must back-propagate through its outputs: the backward of the exchange is a collective.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from efla.ops.cuda.key_checks import immediate_key_checks

__all__ = [
    "ShardLayout",
    "shard_layout",
    "shard",
    "context_parallel",
    "conv_histories",
    "ContextParallel",
    "context_parallel_scope",
    "current_context",
    "context_parallel_aware",
    "context_parallel_conv_states",
    "recompute_in_scope",
]


# -- where each rank's part lies --------------------------------------------------------------------


@dataclass(frozen=True)
class ShardLayout:
    """One rank's contiguous part of a sequence of ``T`` tokens (along dim 1).

    ``bounds``: the ``world_size + 1`` token offsets of all parts. ``documents``: the full sequence's
    ``cu_seqlens`` for packed input (``B == 1``), or ``None`` when every batch row is one document.
    """

    rank: int
    bounds: tuple[int, ...]
    documents: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def length(self) -> int:
        return self.end - self.start

    def _document_start(self, position: int) -> int:
        if self.documents is None:
            return 0
        return self.documents[bisect.bisect_right(self.documents, position) - 1]

    @property
    def continues_previous(self) -> bool:
        """Whether this part's first document began on a lower rank."""
        return self.start > 0 and self._document_start(self.start) != self.start

    @property
    def history_length(self) -> int:
        """Tokens of this part's first document that lie on lower ranks."""
        return self.start - self._document_start(self.start)

    @property
    def local_offsets(self) -> tuple[int, ...] | None:
        """``cu_seqlens`` of this part (its pieces of documents), or ``None`` without documents."""
        if self.documents is None:
            return None
        inner = [d - self.start for d in self.documents if self.start < d < self.end]
        return (0, *inner, self.length)

    def local_cu_seqlens(self, device=None) -> torch.Tensor | None:
        offsets = self.local_offsets
        return None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=device)

    @property
    def document_rows(self) -> slice:
        """Rows of the full sequence's per-document states (``initial_state`` / final states) that
        belong to this part's pieces, in order."""
        if self.documents is None:
            return slice(None)
        first = bisect.bisect_right(self.documents, self.start) - 1
        return slice(first, first + len(self.local_offsets) - 1)


def _as_offsets(cu_seqlens) -> tuple[int, ...] | None:
    if cu_seqlens is None:
        return None
    values = cu_seqlens.detach().cpu().tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    return tuple(int(c) for c in values)


def shard_layout(total_length: int, world_size: int, rank: int, cu_seqlens=None) -> ShardLayout:
    """Split ``total_length`` tokens into ``world_size`` contiguous parts of near-equal length.

    ``cu_seqlens`` (tensor or sequence, packed input) gives the document boundaries; a document may
    span any number of parts.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got {rank}, {world_size}")
    if total_length < world_size:
        raise ValueError(f"total_length: {total_length} tokens cannot give each of {world_size} ranks a token")
    documents = _as_offsets(cu_seqlens)
    if documents is not None and (
        documents[0] != 0 or documents[-1] != total_length or any(b <= a for a, b in zip(documents, documents[1:]))
    ):
        raise ValueError(f"cu_seqlens: expected increasing offsets from 0 to {total_length}, got {documents}")
    bounds = tuple(i * total_length // world_size for i in range(world_size + 1))
    return ShardLayout(rank=rank, bounds=bounds, documents=documents)


def shard(x: torch.Tensor, layout: ShardLayout, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the token dim; 1 in the ``[B, T, ...]`` layout)."""
    return x.narrow(dim, layout.start, layout.length)


# -- autograd-aware collectives ---------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    """Stack every rank's ``x`` (same shape) into ``[world, ...]``; the gradient of a rank's ``x``
    is the sum over ranks of the gradients of its slot."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(mine, grad, group=ctx.group)
            return mine, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return _AllGather.apply(x, group)


class _DependOn(torch.autograd.Function):
    """``x`` unchanged, with ``anchor`` in its graph (zero gradient): a rank that does not use the
    exchanged tensors still takes part in the exchange's backward collective."""

    @staticmethod
    def forward(ctx, x, anchor):
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


def _depend_on(x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    return _DependOn.apply(x, anchor)


# -- the op over parts ------------------------------------------------------------------------------


def _check_layout(layout: ShardLayout, group, q: torch.Tensor, cu_seqlens) -> None:
    if layout.world_size != dist.get_world_size(group) or layout.rank != dist.get_rank(group):
        raise ValueError(
            f"layout: made for rank {layout.rank} of {layout.world_size}, but this is rank "
            f"{dist.get_rank(group)} of {dist.get_world_size(group)} in the group"
        )
    if q.shape[1] != layout.length:
        raise ValueError(f"q: expected {layout.length} tokens (this rank's part), got shape {tuple(q.shape)}")
    if layout.documents is not None and q.shape[0] != 1:
        raise ValueError(f"q: packed documents need batch size 1, got shape {tuple(q.shape)}")
    if cu_seqlens is not None and _as_offsets(cu_seqlens) != layout.local_offsets:
        raise ValueError(f"cu_seqlens: expected this rank's offsets {layout.local_offsets}, got {_as_offsets(cu_seqlens)}")


def _first_piece(args: Sequence[torch.Tensor], layout: ShardLayout):
    """The inputs of the rank's first piece (a document's part), and its ``cu_seqlens``."""
    offsets = layout.local_offsets
    if offsets is None:
        return list(args), None
    n = offsets[1]
    return [a[:, :n] for a in args], torch.tensor([0, n], dtype=torch.int32, device=args[0].device)


def _transition_pass(op, args, layout, scale):
    """``(o_P, P)`` of the first piece: the op with zero values of width K from the identity."""
    first, cu = _first_piece(args, layout)
    q, k, v = first[0], first[1], first[2]
    B, HV, K = q.shape[0], v.shape[2], q.shape[3]  # one state per value head (grouped values)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=state_dtype, device=q.device).expand(B, HV, K, K).contiguous()
    zero_v = v.new_zeros(*v.shape[:-1], K)
    return op(q, k, zero_v, *first[3:], scale=scale, initial_state=eye, output_final_state=True, cu_seqlens=cu)


def _own_initial_state(initial_state, layout: ShardLayout):
    """The op's initial states on this part: a document begun on a lower rank starts from zero here."""
    if initial_state is None or not layout.continues_previous:
        return initial_state
    if layout.documents is None:
        return None
    return torch.cat([torch.zeros_like(initial_state[:1]), initial_state[1:]])


def _outgoing(states, transition, layout: ShardLayout):
    """``(P, H)`` of the rank's last piece as one tensor ``[C, H, K, K + V]``."""
    last = states if layout.documents is None else states[-1:]
    single_piece = layout.documents is None or len(layout.local_offsets) == 2
    if transition is not None and single_piece:
        P = transition
    else:  # the last piece starts here: whatever enters the rank does not reach its end
        P = last.new_zeros(*last.shape[:-1], last.shape[-2])
    return torch.cat([P.to(last.dtype), last], dim=-1)


def _incoming(gathered: torch.Tensor, rank: int, K: int) -> torch.Tensor | None:
    """Fold the lower ranks' ``(P, H)`` into the state entering ``rank``."""
    if rank == 0:
        return None
    state = gathered[0][..., K:]
    for j in range(1, rank):
        P, H = gathered[j][..., :K], gathered[j][..., K:]
        state = P @ state + H
    return state


def _apply_incoming(o, states, o_P, P, S_in):
    """Add the incoming state's contribution to the first piece's outputs and final state."""
    correction = torch.einsum("bthk,bhkv->bthv", o_P.to(S_in.dtype), S_in)
    n = o_P.shape[1]
    o_first = (o[:, :n].to(S_in.dtype) + correction).to(o.dtype)
    o = o_first if n == o.shape[1] else torch.cat([o_first, o[:, n:]], dim=1)
    first_rows = P.shape[0]
    states_first = states[:first_rows] + P @ S_in
    states = states_first if first_rows == states.shape[0] else torch.cat([states_first, states[first_rows:]])
    return o, states


def context_parallel(
    op: Callable,
    *args: torch.Tensor,
    layout: ShardLayout,
    group=None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Run ``op`` (any ``efla.ops`` function) on this rank's part of a sequence split over ``group``.

    Args:
        op: e.g. ``chunk_efla`` or ``chunk_gated_efla`` (the recurrent ops work too).
        *args: this rank's part of the op's tensors, in its order: ``q, k, v, beta`` or
            ``q, k, v, g, beta`` (``[B, T_part, ...]``; see :func:`shard`).
        layout: this rank's :class:`ShardLayout` (from :func:`shard_layout`).
        group: the process group the sequence is split over (default: the whole world).
        scale: read-out scale (``None``: ``K ** -0.5``).
        initial_state: per piece of this part (``[B, HV, K, V]``, or ``[pieces, HV, K, V]`` with
            documents; ``full[layout.document_rows]`` of the full sequence's states): the entry of
            a document begun on a lower rank is not used (its state comes from there).
        output_final_state: also return the state after each piece of this part (a document's
            final state where the document ends on this rank).
        cu_seqlens: optional; when given it must equal ``layout.local_cu_seqlens()``.

    Returns:
        ``(o, final_state)`` for this part, equal to the single-process op's restricted to it.
    """
    group = group if group is not None else dist.group.WORLD
    q = args[0]
    _check_layout(layout, group, q, cu_seqlens)
    local_cu = layout.local_cu_seqlens(q.device)

    def local_passes():
        o, states = op(
            *args,
            scale=scale,
            initial_state=_own_initial_state(initial_state, layout),
            output_final_state=True,
            cu_seqlens=local_cu,
        )
        o_P, P = _transition_pass(op, args, layout, scale) if layout.continues_previous else (None, None)
        return o, states, o_P, P

    o, states, o_P, P = _on_every_rank_or_none(local_passes, group, q.device)
    gathered = _all_gather(_outgoing(states, P, layout), group)
    with torch.autocast(q.device.type, enabled=False):  # the state algebra stays in the states' dtype
        S_in = _incoming(gathered, layout.rank, q.shape[-1])
        if S_in is not None and layout.continues_previous:
            o, states = _apply_incoming(o, states, o_P, P, S_in)
    o = _depend_on(o, gathered)
    final = _depend_on(states, gathered) if output_final_state else None
    return o, final


def _on_every_rank_or_none(fn, group, device):
    """``fn()``, or a ``ValueError`` on every rank when ``fn`` raised one on any: a rank that refused
    its part of the inputs alone would leave the others waiting in the exchange that follows."""
    error = None
    try:
        with immediate_key_checks():  # a model's deferred check would raise after the exchange, on this rank alone
            result = fn()
    except ValueError as e:
        error, result = e, None
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise ValueError("another rank of the context-parallel group refused its part of the inputs")
    return result


# -- short-convolution history ----------------------------------------------------------------------


def _tails(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` tokens of ``x [B, T, D]``, zero-padded on the left when ``T < width``."""
    tail = x[:, -width:]
    missing = width - tail.shape[1]
    if missing:
        tail = torch.cat([tail.new_zeros(tail.shape[0], missing, tail.shape[2]), tail], dim=1)
    return tail


def _history(gathered: torch.Tensor, layout: ShardLayout, width: int) -> torch.Tensor:
    """``[B, width, D]``: the tokens of this part's first document just before it (zeros before the
    document start), from the lower ranks' tails ``gathered [world, B, width, D]``."""
    needed = min(width, layout.history_length)
    pieces, have = [], 0
    for j in range(layout.rank - 1, -1, -1):
        if have >= needed:
            break
        valid = min(width, layout.bounds[j + 1] - layout.bounds[j])
        pieces.insert(0, gathered[j][:, width - valid :])
        have += valid
    zeros = gathered.new_zeros(gathered.shape[1], width, gathered.shape[3])
    if needed == 0:
        return zeros
    recent = torch.cat(pieces, dim=1)[:, -needed:]
    return torch.cat([zeros[:, : width - needed], recent], dim=1)


def conv_histories(xs: Sequence[torch.Tensor], width: int, layout: ShardLayout, group=None) -> list[torch.Tensor]:
    """Short-convolution caches that continue each ``x`` (``[B, T_part, D_i]``, the convolution
    inputs of this rank's part) from the lower ranks: ``[pieces, D_i, width]`` per ``x``, the last
    ``width`` inputs of the same document before this part (oldest first, zeros before the document
    start; all zeros for pieces that start here). One all-gather for all of ``xs``."""
    group = group if group is not None else dist.group.WORLD
    sizes = [x.shape[-1] for x in xs]
    gathered = _all_gather(torch.cat([_tails(x, width) for x in xs], dim=-1), group)
    history = _depend_on(_history(gathered, layout, width), gathered).transpose(1, 2)  # [B, D, width]
    pieces = 1 if layout.local_offsets is None else len(layout.local_offsets) - 1
    if pieces > 1:
        history = torch.cat([history, history.new_zeros(pieces - 1, *history.shape[1:])])
    return list(torch.split(history, sizes, dim=1))


# -- a scope the token mixers consult ---------------------------------------------------------------


@dataclass
class ContextParallel:
    """An active split: the layout and group, and counters of the calls routed through it."""

    layout: ShardLayout
    group: object = None
    op_calls: int = 0
    conv_calls: int = 0

    def run(
        self, op: Callable, *args, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **per_token_options
    ):
        # per-token options (the in-op q/k normalisation) act on every op call of the split alike
        self.op_calls += 1
        if per_token_options:
            op = functools.partial(op, **per_token_options)
        return context_parallel(
            op,
            *args,
            layout=self.layout,
            group=self.group,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
        )

    def conv_states(self, xs: Sequence[torch.Tensor], width: int) -> tuple[torch.Tensor, ...]:
        self.conv_calls += 1
        return tuple(conv_histories(xs, width, self.layout, self.group))


_active = threading.local()


def current_context() -> ContextParallel | None:
    """The :class:`ContextParallel` of the innermost :func:`context_parallel_scope`, or ``None``."""
    return getattr(_active, "context", None)


@contextlib.contextmanager
def context_parallel_scope(layout: ShardLayout, group=None):
    """Within the block, :func:`context_parallel_aware` ops and :func:`context_parallel_conv_states`
    run over ``layout``'s part (this thread only). Yields the :class:`ContextParallel`."""
    with _reopened(ContextParallel(layout=layout, group=group)) as context:
        yield context


def recompute_in_scope() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` for ``torch.utils.checkpoint`` (non-reentrant): a checkpointed block's
    recomputation runs in the split that was open when the block ran forward. Autograd recomputes
    during the backward, outside any scope (and, on the GPU, on a thread of its own), so without it
    the recomputed block would run its part as a whole sequence. Every rank recomputes its blocks in
    the order of the backward, so the exchanges of the recomputed ops and convolution caches meet."""
    return contextlib.nullcontext(), _reopened(current_context())


@contextlib.contextmanager
def _reopened(context: ContextParallel | None):
    previous = current_context()
    _active.context = context
    try:
        yield context
    finally:
        _active.context = previous


def context_parallel_inactive() -> bool:
    """Whether no :func:`context_parallel_scope` is open (ops run over the whole sequence)."""
    return current_context() is None


def context_parallel_aware(op: Callable) -> Callable:
    """``op`` itself, or inside a :func:`context_parallel_scope` ``op`` run over the scope's part."""
    context = current_context()
    if context is None:
        return op

    def split_op(*args, **kwargs):
        return context.run(op, *args, **kwargs)

    return split_op


def context_parallel_conv_states(xs: Sequence[torch.Tensor], width: int) -> tuple[torch.Tensor, ...] | None:
    """Inside a :func:`context_parallel_scope`: the short-convolution caches of ``xs`` (see
    :func:`conv_histories`); otherwise ``None``."""
    context = current_context()
    return None if context is None else context.conv_states(xs, width)
