"""Small building blocks shared by the token mixers and the model blocks.

Each module keeps flash-linear-attention's parameter names and shapes (``weight`` / ``bias``,
``gate_proj`` / ``up_proj`` / ``down_proj``) so that a DeltaNet or Gated DeltaNet checkpoint
maps onto our modules tensor by tensor. They are written in plain PyTorch (any device); on CUDA
tensors they run flash-linear-attention's fused kernels when it is installed (``efla.layers.fla_kernels``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from efla.ops.normalize import l2_normalize

from ._common import _bare_linear
from .fla_kernels import kernels_for
from .single_step import stacked_projections

__all__ = ["ShortConvolution", "RMSNorm", "RMSNormGated", "GatedMLP", "decay_gate", "l2_normalize", "mlp_intermediate_size"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Norms and gates compute in float32, or float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution over time with a cached state for decoding.

    Args:
        hidden_size: channels ``D`` (one filter per channel). Default: required.
        kernel_size: filter width ``W``. Default: required (4 in the layers).
        bias: learnable per-channel bias. Default: ``False``.
        activation: ``"silu"`` / ``"swish"`` or ``None``. Default: ``"silu"``.

    Parameters are ``weight: [D, 1, W]`` and optional ``bias: [D]`` (``nn.Conv1d``'s), as in
    flash-linear-attention's ``ShortConvolution``.

    ``forward(x [B, T, D], cache=None, output_final_state=False, cu_seqlens=None, mask=None)``
    returns ``(y [B, T, D], state)``. ``cache`` / ``state`` is ``[N, D, W]``: the last ``W``
    inputs of each sequence (oldest first, zeros before the sequence start); ``N = B``, or the
    number of packed sequences when ``cu_seqlens`` (``B == 1``) is given. ``state`` is ``None``
    unless ``output_final_state``. ``mask [B, T, 1]`` (0 = padding, whose inputs the caller
    zeroed) makes ``state`` end at each row's last real input, so a row padded on the right
    leaves the state where its tokens end.

    Examples:
        >>> import torch
        >>> conv = ShortConvolution(8, 4)
        >>> y, s = conv(torch.randn(2, 5, 8), output_final_state=True)
        >>> y.shape, s.shape
        (torch.Size([2, 5, 8]), torch.Size([2, 8, 4]))
    """

    def __init__(
        self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu", device=None, dtype=None
    ):
        if kernel_size < 1:
            raise ValueError(f"kernel_size: expected >= 1, got {kernel_size}")
        super().__init__(
            hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias, padding=0, device=device, dtype=dtype
        )
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, kernel_size={self.kernel_size[0]}, bias={self.bias is not None}, activation={self.activation}"
        )

    def _act(self, y: torch.Tensor) -> torch.Tensor:
        return F.silu(y) if self.activation is not None else y

    def forward(
        self,
        x: torch.Tensor,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        y, state = self._forward(x, cache, output_final_state, cu_seqlens)
        if mask is not None and state is not None:
            state = self.history_until_last_real(x, cache, mask)
        return y, state

    def history_until_last_real(self, x: torch.Tensor, cache: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """``[B, D, W]``: each row's last ``W`` inputs up to its last real position (``mask [B, T, 1]``),
        the cache's before its first input; a row without real inputs keeps its cache."""
        B, T, D = x.shape
        W = self.kernel_size[0]
        history = cache.to(x.dtype) if cache is not None else x.new_zeros(B, D, W)
        full = torch.cat([history, x.transpose(1, 2)], dim=-1)  # input t at column W + t
        ends = (mask[..., 0].to(torch.long) * torch.arange(1, T + 1, device=x.device)).amax(1)  # last real + 1
        columns = ends[:, None] + torch.arange(W, device=x.device)
        return full.gather(-1, columns[:, None, :].expand(B, D, W)).contiguous()

    def _forward(self, x, cache, output_final_state, cu_seqlens):
        B, T, D = x.shape
        W = self.kernel_size[0]
        if self.hidden_size != D:
            raise ValueError(f"x: expected last dim {self.hidden_size}, got shape {tuple(x.shape)}")
        fused = kernels_for(x)
        # fla's kernel drops the gradient that reaches x through the final state, so a final state
        # that autograd tracks stays on the PyTorch path (training never asks for one)
        final_state_needs_grad = output_final_state and torch.is_grad_enabled()
        if fused is not None and T > 1 and not final_state_needs_grad:
            return self._forward_fused(fused, x, cache, output_final_state, cu_seqlens)
        if cu_seqlens is not None:
            return self._forward_varlen(x, cache, output_final_state, cu_seqlens)
        if cache is not None and cache.shape != (B, D, W):
            raise ValueError(f"cache: expected shape ({B}, {D}, {W}), got {tuple(cache.shape)}")
        if T > 1 and x.device.type == "cpu" and not torch.is_grad_enabled():
            return self._forward_shifted(x, cache, output_final_state)
        xt = x.transpose(1, 2)  # [B, D, T]
        if cache is None:
            history = xt.new_zeros(B, D, W)
        else:
            history = cache.to(xt.dtype)
        full = torch.cat([history, xt], dim=-1)  # [B, D, W + T]
        if T == 1:  # a decoding step: a weighted sum (conv1d's CPU path costs ~10x more at this size)
            y = (full[..., 1:] * self.weight[:, 0]).sum(-1, keepdim=True)
            y = y + self.bias[:, None] if self.bias is not None else y
        else:
            y = F.conv1d(full[..., 1:], self.weight, self.bias, groups=D)  # [B, D, T]
        state = full[..., -W:].contiguous() if output_final_state else None
        return self._act(y.transpose(1, 2)), state

    def _forward_shifted(self, x, cache, output_final_state):
        """The convolution as a weighted sum of ``W`` shifted copies of ``x``, for inference on the CPU.

        oneDNN's CPU convolution creates a compiled kernel for each new input shape and keeps up to
        1,024 of them: a server or ``generate`` meets a new shape with nearly every prompt length, and
        a server's resident memory grew with them. This sum keeps nothing per shape and is faster at
        most inference sizes (``benchmarks/cpu_short_conv.py``); training keeps ``conv1d``, whose
        backward is faster than this sum's at long sequences."""
        B, T, D = x.shape
        W = self.kernel_size[0]
        history = cache.transpose(1, 2).to(x.dtype) if cache is not None else x.new_zeros(B, W, D)
        full = torch.cat([history, x], dim=1)  # [B, W + T, D]: input t at row W + t
        taps = self.weight[:, 0].t().to(x.dtype)  # [W, D]; taps[W - 1] multiplies the current input
        y = full[:, 1 : 1 + T] * taps[0]
        for j in range(1, W):
            y.addcmul_(full[:, 1 + j : 1 + j + T], taps[j])
        if self.bias is not None:
            y += self.bias.to(x.dtype)
        state = full[:, -W:].transpose(1, 2).contiguous() if output_final_state else None
        return self._act(y), state

    def _forward_fused(self, fused, x, cache, output_final_state, cu_seqlens):
        B, _, D = x.shape
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        W = self.kernel_size[0]
        if cache is not None and cache.shape != (N, D, W):
            raise ValueError(f"cache: expected shape ({N}, {D}, {W}), got {tuple(cache.shape)}")
        return fused.causal_conv1d(
            # squeeze, not [:, 0]: a select's backward writes a zeroed copy (two more GPU ops per step)
            x,
            weight=self.weight.squeeze(1),
            bias=self.bias,
            initial_state=cache.to(x.dtype) if cache is not None else None,
            output_final_state=output_final_state,
            activation=self.activation,
            cu_seqlens=cu_seqlens,
        )

    def _forward_varlen(self, x, cache, output_final_state, cu_seqlens):
        # Packed sequences [1, T, D]: each output mixes only inputs of its own sequence (and that
        # sequence's cached history); done with W shifted copies instead of a Python loop.
        B, T, D = x.shape
        W = self.kernel_size[0]
        if B != 1:
            raise ValueError(f"cu_seqlens: varlen input needs batch size 1, got x of shape {tuple(x.shape)}")
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        N = cu.numel() - 1
        if cache is not None and cache.shape != (N, D, W):
            raise ValueError(f"cache: expected shape ({N}, {D}, {W}), got {tuple(cache.shape)}")
        lengths = cu[1:] - cu[:-1]
        seq_id = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)  # [T]
        pos = torch.arange(T, device=x.device) - cu[:-1][seq_id]  # position inside its sequence
        hist = cache.to(x.dtype) if cache is not None else x.new_zeros(N, D, W)
        xs = x[0]  # [T, D]
        w = self.weight.squeeze(1)  # [D, W]; w[:, W-1] multiplies the current input
        y = xs * w[:, W - 1]
        for j in range(1, W):
            inside = (pos - j) >= 0  # [T]
            shifted = torch.roll(xs, shifts=j, dims=0)
            # before the sequence start read the cached history: index W + (pos - j) in [0, W)
            from_hist = hist[seq_id, :, (W + pos - j).clamp(0, W - 1)]  # [T, D]
            src = torch.where(inside[:, None], shifted, from_hist)
            y = y + src * w[:, W - 1 - j]
        if self.bias is not None:
            y = y + self.bias
        state = None
        if output_final_state:
            # last W inputs of each sequence: concat(history, inputs)[-W:]
            idx = cu[1:, None] - W + torch.arange(W, device=x.device)[None, :]  # [N, W] absolute positions
            rel = idx - cu[:-1, None]  # relative to sequence start
            inside = rel >= 0
            from_x = xs[idx.clamp(0, max(T - 1, 0))]  # [N, W, D]
            from_hist = torch.gather(hist, 2, (W + rel).clamp(0, W - 1)[:, None, :].expand(N, D, W))  # [N, D, W]
            state = torch.where(inside[:, None, :], from_x.transpose(1, 2), from_hist).contiguous()
        return self._act(y)[None], state


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``.

    Args:
        hidden_size: normalised dim. Default: required.
        eps: Default ``1e-5``.
        elementwise_affine: learnable ``weight`` (ones at init). Default ``True``.
        dtype: parameter dtype. Default ``None``.

    Computed in float32 (float64 for float64 inputs) and returned in the input dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, device=None, dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, prenorm: bool = False):
        """``norm(x)``; with ``residual``, ``norm(x + residual)``; with ``prenorm`` also the sum
        ``x + residual`` (in ``residual``'s dtype), as ``(normed, sum)``: the pre-norm block's
        residual stream, fused into one kernel on the GPU."""
        fused = kernels_for(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, None, residual=residual, eps=self.eps, prenorm=prenorm)
        if residual is not None:
            x = x.to(residual.dtype) + residual
        y = self._normalize(x)
        return (y, x) if prenorm else y

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(xf.dtype)
        return y.to(x.dtype)


