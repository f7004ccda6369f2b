"""``EFLAConfig``: one configuration for the four variants (EFLA, Gated EFLA, DeltaNet, Gated DeltaNet)."""

from __future__ import annotations

import functools
import inspect

from transformers import PretrainedConfig

from ..variants import Variant
from .hybrid import parse_attn_spec

__all__ = ["EFLAConfig", "config_file_keys"]


def _check_num_v_heads(num_v_heads, num_heads: int) -> int | None:
    if num_v_heads is None:
        return None
    if not isinstance(num_v_heads, int) or isinstance(num_v_heads, bool) or num_v_heads < 1:
        raise ValueError(f"num_v_heads: expected a positive int or None, got {num_v_heads!r}")
    if num_v_heads % num_heads != 0:
        raise ValueError(
            f"num_v_heads: expected a multiple of num_heads = {num_heads} (each query/key head "
            f"serves num_v_heads // num_heads value heads), got {num_v_heads}"
        )
    return num_v_heads


class EFLAConfig(PretrainedConfig):
    r"""Configuration of ``efla.models.EFLAModel`` / ``efla.models.EFLAForCausalLM``.

    The field names are flash-linear-attention's (``DeltaNetConfig`` / ``GatedDeltaNetConfig``),
    so its configs translate field by field. Two fields choose the variant:

    | update_rule   | gated   | model                                                 |
    | ------------- | ------- | ----------------------------------------------------- |
    | ``"exact"``   | False   | EFLA (token mixer ``efla.layers.EFLA``)               |
    | ``"euler"``   | False   | DeltaNet (same parameters as EFLA)                    |
    | ``"exact"``   | True    | Gated EFLA (token mixer ``efla.layers.GatedEFLA``)    |
    | ``"euler"``   | True    | Gated DeltaNet (same parameters as Gated EFLA)        |

    Args:
        vocab_size: vocabulary size. Default ``32000``.
        hidden_size: model width. Default ``2048``.
        num_hidden_layers: blocks. Default ``24``.
        num_heads: query/key heads. Default ``16``.
        update_rule: ``"exact"`` (EFLA) or ``"euler"`` (DeltaNet). Default ``"exact"``.
        gated: Gated DeltaNet architecture (log gate ``a_proj``/``A_log``/``dt_bias``). Default ``False``.
        attn_mode: ``"chunk"`` or ``"recurrent"``. Default ``"chunk"``.
        expand_k: ungated only: key width ``= hidden_size * expand_k``. Default ``1.0``.
        expand_v: value expansion; ungated: value width ``= hidden_size * expand_v``; gated: value
            head dim ``= head_dim * expand_v``. Default ``None`` = ``1.0`` ungated, ``2.0`` gated
            (flash-linear-attention's defaults).
        head_dim: gated only: query/key head dim. Default ``None`` = ``hidden_size * expand_k // num_heads``.
        num_v_heads: value heads, a multiple of ``num_heads`` (grouped values when larger: each
            query/key head serves ``num_v_heads // num_heads`` consecutive value heads, each with
            its own state; gated: value width ``= num_v_heads * head_dim * expand_v``; ungated:
            the value width ``hidden_size * expand_v`` is split over them). Default ``None`` =
            ``num_heads``.
        use_gate: SiLU output gate. Default ``None`` = ``gated`` (False for DeltaNet, True for
            Gated DeltaNet, as in flash-linear-attention).
        output_gate_activation: gated only: ``"swish"`` (SiLU) or ``"sigmoid"``. Default ``"swish"``.
        fuse_input_projections: in training, each layer's input projections (q, k, v, beta's and
            the decay gate's; not the output gate's) as one matrix product over their stacked
            weights: the same weights, checkpoints and results (to rounding), fewer kernel launches,
            no stacked copy kept for backward. ``False`` runs them one by one. Default ``True``.
        use_short_conv: short causal convolutions on q, k, v. Default ``True``.
        conv_size: their width. Default ``4``.
        conv_bias: their bias. Default ``False``.
        use_beta: ungated only: learned ``beta = sigmoid(b_proj(x))`` (else 1). Default ``True``.
        qk_activation: ungated only: ``"silu"``/``"relu"``/``"elu"``/``"identity"``. Default ``"silu"``.
        qk_norm: ungated only: ``"l2"`` or ``"sum"``. Default ``"l2"``.
        allow_neg_eigval: ``beta *= 2``. Default ``False``.
        hidden_ratio: SwiGLU width ratio. Default ``4``.
        intermediate_size: explicit SwiGLU width (else ``2/3 * hidden_ratio * hidden_size``
            rounded up to a multiple of 256). Default ``None``.
        hidden_act: ``"swish"``. Default ``"swish"``.
        norm_eps: RMSNorm epsilon. Default ``1e-6``.
        initializer_range: std of the normal init. Default ``0.02``.
        max_position_embeddings: informational (no positional embeddings). Default ``2048``.
        use_cache: return a cache by default at inference. Default ``True``.
        pad_token_id: Default ``None``.
        bos_token_id: Default ``1``.
        eos_token_id: Default ``2``.
        tie_word_embeddings: share ``lm_head`` with the embeddings. Default ``False``.
        attn: softmax-attention layers among the linear ones (a hybrid model), flash-linear-attention's
            field: ``{"layers": [indices], "num_heads": H, "num_kv_heads": H (fewer: grouped keys/values),
            "qkv_bias": False, "window_size": None (or a sliding window of that many tokens, the
            query's own included), "rope_theta": 10000.0}``; only ``layers`` and ``num_heads`` are
            required. Those blocks use ``efla.layers.Attention`` (causal SDPA with RoPE).
            Default ``None`` (no attention layers).
        fuse_linear_cross_entropy: on the GPU with flash-linear-attention, a training forward with
            labels computes the loss chunk by chunk from the hidden states and never materialises
            the logits (``logits`` is then ``None``); evaluation and generation are unaffected.
            Default ``False`` (flash-linear-attention's default): the loss is fla's fused
            cross-entropy of the logits, whose backward in a training step overwrites the returned
            logits with their gradient (they are valid until ``backward``).

    Examples:
        >>> from efla.models import EFLAConfig
        >>> cfg = EFLAConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2)
        >>> cfg.model_type, cfg.variant
        ('efla', 'efla')
    """

    model_type = "efla"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        num_hidden_layers: int = 24,
        num_heads: int = 16,
        update_rule: str = "exact",
        gated: bool = False,
        attn_mode: str = "chunk",
        expand_k: float = 1.0,
        expand_v: float | None = None,
        head_dim: int | None = None,
        num_v_heads: int | None = None,
        use_gate: bool | None = None,
        output_gate_activation: str = "swish",
        fuse_input_projections: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_beta: bool = True,
        qk_activation: str = "silu",
        qk_norm: str = "l2",
        allow_neg_eigval: bool = False,
        hidden_ratio: float | None = 4,
        intermediate_size: int | None = None,
        hidden_act: str = "swish",
        norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 2048,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        fuse_linear_cross_entropy: bool = False,
        attn: dict | None = None,
        **kwargs,
    ):
        if update_rule not in ("exact", "euler"):
            raise ValueError(f"update_rule: expected 'exact' or 'euler', got {update_rule!r}")
        if not isinstance(gated, bool):
            raise ValueError(f"gated: expected True or False, got {gated!r}")
        if attn_mode not in ("chunk", "recurrent", "fused_recurrent"):
            raise ValueError(f"attn_mode: expected 'chunk' or 'recurrent', got {attn_mode!r}")
        for name, val in (
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("num_hidden_layers", num_hidden_layers),
            ("num_heads", num_heads),
            ("conv_size", conv_size),
        ):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected a positive int, got {val!r}")
        if hidden_act not in ("swish", "silu"):
            raise ValueError(f"hidden_act: expected 'swish', got {hidden_act!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.update_rule = update_rule
        self.gated = gated
        self.attn_mode = attn_mode
        self.expand_k = expand_k
        self.expand_v = expand_v if expand_v is not None else (2.0 if gated else 1.0)
        self.head_dim = head_dim if head_dim is not None else int(hidden_size * expand_k) // num_heads
        self.num_v_heads = _check_num_v_heads(num_v_heads, num_heads)
        self.use_gate = use_gate if use_gate is not None else gated
        if output_gate_activation not in ("swish", "silu", "sigmoid"):
            raise ValueError(f"output_gate_activation: expected 'swish', 'silu' or 'sigmoid', got {output_gate_activation!r}")
        self.output_gate_activation = output_gate_activation
        self.fuse_input_projections = bool(fuse_input_projections)
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.use_beta = use_beta
        self.qk_activation = qk_activation
        self.qk_norm = qk_norm
        self.allow_neg_eigval = allow_neg_eigval
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self.fuse_linear_cross_entropy = bool(fuse_linear_cross_entropy)
        self.attn = parse_attn_spec(attn, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size)
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @property
    def variant(self) -> str:
        """``"efla"``, ``"gated_efla"``, ``"deltanet"`` or ``"gated_deltanet"``."""
        return Variant.of(self.update_rule, self.gated).model_name


# keys of a config.json that transformers reads though a config of this version does not write them back
_OLDER_TRANSFORMERS_KEYS = frozenset({"torch_dtype", "auto_map"})
# what efla writes beside the fields: ``efla convert``'s record of the checkpoint the weights came from
_PROVENANCE_KEYS = frozenset({"converted_from"})


@functools.cache
def config_file_keys() -> frozenset[str]:
    """The keys an EFLAConfig JSON file (``efla train --config``, a model directory's ``config.json``) may
    hold: EFLAConfig's own fields and what transformers writes into every config. Any other key would be
    kept as an attribute that nothing reads, so a misspelt field would leave its default in force."""
    own = set(inspect.signature(EFLAConfig.__init__).parameters) - {"self", "kwargs"}
    return frozenset(own | set(EFLAConfig().to_dict()) | _OLDER_TRANSFORMERS_KEYS | _PROVENANCE_KEYS)
