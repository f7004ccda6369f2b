"""Several GPUs of one host against one, through ``efla train`` under torchrun: data parallelism,
FSDP2, a killed rank resumed, and one long sequence split over the GPUs (context parallelism).

Each stage's result goes to ``OUT/<stage>.json`` when it ends (``longest``'s after every run), and
``OUT/distributed.md`` is written anew from every ``OUT/*.json`` each time, so a call stopped at its
limit keeps what finished and a later call with the same ``OUT`` adds to it. ``--budget`` bounds all
the runs (none starts or lasts past it); on SIGTERM every worker is killed, so none outlives the
script holding a GPU. A failed run is recorded with the line of its output that names the error and
the output's last lines. Stages (``--stages``, run in the order given):

* ``ddp``: ``--preset`` (340M EFLA) at ``--seq-len`` 2048 and a global batch of ``--batch-tokens``
  (32K) for ``--steps`` steps on one GPU and on ``--nproc``, same data, tokenizer, seed and
  micro-batches: steady-state tokens/s of each, the speed-up and the losses side by side;
* ``resume``: the ``--nproc`` run again, checkpointing every ``--save-every`` steps; once
  ``--kill-at`` steps are logged one rank is killed (SIGKILL), then the run is resumed to the end
  (``--resume``): its losses against the uninterrupted run of ``ddp`` (run first if absent from
  ``OUT``: a lent machine empties ``OUT`` before each call, so give both stages to one call);
* ``fsdp``: ``--fsdp-preset`` (1.3B EFLA) with ``--fsdp`` on ``--nproc``: tokens/s, peak memory per GPU;
* ``cp``: ``benchmarks/context_parallel_check.py`` on ``--nproc`` at ``--cp-tokens`` (64K) tokens,
  bf16: the split's outputs, final states and gradients against the single-process op's;
* ``longest``: ``--preset`` at each of ``--lengths`` (one sequence per step, activation
  checkpointing per block: ``--length-args``) on one GPU, then split over ``--nproc`` with
  ``--context-parallel``, each up to the first length that fails: tokens/s and peak memory per GPU.

Without a GPU every run takes the CPU with gloo (a rehearsal at tiny sizes; ``tests/distributed``
runs one). NVLink multicast stays off in every process started here.

Usage (two GPUs): ``python benchmarks/gpu_distributed.py --data DIR --out OUT --stages ddp,resume,cp``;
``--stages ''`` writes ``OUT/distributed.md`` from the JSON files in ``OUT`` alone (those of several
calls copied into one folder). ``scripts/device.sh distributed`` runs it on a lent machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
STAGES = ("ddp", "resume", "fsdp", "cp", "longest")
BF16_TOLERANCE = 2e-2  # the project's relative error for bf16 against a reference
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------------------------------ runs


class Runner:
    """One stage's runs: starts torchrun processes with the shared options within the time left,
    records each command line, and saves the stage's result (also part way)."""

    def __init__(self, a, stage: str, deadline: float | None):
        self.a, self.stage, self.deadline = a, stage, deadline
        self.work = pathlib.Path(a.work)
        self.commands: list[str] = []
        self.started = time.monotonic()

    def time_left(self) -> float:
        left = self.a.run_timeout
        return left if self.deadline is None else min(left, self.deadline - time.monotonic())

    def save(self, result: dict) -> None:
        """``OUT/<stage>.json`` and the report anew."""
        out = pathlib.Path(self.a.out)
        (out / f"{self.stage}.json").write_text(json.dumps({**result, "meta": meta(self)}, indent=1))
        print(write_report(out), flush=True)

    def env(self) -> dict:
        env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def torchrun(self, nproc: int, *args: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]

    def train_command(self, nproc: int, out: pathlib.Path, preset: str, *extra: str) -> list[str]:
        a = self.a
        return self.torchrun(
            nproc,
            *("-m", "efla", "train", "--preset", preset, "--data", *a.data, "--tokenizer", str(self.tokenizer())),
            *("--cache-dir", str(self.work / "cache"), "--val-sequences", str(a.val_sequences), "--seed", "0"),
            *("--no-progress", "--out", str(out), *a.train_args.split(), *extra),
        )

    def start(self, command: list[str], log: pathlib.Path) -> subprocess.Popen:
        self.commands.append(" ".join(_shown(command)))
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = open(log, "w")  # noqa: SIM115 (closed when the process is waited for)
        process = subprocess.Popen(
            command, env=self.env(), cwd=str(REPO), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        process.log_handle = handle
        LIVE.append(process)
        return process

    def run(self, command: list[str], log: pathlib.Path) -> int | None:
        """The run's exit status (-9: stopped at the time left); ``None``: not started, no time left."""
        if self.time_left() <= 0:
            return None
        process = self.start(command, log)
        return finish(process, self.time_left())

    def train(self, name: str, nproc: int, preset: str, *extra: str) -> dict:
        """One ``efla train`` run into ``WORK/<name>`` (its output in ``WORK/<name>.log``), recorded."""
        out, log = self.work / name, self.work / f"{name}.log"
        return self.record(out, self.run(self.train_command(nproc, out, preset, *extra), log), log)

    def record(self, out: pathlib.Path, rc: int | None, log: pathlib.Path) -> dict:
        """What a finished run logged; its directory (checkpoints of gigabytes at 340M) then goes
        unless ``--keep-runs``."""
        record = run_record(out, rc, log)
        if not self.a.keep_runs:
            shutil.rmtree(out, ignore_errors=True)
        return record

    def tokenizer(self) -> pathlib.Path:
        """One byte-level BPE for every run of the call, trained once on the data."""
        path = self.work / "tokenizer"
        if not (path / "tokenizer_config.json").exists():
            from efla.data.text import read_documents
            from efla.data.tokenizer import train_bpe_tokenizer

            texts = _limited(read_documents(self.a.data), self.a.tokenizer_chars)
            train_bpe_tokenizer(texts, vocab_size=self.a.vocab_size, save_dir=str(path))
        return path


def _limited(documents, budget: int):
    """Documents up to ``budget`` characters in all (the last one cut)."""
    for doc in documents:
        if budget <= 0:
            return
        yield doc[:budget]
        budget -= len(doc)


def _shown(command: list[str]) -> list[str]:
    return ["python" if part == sys.executable else part for part in command]


LIVE: list[subprocess.Popen] = []  # torchrun processes started and not yet waited for


def finish(process: subprocess.Popen, timeout: float) -> int:
    """The process's exit status; killed with its workers past ``timeout`` seconds: -9."""
    try:
        return process.wait(timeout=max(timeout, 0))
    except subprocess.TimeoutExpired:
        kill_tree(process)
        return process.wait()
    finally:
        process.log_handle.close()
        LIVE.remove(process)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers and torchrun, each with its process group: torchrun starts every
    worker in a session of its own, and a worker's own children (compiler pools) go with its group."""
    for pid in [*children(process.pid), process.pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def stop_everything(signum, _frame) -> None:
    """On SIGTERM (a caller's time limit): no worker may outlive the script and hold the GPUs."""
    for process in list(LIVE):
        kill_tree(process)
    raise SystemExit(128 + signum)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = pathlib.Path(stat).read_text()
        except OSError:
            continue
        if int(text.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(stat.split("/")[2]))
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def read_log(out: pathlib.Path) -> list[dict]:
    path = out / "log.jsonl"
    return json_lines(path.read_text()) if path.exists() else []


def json_lines(text: str) -> list[dict]:
    """The complete JSON objects of ``text``, one a line (a line being written is left out)."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                found.append(json.loads(line))
    return found


def summary(out: pathlib.Path) -> dict:
    path = out / "train_summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


NAMED_ERROR = re.compile(r"^\s*(\[rank\d+\]:\s*)?([\w.]+(Error|Exception)|efla \w[\w-]*):")
TORCHRUN_SUMMARY = ("failed (exitcode", "ChildFailedError")


def failure(log: pathlib.Path) -> dict:
    """Why a run failed: the last line that names an error before torchrun's own summary (whose
    lines name none), and the last lines of the workers' output."""
    if not log.exists():
        return dict(error="not run: the time left (--budget) was spent", log_tail=[])
    lines = [line.rstrip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    end = next((i for i, line in enumerate(lines) if any(mark in line for mark in TORCHRUN_SUMMARY)), len(lines))
    named = [line for line in lines[:end] if NAMED_ERROR.match(line)]
    last = named[-1] if named else (lines[end - 1] if end else "no output")
    return dict(error=last.strip()[:300], log_tail=[line[:300] for line in lines[:end][-30:]])


def run_record(out: pathlib.Path, rc: int | None, log: pathlib.Path) -> dict:
    s = summary(out)
    record = dict(
        ok=rc == 0,
        tokens_per_s=s.get("tokens_per_s"),
        peak_memory_gib_per_gpu=s.get("peak_memory_gib_per_gpu"),
        losses=[e["loss"] for e in read_log(out)],
        val_loss=s.get("val_loss"),
        world_size=s.get("world_size"),
        device=s.get("device"),
        precision=s.get("precision"),
    )
    if rc != 0:
        record.update(failure(log))
    return record


# ---------------------------------------------------------------------------------------- stages


def batch_args(a, steps: int) -> list[str]:
    """``--seq-len`` sequences, ``--batch-tokens`` a step in micro-batches of ``--micro-batch-size``."""
    return [
        *("--seq-len", str(a.seq_len), "--batch-tokens", str(a.batch_tokens)),
        *("--micro-batch-size", str(a.micro_batch_size), "--max-steps", str(steps)),
    ]


def stage_ddp(r: Runner) -> dict:
    a = r.a
    runs = {str(nproc): r.train(f"ddp-{nproc}", nproc, a.preset, *batch_args(a, a.steps)) for nproc in (1, a.nproc)}
    return dict(preset=a.preset, seq_len=a.seq_len, batch_tokens=a.batch_tokens, nproc=a.nproc, runs=runs)


def stage_resume(r: Runner, done: dict) -> dict:
    a = r.a
    reference = (done.get("ddp") or {}).get("runs", {}).get(str(a.nproc)) or stage_ddp(r)["runs"][str(a.nproc)]
    if not reference["ok"]:
        return dict(preset=a.preset, nproc=a.nproc, failed=f"the uninterrupted run failed: {reference['error']}")
    out = r.work / "resume"
    command = r.train_command(a.nproc, out, a.preset, *batch_args(a, a.steps), "--save-every", str(a.save_every))
    killed_rank, killed_rc, killed_losses = kill_a_rank(r, command, out)
    rc = r.run(command + ["--resume"], r.work / "resume-2.log")
    resumed = r.record(out, rc, r.work / "resume-2.log")
    return dict(
        preset=a.preset,
        nproc=a.nproc,
        save_every=a.save_every,
        kill_at=a.kill_at,
        killed_rank=killed_rank,
        killed_exit_status=killed_rc,
        losses_before_kill=killed_losses,
        resumed=resumed,
        uninterrupted=reference["losses"],
    )


def kill_a_rank(r: Runner, command: list[str], out: pathlib.Path) -> tuple[int | None, int, list[float]]:
    """Start ``command``; once ``--kill-at`` steps are logged, SIGKILL its last rank. Returns
    (the rank killed, or None if the run ended first; torchrun's exit status; the losses logged)."""
    a = r.a
    process = r.start(command, r.work / "resume-1.log")
    deadline = time.monotonic() + r.time_left()
    killed = None
    while process.poll() is None and time.monotonic() < deadline:
        if len(read_log(out)) >= a.kill_at:
            workers = {rank_of(pid): pid for pid in children(process.pid)}
            if a.nproc - 1 in workers:
                _kill(workers[a.nproc - 1])
                killed = a.nproc - 1
                break
        time.sleep(0.05)
    rc = finish(process, max(deadline - time.monotonic(), 60 if killed is not None else 0))
    return killed, rc, [e["loss"] for e in read_log(out)]


def stage_fsdp(r: Runner) -> dict:
    a = r.a
    run = r.train("fsdp", a.nproc, a.fsdp_preset, *batch_args(a, a.fsdp_steps), "--fsdp")
    return dict(preset=a.fsdp_preset, nproc=a.nproc, seq_len=a.seq_len, batch_tokens=a.batch_tokens, run=run)


def stage_cp(r: Runner) -> dict:
    a = r.a
    log = r.work / "cp.log"
    script = str(REPO / "benchmarks" / "context_parallel_check.py")
    rc = r.run(r.torchrun(a.nproc, script, "--dtype", a.cp_dtype, "--tokens", str(a.cp_tokens), *a.cp_args.split()), log)
    cases = json_lines(log.read_text()) if log.exists() else []
    result = dict(nproc=a.nproc, tokens=a.cp_tokens, dtype=a.cp_dtype, ok=rc == 0, cases=cases)
    if rc != 0:
        result.update(failure(log))
    return result


def stage_longest(r: Runner) -> dict:
    a = r.a
    found = {}
    result = dict(preset=a.preset, nproc=a.nproc, length_args=a.length_args, runs=found)
    for nproc, split in ((1, []), (a.nproc, ["--context-parallel", str(a.nproc)])):
        rows = found[str(nproc)] = []
        for length in a.lengths:
            # one sequence a step: on one GPU, or split over the group of all of them
            args = ["--seq-len", str(length), "--batch-tokens", str(length), "--micro-batch-size", "1"]
            args += ["--max-steps", str(a.length_steps), "--val-sequences", "0", *a.length_args.split(), *split]
            rows.append(dict(seq_len=length, **r.train(f"longest-{nproc}-{length}", nproc, a.preset, *args)))
            r.save(result)  # a call stopped at its limit keeps the lengths done
            if not rows[-1]["ok"]:
                break
    return result


def run_stage(name: str, r: Runner, done: dict) -> dict:
    if name == "resume":
        return stage_resume(r, done)
    return {"ddp": stage_ddp, "fsdp": stage_fsdp, "cp": stage_cp, "longest": stage_longest}[name](r)


# ---------------------------------------------------------------------------------------- report


def _heading(title: str, columns: list[str]) -> list[str]:
    """A section's title and the head of its table."""
    return [title, "", *_table_head(columns)]


def _table_head(columns: list[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def fmt(x, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def memory(record: dict) -> str:
    peaks = record.get("peak_memory_gib_per_gpu")
    return " / ".join(f"{p:.1f}" for p in peaks) if peaks else "-"


def largest_difference(a: list[float], b: list[float]) -> float | None:
    pairs = list(zip(a, b))
    return max(abs(x - y) for x, y in pairs) if pairs else None


def report_ddp(d: dict) -> list[str]:
    one, many = d["runs"]["1"], d["runs"][str(d["nproc"])]
    speed = many["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] and many["tokens_per_s"] else None
    lines = _heading(
        f"### Data parallelism: {d['preset']}, {d['seq_len']} tokens a sequence, {d['batch_tokens']:,} a step",
        ["ranks", "tokens/s", "peak GiB per GPU", "final loss", "validation loss"],
    )
    lines += [_run_row(n, rec) for n, rec in (("1", one), (str(d["nproc"]), many))]
    lines += [
        "",
        f"Speed-up: {fmt(speed, '.2f')}x; largest loss difference over the steps: "
        f"{fmt(largest_difference(one['losses'], many['losses']), '.2e')}.",
        "",
    ]
    lines += _table_head(["step", "loss, 1 rank", f"loss, {d['nproc']} ranks"])
    lines += [f"| {i + 1} | {x:.4f} | {y:.4f} |" for i, (x, y) in enumerate(zip(one["losses"], many["losses"]))]
    return lines + _errors(d["runs"])


def _run_row(ranks: str, rec: dict) -> str:
    final, val = fmt(_last(rec["losses"]), ".4f"), fmt(rec["val_loss"], ".4f")
    return f"| {ranks} | {fmt(rec['tokens_per_s'])} | {memory(rec)} | {final} | {val} |"


def _last(values: list):
    return values[-1] if values else None


def _errors(runs: dict) -> list[str]:
    return [f"- {n}: failed: `{rec['error']}`" for n, rec in runs.items() if rec.get("error")]


def report_resume(d: dict) -> list[str]:
    resumed = d["resumed"]["losses"]
    killed = (
        f"rank {d['killed_rank']} killed (SIGKILL) once {d['kill_at']} steps were logged"
        if d["killed_rank"] is not None
        else f"no rank killed: the run ended before {d['kill_at']} steps were logged"
    )
    lines = [
        f"### A rank killed and the run resumed: {d['preset']} on {d['nproc']} ranks",
        "",
        f"Checkpoints every {d['save_every']} steps; {killed} (torchrun exited with {d['killed_exit_status']}), "
        f"then `--resume` to the end ({'finished' if d['resumed']['ok'] else 'failed: ' + d['resumed'].get('error', '')}).",
        "",
        *_table_head(["step", "uninterrupted", "before the kill", "resumed"]),
    ]
    before = d["losses_before_kill"]
    for i, ref in enumerate(d["uninterrupted"]):
        cells = [f"{v[i]:.4f}" if i < len(v) else "" for v in (before, resumed)]
        lines.append(f"| {i + 1} | {ref:.4f} | {cells[0]} | {cells[1]} |")
    diff = largest_difference(d["uninterrupted"], resumed)
    same = d["uninterrupted"] == resumed
    return lines + [
        "",
        f"Resumed against uninterrupted: largest difference {fmt(diff, '.2e')}{' (bitwise equal)' if same else ''}.",
    ]


def report_fsdp(d: dict) -> list[str]:
    rec = d["run"]
    lines = _heading(
        f"### FSDP2: {d['preset']} on {d['nproc']} ranks, {d['seq_len']} tokens a sequence, {d['batch_tokens']:,} a step",
        ["tokens/s", "peak GiB per GPU", "final loss"],
    ) + [
        f"| {fmt(rec['tokens_per_s'])} | {memory(rec)} | {fmt(_last(rec['losses']), '.4f')} |",
    ]
    return lines + _errors({"fsdp": rec})


def report_cp(d: dict) -> list[str]:
    lines = _heading(
        f"### Context parallelism, correctness: {d['tokens']:,} tokens split over {d['nproc']} ranks, {d['dtype']}",
        ["rule", "case", "split vs one process", "one process vs float32", "split vs float32", f"within {BF16_TOLERANCE:g}"],
    )
    for c in d["cases"]:
        worst = c["max_relative_error"]
        cells = [fmt(worst.get(k), ".2e") for k in ("split_vs_single", "single_vs_float32", "split_vs_float32")]
        within = "yes" if worst["split_vs_single"] < BF16_TOLERANCE else "**no**"
        lines.append(f"| {c['rule']} | {c['case']} | " + " | ".join(cells) + f" | {within} |")
    return lines + ([f"- failed: `{d['error']}`"] if d.get("error") else [])


def report_longest(d: dict) -> list[str]:
    lines = _heading(
        f"### The longest sequence that trains: {d['preset']}, one sequence a step, `{d['length_args']}`",
        ["ranks", "tokens a sequence", "tokens/s", "peak GiB per GPU", "result"],
    )
    for nproc, rows in d["runs"].items():
        for row in rows:
            result = "trains" if row["ok"] else f"fails: `{row.get('error', '')}`"
            lines.append(f"| {nproc} | {row['seq_len']:,} | {fmt(row['tokens_per_s'])} | {memory(row)} | {result} |")
    return lines


REPORTS = {"ddp": report_ddp, "resume": report_resume, "fsdp": report_fsdp, "cp": report_cp, "longest": report_longest}


def write_report(out: pathlib.Path) -> str:
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in STAGES if (out / f"{name}.json").exists()}
    lines = ["## Several GPUs against one (`benchmarks/gpu_distributed.py`)", ""]
    for name, d in results.items():
        meta = d["meta"]
        lines += [f"Stage `{name}`: {meta['date']}, {meta['device']}, {meta['versions']}, {meta['seconds']:.0f} s;", ""]
        lines += [f"    {command}" for command in meta["commands"]] + [""]
        lines += ([f"### Stage `{name}` failed: `{d['failed']}`"] if "failed" in d else REPORTS[name](d)) + [""]
    text = "\n".join(lines)
    (out / "distributed.md").write_text(text)
    return text


# ------------------------------------------------------------------------------------------ main


def meta(r: Runner) -> dict:
    from efla.records import versions

    import torch

    found = versions("triton", "transformers", "fla")
    device = f"{torch.cuda.device_count()} x {found['cuda_device']}" if found["cuda_device"] else f"CPU ({os.cpu_count()} cores)"
    shown = ", ".join(f"{k} {v}" for k, v in found.items() if k not in ("cuda_device", "machine", "python"))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return dict(date=date, device=device, versions=shown, seconds=time.monotonic() - r.started, commands=list(r.commands))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", default=None, help="text files or directories to train on (needed by every stage)")
    p.add_argument("--out", required=True, help="where the stages' JSON and distributed.md go")
    p.add_argument("--work", default=None, help="the runs' logs and directories (default: a new temporary directory)")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory (checkpoints, model)")
    p.add_argument("--stages", default="ddp,resume,cp", help=f"comma-separated of {', '.join(STAGES)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs) of the runs on several; at least 2")
    p.add_argument("--preset", default="340m-efla")
    p.add_argument("--fsdp-preset", default="1.3b-efla")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=12, help="steps logged before a rank is killed")
    p.add_argument("--fsdp-steps", type=int, default=10)
    p.add_argument("--cp-tokens", type=int, default=65536)
    p.add_argument("--cp-dtype", default="bfloat16")
    p.add_argument("--cp-args", default="", help="more options of context_parallel_check.py")
    p.add_argument("--lengths", default="131072,262144,524288,1048576")
    p.add_argument("--length-args", default="--grad-checkpointing", help="more options of the longest stage's runs")
    p.add_argument("--length-steps", type=int, default=3)
    p.add_argument("--val-sequences", type=int, default=16, help="held out for the validation loss (longest: none)")
    p.add_argument("--vocab-size", type=int, default=32000, help="of the byte-level BPE trained on --data (fla's models': 32000)")
    p.add_argument("--tokenizer-chars", type=int, default=20_000_000, help="characters of --data the BPE is trained on")
    p.add_argument("--train-args", default="", help="more options of every efla train run, e.g. '--threads 1'")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds a run may take")
    p.add_argument("--budget", type=float, default=None, help="seconds for all the runs: no run starts or lasts past it")
    a = p.parse_args(argv)
    a.stages = [s for s in a.stages.split(",") if s]
    if a.stages and not a.data:
        p.error("--data: text to train on is needed by every stage (an empty --stages '' only writes the report)")
    unknown = [s for s in a.stages if s not in STAGES]
    if unknown:
        p.error(f"unknown stage(s) {', '.join(unknown)} (--stages: {', '.join(STAGES)})")
    if a.nproc < 2:
        p.error(f"--nproc: expected at least 2 ranks, got {a.nproc}")
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    # the runs start in the repository: every path as the caller meant it
    a.data = [x if x.startswith("hf:") else os.path.abspath(x) for x in a.data or []]
    a.out = os.path.abspath(a.out)
    if a.stages:
        a.work = os.path.abspath(a.work) if a.work else tempfile.mkdtemp(prefix="gpu_distributed-")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    begun = time.monotonic()
    done = {name: json.loads((out / f"{name}.json").read_text()) for name in STAGES if (out / f"{name}.json").exists()}
    if not a.stages:
        print(write_report(out), flush=True)
        return 0
    print(f"gpu_distributed: runs in {a.work}", flush=True)
    signal.signal(signal.SIGTERM, stop_everything)
    deadline = None if a.budget is None else begun + a.budget
    for name in a.stages:
        if deadline is not None and time.monotonic() >= deadline:
            print(f"gpu_distributed: stage {name} not started (--budget {a.budget:.0f} s)", flush=True)
            continue
        r = Runner(a, name, deadline)
        try:
            done[name] = run_stage(name, r, done)
        except Exception as e:  # one stage's fault must not cost the stages after it
            done[name] = dict(failed=f"{type(e).__name__}: {e}"[:300])
        r.save(done[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