class RMSNormGated(RMSNorm):
    """Gated RMS normalisation: ``RMSNorm(x) * act(g)`` with ``act`` = SiLU (``"swish"``/``"silu"``,
    the default) or ``"sigmoid"`` (flash-linear-attention's ``FusedRMSNormGated``).
    ``forward(x, g)``, same shapes."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        activation: str = "swish",
        device=None,
        dtype=None,
    ):
        super().__init__(hidden_size, eps=eps, elementwise_affine=elementwise_affine, device=device, dtype=dtype)
        if activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"activation: expected 'swish', 'silu' or 'sigmoid', got {activation!r}")
        self.activation = activation

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation={self.activation}"

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        fused = kernels_for(x)
        if fused is not None:
            return fused.rms_norm_gated(x, g, self.weight, None, activation=self.activation, eps=self.eps)
        gf = g.to(_compute_dtype(x))
        gate = torch.sigmoid(gf) if self.activation == "sigmoid" else F.silu(gf)
        return (self._normalize(x).to(gf.dtype) * gate).to(x.dtype)


def decay_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's decay in log space, ``g = -exp(A_log) * softplus(a + dt_bias)`` per head
    (``a [..., H]``, ``A_log, dt_bias [H]``), in float32 (float64 for float64 ``a``): the ops keep the
    gate's cumulative sum in that precision. On CUDA one fused kernel each way (fla's) replaces a
    chain of six elementwise kernels forward and ten backward; under ``torch.compile`` the PyTorch
    code runs, which the compiler fuses itself (fla's gate function is kept out of graphs)."""
    fused = kernels_for(a)
    if fused is not None and not torch.compiler.is_compiling():
        return fused.decay_gate(a, A_log, dt_bias, output_dtype=torch.float32)
    cdt = torch.float64 if a.dtype == torch.float64 else torch.float32
    return -A_log.to(cdt).exp() * F.softplus(a.to(cdt) + dt_bias.to(cdt))


