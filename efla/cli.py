"""``efla <command>``: argument parsing and printing only; the work lives in efla.experiments."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from rich.console import Console
from rich.table import Table

console = Console()


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def cmd_demo(args) -> int:
    from efla.experiments.onestep import one_step_table
    from efla.experiments.timing import op_timings

    t0 = time.perf_counter()
    console.rule("[bold]EFLA demo[/bold]: exact flow vs Euler (DeltaNet)")
    console.print(
        "One step of S' = (I - c k k^T) S + c k v^T from the same state, unit key (lambda = 1).\n"
        "Euler (DeltaNet) uses c = beta: its eigenvalue along k is 1 - beta*lambda.\n"
        "EFLA integrates the ODE exactly: c = (1 - exp(-beta*lambda))/lambda, eigenvalue exp(-beta*lambda)."
    )
    rows = one_step_table()
    tab = Table(title="One step: exact flow vs Euler")
    for col in ("beta*lambda", "Euler eigenvalue 1-beta*lambda", "EFLA eigenvalue exp(-beta*lambda)",
                "||S_exact - S_euler|| / ||S_0||", "Euler"):
        tab.add_column(col, justify="right")
    for r in rows:
        tab.add_row(
            f"{r['beta_lambda']:g}", f"{r['euler_eigenvalue']:+.4f}", f"{r['exact_eigenvalue']:.4f}",
            f"{r['one_step_rel_diff']:.2e}", "[red]expands[/red]" if r["euler_expands"] else "contracts",
        )
    console.print(tab)
    console.print("The difference shrinks as (beta*lambda)^2 for small steps; past beta*lambda = 2 Euler expands the state.\n")

    shapes = ((1, 256, 4, 64), (1, 1024, 4, 64)) if args.quick else ((1, 512, 4, 64), (1, 2048, 4, 64), (2, 2048, 4, 64))
    with console.status("timing chunk_efla vs recurrent_efla on the CPU ..."):
        timings = op_timings(shapes=shapes, reps=2 if args.quick else 3)
    tab = Table(title="CPU time, float32 (median ms)")
    for col in ("[B, T, H, D]", "chunk fwd", "recurrent fwd", "chunk fwd+bwd", "recurrent fwd+bwd", "chunk speed-up (fwd+bwd)"):
        tab.add_column(col, justify="right")
    for r in timings:
        tab.add_row(
            str(r["shape"]), f"{r['chunk_fwd_ms']:.1f}", f"{r['recurrent_fwd_ms']:.1f}", f"{r['chunk_fwd_bwd_ms']:.1f}",
            f"{r['recurrent_fwd_bwd_ms']:.1f}", f"{r['recurrent_fwd_bwd_ms'] / r['chunk_fwd_bwd_ms']:.1f}x",
        )
    console.print(tab)
    out = os.path.join(args.out, "demo.json")
    _write_json(out, dict(one_step=rows, cpu_timings=timings, seconds=time.perf_counter() - t0))
    console.print(f"Results written to [bold]{out}[/bold] ({time.perf_counter() - t0:.1f} s). "
                  "This is a small demonstration; see the README for the full experiments.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="efla", description="Exact Flow Linear Attention: ops, models and experiments.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="exact vs Euler in one step, and CPU timings of the ops")
    d.add_argument("--out", default="efla-demo", help="output directory (default: ./efla-demo)")
    d.add_argument("--quick", action="store_true", help="smaller timing shapes")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
