"""Model-level training speed and memory on one GPU: efla presets vs flash-linear-attention's DeltaNet.

Every model of one size lives in one process; training steps (forward, loss, backward, fused AdamW
step; bf16 weights; random tokens) are taken in turn, one step per model per round, so all models
see the same machine state. Reported per model and shape:

* tokens/s: median over the measured steps (after warm-up steps that compile and autotune);
* peak memory: the model's own weights and optimizer state plus the largest amount of memory the
  step allocated above what was allocated before it (gradients, activations, logits), i.e. what
  the model would peak at alone in a process.

Models: ``fla``: ``fla.models.DeltaNetForCausalLM`` with its default fused settings and our preset's
sizes (same parameter count); ours: the ``<size>-efla``, ``-deltanet``, ``-gated-efla`` and
``-gated-deltanet`` presets as they are, ``efla+flce`` (``fuse_linear_cross_entropy=True``) and
``<preset>+compile`` (the preset under ``torch.compile(dynamic=False)``: one graph per shape, built in
the warm-up; a compile failure is that model's failed row) and ``<preset>-no-output-gate`` (a gated
preset with ``use_gate=False`` at the ungated preset's depth: the plain model plus the decay gate, so
its ratio to ``efla`` is what the gate's arithmetic costs), ``<preset>+fusedproj`` (its layers'
input projections as one matrix product, ``fuse_input_projections=True``, now the presets' default)
and ``<preset>+separateproj`` (one product per projection, the default before), ``<preset>+nokeycheck``
(the preset with ``EFLA_CHECK_KEYS=0`` during its steps: no device sync per layer call for the
overflowing-key check, so its ratio to the preset is what the check costs), ``<preset>+triton``
(``EFLA_DIRECT_LAUNCH=0`` during its steps: every launch of the ops through Triton's own launch path
instead of straight to the compiled kernel after the first; ``efla+triton`` runs by default),
``<preset>+tuned`` (``EFLA_STATE_TUNING=1``: the ops' state passes tuned per batch x heads) and
``<preset>+fusedfwd`` (``EFLA_FUSED_FORWARD=1``: the forward's state and output passes in one
kernel) and ``<preset>+split4`` (``EFLA_SPLIT_STATE=4``: the state pass over sequences in 4 pieces).

``<kind>+graph`` (e.g. ``efla+graph``; not run by default: ask for it with ``--models
fla,efla,efla+graph,efla+triton``) replays the whole step (forward with labels, backward, AdamW in its
capturable form) from a CUDA graph recorded once per shape with ``efla.cuda_graphs.capture``: the
host launches one graph instead of every kernel, so its ratio to the kind without ``+graph`` is what
the host's launches cost. Per shape, its first ``GRAPH_EAGER_STEPS`` steps run eagerly on a side
stream (Triton compiles and tunes there, AdamW makes its state), the next one records the graph and
replays it, and every later one copies the input ids into the graph's own tensor and replays it
(so ``--warmup`` must be at least ``GRAPH_EAGER_STEPS + 1``: the timed steps are all replays). Every
step is one optimizer step, so its losses follow the eager kind's. The gradients are made in the
graph's memory while it records and overwritten in place by each replay, never set to None between
replays. Its peak memory is the recording's (the replays allocate nothing), on the same terms as the
other kinds'; the graph's memory pool is held until the shape's last step, and a failed recording is
that row's error. The replays check no keys for overflow (nothing can be read while a graph records,
so the ops skip the check): ``<kind>+nokeycheck`` is the eager step without that check's sync.

``--profile`` adds, per shape, one profiled step of every model (``torch.profiler``): its GPU kernel
time, kernel launches, the share of the median step the GPU is busy (well below 100%: the step is
bound by the host), the kernels that take most of it and the host operators (self CPU time, calls
under the profiler), to see where two models differ. ``--host-profile`` runs one step per model under
``cProfile``: the Python functions with the most own and cumulative time.

A second stage (``--loss-curve``) trains a preset for a few steps on real tokens twice from the same
initialisation, once with the fused GPU modules and once with the PyTorch modules
(``efla.layers.fla_kernels.disabled()``), and reports the two loss curves.

Usage (GPU machine): ``python benchmarks/gpu_model.py --sizes 340m --shapes 2048x8,4096x4 --out DIR``.
Prints Markdown tables and writes ``DIR/gpu_model.json``, ``DIR/gpu_model.md`` and, after every shape, the
run in the shape of ``benchmarks/evidence.py`` (every measured step of every model: a round),
``DIR/gpu_model_run.json``, the raw file to keep under ``benchmarks/results/model_speed/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from efla import environment
from efla.cuda_graphs import capture
from efla.layers import fla_kernels as fused
from efla.models import EFLAForCausalLM, get_preset_config

GIB = 2**30
OURS = ("efla", "efla+triton", "efla+flce", "deltanet", "gated-efla", "gated-deltanet")
NO_OUTPUT_GATE = "-no-output-gate"  # e.g. gated-efla-no-output-gate: the gated preset without its SiLU output gate
FUSED_PROJECTIONS = "+fusedproj"  # e.g. gated-efla+fusedproj: the layers' input projections as one product
SEPARATE_PROJECTIONS = "+separateproj"  # e.g. efla+separateproj: one product per projection
NO_KEY_CHECK = "+nokeycheck"  # e.g. efla+nokeycheck: EFLA_CHECK_KEYS=0 during its steps (no sync per layer call)
GATES_IN_LAYER = "+gates-in-layer"  # gated-efla+gates-in-layer: the layer activates gate and beta, not the op
TRITON_LAUNCHES = "+triton"  # e.g. efla+triton: EFLA_DIRECT_LAUNCH=0 during its steps (every launch through Triton)
STATE_TUNING = "+tuned"  # e.g. efla+tuned: EFLA_STATE_TUNING=1 during its steps (state passes tuned per batch x heads)
FUSED_FORWARD = "+fusedfwd"  # e.g. efla+fusedfwd: EFLA_FUSED_FORWARD=1 (the forward's state and output passes in one kernel)
SPLIT_STATE = "+split4"  # e.g. efla+split4: EFLA_SPLIT_STATE=4 (the state pass over sequences in 4 pieces side by side)
GRAPH = "+graph"  # e.g. efla+graph: the whole step recorded as a CUDA graph per shape and replayed
GRAPH_EAGER_STEPS = 2  # per shape, before recording: Triton compiles and tunes, AdamW makes its state
STEP_ENVIRONMENT = {
    NO_KEY_CHECK: ("EFLA_CHECK_KEYS", "0"),
    TRITON_LAUNCHES: ("EFLA_DIRECT_LAUNCH", "0"),
    STATE_TUNING: ("EFLA_STATE_TUNING", "1"),
    FUSED_FORWARD: ("EFLA_FUSED_FORWARD", "1"),
    SPLIT_STATE: ("EFLA_SPLIT_STATE", "4"),
}
LINES: list[str] = []


def emit(out_dir: str, line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)
    with open(os.path.join(out_dir, "gpu_model.md"), "w") as fh:
        fh.write("\n".join(LINES) + "\n")


def build_fla(size: str):
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    ours = get_preset_config(f"{size}-efla")
    cfg = DeltaNetConfig(
        hidden_size=ours.hidden_size,
        num_hidden_layers=ours.num_hidden_layers,
        num_heads=ours.num_heads,
        vocab_size=ours.vocab_size,
        hidden_ratio=ours.hidden_ratio,
        intermediate_size=ours.intermediate_size,
        norm_eps=ours.norm_eps,
        conv_size=ours.conv_size,
        expand_k=1.0,
        expand_v=1.0,
        use_gate=False,
        tie_word_embeddings=False,
    )
    return DeltaNetForCausalLM(cfg)


def build(kind: str, size: str):
    for suffix in STEP_ENVIRONMENT:
        if kind.endswith(suffix):
            return build(kind.removesuffix(suffix), size)
    if kind.endswith(GRAPH):
        model, opt = build(kind.removesuffix(GRAPH), size)
        for group in opt.param_groups:  # the form a graph can record; fused AdamW's arithmetic is the same
            group["capturable"] = True
        return model, opt
    if kind.endswith(GATES_IN_LAYER):
        model, opt = build(kind.removesuffix(GATES_IN_LAYER), size)
        for layer in model.modules():
            if hasattr(layer, "_gates_in_op"):
                layer._gates_in_op = lambda *args, **kwargs: False
        return model, opt
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: a 1.3B model's CPU init takes a minute
        if kind == "fla":
            model = build_fla(size)
        elif kind == "efla+flce":
            model = EFLAForCausalLM(get_preset_config(f"{size}-efla", fuse_linear_cross_entropy=True))
        elif kind.endswith(FUSED_PROJECTIONS):
            preset = kind.removesuffix(FUSED_PROJECTIONS)
            model = EFLAForCausalLM(get_preset_config(f"{size}-{preset}", fuse_input_projections=True))
        elif kind.endswith(SEPARATE_PROJECTIONS):
            preset = kind.removesuffix(SEPARATE_PROJECTIONS)
            model = EFLAForCausalLM(get_preset_config(f"{size}-{preset}", fuse_input_projections=False))
        elif kind.removesuffix("+compile").endswith(NO_OUTPUT_GATE):
            preset = kind.removesuffix("+compile").removesuffix(NO_OUTPUT_GATE)
            depth = get_preset_config(f"{size}-efla").num_hidden_layers
            model = EFLAForCausalLM(get_preset_config(f"{size}-{preset}", use_gate=False, num_hidden_layers=depth))
        else:
            model = EFLAForCausalLM(get_preset_config(f"{size}-{kind.removesuffix('+compile')}"))
    model = model.to(torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    if kind.endswith("+compile"):
        # parameters stay shared with the optimizer; shapes are fixed per run, so no symbolic shapes
        model = torch.compile(model, dynamic=False)
    return model, opt


def state_bytes(model, opt) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.is_cuda
    )
    return params + moments


def error_line(e: BaseException) -> str:
    """``Type: first line`` of the innermost cause (a compile failure wraps the error behind it) or,
    without one, of the error it was raised while handling (a failed CUDA-graph recording ends
    with an error of its own about the invalidated capture), fit for a table cell."""
    while (e.__cause__ or (None if e.__suppress_context__ else e.__context__)) is not None:
        e = e.__cause__ or e.__context__
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:160]}".replace("|", "/")


def step_environment(kind: str):
    """The switches a model's suffixes set while it steps (``efla.environment.override``):
    ``+nokeycheck`` ``EFLA_CHECK_KEYS=0``, ``+triton`` ``EFLA_DIRECT_LAUNCH=0``, ``+tuned``
    ``EFLA_STATE_TUNING=1``, ``+fusedfwd`` ``EFLA_FUSED_FORWARD=1``, ``+split4`` ``EFLA_SPLIT_STATE=4``."""
    return environment.override(**dict(env for suffix, env in STEP_ENVIRONMENT.items() if suffix in kind))


def step_loss(model, opt, ids) -> torch.Tensor:
    """Forward with labels, backward, optimizer step; the loss, on the device."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss.detach()


