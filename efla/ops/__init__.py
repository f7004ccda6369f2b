"""The EFLA recurrence and its Euler baselines, as a per-token scan and a chunkwise form.

Layout (flash-linear-attention's): ``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]``,
``beta, g: [B, T, HV]``, states ``[N, HV, K, V]`` (float32; float64 for float64 inputs).
``HV`` is ``H`` or a multiple of it (grouped values, as in Qwen3-Next): value head ``i`` reads
query/key head ``i // (HV // H)``, the head order of flash-linear-attention's grouped ops.
Every op returns ``(o, final_state)`` with ``o = scale * S_t^T q_t`` of ``v``'s shape and the
input dtype, and ``final_state`` only when ``output_final_state=True`` (else ``None``).

| op                     | recurrence per head (``lambda = ||k||^2``)                                                   |
| ---------------------- | -------------------------------------------------------------------------------------------- |
| ``*_efla``             | ``S = (I - alpha k k^T) S + alpha k v^T``, exact flow, ``alpha = (1 - exp(-beta lambda)) / lambda`` |
| ``*_gated_efla``       | exact flow of Gated DeltaNet                                                                 |
| ``*_delta_rule``       | DeltaNet (Euler): ``S = (I - beta k k^T) S + beta k v^T``                                    |
| ``*_gated_delta_rule`` | Gated DeltaNet: ``S = e^g (I - beta k k^T) S + beta k v^T``                                  |

Keywords shared by all: ``scale=None`` (``K ** -0.5``), ``initial_state=None``
(``[N, HV, K, V]``), ``output_final_state=False``, ``cu_seqlens=None`` (varlen: ``B == 1`` and
``N + 1`` offsets into T), ``use_q_l2norm_in_kernel`` / ``use_qk_l2norm_in_kernel`` (normalise
``q`` / ``q`` and ``k`` inside the op; default off: ``q`` and ``k`` are used as given, and EFLA
uses raw keys). CUDA tensors go to the GPU backend when it is installed
(``pip install "efla[cuda]"``); everything else runs the PyTorch implementation.
"""

from __future__ import annotations

from ..variants import Variant
from .api import run as _run
from .coefficients import efla_coefficient, gated_efla_coefficients
from .cuda.key_checks import check_keys, deferred_key_checks
from .mixer_step import DecodeSpec, fused_decode_available, fused_decode_step
from .gates import raw_gates
from .normalize import l2_normalize

__all__ = [
    "DecodeSpec",
    "fused_decode_available",
    "fused_decode_step",
    "efla_coefficient",
    "gated_efla_coefficients",
    "l2_normalize",
    "check_keys",
    "deferred_key_checks",
    "chunk_efla",
    "recurrent_efla",
    "chunk_gated_efla",
    "recurrent_gated_efla",
    "chunk_delta_rule",
    "recurrent_delta_rule",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
]

_DOC = """{title}

    Args:
        q: queries ``[B, T, H, K]`` (used as given).
        k: keys ``[B, T, H, K]``{knote}.
        v: values ``[B, T, HV, V]``; ``HV`` is ``H`` or a multiple of it (grouped values: value
            head ``i`` reads q/k head ``i // (HV // H)``; q and k are repeated per group inside
            the op, a copy ``HV // H`` times their size).{gdoc}
        beta: step sizes ``[B, T, HV]``, >= 0{bnote}.
        scale: read-out scale; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` or ``None`` (zeros).
        output_final_state: also return the final state ``[N, HV, K, V]`` (float32, or
            float64 for float64 inputs).
        cu_seqlens: ``None`` or int tensor ``[N + 1]`` of offsets (``B == 1``, varlen).
        use_q_l2norm_in_kernel: L2-normalise ``q`` inside the op (EFLA's layers: unit queries,
            raw keys); on the GPU it is fused into the kernels' prologue and backward.
        use_qk_l2norm_in_kernel: L2-normalise ``q`` and ``k`` inside the op (DeltaNet's layers;
            flash-linear-attention's keyword).{gkw}

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, HV, V]`` in the input dtype; ``final_state``
        is ``None`` unless ``output_final_state``.

    Raises:
        ValueError: an input that is not a tensor or has the wrong shape, dtype or device,
            ``HV`` not a multiple of ``H``, or malformed ``cu_seqlens``; and on the CPU (on a
            GPU with ``EFLA_CHECK_VALUES=1``) NaN/Inf, ``beta < 0``, ``g > 0``, a key whose
            ``||k||^2`` overflows the compute dtype, or finite inputs whose result overflows it
            (value checks are skipped inside ``torch.compile``d code). On a GPU, keys whose
            ``||k||^2`` overflows float32 are refused whatever ``EFLA_CHECK_VALUES`` says (the
            exact rules' chunk ops without stalling the host: at a later chunk call, or at
            ``check_keys()``; at the call itself with ``EFLA_CHECK_KEYS=sync``, one device sync;
            inside ``deferred_key_checks()`` at the block's end; the other paths at the call, one
            device sync), except by the exact rules' scan without autograd, which
            computes them exactly; the check is skipped where a sync is not allowed (CUDA-graph
            capture and replay; compiled code, apart from the exact rules' chunk ops).

    Examples:
        >>> import torch
        >>> from efla.ops import {name}
        >>> B, T, H, K, V = 2, 100, 4, 16, 16
        >>> q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H){gex}
        >>> o, S = {name}(q, k, v, {gargs}beta, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([2, 100, 4, 16]), torch.Size([2, 4, 16, 16]))
    """


