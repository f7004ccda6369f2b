"""``EFLAModel`` and ``EFLAForCausalLM``: pre-norm blocks of (EFLA | GatedEFLA) + SwiGLU MLP; in a
hybrid model (config ``attn``) the listed blocks use softmax ``Attention`` instead.

Module names follow flash-linear-attention's DeltaNet / Gated DeltaNet models
(``model.embeddings``, ``model.layers.N.{attn_norm, attn, mlp_norm, mlp}``, ``model.norm``,
``lm_head``), so those checkpoints map onto these models tensor by tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from efla.layers import EFLA, GatedEFLA, GatedMLP, RMSNorm
from efla.layers.fla_kernels import kernels_for
from efla.ops import deferred_key_checks

from .cache import EFLACache
from .configuration_efla import EFLAConfig
from .hybrid import build_attention_layer

try:  # transformers >= 4.52
    from transformers.modeling_layers import GradientCheckpointingLayer as _BlockBase
except ImportError:  # pragma: no cover
    _BlockBase = nn.Module

try:  # transformers >= 5: init helpers that skip weights already loaded from a checkpoint
    from transformers import initialization as _init
except ImportError:  # pragma: no cover
    _init = nn.init

# Generation bookkeeping that a recurrent cache makes redundant: it keeps its own position.
_REDUNDANT_KWARGS = frozenset({"cache_position"})


def _refuse_unknown_kwargs(kwargs: dict) -> None:
    # Anything else would be dropped without effect; position_ids in particular is how transformers'
    # packing collator marks sequence starts, which this model takes as cu_seqlens instead.
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _REDUNDANT_KWARGS)
    if unknown:
        raise ValueError(f"unsupported forward arguments: {', '.join(unknown)} (packed sequences: pass cu_seqlens)")


def _keys_checked_once():
    """The GPU chunk calls of all layers checked for overflowing keys once, after the last layer (one
    device sync per forward); compiled code checks each call as a single op call does, as a traced
    context manager would break its graph."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else deferred_key_checks()


def _refuse_attention_weights(output_attentions: bool | None) -> None:
    # Linear attention never forms a [T, T] weight matrix, so there is nothing to return; transformers'
    # attention-free models (Mamba, RWKV) have no such output either. A ValueError rather than a warning:
    # a caller asking for attention maps would otherwise get a tuple without them and misread its fields.
    if output_attentions:
        raise ValueError("output_attentions=True: EFLA layers have no attention weights to return")


__all__ = ["EFLABlock", "EFLAPreTrainedModel", "EFLAModel", "EFLAForCausalLM"]

_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# transformers 5 renamed the cache argument/output field from `past_key_values` to `cache`
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _pick_cache(past_key_values, cache):
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("past_key_values, cache: pass the cache once (they are aliases)")
    c = past_key_values if past_key_values is not None else cache
    if c is not None and not isinstance(c, EFLACache):
        raise ValueError(f"past_key_values: expected an efla.models.EFLACache, got {type(c).__name__}")
    return c


def _is_loaded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_is_hf_initialized", False))


def build_token_mixer(config: EFLAConfig, layer_idx: int) -> nn.Module:
    """The block's ``attn`` module for ``config`` (``EFLA`` or ``GatedEFLA``; ``Attention`` for the
    blocks listed in ``config.attn``)."""
    attention = build_attention_layer(config, layer_idx)
    if attention is not None:
        return attention
    if config.gated:
        return GatedEFLA(
            hidden_size=config.hidden_size,
            expand_v=config.expand_v,
            head_dim=config.head_dim,
            num_heads=config.num_heads,
            num_v_heads=config.num_v_heads,
            mode=config.attn_mode,
            use_gate=config.use_gate,
            use_short_conv=config.use_short_conv,
            allow_neg_eigval=config.allow_neg_eigval,
            conv_size=config.conv_size,
            conv_bias=config.conv_bias,
            layer_idx=layer_idx,
            norm_eps=config.norm_eps,
            update_rule=config.update_rule,
            output_gate_activation=config.output_gate_activation,
            fuse_input_projections=config.fuse_input_projections,
        )
    return EFLA(
        mode=config.attn_mode,
        hidden_size=config.hidden_size,
        expand_k=config.expand_k,
        expand_v=config.expand_v,
        num_heads=config.num_heads,
        use_beta=config.use_beta,
        use_gate=config.use_gate,
        use_short_conv=config.use_short_conv,
        conv_size=config.conv_size,
        conv_bias=config.conv_bias,
        allow_neg_eigval=config.allow_neg_eigval,
        layer_idx=layer_idx,
        qk_activation=config.qk_activation,
        qk_norm=config.qk_norm,
        norm_eps=config.norm_eps,
        update_rule=config.update_rule,
        num_v_heads=config.num_v_heads,
        fuse_input_projections=config.fuse_input_projections,
    )