def measured(run):
    """``run()`` between device syncs: (seconds, bytes allocated above the level before it at the
    peak, what it returned)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated() - before, out


def train_step(model, opt, ids) -> tuple[float, int, float]:
    """One step; returns (seconds, bytes allocated above the pre-step level at the peak, loss)."""
    opt.zero_grad(set_to_none=True)
    seconds, peak, loss = measured(lambda: step_loss(model, opt, ids))
    return seconds, peak, loss.item()


class GraphedSteps:
    """``train_step``'s contract for a ``+graph`` model: per shape, ``GRAPH_EAGER_STEPS`` eager steps on
    a side stream, then the step recorded as a CUDA graph and replayed from then on (see the module's
    docstring). Every call is one optimizer step. ``release()`` drops the graph and the gradients
    that live in its memory."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.side = None  # the eager steps' stream, made at the first
        self.shape = None  # the shape the eager steps and the graph are for
        self.eager_steps = 0
        self.graph = self.ids = self.loss = self.peak = None

    def __call__(self, ids) -> tuple[float, int, float]:
        if tuple(ids.shape) != self.shape:
            self.release()
            self.shape = tuple(ids.shape)
        if self.graph is None and self.eager_steps < GRAPH_EAGER_STEPS:
            self.eager_steps += 1
            return self.eager_step(ids)
        if self.graph is None:
            self.record(ids)
        seconds, _, _ = measured(lambda: self.replay(ids))
        return seconds, self.peak, self.loss.item()

    def eager_step(self, ids):
        if self.side is None:
            self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        # the key check as the recording runs it (off while capturing): the kernels the graph records
        # compile and tune here, since a module loaded during a capture can break it
        with torch.cuda.stream(self.side), environment.override(EFLA_CHECK_KEYS="0"):
            seconds, _, loss = train_step(self.model, self.opt, ids)
        torch.cuda.current_stream().wait_stream(self.side)
        return seconds, 0, loss  # the kind's peak is the replays': the recording's

    def record(self, ids) -> None:
        """Record the step on a copy of ``ids`` (recording runs nothing); its peak is the replays'."""
        self.opt.zero_grad(set_to_none=True)  # the recorded backward makes them in the graph's memory
        static_ids = ids.clone()
        # torch.cuda.graph's exit raises on a failed recording before it restores the stream: this one is restored
        with torch.cuda.stream(torch.cuda.current_stream()):
            # on the eager steps' stream, whose cuBLAS workspace exists: none is made in the graph's pool
            run = functools.partial(step_loss, self.model, self.opt, static_ids)
            _, peak, (graph, loss) = measured(lambda: capture(run, stream=self.side))
        self.graph, self.ids, self.loss, self.peak = graph, static_ids, loss, peak

    def replay(self, ids) -> None:
        self.ids.copy_(ids)
        self.graph.replay()

    def release(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph = self.ids = self.loss = None
            self.opt.zero_grad(set_to_none=True)  # they would keep the graph's memory
            torch.cuda.empty_cache()  # the graph's pool goes back to the device, not only to its own reuse
        self.shape, self.eager_steps = None, 0


def stepper(kind: str, model, opt):
    """The step a model is timed by, ``step(ids)`` with ``train_step``'s contract: eager, or replayed
    from a graph for a ``+graph`` kind."""
    if GRAPH in kind:
        return GraphedSteps(model, opt)
    return functools.partial(train_step, model, opt)


# suffixes a recorded step cannot honour: the split state runs whole while capturing, the fused loss reads
# a count back to the host, and the key check is off in every recording already
NOT_GRAPHED = (SPLIT_STATE, "+flce", NO_KEY_CHECK)


def check_graph_kinds(kinds, warmup: int) -> None:
    """A ``+graph`` kind's timed steps must all be replays: its eager steps and the recording step
    are warm-up steps. Suffixes that a recording would silently drop or fail on are refused."""
    for kind in kinds:
        refused = [suffix for suffix in NOT_GRAPHED if GRAPH in kind and suffix in kind]
        if refused:
            raise ValueError(f"--models: {kind} cannot be recorded as a graph ({', '.join(refused)})")
    if warmup <= GRAPH_EAGER_STEPS and any(GRAPH in kind for kind in kinds):
        raise ValueError(
            f"--warmup {warmup}: a {GRAPH} model needs at least {GRAPH_EAGER_STEPS + 1} warm-up steps "
            f"({GRAPH_EAGER_STEPS} eager, then the one that records its graph)"
        )


def bench_size(
    size: str,
    kinds,
    shapes,
    warmup: int,
    steps: int,
    out_dir: str,
    on_shape=lambda _rows: None,
    profile: int = 0,
    host_profile: int = 0,
) -> list[dict]:
    """Rows of every model at every shape; ``on_shape(rows)`` after each shape (keeps partial runs)."""
    models = {}
    for kind in kinds:
        try:
            models[kind] = build(kind, size)
        except Exception as e:  # fla missing or a build error: that column is left out, not the table
            emit(out_dir, f"- {size} {kind}: not built ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    params = {k: sum(p.numel() for p in m.parameters()) for k, (m, _) in models.items()}
    steps_of = {kind: stepper(kind, model, opt) for kind, (model, opt) in models.items()}
    rows = []
    for T, B in shapes:
        gen = torch.Generator(device="cuda").manual_seed(T)
        ids = torch.randint(0, 32000, (B, T), device="cuda", generator=gen)
        times = {k: [] for k in models}
        step_peaks = {k: [] for k in models}
        peaks = {k: 0 for k in models}
        losses = {k: None for k in models}
        failed = {}
        for r in range(warmup + steps):
            for kind, (_, opt) in models.items():
                if kind in failed:
                    continue
                try:
                    with step_environment(kind):
                        sec, peak, loss = steps_of[kind](ids)
                except Exception as e:
                    failed[kind] = error_line(e)
                    traceback.print_exc()
                    release(steps_of[kind])
                    opt.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
                    continue
                peaks[kind] = max(peaks[kind], peak)
                losses[kind] = loss
                if r >= warmup:
                    times[kind].append(sec)
                    step_peaks[kind].append(peak)
        for kind, (model, opt) in models.items():
            if kind in failed or not times[kind]:
                rows.append(dict(size=size, model=kind, T=T, B=B, error=failed.get(kind, "no steps")))
                continue
            med = statistics.median(times[kind])
            rows.append(
                dict(
                    size=size,
                    model=kind,
                    T=T,
                    B=B,
                    params=params[kind],
                    steps=len(times[kind]),
                    step_s_median=med,
                    step_s_all=times[kind],
                    tokens_per_s=B * T / med,
                    peak_gib=(state_bytes(model, opt) + peaks[kind]) / GIB,
                    peak_gib_all=[(state_bytes(model, opt) + p) / GIB for p in step_peaks[kind]],
                    last_loss=losses[kind],
                )
            )
        emit_shape(
            out_dir,
            size,
            T,
            B,
            [r for r in rows if r["T"] == T and r["B"] == B and r["size"] == size and ("tokens_per_s" in r or "error" in r)],
        )
        if profile:
            medians = {
                r["model"]: r.get("step_s_median")
                for r in rows
                if r["T"] == T and r["B"] == B and r["size"] == size and "tokens_per_s" in r
            }
            for kind in models:
                if kind not in failed:
                    with step_environment(kind):
                        step_profile = profile_step(steps_of[kind], ids)
                    rows.append(dict(size=size, model=kind, T=T, B=B, profile=step_profile, step_s_median=medians.get(kind)))
            emit_profiles(out_dir, size, T, B, [r for r in rows if r["T"] == T and r["B"] == B and "profile" in r], profile)
        if host_profile:
            for kind in models:
                if kind not in failed:
                    with step_environment(kind):
                        functions = python_profile_step(steps_of[kind], ids)
                    rows.append(dict(size=size, model=kind, T=T, B=B, python_profile=functions))
                    emit_python_profile(out_dir, size, T, B, kind, functions, host_profile)
        for step in steps_of.values():  # a graph's memory pool goes before the next shape's steps
            release(step)
        on_shape(rows)
    del models, steps_of
    torch.cuda.empty_cache()
    return rows


def release(step) -> None:
    """Drop what a step keeps between calls (a graph and its memory; eager steps keep nothing)."""
    if isinstance(step, GraphedSteps):
        step.release()


def profile_step(step, ids) -> dict:
    """One profiled training step (``step(ids)``, ``stepper``'s): GPU kernels ``{"total_ms",
    "kernels": {name: [ms, calls]}}`` and host operators ``{"host_ms", "host": {name: [self CPU ms,
    calls]}}`` (the host side of a host-bound step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids)
    kernels, host = {}, {}
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False):  # e.g. the optimizer step's range: not a kernel
            continue
        if e.device_type == DeviceType.CUDA:
            ms = getattr(e, "self_device_time_total", 0) / 1e3
            if ms > 0:
                kernels[e.key] = [ms, e.count]
        elif e.self_cpu_time_total > 0:
            host[e.key] = [e.self_cpu_time_total / 1e3, e.count]
    return dict(
        total_ms=sum(ms for ms, _ in kernels.values()),
        kernels=kernels,
        host_ms=sum(ms for ms, _ in host.values()),
        host=host,
        copies=copy_callers(prof.events()),
    )


KEPT_FUNCTIONS = 150  # per ordering (own, cumulative time): the JSON keeps these, not every function


def python_profile_step(step, ids) -> list[list]:
    """One training step (``step(ids)``, ``stepper``'s) under ``cProfile``: ``[function, calls, own
    ms, cumulative ms]`` per Python function. The step is bound by the host, so these times are where
    its wall time goes (kernel launches are asynchronous: a launcher's time is its host cost)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    # backward on this thread (the CUDA device's autograd thread is invisible to cProfile)
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        step(ids)
        profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}:{line}" if line else path
        rows.append([f"{name} ({where})", calls, 1e3 * own, 1e3 * cumulative])
    kept = {id(r) for key in (2, 3) for r in sorted(rows, key=lambda r: -r[key])[:KEPT_FUNCTIONS]}
    return [r for r in rows if id(r) in kept]


def emit_python_profile(out_dir, size, T, B, kind, functions, top: int):
    emit(
        out_dir,
        f"Python profile of one step, {size}, {T} x {B}, {kind} (cProfile): the {top} functions with "
        f"most own time, then the {top} with most cumulative time",
    )
    emit(out_dir, "")
    for key, label in ((2, "own"), (3, "cumulative")):
        for name, calls, own, cumulative in sorted(functions, key=lambda f: -f[key])[:top]:
            emit(out_dir, f"- {label}: {own:8.2f} ms own, {cumulative:8.2f} ms cumulative, x{calls:<5d} {name[:120]}")
    emit(out_dir, "")


def copy_callers(events, depth: int = 3) -> dict:
    """Where the step's memory copies and memsets come from: ``{"<call> <- <caller> <- ...": count}``
    (copies can wait on the GPU, so an unexpected one is worth knowing about)."""
    callers = {}
    for e in events:
        if e.name not in ("cudaMemcpyAsync", "cudaMemsetAsync"):
            continue
        chain, parent = [e.name], e.cpu_parent
        while parent is not None and len(chain) <= depth:
            chain.append(parent.name)
            parent = parent.cpu_parent
        key = " <- ".join(chain)
        callers[key] = callers.get(key, 0) + 1
    return callers


def emit_profiles(out_dir, size, T, B, rows, top: int):
    emit(
        out_dir,
        f"Profile of one step, {size}, {T} x {B}: GPU kernel time per model, then its {top} largest "
        "kernels (ms, calls), then the host operators with the most self CPU time",
    )
    emit(out_dir, "")
    for r in rows:
        p = r["profile"]
        launches = sum(calls for _, calls in p["kernels"].values())
        # kernel time over the median wall time of a step: well below 1, the step waits on the host
        busy = (
            f"; median step {1e3 * r['step_s_median']:.1f} ms (GPU busy {p['total_ms'] / (1e3 * r['step_s_median']):.0%})"
            if r.get("step_s_median")
            else ""
        )
        emit(out_dir, f"- {r['model']}: {p['total_ms']:.1f} ms of GPU kernels in {launches:,} launches{busy}")
        for name, (ms, calls) in sorted(p["kernels"].items(), key=lambda kv: -kv[1][0])[:top]:
            emit(out_dir, f"  - {ms:8.2f} ms x{calls:<4d} {name[:110]}")
        host = p.get("host", {})
        calls_total = sum(calls for _, calls in host.values())
        emit(
            out_dir,
            f"  - host: {p.get('host_ms', 0):.1f} ms self CPU time in {calls_total:,} operator calls "
            "(under the profiler), largest:",
        )
        for name, (ms, calls) in sorted(host.items(), key=lambda kv: -kv[1][0])[: top // 2]:
            emit(out_dir, f"    - {ms:8.2f} ms x{calls:<5d} {name[:100]}")
        if p.get("copies"):
            emit(out_dir, "  - copies and memsets by caller:")
            for chain, calls in sorted(p["copies"].items(), key=lambda kv: -kv[1])[:8]:
                emit(out_dir, f"    - x{calls:<5d} {chain[:160]}")
    emit(out_dir, "")


def emit_shape(out_dir, size, T, B, rows):
    ref = next((r for r in rows if r["model"] == "fla" and "error" not in r), None)
    efla = next((r for r in rows if r["model"] == "efla" and "error" not in r), None)
    emit(out_dir, f"### {size}, T x B = {T} x {B}")
    emit(out_dir, "")
    # the fastest half of the steps: a host-bound machine's step times jump between levels (at 340M on
    # 2026-12-01, about 155 and 210 ms), which moves a median of 10 steps by more than the gaps it measures
    emit(out_dir, "| model | tokens/s | vs fla DeltaNet | vs our efla | fastest half: vs fla, vs efla | peak GiB | peak vs fla |")
    emit(out_dir, "| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            emit(out_dir, f"| {r['model']} | failed: {r['error']} | | | | | |")
            continue
        vs_fla = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        vs_efla = f"{r['tokens_per_s'] / efla['tokens_per_s']:.2f}x" if efla else "-"
        fast = ", ".join(f"{fastest_half(other) / fastest_half(r):.2f}x" if other else "-" for other in (ref, efla))
        mem = f"{r['peak_gib'] / ref['peak_gib']:.2f}x" if ref else "-"
        emit(
            out_dir, f"| {r['model']} | {r['tokens_per_s']:,.0f} | {vs_fla} | {vs_efla} | {fast} | {r['peak_gib']:.1f} | {mem} |"
        )
    emit(out_dir, "")


def fastest_half(row) -> float:
    """Mean seconds of the faster half of a row's timed steps."""
    steps = sorted(row["step_s_all"])
    return statistics.mean(steps[: max(1, len(steps) // 2)])


def load_tokens(path: str, n: int) -> torch.Tensor:
    import numpy as np

    ids = np.load(path)
    return torch.from_numpy(ids[:n].astype("int64"))


def loss_curve(size: str, variants, tokens_path: str, steps: int, T: int, B: int, out_dir: str) -> list[dict]:
    tokens = load_tokens(tokens_path, steps * T * B).view(steps, B, T).cuda()
    rows = []
    for variant in variants:
        curves = {}
        for path in ("fused", "pytorch"):
            model, opt = build(variant, size)
            curve = []
            ctx = fused.disabled() if path == "pytorch" else contextlib.nullcontext()
            with ctx:
                for s in range(steps):
                    opt.zero_grad(set_to_none=True)
                    loss = model(input_ids=tokens[s], labels=tokens[s]).loss
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    curve.append(loss.item())
            curves[path] = curve
            del model, opt
            torch.cuda.empty_cache()
        diffs = [abs(a - b) for a, b in zip(curves["fused"], curves["pytorch"])]
        row = dict(
            size=size,
            model=variant,
            T=T,
            B=B,
            steps=steps,
            fused=curves["fused"],
            pytorch=curves["pytorch"],
            max_abs_diff=max(diffs),
            max_rel_diff=max(d / b for d, b in zip(diffs, curves["pytorch"])),
            mean_abs_diff_last10=statistics.mean(diffs[-10:]),
        )
        rows.append(row)
        emit(
            out_dir,
            f"- loss curve {size}-{variant}, {steps} steps of {T} x {B} real tokens: first "
            f"{curves['fused'][0]:.3f} / {curves['pytorch'][0]:.3f}, last {curves['fused'][-1]:.3f} / "
            f"{curves['pytorch'][-1]:.3f} (fused / PyTorch); max |diff| {row['max_abs_diff']:.4f}, "
            f"max rel {row['max_rel_diff']:.2e}",
        )
    emit(out_dir, "")
    return rows


def header(out_dir: str, args) -> dict:
    import transformers
    import triton

    try:
        import fla

        fla_version = getattr(fla, "__version__", "?")
    except Exception:  # fla is optional: our models still run
        fla_version = "not installed"
    info = dict(
        date=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        fla=fla_version,
        command=" ".join(sys.argv),
        warmup=args.warmup,
        steps=args.steps,
    )
    emit(out_dir, "# Model-level training speed and memory")
    emit(out_dir, "")
    for k, v in info.items():
        emit(out_dir, f"- {k}: {v}")
    emit(out_dir, "")
    return info


def parse_shapes(text: str):
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def name(row: dict) -> str:
    return "fla DeltaNet" if row["model"] == "fla" else row["model"]


def tokens_per_step(row: dict) -> list[float]:
    return [row["B"] * row["T"] / s for s in row["step_s_all"]]


def measurements(rows: list[dict]) -> list[dict]:
    """Every model against fla's (or, without it, the first model) at each size and shape, step by
    step as they alternated: tokens/s and peak memory per measured step. A model alone is a plain figure."""
    from evidence import measurement

    timed = [r for r in rows if "step_s_all" in r]
    found = []
    for key in dict.fromkeys((r["size"], r["T"], r["B"]) for r in timed):
        group = [r for r in timed if (r["size"], r["T"], r["B"]) == key]
        base = next((r for r in group if r["model"] == "fla"), group[0])
        case = f"{key[0]}, {key[1]} x {key[2]}"
        for r in [r for r in group if r is not base] or [base]:
            alone = r is base
            speed = None if alone else (name(base), tokens_per_step(base))
            memory = None if alone else (name(base), base["peak_gib_all"])
            found.append(measurement(case, "training throughput", "tokens/s", "higher", (name(r), tokens_per_step(r)), speed))
            found.append(measurement(case, "peak memory", "GiB", "lower", (name(r), r["peak_gib_all"]), memory))
    return found


def write_record(out_dir: str, rows: list[dict], args) -> None:
    """The run in the shape of ``benchmarks/evidence.py``: ``DIR/gpu_model_run.json``."""
    from evidence import write_run

    found = measurements(rows)
    if found:
        notes = [f"{args.warmup} warm-up steps, then {args.steps} measured steps; the models take turns step by step (a round)"]
        title = f"Training steps, {args.sizes} at {args.shapes}"
        write_run(os.path.join(out_dir, "gpu_model_run.json"), "gpu_model", title, args.steps, found, notes)


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="340m")
    ap.add_argument("--shapes", default="2048x8,4096x4,8192x2,16384x1", help="TxB,TxB,...")
    ap.add_argument("--models", default="fla," + ",".join(OURS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", type=int, default=0, help="profile one step per model; list this many kernels")
    ap.add_argument(
        "--host-profile", type=int, default=0, help="run one step per model under cProfile; list this many Python functions"
    )
    ap.add_argument("--loss-curve", default=None, help="token ids (.npy) for the fused-vs-PyTorch loss curves")
    ap.add_argument("--loss-curve-variants", default="efla,gated-efla")
    ap.add_argument("--loss-curve-steps", type=int, default=50)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    kinds = [k for k in args.models.split(",") if k and k != "none"]
    try:
        check_graph_kinds(kinds, args.warmup)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do")
        return 0
    info = header(args.out, args)
    result = dict(info=info, speed=[], loss_curves=[])
    json_path = os.path.join(args.out, "gpu_model.json")
    for size in args.sizes.split(",") if kinds else []:
        done = list(result["speed"])

        def save(rows, done=done):
            result["speed"] = done + rows
            write_json(json_path, result)
            write_record(args.out, result["speed"], args)

        try:
            bench_size(
                size,
                kinds,
                parse_shapes(args.shapes),
                args.warmup,
                args.steps,
                args.out,
                on_shape=save,
                profile=args.profile,
                host_profile=args.host_profile,
            )
        except Exception:
            traceback.print_exc()
    if args.loss_curve:
        try:
            result["loss_curves"] = loss_curve(
                args.sizes.split(",")[0],
                args.loss_curve_variants.split(","),
                args.loss_curve,
                args.loss_curve_steps,
                2048,
                8,
                args.out,
            )
        except Exception:
            traceback.print_exc()
    write_json(json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