_GATE_KEYWORDS = """
        use_gate_in_kernel: ``g`` is the decay's raw input ``a`` and the op forms
            ``g = -exp(A_log) * softplus(a + dt_bias)`` (flash-linear-attention's keyword; Gated
            DeltaNet's gate). On the GPU the Gated EFLA chunk op does it inside its coefficient
            pass, forward and backward; elsewhere PyTorch does it first.
        A_log: ``[HV]``, required with ``use_gate_in_kernel`` (gradients flow to it).
        dt_bias: ``[HV]`` or ``None``, used with ``use_gate_in_kernel``.
        use_beta_sigmoid_in_kernel: ``beta`` is a logit and the step is ``sigmoid(beta)``.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, the step is ``2 * sigmoid(beta)``."""


def _make(rule: str, mode: str, title: str):
    variant = Variant.parse(rule)
    gated, exact = variant.gated, variant.exact
    name = f"{mode}_{rule}"

    if gated:

        def op(
            q,
            k,
            v,
            g,
            beta,
            *,
            scale=None,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=None,
            use_q_l2norm_in_kernel=False,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
            A_log=None,
            dt_bias=None,
            use_beta_sigmoid_in_kernel=False,
            allow_neg_eigval=False,
        ):
            gates = raw_gates(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
            return _run(
                rule,
                mode,
                q,
                k,
                v,
                g,
                beta,
                scale=scale,
                initial_state=initial_state,
                output_final_state=output_final_state,
                cu_seqlens=cu_seqlens,
                q_l2norm=bool(use_q_l2norm_in_kernel or use_qk_l2norm_in_kernel),
                k_l2norm=bool(use_qk_l2norm_in_kernel),
                gates=gates,
            )
    else:

        def op(
            q,
            k,
            v,
            beta,
            *,
            scale=None,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=None,
            use_q_l2norm_in_kernel=False,
            use_qk_l2norm_in_kernel=False,
        ):
            return _run(
                rule,
                mode,
                q,
                k,
                v,
                None,
                beta,
                scale=scale,
                initial_state=initial_state,
                output_final_state=output_final_state,
                cu_seqlens=cu_seqlens,
                q_l2norm=bool(use_q_l2norm_in_kernel or use_qk_l2norm_in_kernel),
                k_l2norm=bool(use_qk_l2norm_in_kernel),
            )

    op.__name__ = op.__qualname__ = name
    op.__doc__ = _DOC.format(
        title=title,
        name=name,
        knote=" (raw: ``||k||^2`` is the stiffness)" if exact else "",
        gdoc="\n        g: log gate ``[B, T, HV]``, ``g <= 0`` (gate ``exp(g)``)." if gated else "",
        bnote=" (the exact coefficient is computed inside)" if exact else " (used directly)",
        gex="\n        >>> g = -torch.rand(B, T, H)" if gated else "",
        gargs="g, " if gated else "",
        gkw=_GATE_KEYWORDS if gated else "",
    )
    return op


chunk_efla = _make("efla", "chunk", "EFLA, chunkwise WY/UT form (training and prefill).")
recurrent_efla = _make("efla", "recurrent", "EFLA, per-token scan (reference and decoding).")
chunk_gated_efla = _make("gated_efla", "chunk", "Gated EFLA, chunkwise form.")
recurrent_gated_efla = _make("gated_efla", "recurrent", "Gated EFLA, per-token scan.")
chunk_delta_rule = _make("delta_rule", "chunk", "DeltaNet (Euler step), chunkwise form.")
recurrent_delta_rule = _make("delta_rule", "recurrent", "DeltaNet (Euler step), per-token scan.")
chunk_gated_delta_rule = _make("gated_delta_rule", "chunk", "Gated DeltaNet (Euler step), chunkwise form.")
recurrent_gated_delta_rule = _make("gated_delta_rule", "recurrent", "Gated DeltaNet (Euler step), per-token scan.")
