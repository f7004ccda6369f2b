"""Which launch settings of the gated ``dqkwg`` kernel fault at small value heads (GPU).

Each setting of ``DQKWG_CONFIGS`` as written (value blocks of 64 and 128, not fitted to the head)
runs once at the given head dims in its own process (a fault poisons the process's CUDA context)
on the inputs the gated backward hands the kernel; the table says which ones ran.

Usage (GPU machine): ``python benchmarks/gpu_launch_faults.py --dims 32x32,64x64 --out DIR``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CHILD = """
import sys, torch
sys.path.insert(0, {repo!r})
import tests.ops.test_launch_settings as t
from efla.ops.cuda import chunk as ch
args, _ = t._gated_backward_inputs({K}, {V})
ch.gated_dqkwg(*args, launch=dict(BV={BV}, num_warps={w}, num_stages={s}))
torch.cuda.synchronize()
print("ok")
"""


def try_setting(K: int, V: int, BV: int, w: int, s: int) -> str:
    code = CHILD.format(repo=REPO, K=K, V=V, BV=BV, w=w, s=s)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode == 0 and r.stdout.strip().endswith("ok"):
        return "ran"
    last = [line for line in r.stderr.strip().splitlines() if "Error" in line]
    return "fault: " + (last[-1][:90] if last else f"exit {r.returncode}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="32x32", help="K x V pairs, comma-separated")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from efla.ops.cuda.kernels import DQKWG_CONFIGS

    cases = [
        (int(d.split("x")[0]), int(d.split("x")[1]), c.kwargs["BV"], c.num_warps, c.num_stages)
        for d in args.dims.split(",")
        for c in DQKWG_CONFIGS
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: try_setting(*c), cases))
    lines = ["| K x V | BV | warps | stages | result |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {K}x{V} | {BV} | {w} | {s} | {res} |" for (K, V, BV, w, s), res in zip(cases, results)]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_launch_faults.md"), "w") as fh:
        fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
