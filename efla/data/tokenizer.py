"""Tokenizers for language-model training: any Hugging Face tokenizer, or a byte-level BPE trained
locally with the ``tokenizers`` library and saved so ``AutoTokenizer.from_pretrained`` loads it.

The trained tokenizer puts its three special tokens first, so their ids match
:class:`efla.models.EFLAConfig`'s defaults: ``<pad>`` = 0, ``<s>`` = 1 (bos), ``</s>`` = 2 (eos;
appended after every document when packing).

Examples:
    >>> from efla.data.tokenizer import train_bpe_tokenizer
    >>> tok = train_bpe_tokenizer(["hello world"] * 50, vocab_size=300)
    >>> tok.eos_token_id, tok.decode(tok("hello world")["input_ids"])
    (2, 'hello world')
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["SPECIAL_TOKENS", "load_tokenizer", "train_bpe_tokenizer", "get_tokenizer", "tokenizer_eos_id"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def _wrap(tok_obj):
    """A transformers fast tokenizer around a ``tokenizers.Tokenizer`` with our special tokens."""
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 (lazy: transformers and tokenizers take seconds to import)

    return PreTrainedTokenizerFast(
        tokenizer_object=tok_obj,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token=None,
        model_max_length=1_000_000_000,
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096, save_dir: str | None = None, min_frequency: int = 2):
    """Train a byte-level BPE (GPT-2 style byte alphabet, so every input is encodable and decoding is
    lossless) with ``vocab_size`` entries (256 bytes + 3 special tokens + merges).

    Args:
        texts: training documents (an iterable of strings; read once).
        vocab_size: total vocabulary size, at least 259.
        save_dir: when given, ``save_pretrained(save_dir)`` (``tokenizer.json`` and
            ``tokenizer_config.json``), loadable with ``AutoTokenizer.from_pretrained(save_dir)``.
        min_frequency: a pair must occur this often to be merged.

    Returns:
        a ``transformers`` fast tokenizer.

    Raises:
        ValueError: ``vocab_size`` < 259.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 (lazy: transformers and tokenizers take seconds to import)

    if not isinstance(vocab_size, int) or vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size: expected an int >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size!r}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = _wrap(tok)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        hf.save_pretrained(save_dir)
    return hf


def load_tokenizer(name_or_path: str):
    """``AutoTokenizer.from_pretrained(name_or_path)`` (a local directory, or a Hub name when online).
    A tokenizer without an end-of-sequence token is refused: packing separates documents with it."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (lazy: transformers and tokenizers take seconds to import)

    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer_eos_id(tok) is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no eos token; documents are separated by eos when packing")
    return tok


def tokenizer_eos_id(tok) -> int | None:
    eos = getattr(tok, "eos_token_id", None)
    if eos is None:
        eos = getattr(tok, "sep_token_id", None)
    return eos


def get_tokenizer(spec: str | None, texts_factory=None, vocab_size: int = 4096, save_dir: str | None = None):
    """``spec`` ``None`` or ``"bpe"``: train a byte-level BPE on ``texts_factory()`` (``vocab_size``);
    anything else: a Hugging Face tokenizer name or path. Saved to ``save_dir`` when given."""
    if spec in (None, "", "bpe"):
        if texts_factory is None:
            raise ValueError("texts_factory: needed to train a tokenizer")
        return train_bpe_tokenizer(texts_factory(), vocab_size=vocab_size, save_dir=save_dir)
    tok = load_tokenizer(spec)
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        tok.save_pretrained(save_dir)
    return tok
