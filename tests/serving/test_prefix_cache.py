"""The prefix state cache: block-aligned prefixes looked up exactly (tokens compared, not only hashes),
least recently used entries evicted within the byte budget, save points where prompts branch; the
bytes it counts are those its entries keep (their tensors' storages, and the resident memory of a
fresh process filled with entries), so its budget bounds real memory; through the server it reports
hits and gives the same tokens as generate without any cache."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import types

import torch

from efla.serving import PrefixCache

from .conftest import MODEL_NAME, http_stack, serve


def state(value: float, numel: int = 4) -> torch.Tensor:
    return torch.full((numel,), float(value))


def _put(cache: PrefixCache, tokens: list[int], length: int, state: torch.Tensor) -> None:
    cache.put(tokens[:length], cache.block_keys(tokens)[length // cache.block - 1], state)


def test_lookup_finds_the_longest_cached_block_prefix_and_compares_tokens():
    cache = PrefixCache(block=4, max_bytes=1 << 20)
    prompt = list(range(10))
    assert len(cache.block_keys(prompt)) == 2 and len(cache.block_keys(prompt[:8])) == 1  # one token left to run
    _put(cache, prompt, 4, state(4))
    _put(cache, prompt, 8, state(8))
    hit = cache.lookup(prompt, cache.block_keys(prompt))
    assert (hit.length, hit.state[0].item()) == (8, 8)
    other = prompt[:6] + [99, 98, 97, 96]
    assert cache.lookup(other, cache.block_keys(other)).state[0].item() == 4
    assert cache.lookup([5] * 10, cache.block_keys([5] * 10)).length == 0
    stats = cache.stats()
    assert (stats["lookups"], stats["hits"], stats["tokens_saved"]) == (3, 2, 12)


def test_an_entry_under_a_colliding_key_is_not_used():
    cache = PrefixCache(block=4)
    first, second = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    cache.put(first[:4], cache.block_keys(second)[0], state(1))  # as if the two prefixes hashed alike
    assert cache.lookup(second, cache.block_keys(second)).length == 0


def test_block_keys_depend_on_every_token_and_on_the_blocks_before():
    cache = PrefixCache(block=2)
    keys = cache.block_keys([1, 2, 3, 4, 5])
    assert len(set(keys)) == 2
    assert cache.block_keys([1, 2, 3, 9, 5])[0] == keys[0] and cache.block_keys([1, 2, 3, 9, 5])[1] != keys[1]
    assert cache.block_keys([0, 2, 3, 4, 5])[1] != keys[1]  # the same second block after another first one
    assert cache.block_keys([2, 1, 3, 4, 5])[0] != keys[0]  # order matters


def test_least_recently_used_entries_go_first_within_the_byte_budget():
    one = PrefixCache(block=2)
    _put(one, [0, 0, 0], 2, state(0))
    entry = one.stats()["bytes"]  # what one such entry counts
    cache = PrefixCache(block=2, max_bytes=2 * entry + entry // 2)
    prompts = [[i, i, i] for i in range(3)]
    for p in prompts[:2]:
        _put(cache, p, 2, state(0))
    assert cache.lookup(prompts[0], cache.block_keys(prompts[0])).length == 2  # now the most recent
    _put(cache, prompts[2], 2, state(0))
    assert [cache.lookup(p, cache.block_keys(p)).length for p in prompts] == [2, 0, 2]
    stats = cache.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (2, 2 * entry, 1)
    _put(cache, [7, 7, 7], 2, state(0, numel=3 * entry // 4))  # larger than the whole budget: not kept
    assert cache.stats()["entries"] == 2 and cache.stats()["evictions"] == 1


def _storages_kept(root: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through Python references."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif not isinstance(obj, (type, types.ModuleType, types.FunctionType)):  # not into the program's globals
            stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def test_an_entry_made_from_a_view_keeps_only_its_own_elements():
    pool = torch.randn(64, 1024)
    cache = PrefixCache(block=4)
    _put(cache, list(range(5)), 4, pool[3])  # a view: its storage is the whole pool's 256 KiB
    kept = _storages_kept(cache)
    assert kept == 1024 * 4
    assert kept < cache.bytes < kept + 2048  # counted: the row, its tokens and key, an entry's overhead
    assert torch.equal(cache.lookup(list(range(5)), cache.block_keys(list(range(5)))).state, pool[3])


def test_the_budget_bounds_the_storages_of_many_entries():
    cache = PrefixCache(block=8, max_bytes=256 << 10)
    generator = torch.Generator().manual_seed(0)
    for i in range(2000):
        prompt = torch.randint(0, 320, (8 * (1 + i % 5) + 1,), generator=generator).tolist()
        _put(cache, prompt, len(prompt) - 1, torch.randn(64 * (1 + i % 7)))
        assert cache.bytes <= cache.max_bytes
    stats = cache.stats()
    assert stats["evictions"] > 1000 and stats["entries"] > 50
    assert _storages_kept(cache) + stats["entries"] * 8 * 5 * 4 < cache.max_bytes


def test_a_snapshot_restores_a_half_precision_models_row_exactly():
    """Recurrent states in float32 and convolution histories in bfloat16 share one flat float32
    snapshot; restored into another row, every layer's tensors equal the row's bit for bit."""
    from efla.models import EFLAForCausalLM, get_preset_config
    from efla.models.cache import EFLACache
    from efla.serving.states import restore_row, snapshot_row

    model = EFLAForCausalLM(get_preset_config("tiny-efla")).to(torch.bfloat16).eval()
    pool = EFLACache.for_model(model, 3)
    generator = torch.Generator().manual_seed(0)
    tensors = [t for state in pool.states for t in (state["recurrent_state"], *state["conv_state"])]
    assert {t.dtype for t in tensors} == {torch.float32, torch.bfloat16}
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=generator))
    snapshot = snapshot_row(pool, 1)
    assert snapshot.untyped_storage().nbytes() == snapshot.nbytes == 4 * sum(t[1].numel() for t in tensors)
    restore_row(pool, 2, snapshot)
    assert all(torch.equal(t[2], t[1]) for t in tensors)
    assert not any(torch.equal(t[0], t[1]) for t in tensors)


FILL_A_CACHE = """
import gc, json, sys, torch
from efla.models import EFLAForCausalLM, get_preset_config
from efla.models.cache import EFLACache
from efla.serving import PrefixCache
from efla.serving.states import snapshot_row

