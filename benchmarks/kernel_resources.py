"""Registers and spills of our Triton kernels on an sm_90 GPU, without a GPU.

Compiles each launch setting of the coefficient backward (``efla.ops.cuda.kernels.coef_bwd_kernel``,
plain and gated, K = V = 128, bf16, pointers 16-byte aligned as at run time) with Triton's bundled
ptxas and prints, per setting: registers per thread, stack bytes per thread (spills), float64
divisions per thread and how many threads share one row (each of them computes the row's float64
scalar chain). A proxy to choose settings between GPU visits; speed itself is measured on the GPU.

Then the shared memory each setting of the gated ``dqkwg`` kernel needs at several head sizes,
against the H200's limit per block: a setting above it cannot launch there (the autotuner skips it);
and registers, spills and shared memory of every setting the fused forward's kernel tunes over
(``efla.ops.cuda.experimental.fused_forward``; ``w``/``u`` read, or formed from ``A``), plain and gated, at
K = V = 64, 128 and 256.

Usage: ``python benchmarks/kernel_resources.py`` (needs triton with its NVIDIA backend; no GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from efla.ops.cuda.experimental import fused_forward as ff
from efla.ops.cuda import kernels as kn

H200_SHARED_BYTES = 232448  # shared memory per block on sm_90 (opt-in maximum)
DQKWG_HEAD_DIMS = [(32, 32), (64, 128), (128, 128), (256, 128), (32, 256), (128, 256), (256, 256)]
DQKWG_SIGNATURE = {
    "q": "*bf16",
    "k": "*bf16",
    "v": "*bf16",
    "g": "*fp32",
    "h": "*bf16",
    "do": "*bf16",
    "dh": "*bf16",
    "dv": "*bf16",
    "dq": "*bf16",
    "dk": "*bf16",
    "dw": "*bf16",
    "dg": "*fp32",
    "cu_seqlens": "*i64",
    "chunk_indices": "*i32",
    "scale": "fp32",
    "T": "i32",
    "TOT": "i32",
}
SIGNATURE = {
    "k": "*bf16",
    "v": "*bf16",
    "beta": "*bf16",
    "g": "*fp32",
    "derase": "*bf16",
    "dgl": "*fp32",
    "dvin": "*bf16",
    "dk": "*bf16",
    "dk_more": "*bf16",
    "dbeta": "*bf16",
    "dg": "*fp32",
    "dv": "*bf16",
    "R": "i32",
    "H": "i32",
    "q": "*bf16",
    "q_rstd": "*fp32",
    "dq": "*bf16",
}


def compile_setting(gated: bool, BR: int, BC: int, num_warps: int, K: int = 128, V: int = 128):
    fn = kn.coef_bwd_kernel.fn
    signature = {name: SIGNATURE.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if signature[name][0] == "*"}
    # the gated backward adds its second dk part in the same pass
    # with the queries' normalisation, as the layers run it (use_q_l2norm_in_kernel)
    constants = dict(
        K=K,
        V=V,
        BR=BR,
        BC=BC,
        GATED=gated,
        G_MIN=kn.G_FLOOR,
        HAS_DK_MORE=gated,
        A_log=None,
        dt_bias=None,
        dgate=None,
        GATE_ACT=False,
        HAS_DT_BIAS=False,
        BETA_SCALE=0.0,
        QNORM=True,
    )
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def compile_dqkwg(K: int, V: int, config):
    fn = kn.gated_dqkwg_kernel.fn
    signature = {name: DQKWG_SIGNATURE.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if signature[name][0] == "*"}
    constants = dict(H=2, K=K, V=V, BT=64, BK=min(triton.next_power_of_2(K), 128), BV=config.kwargs["BV"], IS_VARLEN=False)
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def dqkwg_shared_memory_table() -> None:
    print()
    print(f"gated dqkwg: shared memory per block (bytes; H200 limit {H200_SHARED_BYTES:,})")
    print("| K | V | value block | warps | stages | shared bytes | fits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for K, V in DQKWG_HEAD_DIMS:
        for cfg in kn.dqkwg_configs(V):
            shared = compile_dqkwg(K, V, cfg).metadata.shared
            fits = "yes" if shared <= H200_SHARED_BYTES else "**no**"
            print(f"| {K} | {V} | {cfg.kwargs['BV']} | {cfg.num_warps} | {cfg.num_stages} | {shared:,} | {fits} |")


def compile_fused_forward(gated: bool, K: int, V: int, config):
    fn = ff.state_output_fwd_kernel.fn.fn  # under the heuristics and the autotuner
    signature = {name: ff.ARGUMENT_TYPES.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if signature[name][0] == "*"}
    flags = dict(USE_G=gated, USE_INITIAL_STATE=True, STORE_FINAL_STATE=True, IS_VARLEN=False)
    constants = dict(H=16, K=K, V=V, BT=64, BK=max(triton.next_power_of_2(K), 16), BV=config.kwargs["BV"], **flags)
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def fused_forward_table() -> None:
    print()
    print(f"fused forward (state and output in one kernel): per setting, bf16 (H200 shared limit {H200_SHARED_BYTES:,})")
    print("| rule | K = V | value block | warps | stages | registers | stack bytes | shared bytes | fits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gated in (False, True):
        for dim in (64, 128, 256):
            tunable = ff.state_output_fwd_kernel.fn.configs
            for cfg in ff._settings_that_hold_their_state(tunable, {}, K=dim):
                compiled = compile_fused_forward(gated, dim, dim, cfg)
                regs, stack = resources(compiled)
                shared = compiled.metadata.shared
                fits = "yes" if shared <= H200_SHARED_BYTES else "**no**"
                print(
                    f"| {'gated' if gated else 'plain'} | {dim} | {cfg.kwargs['BV']} "
                    f"| {cfg.num_warps} | {cfg.num_stages} | {regs} | {stack} | {shared:,} | {fits} |"
                )


def resources(compiled) -> tuple[int, int]:
    """(registers, stack bytes) per thread, from cuobjdump of the cubin."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        out = subprocess.run([cuobjdump, "-res-usage", fh.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", out).groups()
    return int(regs), int(stack)


def threads_per_row(compiled) -> int:
    """Threads that share one row of the [BR, BC] blocks (from the kernel's 2D blocked layout)."""
    layout = re.search(r"threadsPerWarp = \[(\d+), (\d+)\]", compiled.asm["ttgir"])
    return int(layout.group(2)) if layout else 1


def main() -> int:
    print(f"triton {triton.__version__}, sm_90, K = V = 128, bf16")
    print(
        "| rule | rows per program | columns per block | warps | registers | stack bytes | "
        "float64 divisions per thread | threads per row |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gated in (False, True):
        for cfg in kn.COEF_BWD_CONFIGS:
            BR, BC, w = cfg.kwargs["BR"], cfg.kwargs["BC"], cfg.num_warps
            compiled = compile_setting(gated, BR, BC, w)
            regs, stack = resources(compiled)
            divisions = len(re.findall(r"div\.rn\.f64", compiled.asm["ptx"]))
            rule = "gated" if gated else "plain"
            print(f"| {rule} | {BR} | {BC} | {w} | {regs} | {stack} | {divisions} | {threads_per_row(compiled)} |")
    dqkwg_shared_memory_table()
    fused_forward_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
