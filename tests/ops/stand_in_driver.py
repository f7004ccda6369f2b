"""Triton's own launch path on a machine without a GPU, for the launch and tuning tests: the
binder, specialisation, autotuner and heuristics are Triton's and fla's, only the driver and the
compiled kernel are stand-ins; each launch notes its grid, stream, argument vector and warp count
in ``launches``. Import only in a subprocess (it patches Triton for the whole process), with
Triton and fla installed and ``TRITON_INTERPRET`` unset."""

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

launches = []


class StandInKernel:
    function = packed_metadata = None

    def __init__(self, num_warps):
        self.num_warps = num_warps

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *values):
        launches.append(((gx, gy, gz), stream, values, self.num_warps))


class StandInDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 77

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def _compile_stand_in(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = self.device_caches[device][0][key] = StandInKernel(options.num_warps)
    return kernel


def install():
    """Patches Triton and torch for the process; the autotuner's timings favour the last setting."""
    from efla.ops.cuda import stages

    stages.kernels()  # fla reads the machine as it imports: before the stand-in takes over
    driver.set_active(StandInDriver())
    JITFunction._do_compile = _compile_stand_in
    Autotuner._bench = lambda self, *a, config, **k: [-float(self.configs.index(config))] * 3
    torch.cuda.current_device = lambda: 0