def resident():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10

kept = []  # every cache stays alive: memory one frees would be reused by the next

def fill(cache, count, make_state, block):
    kept.append(cache)
    prompts = [[i % 256, i // 256] + [(i * 7 + j) % 320 for j in range(block * (1 + i % 3) - 2)] + [1] for i in range(count)]
    keys = [cache.block_keys(p)[-1] for p in prompts]
    gc.collect()
    before = resident()
    for prompt, key in zip(prompts, keys):
        cache.put(prompt[:-1], key, make_state())
    gc.collect()
    return {"resident": resident() - before, "counted": cache.bytes, "entries": len(cache._entries)}

pool = EFLACache.for_model(EFLAForCausalLM(get_preset_config("tiny-efla")).eval(), 4)
rows = torch.randn(4, 1024)
results = {
    "snapshots": fill(PrefixCache(block=64), 2000, lambda: snapshot_row(pool, 1), 64),
    "small states": fill(PrefixCache(block=16), 20000, lambda: rows[1].clone(), 16),
}
print(json.dumps(results))
"""


def test_counted_bytes_are_the_resident_memory_entries_take_in_a_fresh_process():
    """Entries of a tiny model's row snapshots (22 KiB), and of 4 KiB states (where what an entry keeps
    beyond its state counts more), grow a fresh process's resident memory by the bytes the cache
    counts, within 10% (the tensors' and entries' own objects were a quarter more than the states
    of the tiny model when a snapshot was a tensor per layer and the tokens a tuple)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    done = subprocess.run([sys.executable, "-c", FILL_A_CACHE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    for case in ("snapshots", "small states"):
        grown, counted = results[case]["resident"], results[case]["counted"]
        assert abs(grown / counted - 1) < 0.10, (case, results[case])


def test_save_points_are_the_last_boundary_and_where_prompts_branch():
    cache = PrefixCache(block=4)
    system = list(range(100, 110))  # 10 tokens: a shared prefix of two whole blocks
    first, second = system + [1, 2, 3, 4, 5, 6, 7], system + [8, 9, 10]
    assert cache.save_points(cache.block_keys(first), 0) == [16]
    assert cache.save_points(cache.block_keys(second), 0) == [8, 12]  # branch after two blocks, last boundary
    assert cache.save_points(cache.block_keys(second), 8) == [12]  # only beyond where the prefill starts


def test_the_server_reuses_a_shared_prefix_with_the_same_tokens(loaded, reference):
    system = "You are a helpful assistant that answers questions about the efla library and its layers.\n"
    questions = ["What is EFLA?", "def forward(self, x):", "import torch", "Explain the state."]
    http_stack()
    with serve(*loaded, prefix_cache=PrefixCache(block=8, max_bytes=1 << 20)) as served:
        client = served.client()
        texts = [
            client.completions.create(model=MODEL_NAME, prompt=system + q, max_tokens=10, temperature=0).choices[0].text
            for q in questions
        ]
        again = client.completions.create(model=MODEL_NAME, prompt=system + questions[0], max_tokens=10, temperature=0)
        stats = served.health()["prefix_cache"]
    assert texts == [reference(system + q, 10)[0] for q in questions]
    assert again.choices[0].text == texts[0]
    system_tokens = len(reference.tokenizer(system)["input_ids"])
    # the first two prompts find nothing; the second stores the state after the shared blocks, which
    # the third and fourth start from; the repeated first prompt starts from its own last boundary
    assert (stats["lookups"], stats["hits"]) == (5, 3)
    assert stats["tokens_saved"] >= 3 * (system_tokens // 8 * 8)
    assert 0 < stats["bytes"] <= stats["max_bytes"] and stats["hit_rate"] == 3 / 5