class EFLABlock(_BlockBase):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: EFLAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = build_token_mixer(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = GatedMLP(
            config.hidden_size,
            hidden_ratio=config.hidden_ratio,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
        )

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False, cu_seqlens=None, **kwargs):
        residual = hidden_states
        h, _, past_key_values = self.attn(
            self.attn_norm(hidden_states),
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            cu_seqlens=cu_seqlens,
        )
        h, residual = self.mlp_norm(h, residual, prenorm=True)  # residual += h, then the norm: one kernel on GPU
        return self.mlp.add_to(h, residual)


class EFLAPreTrainedModel(PreTrainedModel):
    config_class = EFLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EFLABlock"]
    _supports_cache_class = True
    _is_stateful = True  # recurrent state: no rollback (assisted decoding is refused by generate)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The model builds its own EFLACache on the first forward with use_cache=True.
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            _init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                _init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            _init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not _is_loaded(module.weight):
                module.weight[module.padding_idx].zero_()
        elif isinstance(module, RMSNorm) and module.weight is not None:
            _init.ones_(module.weight)
        elif isinstance(module, GatedEFLA) and not (_is_loaded(module.A_log) or _is_loaded(module.dt_bias)):
            module.reset_gate_parameters()


class EFLAModel(EFLAPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` blocks and a final RMSNorm.

    ``forward(input_ids [B, T] | inputs_embeds [B, T, D], attention_mask=None [B, T] 0/1
    (left padding), past_key_values=None (EFLACache; alias ``cache``), use_cache=None,
    cu_seqlens=None (packed ``B == 1`` input), output_hidden_states=None, return_dict=None)``.
    """

    def __init__(self, config: EFLAConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([EFLABlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: EFLACache | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        cache: EFLACache | None = None,
        **kwargs: Any,
    ):
        _refuse_attention_weights(output_attentions)
        _refuse_unknown_kwargs(kwargs)
        past_key_values = _pick_cache(past_key_values, cache)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        return_dict = True if return_dict is None else return_dict
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids, inputs_embeds: pass exactly one of them")
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [B, T], got {tuple(input_ids.shape)}")
        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        T = hidden_states.shape[1]
        if (
            isinstance(attention_mask, torch.Tensor)
            and attention_mask.dim() == 2
            and attention_mask.shape[1] >= T
            and not (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())
            and bool((attention_mask[:, -T:] == 1).all())
        ):
            attention_mask = None  # no padding among these tokens: one check here instead of one per layer
        if use_cache and past_key_values is None:
            past_key_values = EFLACache(len(self.layers))

        all_hidden = () if output_hidden_states else None
        with _keys_checked_once():
            for layer in self.layers:
                if output_hidden_states:
                    all_hidden += (hidden_states,)
                hidden_states = layer(
                    hidden_states,
                    attention_mask=attention_mask,
                    past_key_values=past_key_values,
                    use_cache=use_cache,
                    cu_seqlens=cu_seqlens,
                )
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden += (hidden_states,)

        out_cache = past_key_values if use_cache else None
        if not return_dict:
            return tuple(x for x in (hidden_states, out_cache, all_hidden) if x is not None)
        return BaseModelOutputWithPast(
            **{"last_hidden_state": hidden_states, _CACHE_FIELD: out_cache, "hidden_states": all_hidden}
        )

    # -- analysis -------------------------------------------------------------------------------------
    def set_record_stats(self, enabled: bool = True) -> None:
        """Make every token mixer keep ``stats`` (stiffness ``beta * ||k||^2`` etc.) after each forward."""
        for layer in self.layers:
            layer.attn.record_stats = bool(enabled)
            if not enabled:
                layer.attn.stats = None

    def get_stats(self) -> list[dict | None]:
        """Per layer, the ``stats`` dict of the last forward (``None`` when not recorded)."""
        return [layer.attn.stats for layer in self.layers]


@torch.compiler.disable
def _fused_cross_entropy(kernels, logits, target, reduction, inplace_backward):
    """fla's fused cross-entropy of ``[B, T, V]`` logits, flattened here, outside any compiled graph:
    a graph that returned the logits together with a flattened view of them was replayed with a
    corrupt view shape from torch 2.11's AOTAutograd cache."""
    loss_fn = kernels.CrossEntropyLoss(reduction=reduction, inplace_backward=inplace_backward)
    return loss_fn(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class EFLAForCausalLM(EFLAPreTrainedModel, GenerationMixin):
    """``EFLAModel`` plus a linear LM head; ``labels`` give the next-token cross-entropy
    (``labels`` are the inputs; the shift happens inside; ``-100`` is ignored).

    Examples:
        >>> import torch
        >>> from efla.models import EFLAConfig, EFLAForCausalLM
        >>> cfg = EFLAConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_heads=2)
        >>> model = EFLAForCausalLM(cfg)
        >>> ids = torch.randint(0, 256, (2, 12))
        >>> out = model(ids, labels=ids)
        >>> out.logits.shape
        torch.Size([2, 12, 256])
    """

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"} if _TRANSFORMERS_5 else ["lm_head.weight"]

    def __init__(self, config: EFLAConfig):
        super().__init__(config)
        self.model = EFLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def get_decoder(self):
        return self.model

    def set_decoder(self, decoder):
        self.model = decoder

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: EFLACache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | None = 0,
        cu_seqlens: torch.Tensor | None = None,
        cache: EFLACache | None = None,
        shift_labels: torch.LongTensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs: Any,
    ):
        _refuse_unknown_kwargs(kwargs)
        return_dict = True if return_dict is None else return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            past_key_values=_pick_cache(past_key_values, cache),
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            cu_seqlens=cu_seqlens,
        )
        hidden_states = outputs.last_hidden_state
        keep = logits_to_keep or 0
        if not isinstance(keep, int) or keep < 0:
            raise ValueError(f"logits_to_keep: expected an int >= 0, got {logits_to_keep!r}")
        target = self._targets(hidden_states, labels, shift_labels, keep, cu_seqlens)
        if target is None:
            logits, loss = self.lm_head(hidden_states[:, -keep:] if keep > 0 else hidden_states), None
        else:
            logits, loss = self._logits_and_loss(hidden_states, target, num_items_in_batch)

        out_cache = getattr(outputs, _CACHE_FIELD)
        if not return_dict:
            rest = tuple(x for x in (logits, out_cache, outputs.hidden_states) if x is not None)
            return ((loss,) + rest) if loss is not None else rest
        return CausalLMOutputWithPast(
            **{"loss": loss, "logits": logits, _CACHE_FIELD: out_cache, "hidden_states": outputs.hidden_states}
        )

    @staticmethod
    def shift(labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token targets: position ``t`` predicts ``labels[t + 1]``; the last position, and in
        packed input the last position of every sequence, get ``-100`` (ignored)."""
        target = torch.full_like(labels, -100)
        target[:, :-1] = labels[:, 1:]
        if cu_seqlens is not None:
            ends = cu_seqlens[1:].to(labels.device).long() - 1
            target[0, ends[ends >= 0]] = -100
        return target

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (float32) of ``labels`` (see ``shift``)."""
        target = EFLAForCausalLM.shift(labels, cu_seqlens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)

    def _targets(self, hidden_states, labels, shift_labels, keep, cu_seqlens):
        """The per-position targets from ``shift_labels`` (shifted by the caller, as sequence- and
        context-parallel trainers pass them, often beside ``labels``: then ``labels`` is ignored, as in
        transformers' ``ForCausalLMLoss``), else ``labels`` (shifted here), or ``None`` without either."""
        if labels is None and shift_labels is None:
            return None
        name, given = ("shift_labels", shift_labels) if shift_labels is not None else ("labels", labels)
        if given.shape != hidden_states.shape[:2]:
            raise ValueError(f"{name}: expected shape {tuple(hidden_states.shape[:2])}, got {tuple(given.shape)}")
        if keep > 0:
            raise ValueError(f"{name}: cannot compute the loss with logits_to_keep > 0")
        given = given.to(hidden_states.device)
        return given if shift_labels is not None else self.shift(given, cu_seqlens)

    def _logits_and_loss(self, hidden_states, target, num_items_in_batch):
        """``(logits or None, loss)``. On the GPU (flash-linear-attention installed) a training step
        with ``config.fuse_linear_cross_entropy`` never materialises the logits (returns ``None``
        for them); otherwise the loss is a fused (GPU) or float32 (CPU; float64 for a float64 model)
        cross-entropy of the logits, and on the GPU a training step's backward overwrites the returned
        logits with their gradient.
        ``num_items_in_batch`` switches to a sum divided by it (gradient accumulation)."""
        reduction = "mean" if num_items_in_batch is None else "sum"
        fused = kernels_for(hidden_states) if hidden_states.is_cuda else None  # fla's losses are CUDA-only
        training_step = self.training and torch.is_grad_enabled()
        logits = None
        if fused is not None and self.config.fuse_linear_cross_entropy and training_step:
            loss = fused.LinearCrossEntropyLoss(reduction=reduction)(
                hidden_states, target, self.lm_head.weight, self.lm_head.bias
            )
        else:
            logits = self.lm_head(hidden_states)
            if fused is not None:
                # a training step writes the logits' gradient over the logits (one logits-sized buffer
                # less, as in fla's models): the returned logits are valid until backward
                loss = _fused_cross_entropy(fused, logits, target, reduction, inplace_backward=training_step)
            else:
                wide = torch.promote_types(logits.dtype, torch.float32)  # float64 logits keep float64
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).to(wide), target.reshape(-1), ignore_index=-100, reduction=reduction
                )
        if num_items_in_batch is not None:
            loss = loss / torch.as_tensor(num_items_in_batch, device=loss.device, dtype=loss.dtype)
        return logits, loss

    # -- analysis -------------------------------------------------------------------------------------
    def set_record_stats(self, enabled: bool = True) -> None:
        """See ``EFLAModel.set_record_stats``."""
        self.model.set_record_stats(enabled)

    def get_stats(self) -> list[dict | None]:
        """See ``EFLAModel.get_stats``."""
        return self.model.get_stats()

    def num_parameters_by_part(self) -> dict[str, int]:
        """Parameter counts: ``embeddings``, ``lm_head`` (0 when tied), ``token_mixers`` (with their
        output norms), ``mlps``, ``norms`` (block and final RMSNorms), ``total``."""
        parts = {
            "embeddings": self.model.embeddings.weight.numel(),
            "lm_head": 0 if self.config.tie_word_embeddings else self.lm_head.weight.numel(),
            "token_mixers": sum(p.numel() for layer in self.model.layers for p in layer.attn.parameters()),
            "mlps": sum(p.numel() for layer in self.model.layers for p in layer.mlp.parameters()),
        }
        total = sum(p.numel() for p in self.parameters())
        parts["norms"] = total - sum(parts.values())
        parts["total"] = total
        return parts
