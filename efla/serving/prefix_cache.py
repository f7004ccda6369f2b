"""``PrefixCache``: the model state after recently served prompt prefixes, so a prompt that starts
with one (a shared system prompt, the earlier turns of a chat) continues from a copy of that state
instead of prefilling the prefix again.

A recurrent model's state after ``L`` tokens summarises all of them: it exists only where a prefill
stopped, so the scheduler stops prefills at *save points* and snapshots the state there. Save points
are multiples of ``block`` tokens (prefixes are looked up block by block, through a chain of block
hashes): for each prompt, its last block boundary (before its last token, which must run to give
the first new token's logits), and the end of the longest block-aligned prefix it shares with an
earlier prompt (where prompts branch: the second prompt with a new system prompt stores the state
after it, and every later one starts there). An entry keeps its prefix's tokens and is used only when
they equal the prompt's, so a hash collision cannot change a result. Entries are evicted least
recently used first, within ``max_bytes``, which bounds what the entries really keep: each counts its
state tensor's storage, its tokens (4 bytes each), its key and ``ENTRY_OVERHEAD`` for the objects
around them (the snapshot is one flat tensor, so that overhead is one tensor's, not one per layer).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = ["PrefixCache", "PrefixHit", "ENTRY_OVERHEAD"]

_SEEN_BLOCKS = 65536  # block-prefix digests remembered for finding shared prefixes (9 MB when full)
_KEY_BYTES = 16  # a block-prefix digest: collisions are as good as impossible, and still checked
# Bytes an entry keeps beyond its state's storage, its tokens and its key: the tensor's Python object,
# TensorImpl and StorageImpl, the allocator's alignment, the entry, its bytes objects and its node in
# the ordered dict. Resident memory per entry in a fresh process, less those bytes, was 630 to 930 (CPU,
# states of 64 B to 48 KB, 15 to 192 tokens); the prefix-cache tests compare counted and resident bytes.
ENTRY_OVERHEAD = 768


@dataclass
class PrefixHit:
    length: int  # prompt tokens the state covers (0: no cached prefix)
    state: torch.Tensor | None = None


@dataclass(slots=True)
class _Entry:
    tokens: bytes  # the prefix's token ids as 32-bit integers
    state: torch.Tensor
    nbytes: int


def _token_bytes(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


class PrefixCache:
    """States after prompt prefixes, by prefix, least recently used evicted first within ``max_bytes``
    counted as the bytes each entry keeps. A state is a tensor (the scheduler's flat row snapshot)
    that owns its storage: a view would keep its whole base alive, so it is copied when it is one."""

    def __init__(self, block: int = 64, max_bytes: int = 1 << 30):
        if block < 1:
            raise ValueError(f"block: expected a positive number of tokens, got {block}")
        self.block, self.max_bytes = int(block), int(max_bytes)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # the scheduler writes, /health reads
        self.bytes = 0
        self.lookups = self.hits = self.tokens_saved = self.evictions = 0

    def block_keys(self, tokens: list[int]) -> list[bytes]:
        """The digest of each block-aligned prefix ``tokens[:i * block]`` that leaves at least one token
        after it (``i >= 1``), each chained on the one before."""
        keys, key = [], b""
        for end in range(self.block, len(tokens), self.block):
            key = hashlib.blake2b(key + _token_bytes(tokens[end - self.block : end]), digest_size=_KEY_BYTES).digest()
            keys.append(key)
        return keys

    def lookup(self, tokens: list[int], keys: list[bytes]) -> PrefixHit:
        """The longest cached prefix of ``tokens`` (counted as a hit or a miss)."""
        with self._lock:
            self.lookups += 1
            for i in range(len(keys) - 1, -1, -1):
                entry = self._entries.get(keys[i])
                length = (i + 1) * self.block
                if entry is not None and entry.tokens == _token_bytes(tokens[:length]):
                    self._entries.move_to_end(keys[i])
                    self.hits += 1
                    self.tokens_saved += length
                    return PrefixHit(length, entry.state)
        return PrefixHit(0)

    def save_points(self, keys: list[bytes], start: int) -> list[int]:
        """Where to snapshot a prompt with block hashes ``keys`` whose prefill starts at ``start``:
        the end of its longest prefix shared with an earlier prompt and its last block boundary,
        those beyond ``start`` that hold no entry yet. Remembers the prompt's blocks."""
        with self._lock:
            shared = next((i + 1 for i in range(len(keys) - 1, -1, -1) if keys[i] in self._seen), 0)
            for key in keys:
                self._seen[key] = None
                self._seen.move_to_end(key)
            while len(self._seen) > _SEEN_BLOCKS:
                self._seen.popitem(last=False)
            points = {i for i in (shared, len(keys)) if i > 0 and keys[i - 1] not in self._entries}
        return sorted(i * self.block for i in points if i * self.block > start)

    def put(self, tokens: list[int], key: bytes, state: torch.Tensor) -> None:
        """Keep ``state``, the state after ``tokens`` (whose last block digest is ``key``), evicting the
        least recently used entries to stay within ``max_bytes`` (an entry larger than that is not kept)."""
        if state.untyped_storage().nbytes() > state.nbytes:  # a view: keep only its own elements
            state = state.clone()
        token_bytes = _token_bytes(tokens)
        nbytes = state.untyped_storage().nbytes() + len(token_bytes) + len(key) + ENTRY_OVERHEAD
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            while self._entries and self.bytes + nbytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.bytes -= evicted.nbytes
                self.evictions += 1
            self._entries[key] = _Entry(token_bytes, state, nbytes)
            self.bytes += nbytes

    def stats(self) -> dict:
        with self._lock:
            return {
                "enabled": True,
                "block": self.block,
                "entries": len(self._entries),
                "bytes": self.bytes,
                "max_bytes": self.max_bytes,
                "lookups": self.lookups,
                "hits": self.hits,
                "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
                "tokens_saved": self.tokens_saved,
                "evictions": self.evictions,
            }
