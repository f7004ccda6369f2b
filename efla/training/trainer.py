"""Language-model training (the paper's recipe): one process on a CPU to many GPUs under torchrun.

``train`` is the whole loop; ``efla train`` (efla/commands/train.py) only parses arguments.

Recipe defaults (the paper's): AdamW (betas 0.9/0.95, eps 1e-8), peak lr 3e-4, linear warm-up from
3e-5 to 3e-4 over the first 1/8 of the steps (the paper warms up over 1B of 8B tokens), cosine decay to
3e-5 at the last step, weight decay 0.1 (on matrices and embeddings; not on norms, biases and the gate
parameters ``A_log``/``dt_bias``), gradient clipping at 1.0. The batch is given in tokens; what does not
fit one forward per rank is accumulated.

Loss normalisation: the step loss is the mean next-token cross-entropy over every prediction of the
global batch. Each micro-batch's mean loss is weighted by its share of the global predictions (times the
world size, as DDP/FSDP average gradients over ranks), so 1 process with accumulation, N processes, or
packed varlen batches all optimise the same quantity.

Output directory ``out``:
    ``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer files: a Hugging Face
    model directory (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` after ``import efla``);
    ``log.jsonl``: one JSON object per logged step (loss, lr, grad norm, tokens, tokens/s, val loss);
    ``train_args.json``, ``train_summary.json``; ``checkpoints/step-NNNNNNN/``: ``model.safetensors``,
    ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` (every rank's RNG states; all three hold tensors and
    plain values only and load with ``torch.load(weights_only=True)``, so a crafted pickle is refused,
    never run), ``trainer_state.json`` (step, data position, data fingerprint, learning-rate schedule
    and optimizer settings) and ``manifest.json`` (size and SHA-256 of every file, written last).
    ``.efla-run.lock``: marks the directory as a run and locks it while a run uses it
    (``efla.training.run_dir``). A checkpoint is written in ``checkpoints/.tmp-...`` and renamed into place, so a
    crash never leaves a half-written checkpoint under a ``step-`` name; one whose files do not match
    their manifest is refused (``CheckpointError``, naming the newest good one).

Resuming (``resume=True``) loads the newest checkpoint and continues: the data position, RNG states,
optimizer and scheduler are restored, so on a CPU the per-step losses equal the uninterrupted run's bit
for bit (same thread count and library versions). Without a checkpoint it stops (``resume_or_start``
starts a new run then). The learning-rate schedule and optimizer settings are the checkpoint's: a
change is refused, except a larger ``max_steps`` with ``extend_at_min_lr``, which finishes the saved
schedule and trains the extra steps at ``min_lr`` (``scheduled_lr``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from safetensors.torch import load_file

from efla.data.text import SequenceOrder
from efla.data.tokenizer import tokenizer_eos_id
from efla.distributed import recompute_in_scope, setup_context_parallel
from efla.errors import UsageError
from efla.models import EFLAConfig, EFLAForCausalLM, get_preset_config

from efla import records
from efla.training.checkpoint import (
    CheckpointError,
    find_resume_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    rng_state,
    set_rng_state,
    verify_checkpoint,
    write_checkpoint,
)
from efla.training.config import SIZE_DEFAULTS, Sizes, TrainConfig, check_train_config, stored_train_args
from efla.training.data import check_text, load_data, prepare_tokenizer
from efla.training.process_group import (
    Dist,
    full_model_state,
    full_optim_state,
    init_dist,
    main_ddp_cleanup,
    peak_memory_per_gpu,
    unwrap,
)
from efla.training.schedule import (
    hyperparameters,
    lr_at,
    resumed_schedule,
    schedule_of,
    scheduled_lr,
)
from efla.training.session import Progress, Session, log_nothing
from efla.training.start import claim_and_choose_start, clean_after_failure, refuse_a_changed_resume
from efla.training.step import NonFiniteLossError, train_step

__all__ = [
    "TrainConfig",
    "CheckpointError",
    "check_train_config",
    "load_checkpoint_state",
    "scheduled_lr",
    "NonFiniteLossError",
    "train",
    "lr_at",
    "list_checkpoints",
    "verify_checkpoint",
    "find_resume_checkpoint",
    "read_log",
    "SIZE_DEFAULTS",
    "main_ddp_cleanup",
]


# -- model / state helpers ---------------------------------------------------------------------------


def _param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith(("A_log", "dt_bias")):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def read_log(out: str) -> list[dict]:
    """The entries of ``out/log.jsonl``."""
    path = os.path.join(out, "log.jsonl")
    return records.read_records(path) if os.path.exists(path) else []


def _truncate_log(out: str, step: int) -> None:
    path = os.path.join(out, "log.jsonl")
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                break  # a torn last line from a crash
    records.atomic_write(path, "".join(keep))


def _size_of(preset: str | None) -> str:
    if preset is None:
        return "tiny"
    key = preset.strip().lower().replace("_", "-")
    for size in SIZE_DEFAULTS:
        if key.startswith(size + "-"):
            return size
    return "tiny"


def _model_config(cfg: TrainConfig, tok, eos_id: int):

    ids = dict(
        vocab_size=len(tok),
        eos_token_id=eos_id,
        bos_token_id=getattr(tok, "bos_token_id", None),
        pad_token_id=getattr(tok, "pad_token_id", None),
    )
    if cfg.config_file:
        with open(cfg.config_file) as f:
            d = json.load(f)
        d.pop("model_type", None)
        d.pop("architectures", None)
        d.update(ids)
        return EFLAConfig(**d)
    if not cfg.preset:
        raise ValueError("preset / config_file: give one")
    return get_preset_config(cfg.preset, **ids)


# -- the loop ----------------------------------------------------------------------------------------


def _resolve(cfg: TrainConfig, dist: Dist) -> Sizes:
    size = _size_of(cfg.preset)
    seq_len = cfg.seq_len or SIZE_DEFAULTS[size][0]
    batch_tokens = cfg.batch_tokens or SIZE_DEFAULTS[size][1]
    if batch_tokens % seq_len:
        raise UsageError(f"{batch_tokens} tokens are not a whole number of {seq_len}-token sequences (--batch-tokens, --seq-len)")
    global_seqs = batch_tokens // seq_len
    data_world = dist.world // max(1, cfg.context_parallel)  # ranks that take different sequences
    if global_seqs % data_world:
        raise UsageError(f"{global_seqs} sequences per step do not split over {data_world} ranks (--batch-tokens)")
    per_rank = global_seqs // data_world
    mb = min(cfg.micro_batch_size or per_rank, per_rank)
    if per_rank % mb:
        raise UsageError(f"{mb} does not divide the {per_rank} sequences per rank and step (--micro-batch-size)")
    if cfg.max_steps is None and cfg.max_tokens is None:
        raise UsageError("give the length of the run (--max-steps or --max-tokens)")
    max_steps = cfg.max_steps if cfg.max_steps is not None else max(1, cfg.max_tokens // batch_tokens)
    if max_steps < 1:
        raise UsageError(f"expected >= 1, got {max_steps} (--max-steps)")
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max_steps // 8
    if cfg.on_nonfinite not in ("stop", "skip"):
        raise UsageError(f"expected 'stop' or 'skip', got {cfg.on_nonfinite!r} (--on-nonfinite)")
    return Sizes(
        seq_len=seq_len,
        batch_tokens=batch_tokens,
        global_seqs=global_seqs,
        per_rank=per_rank,
        micro=mb,
        accum=per_rank // mb,
        max_steps=max_steps,
        warmup=warmup,
    )


STEADY_STATE_WARMUP = 5


def train(
    cfg: TrainConfig, on_step_end: Callable[[int, dict], None] | None = None, log: Callable[[str], None] | None = None
) -> dict:
    """Train (or resume) a language model; returns the run's summary (also ``out/train_summary.json``).

    ``on_step_end(step, entry)`` is called on every rank after each update (and after that step's
    checkpoint, if any); an exception raised there ends the run as a crash would. ``log(message)`` is
    called on rank 0 before each phase that may take a while (checking the text, the tokenizer,
    tokenizing or the token cache, the first GPU step, each checkpoint, the model directory).

    Everything that can be checked before work starts is checked first (``check_train_config``,
    the text files, the output directory, the checkpoint to resume); a refused run writes nothing.
    The output directory is locked for the whole run (``efla.training.run_dir``).

    Returns:
        dict with ``losses`` (every step of the whole run, resumed ones included, read back from the
        log on rank 0), ``val_loss``, ``tokens_per_s`` (steady-state training throughput of all ranks
        together, see ``throughput``), ``tokens_per_s_all_steps``, ``peak_memory_gib_per_gpu`` (one
        entry per rank; ``None`` off the GPU), ``steps``, ``tokens``, ``resumed_from``, ``out``, ``data``
        (what was trained on: SHA-256 of the token stream and of the order of its sequences). Each
        ``log.jsonl`` entry carries that step's ``tokens_per_s`` and, on the GPU, ``peak_memory_gib``
        (this rank's peak so far).

    Raises:
        UsageError: an option, path or input file is wrong; ``out`` is not an efla run, is locked by
            another run, or has nothing to resume; a resumed run's schedule would change.
        CheckpointError: resuming from a damaged or unsafe checkpoint (names the previous good one).
        NonFiniteLossError: a non-finite loss with ``on_nonfinite="stop"`` (the last good checkpoint stays).
    """
    started = time.perf_counter()
    check_train_config(cfg)
    refuse_a_changed_resume(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev_kind = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dist = init_dist(dev_kind)
    device = torch.device(f"cuda:{dist.local_rank}" if dev_kind == "cuda" else dev_kind)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cp = None
    if cfg.context_parallel > 1:
        cp = setup_context_parallel(cfg.context_parallel, fsdp=cfg.fsdp)
    r = _resolve(cfg, dist)
    log = log if (log is not None and dist.main) else log_nothing
    check_text(cfg, dist, log)
    lock, ckpt, before = claim_and_choose_start(cfg, dist)
    try:
        return _train_from(cfg, dist, device, r, ckpt, on_step_end, cp, log, started)
    except BaseException:
        if dist.main:
            clean_after_failure(cfg.out, lock, before)
        raise
    finally:
        if lock is not None:
            lock.release()


def _train_from(cfg: TrainConfig, dist: Dist, device, r: Sizes, ckpt: str | None, on_step_end, cp, log, started: float) -> dict:
    run = Session(cfg, dist, device, r, ckpt, cp, log, started=started)
    _read_saved_schedule(run)
    _load_tokenizer_and_data(run)
    _build_model(run)
    _wrap_for_parallel_training(run)
    _build_optimizer(run)
    if ckpt is not None:
        _restore_checkpoint(run)
    _write_train_args(run)
    progress = _train_loop(run, on_step_end)
    return _save_final_model(run, progress)


def _read_saved_schedule(run: Session) -> None:
    cfg = run.cfg
    run.precision = cfg.precision if cfg.precision != "auto" else ("bf16" if run.device.type == "cuda" else "fp32")
    run.schedule = schedule_of(cfg, run.r)
    if run.ckpt is not None:
        with open(os.path.join(run.ckpt, "trainer_state.json")) as f:
            run.saved = json.load(f)
        run.schedule = resumed_schedule(cfg, run.r, run.ckpt, run.saved)


def _load_tokenizer_and_data(run: Session) -> None:

    run.tok = prepare_tokenizer(run.cfg, run.dist, resuming=run.ckpt is not None, log=run.log)
    run.eos_id = tokenizer_eos_id(run.tok)
    run.train_data, run.val_data = load_data(run.cfg, run.r, run.tok, run.eos_id, run.dist, run.log)
    run.order = SequenceOrder(len(run.train_data), seed=run.cfg.data_seed)
    fingerprint = run.train_data.fingerprint()
    if run.saved is not None and run.saved["data"]["fingerprint"] != fingerprint:
        raise CheckpointError(
            f"{run.ckpt}: the training data differs from the checkpoint's (fingerprint "
            f"{fingerprint} vs {run.saved['data']['fingerprint']}); resume with the same "
            "--data, tokenizer and --seq-len"
        )


def _build_model(run: Session) -> None:

    cfg = run.cfg
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    run.mconf = _model_config(cfg, run.tok, run.eos_id)
    run.log(
        f"building the model ({run.mconf.variant}, {run.mconf.num_hidden_layers} layers"
        + (f", from {run.ckpt})" if run.ckpt else ")")
    )
    run.model = EFLAForCausalLM(run.mconf)
    if run.ckpt is not None:
        try:
            run.model.load_state_dict(load_file(os.path.join(run.ckpt, "model.safetensors")))
        except RuntimeError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(
                f"{run.ckpt}: the model differs from the checkpoint's ({first}); resume with the run's --preset or --config"
            ) from None
    run.model.to(run.device).train()
    if cfg.grad_checkpointing:
        recompute = {"context_fn": recompute_in_scope} if cfg.context_parallel > 1 else {}
        run.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, **recompute})
    run.n_params = sum(p.numel() for p in run.model.parameters())


def _wrap_for_parallel_training(run: Session) -> None:
    model = run.model
    if run.cfg.fsdp:
        if not run.dist.enabled:
            raise ValueError("fsdp: needs torchrun (WORLD_SIZE > 1)")
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415 (lazy: only for distributed runs)

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if run.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        for block in model.model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        run.wrapped = model
    elif run.dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415 (lazy: only for distributed runs)

        run.wrapped = DDP(model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    else:
        run.wrapped = model


def _build_optimizer(run: Session) -> None:
    cfg = run.cfg
    run.optimizer = torch.optim.AdamW(_param_groups(run.model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: scheduled_lr(s, run.schedule) / cfg.lr)


def _restore_checkpoint(run: Session) -> None:
    """Optimizer, scheduler, RNG states, step and data position of the checkpoint resumed from."""
    ckpt, state = run.ckpt, run.saved
    osd = load_checkpoint_state(os.path.join(ckpt, "optimizer.pt"))
    if run.cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 (lazy: only for distributed runs)
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(run.wrapped, run.optimizer, osd, options=StateDictOptions(full_state_dict=True))
    else:
        run.optimizer.load_state_dict(osd)
    run.scheduler.load_state_dict(load_checkpoint_state(os.path.join(ckpt, "scheduler.pt")))
    rng = load_checkpoint_state(os.path.join(ckpt, "rng.pt"))
    # the loop draws no random numbers (no dropout; the data order is a function of the position), so
    # a different world size only loses bitwise equality with the original run, not correctness
    set_rng_state(rng[run.dist.rank] if len(rng) == run.dist.world else rng[0])
    run.start_step = state["step"]
    if state["data"]["position"] != run.start_step * run.r.global_seqs:
        raise CheckpointError(
            f"{ckpt}: saved with {state['data']['position'] // max(1, run.start_step)} sequences "
            f"per step, resuming with {run.r.global_seqs}: resume with the same --batch-tokens "
            "and --seq-len"
        )
    if run.dist.main:
        _truncate_log(run.cfg.out, run.start_step)


def _write_train_args(run: Session) -> None:
    """``train_args.json``: the run's settings. A resume keeps the saved file, updating only the length of
    a run extended with ``extend_at_min_lr``."""
    if not run.dist.main:
        return
    stored = stored_train_args(run.cfg.out) if run.ckpt is not None else None
    if stored is not None and "resolved" in stored:
        _update_run_length(run, stored)
        return
    args = dataclasses.asdict(run.cfg)
    args["resolved"] = dict(
        dataclasses.asdict(run.r),
        schedule=run.schedule,
        world_size=run.dist.world,
        precision=run.precision,
        device=str(run.device),
        n_params=run.n_params,
        vocab_size=len(run.tok),
        train_sequences=len(run.train_data),
        train_tokens_available=len(run.train_data) * run.r.seq_len,
        val_sequences=len(run.val_data) if run.val_data is not None else 0,
    )
    records.atomic_write_json(os.path.join(run.cfg.out, "train_args.json"), args, indent=2)


def _update_run_length(run: Session, stored: dict) -> None:
    cfg = run.cfg
    if stored["resolved"].get("max_steps") == run.r.max_steps:
        return
    stored = dict(
        stored,
        max_steps=cfg.max_steps,
        max_tokens=cfg.max_tokens,
        extend_at_min_lr=cfg.extend_at_min_lr,
        resolved=dict(stored["resolved"], max_steps=run.r.max_steps, schedule=run.schedule),
    )
    records.atomic_write_json(os.path.join(cfg.out, "train_args.json"), stored, indent=2)


def _save_checkpoint(run: Session, step: int, position: int) -> str | None:
    """Every rank gathers its part of the states; rank 0 writes the checkpoint. Its path on rank 0."""
    msd = full_model_state(run.wrapped, run.cfg.fsdp)
    osd = full_optim_state(run.wrapped, run.optimizer, run.cfg.fsdp)
    rngs = run.dist.all_gather(rng_state())
    path = None
    if run.dist.main:
        run.log(f"writing the checkpoint of step {step}")
        r, cfg = run.r, run.cfg
        trainer_state = dict(
            step=step,
            tokens=step * r.batch_tokens,
            max_steps=r.max_steps,
            world_size=run.dist.world,
            schedule=run.schedule,
            hyperparameters=hyperparameters(cfg),
            data=dict(
                position=position,
                seq_len=r.seq_len,
                data_seed=cfg.data_seed,
                n_sequences=len(run.train_data),
                fingerprint=run.train_data.fingerprint(),
                epoch=run.order.epoch_of(position),
            ),
            model_config=run.mconf.to_dict(),
        )
        path = write_checkpoint(
            cfg.out,
            step,
            model_state=msd,
            optimizer_state=osd,
            scheduler_state=run.scheduler.state_dict(),
            rng_states=rngs,
            trainer_state=trainer_state,
            keep=cfg.keep_checkpoints,
        )
    run.dist.barrier()
    return path


def _train_loop(run: Session, on_step_end) -> Progress:
    cfg, r = run.cfg, run.r
    progress = Progress(step=run.start_step, last_good=run.ckpt)
    if progress.step < r.max_steps:
        run.log(
            f"training steps {progress.step + 1}-{r.max_steps}"
            + ("; compiling GPU kernels (first step)" if run.device.type == "cuda" else "")
        )
    bar = None
    if run.dist.main and cfg.progress:
        bar = records.progress_factory(leave=True, unit="step")(
            r.max_steps, f"train {os.path.basename(cfg.out.rstrip('/'))}", initial=run.start_step
        )
    # open for the whole loop (closed in the finally below): every logged step is appended and flushed
    log_f = open(os.path.join(cfg.out, "log.jsonl"), "a") if run.dist.main else None  # noqa: SIM115
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    try:
        while progress.step < r.max_steps:
            entry = train_step(run, progress, log_f, bar)
            _log_step(run, entry, log_f, bar, progress.val_loss)
            step = progress.step
            progress.stopped_early = step < r.max_steps and _out_of_time(run)
            if (cfg.save_every and step % cfg.save_every == 0) or step == r.max_steps or progress.stopped_early:
                progress.last_good = _save_checkpoint(run, step, step * r.global_seqs) or progress.last_good
            if on_step_end is not None:
                on_step_end(step, entry)
            if progress.stopped_early:
                run.log(f"stopping at step {step} of {r.max_steps}: --time-limit {cfg.time_limit:g} s reached")
                break
    finally:
        if bar is not None:
            bar.close()
        if log_f:
            log_f.close()
    return progress


def _out_of_time(run: Session) -> bool:
    """``--time-limit`` reached, as rank 0's clock says, so every rank stops after the same step."""
    if not run.cfg.time_limit:
        return False
    return bool(run.dist.broadcast(time.perf_counter() - run.started >= run.cfg.time_limit))


def _log_step(run: Session, entry: dict, log_f, bar, val_loss: float | None) -> None:
    step, max_steps = entry["step"], run.r.max_steps
    if log_f and (step % run.cfg.log_every == 0 or step == max_steps or "val_loss" in entry or "skipped" in entry):
        log_f.write(json.dumps(entry) + "\n")
        log_f.flush()
    if bar is not None:
        post = dict(loss=f"{entry['loss']:.4f}", tok_s=f"{entry['tokens_per_s']:,.0f}", lr=f"{entry['lr']:.2e}")
        if val_loss is not None:
            post["val"] = f"{val_loss:.4f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)


def _save_final_model(run: Session, progress: Progress) -> dict:
    """The Hugging Face model directory and ``train_summary.json`` (rank 0); the run's summary."""
    cfg, r, dist = run.cfg, run.r, run.dist
    step = progress.step
    peak_per_gpu = peak_memory_per_gpu(run.device, dist)
    msd = full_model_state(run.wrapped, cfg.fsdp) if cfg.fsdp else None
    summary = None
    if dist.main:
        run.log(f"writing the model directory {cfg.out}")
        core = unwrap(run.model)
        if msd is not None:
            core.save_pretrained(cfg.out, state_dict=msd)
        else:
            core.save_pretrained(cfg.out)
        run.tok.save_pretrained(cfg.out)
        log = read_log(cfg.out)
        losses = [e["loss"] for e in log if "error" not in e]
        # a resumed process with nothing left to train measured no validation loss: the run's last one stands
        val_losses = [e["val_loss"] for e in log if "val_loss" in e]
        val_loss = progress.val_loss if progress.val_loss is not None else (val_losses[-1] if val_losses else None)
        summary = dict(
            out=cfg.out,
            steps=step,
            tokens=step * r.batch_tokens,
            max_steps=r.max_steps,
            stopped_early=progress.stopped_early,
            resumed_from=run.ckpt,
            final_loss=losses[-1] if losses else None,
            val_loss=val_loss,
            **throughput(progress.step_seconds, r.batch_tokens),
            peak_memory_gib_per_gpu=peak_per_gpu,
            train_seconds_this_process=progress.train_time,
            wall_seconds_this_process=time.perf_counter() - progress.started,
            n_params=run.n_params,
            world_size=dist.world,
            device=str(run.device),
            precision=run.precision,
            threads=torch.get_num_threads(),
            variant=run.mconf.variant,
            data=_data_trained_on(run, step),
        )
        records.atomic_write_json(os.path.join(cfg.out, "train_summary.json"), summary, indent=2)
        summary = dict(summary, losses=losses, log=log)
    dist.barrier()
    return summary if summary is not None else dict(out=cfg.out, steps=step)


def _sha256_of_array(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _data_trained_on(run: Session, steps: int) -> dict:
    """What the run's ``steps`` trained on, so two runs can be shown to have seen the same tokens in
    the same order: the SHA-256 of the whole training token stream, of the sequence numbers in the
    order they were taken, and of the validation stream."""
    position = steps * run.r.global_seqs
    taken = run.train_data.index[run.order.take(0, position)].astype(np.int64)
    return dict(
        seq_len=run.r.seq_len,
        data_seed=run.cfg.data_seed,
        train_sequences=len(run.train_data),
        sequences_trained=position,
        epochs=run.order.epoch_of(position),
        tokens_sha256=_sha256_of_array(run.train_data.tokens),
        order_sha256=_sha256_of_array(taken),
        val_sequences=len(run.val_data) if run.val_data is not None else 0,
        val_sha256=_sha256_of_array(run.val_data.sequences(range(len(run.val_data)))) if run.val_data is not None else None,
    )


def warmup_steps(n_steps: int) -> int:
    """Steps left out of the steady-state rate: the first ones compile and autotune kernels (the first
    GPU steps can take minutes); at most half of the steps this process ran."""
    return min(STEADY_STATE_WARMUP, n_steps // 2)


def throughput(step_seconds: list[float], batch_tokens: int) -> dict:
    """``tokens_per_s``: the steady-state rate (all ranks' tokens per second over the steps after the
    warm-up steps); ``tokens_per_s_all_steps``: the rate over every step this process ran."""
    if not step_seconds:
        return dict(tokens_per_s=None, tokens_per_s_all_steps=None, steady_state_steps=0)
    steady = step_seconds[warmup_steps(len(step_seconds)) :]
    return dict(
        tokens_per_s=len(steady) * batch_tokens / sum(steady),
        tokens_per_s_all_steps=len(step_seconds) * batch_tokens / sum(step_seconds),
        steady_state_steps=len(steady),
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `efla train` (python -m efla train)")
