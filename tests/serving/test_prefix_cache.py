"""The prefix state cache: block-aligned prefixes looked up exactly (tokens compared, not only hashes),
least recently used entries evicted within the byte budget, save points where prompts branch; through
the server it reports hits and gives the same tokens as generate without any cache."""

from __future__ import annotations

from efla.serving import PrefixCache

from .conftest import MODEL_NAME, http_stack, serve


class State:
    def __init__(self, nbytes: int, name: str = ""):
        self.nbytes, self.name = nbytes, name


def _put(cache: PrefixCache, tokens: list[int], length: int, state) -> None:
    cache.put(tokens[:length], cache.block_keys(tokens)[length // cache.block - 1], state)


def test_lookup_finds_the_longest_cached_block_prefix_and_compares_tokens():
    cache = PrefixCache(block=4, max_bytes=100)
    prompt = list(range(10))
    assert len(cache.block_keys(prompt)) == 2 and len(cache.block_keys(prompt[:8])) == 1  # one token left to run
    _put(cache, prompt, 4, State(1, "four"))
    _put(cache, prompt, 8, State(1, "eight"))
    hit = cache.lookup(prompt, cache.block_keys(prompt))
    assert (hit.length, hit.state.name) == (8, "eight")
    other = prompt[:6] + [99, 98, 97, 96]
    assert cache.lookup(other, cache.block_keys(other)).state.name == "four"
    assert cache.lookup([5] * 10, cache.block_keys([5] * 10)).length == 0
    stats = cache.stats()
    assert (stats["lookups"], stats["hits"], stats["tokens_saved"]) == (3, 2, 12)


def test_an_entry_under_a_colliding_key_is_not_used():
    cache = PrefixCache(block=4)
    first, second = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    cache.put(first[:4], cache.block_keys(second)[0], State(1))  # as if the two prefixes hashed alike
    assert cache.lookup(second, cache.block_keys(second)).length == 0


def test_least_recently_used_entries_go_first_within_the_byte_budget():
    cache = PrefixCache(block=2, max_bytes=25)
    prompts = [[i, i, i] for i in range(3)]
    for p in prompts[:2]:
        _put(cache, p, 2, State(10))
    assert cache.lookup(prompts[0], cache.block_keys(prompts[0])).length == 2  # now the most recent
    _put(cache, prompts[2], 2, State(10))
    assert [cache.lookup(p, cache.block_keys(p)).length for p in prompts] == [2, 0, 2]
    stats = cache.stats()
    assert (stats["entries"], stats["bytes"], stats["evictions"]) == (2, 20, 1)
    _put(cache, [7, 7, 7], 2, State(26))  # larger than the whole budget: not kept, nothing evicted
    assert cache.stats()["entries"] == 2


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
