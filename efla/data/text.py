"""Text data for language-model training: documents from local files (or Hugging Face ``datasets``
when online), tokenized, packed into fixed-length sequences, shuffled with a seed, sharded by rank,
with a resumable position.

Documents:
    * ``.jsonl`` / ``.json`` lines: one document per line, its ``text`` field (``text_field``);
    * any other file (``.txt``, ``.raw``, ``.md``, ...): the whole file is one document (CRLF -> LF;
      Project Gutenberg header and licence stripped when the ``*** START OF``/``*** END OF`` markers
      are present);
    * any of these compressed with xz (``train.jsonl.xz``, ``book.txt.xz``): read as the file it
      decompresses to, streamed (never written out);
    * a directory: its ``.txt``/``.text``/``.raw``/``.md``/``.jsonl``/``.json`` files (and their
      ``.xz``), recursively, in sorted order;
    * ``hf:NAME[:CONFIG][@SPLIT]``: a Hugging Face dataset (needs the optional ``datasets`` package and
      network; imported only then).

Packing: every document is followed by the eos token and all are concatenated into one token
stream (int32), cut into ``seq_len``-token sequences (the tail that does not fill one is dropped).
Sequence ``i`` is ``tokens[i*seq_len:(i+1)*seq_len]``; the model predicts each next token inside it.
With ``varlen`` the sequences of a micro-batch are concatenated into one ``[1, B*seq_len]`` row with
``cu_seqlens`` at every sequence start and after every eos, so no token attends across documents.

Order: epoch ``e`` visits the training sequences in ``randperm(n, generator=seed(seed, e))`` order.
The *position* (sequences consumed so far, over all ranks) is the whole data state: step ``s`` of a
run with a global batch of ``G`` sequences takes positions ``[s*G, (s+1)*G)``; rank ``r`` of ``W``
takes the ``r``-th contiguous ``G/W`` of them. Resuming needs only the position.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import lzma
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from efla.errors import UsageError

__all__ = [
    "TEXT_SUFFIXES",
    "COMPRESSED_SUFFIX",
    "TextCheck",
    "check_text_file",
    "check_text_files",
    "PackedData",
    "SequenceOrder",
    "expand_paths",
    "read_documents",
    "strip_gutenberg",
    "tokenize_documents",
    "NoTextError",
    "load_token_stream",
    "split_train_val",
    "make_batch",
    "rank_slice",
    "count_targets",
]

TEXT_SUFFIXES = (".txt", ".text", ".raw", ".md", ".jsonl", ".json")
COMPRESSED_SUFFIX = ".xz"
_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """The book between Project Gutenberg's ``*** START OF ...`` and ``*** END OF ...`` lines (the
    text unchanged when the markers are absent)."""
    m = _GUTENBERG_START.search(text)
    if m is None:
        return text
    body = text[m.end() :]
    e = _GUTENBERG_END.search(body)
    if e is not None:
        body = body[: e.start()]
    return body.strip("\n") + "\n"


def expand_paths(paths: list[str]) -> list[str]:
    """Files named by ``paths`` (directories expanded recursively, sorted); ``hf:`` specs kept.

    Raises:
        FileNotFoundError: a path that does not exist, or a directory without text files.
    """
    if isinstance(paths, str):
        paths = [paths]
    out: list[str] = []
    for p in paths:
        if p.startswith("hf:"):
            out.append(p)
        elif os.path.isdir(p):
            found = sorted(os.path.join(root, f) for root, _, files in os.walk(p) for f in files if _is_text_name(f))
            if not found:
                kinds = "/".join(TEXT_SUFFIXES)
                raise FileNotFoundError(f"--data {p}: directory has no {kinds} files (or their {COMPRESSED_SUFFIX})")
            out.extend(found)
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"--data {p}: no such file or directory (Hugging Face datasets: hf:NAME)")
    return out


def _is_text_name(name: str) -> bool:
    return _uncompressed_name(name).endswith(TEXT_SUFFIXES)


def _uncompressed_name(path: str) -> str:
    """``path`` lower-cased, without a trailing ``.xz``: the name that tells how the file is read."""
    name = path.lower()
    return name[: -len(COMPRESSED_SUFFIX)] if name.endswith(COMPRESSED_SUFFIX) else name


def _open_bytes(path: str):
    return lzma.open(path, "rb") if path.lower().endswith(COMPRESSED_SUFFIX) else open(path, "rb")


def _open_text(path: str, errors: str, newline: str | None = None):
    if path.lower().endswith(COMPRESSED_SUFFIX):
        return lzma.open(path, "rt", encoding="utf-8", errors=errors, newline=newline)
    return open(path, encoding="utf-8", errors=errors, newline=newline)


_BINARY_SNIFF_BYTES = 1 << 16
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


@dataclass
class TextCheck:
    """What :func:`check_text_file` found in one file."""

    path: str
    invalid_bytes: int = 0  # bytes that are not UTF-8
    first_invalid_line: int | None = None  # 1-based line of the first such byte
    has_text: bool = False  # anything but whitespace

    def describe(self) -> str:
        return (
            f"{self.path}:{self.first_invalid_line}: not UTF-8 ({self.invalid_bytes} undecodable byte(s) "
            f"in the file, the first on line {self.first_invalid_line})"
        )


def _looks_binary(head: bytes) -> bool:
    return b"\x00" in head


def check_text_file(path: str, chunk_bytes: int = 1 << 20, option: str = "--data") -> TextCheck:
    """Reads ``path`` once (decompressed, for an ``.xz`` file): refuses a binary file (NUL bytes near
    its start) and counts the bytes that are not UTF-8, with the line of the first.

    Raises:
        UsageError: the file looks binary (``path``, the offset of the first NUL byte and ``option``),
            or an ``.xz`` file is damaged or not xz.
    """
    try:
        return _check_text_bytes(path, chunk_bytes, option)
    except (lzma.LZMAError, EOFError) as e:
        raise UsageError(f"{path}: not a whole xz file ({e or 'it ends early'}) ({option})") from None


def _check_text_bytes(path: str, chunk_bytes: int, option: str) -> TextCheck:
    found = TextCheck(path)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    lines_before = 0
    with _open_bytes(path) as f:
        head = f.read(_BINARY_SNIFF_BYTES)
        if _looks_binary(head):
            nul_at = head.index(b"\x00")
            raise UsageError(f"{path}: looks like a binary file, not text (a NUL byte at offset {nul_at}) ({option})")
        chunk, final = head, False
        while not final:
            nxt = f.read(chunk_bytes)
            final = not nxt
            text = decoder.decode(chunk, final=final)
            bad = _ESCAPED_BYTE.findall(text)
            if bad and found.first_invalid_line is None:
                first = _ESCAPED_BYTE.search(text).start()
                found.first_invalid_line = lines_before + text.count("\n", 0, first) + 1
            found.invalid_bytes += len(bad)
            found.has_text = found.has_text or bool(text.strip())
            lines_before += text.count("\n")
            chunk = nxt
    return found


def check_text_files(paths: list[str], accept_invalid_utf8: bool = False, warn=None, option: str = "--data") -> list[TextCheck]:
    """:func:`check_text_file` of every local file named by ``paths`` (``hf:`` specs skipped).

    Undecodable bytes are refused (``UsageError`` naming the file, the count, the first line and ``option``)
    unless ``accept_invalid_utf8``; then ``warn(message)`` is called once per such file and the bytes
    are read as U+FFFD.
    """
    found = [check_text_file(p, option=option) for p in expand_paths(paths) if not p.startswith("hf:")]
    for c in found:
        if not c.invalid_bytes:
            continue
        if not accept_invalid_utf8:
            raise UsageError(
                f"{c.describe()}; convert the file to UTF-8, or pass --accept-invalid-utf8 to read them as U+FFFD ({option})"
            )
        if warn is not None:
            warn(f"{c.describe()}: read as U+FFFD (--accept-invalid-utf8)")
    return found


def _read_hf(spec: str, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - optional dependency
        raise ImportError(f"{spec}: Hugging Face datasets need `pip install datasets` (and network)") from e
    name, _, split = spec[3:].partition("@")
    name, _, config = name.partition(":")
    ds = datasets.load_dataset(name, config or None, split=split or "train")
    for row in ds:  # pragma: no cover - needs network
        t = row[text_field]
        if t and t.strip():
            yield t


def read_documents(
    paths: list[str], text_field: str = "text", gutenberg: bool = True, accept_invalid_utf8: bool = False
) -> Iterator[str]:
    """Documents (strings) from ``paths`` in order (see the module docstring); empty ones skipped.

    Bytes that are not UTF-8 raise ``ValueError`` (file and line) unless ``accept_invalid_utf8``, which
    reads them as U+FFFD (:func:`check_text_files` reports them first)."""
    errors = "replace" if accept_invalid_utf8 else "strict"
    for path in expand_paths(paths):
        if path.startswith("hf:"):
            yield from _read_hf(path, text_field)
            continue
        try:
            yield from _read_file_documents(path, text_field, gutenberg, errors)
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{check_text_file(path).describe()} ({e.reason}); pass --accept-invalid-utf8 to read them as U+FFFD (--data)"
            ) from e


def _read_file_documents(path: str, text_field: str, gutenberg: bool, errors: str) -> Iterator[str]:
    if _uncompressed_name(path).endswith((".jsonl", ".json")):
        with _open_text(path, errors) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    t = json.loads(line)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{n}: expected a JSON object with a {text_field!r} string (--text-field)") from e
                if isinstance(t, str) and t.strip():
                    yield t
        return
    with _open_text(path, errors, newline="") as f:
        text = f.read().replace("\r\n", "\n")
    if gutenberg:
        text = strip_gutenberg(text)
    if text.strip():
        yield text


class NoTextError(ValueError):
    """Every document read was empty."""


def tokenize_documents(docs, tokenizer, eos_id: int, batch_docs: int = 64) -> np.ndarray:
    """All documents tokenized (no special tokens added), each followed by ``eos_id``, concatenated
    into one int32 array."""
    parts: list[np.ndarray] = []
    eos = np.array([eos_id], dtype=np.int32)
    buf: list[str] = []

    def flush():
        if buf:
            for ids in tokenizer(buf, add_special_tokens=False)["input_ids"]:
                parts.append(np.asarray(ids, dtype=np.int32))
                parts.append(eos)
            buf.clear()

    for d in docs:
        buf.append(d)
        if len(buf) >= batch_docs:
            flush()
    flush()
    if not parts:
        raise NoTextError("no text: every document was empty")
    return np.concatenate(parts)


def _fingerprint(paths: list[str], tokenizer, extra: dict) -> str:
    h = hashlib.sha256()
    for p in expand_paths(paths):
        if p.startswith("hf:"):
            h.update(p.encode())
            continue
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else repr(tokenizer)).encode())
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()[:20]


def load_token_stream(
    paths: list[str],
    tokenizer,
    eos_id: int,
    cache_dir: str | None = None,
    text_field: str = "text",
    gutenberg: bool = True,
    accept_invalid_utf8: bool = False,
    log=None,
) -> np.ndarray:
    """:func:`tokenize_documents` of :func:`read_documents`, cached as ``.npy`` in ``cache_dir`` (keyed by
    the files' paths, sizes and mtimes, the tokenizer and the options). ``log(message)``, if given, is
    told before each step that may take a while: reading the cache, tokenizing, writing the cache."""
    log = log or (lambda _message: None)
    path = None
    if cache_dir is not None and not any(p.startswith("hf:") for p in paths):
        key = _fingerprint(paths, tokenizer, dict(eos=eos_id, field=text_field, gutenberg=gutenberg))
        path = os.path.join(cache_dir, f"tokens-{key}.npy")
        if os.path.exists(path):
            log(f"reading the token cache {path}")
            try:
                return np.load(path, allow_pickle=False)
            except (OSError, ValueError):
                pass  # a damaged cache file is rebuilt
    log("tokenizing")
    toks = tokenize_documents(read_documents(paths, text_field, gutenberg, accept_invalid_utf8), tokenizer, eos_id)
    if path is not None:
        log(f"writing the token cache {path}, {len(toks):,} tokens")
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npy"
        np.save(tmp, toks)
        os.replace(tmp, path)
    return toks


@dataclass
class PackedData:
    """A token stream cut into ``seq_len``-token sequences; ``index`` selects which ones belong here."""

    tokens: np.ndarray
    seq_len: int
    index: np.ndarray  # int64 sequence numbers into the stream

    def __len__(self) -> int:
        return len(self.index)

    def sequences(self, idx) -> np.ndarray:
        """``[len(idx), seq_len]`` int64 tokens of the sequences ``self.index[idx]``."""
        starts = self.index[np.asarray(idx, dtype=np.int64)] * self.seq_len
        return np.stack([self.tokens[s : s + self.seq_len] for s in starts]).astype(np.int64)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(f"{len(self.tokens)}|{self.seq_len}|{len(self.index)}".encode())
        h.update(np.ascontiguousarray(self.tokens[: 1 << 16]).tobytes())
        h.update(np.ascontiguousarray(self.index[:4096]).tobytes())
        return h.hexdigest()[:16]


def split_train_val(
    tokens: np.ndarray, seq_len: int, val_sequences: int = 0, val_seed: int = 0, val_tokens: np.ndarray | None = None
) -> tuple[PackedData, PackedData | None]:
    """Training and validation sequences. With ``val_tokens`` (a separate held-out stream) all of
    ``tokens`` is training data; otherwise ``val_sequences`` sequences chosen with ``val_seed`` are held
    out (never trained on)."""
    if seq_len < 2:
        raise ValueError(f"seq_len: expected >= 2, got {seq_len}")
    n = len(tokens) // seq_len
    if n < 1:
        raise ValueError(f"data: {len(tokens)} tokens do not fill one sequence of {seq_len}")
    if val_tokens is not None:
        nv = len(val_tokens) // seq_len
        if nv < 1:
            raise ValueError(f"validation data: {len(val_tokens)} tokens do not fill one sequence of {seq_len}")
        nv = min(nv, val_sequences) if val_sequences else nv
        return (
            PackedData(tokens, seq_len, np.arange(n, dtype=np.int64)),
            PackedData(val_tokens, seq_len, np.arange(nv, dtype=np.int64)),
        )
    if val_sequences <= 0:
        return PackedData(tokens, seq_len, np.arange(n, dtype=np.int64)), None
    if val_sequences >= n:
        raise ValueError(f"val_sequences: {val_sequences} would leave no training data ({n} sequences in all)")
    g = torch.Generator().manual_seed(int(val_seed))
    val = np.sort(torch.randperm(n, generator=g)[:val_sequences].numpy().astype(np.int64))
    mask = np.ones(n, dtype=bool)
    mask[val] = False
    return PackedData(tokens, seq_len, np.nonzero(mask)[0].astype(np.int64)), PackedData(tokens, seq_len, val)


class SequenceOrder:
    """The seeded order in which training sequences are visited, epoch after epoch.

    ``take(position, count)`` are the sequence numbers (into ``PackedData.index``) at positions
    ``[position, position + count)`` of the endless stream of epochs.
    """

    def __init__(self, n: int, seed: int = 0, shuffle: bool = True):
        if n < 1:
            raise ValueError("no training sequences")
        self.n, self.seed, self.shuffle = int(n), int(seed), bool(shuffle)
        self._epoch, self._perm = None, None

    def perm(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n, generator=g).numpy()
            else:
                self._perm = np.arange(self.n)
            self._epoch = epoch
        return self._perm

    def take(self, position: int, count: int) -> np.ndarray:
        out = []
        while count > 0:
            epoch, i = divmod(position, self.n)
            k = min(count, self.n - i)
            out.append(self.perm(epoch)[i : i + k])
            position += k
            count -= k
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def epoch_of(self, position: int) -> float:
        return position / self.n


def rank_slice(global_idx: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of one global batch (its length must divide by ``world``)."""
    if len(global_idx) % world:
        raise ValueError(f"global batch of {len(global_idx)} sequences does not split over {world} ranks")
    per = len(global_idx) // world
    return global_idx[rank * per : (rank + 1) * per]


def make_batch(seqs: np.ndarray, eos_id: int | None = None, varlen: bool = False) -> dict:
    """Model inputs for ``[B, L]`` sequences: ``input_ids``/``labels`` ``[B, L]``, or with ``varlen`` one
    ``[1, B*L]`` row with ``cu_seqlens`` (int32) at every row start and after every eos."""
    ids = torch.from_numpy(np.ascontiguousarray(seqs)).long()
    if not varlen:
        return dict(input_ids=ids, labels=ids)
    B, L = ids.shape
    flat = ids.reshape(1, B * L)
    cuts = set(range(0, B * L + 1, L))
    if eos_id is not None:
        cuts.update((torch.nonzero(flat[0] == eos_id).flatten() + 1).tolist())
    cu = torch.tensor(sorted(cuts), dtype=torch.int32)
    return dict(input_ids=flat, labels=flat, cu_seqlens=cu)


def count_targets(batch: dict) -> int:
    """Next-token predictions in a batch (what the model's mean loss averages over)."""
    ids = batch["input_ids"]
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"]
        return int((cu[1:] - cu[:-1] - 1).clamp_min(0).sum())
    return int(ids.shape[0] * (ids.shape[1] - 1))