def mlp_intermediate_size(hidden_size: int, hidden_ratio: float | None = 4, intermediate_size: int | None = None) -> int:
    """The SwiGLU width: ``intermediate_size`` if given, else ``2/3 * hidden_ratio * hidden_size``
    rounded up to a multiple of 256 (flash-linear-attention's ``GatedMLP`` rule)."""
    if intermediate_size is not None:
        return int(intermediate_size)
    ratio = 4 if hidden_ratio is None else hidden_ratio
    size = int(hidden_size * ratio * 2 / 3)
    return 256 * ((size + 255) // 256)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block: ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    Args:
        hidden_size: model width. Default: required.
        hidden_ratio: width ratio used when ``intermediate_size`` is ``None``. Default ``4``.
        intermediate_size: explicit inner width. Default ``None`` (see ``mlp_intermediate_size``).
        hidden_act: only ``"swish"`` (SiLU). Default ``"swish"``.
    """

    def __init__(
        self, hidden_size: int, hidden_ratio: float | None = 4, intermediate_size: int | None = None, hidden_act: str = "swish"
    ):
        super().__init__()
        if hidden_act not in ("swish", "silu"):
            raise ValueError(f"hidden_act: expected 'swish' (SiLU), got {hidden_act!r}")
        self.hidden_size = hidden_size
        self.intermediate_size = mlp_intermediate_size(hidden_size, hidden_ratio, intermediate_size)
        self.gate_proj = nn.Linear(hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        fused = kernels_for(x)
        if fused is not None:  # SiLU-gate and down projection in one op that keeps no product for backward
            return fused.swiglu_linear(self.gate_proj(x), self.up_proj(x), self.down_proj.weight, self.down_proj.bias)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; without autograd in fewer kernels (inference, decoding above all):
        the down projection accumulates into the residual (one product, no separate sum) and on the
        GPU the gate and up projections of a decoding step are one product over their stacked weights."""
        if torch.is_grad_enabled() or residual.dtype != x.dtype or not _bare_linear(self.down_proj):
            return residual + self(x)
        if x.shape[-2] == 1:
            gate, up = stacked_projections(self, x, [self.gate_proj, self.up_proj])
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        fused = kernels_for(x)
        h = fused.swiglu_forward(gate, up, output_contiguous=True) if fused is not None else F.silu(gate) * up
        out = torch.addmm(
            residual.reshape(-1, self.hidden_size), h.reshape(-1, self.intermediate_size), self.down_proj.weight.t()
        )
        return out.view(residual.shape)
