"""DecodeEngine.prefill_rows on the CPU in float64: pieces of prompts run as right-padded rows, each
continuing its pool row's state (or starting from zero in a row that held another sequence), leave
the states and give the last-token logits of the whole prompts run at once; pieces shorter than the
convolution's width included. Also the convolution's final state of right-padded rows."""

import pytest
import torch

from efla.generation.engine import DecodeEngine
from efla.layers import ShortConvolution

from .test_generate import tiny

# (prompt, start, end) per round: the rows of one call, of unequal lengths
ROUNDS = [[(0, 0, 1), (1, 0, 2), (2, 0, 5), (3, 0, 30)], [(2, 5, 6), (3, 30, 64)], [(3, 64, 70), (2, 6, 37), (1, 2, 3)]]
LENGTHS = [1, 3, 37, 70]
SLOTS = [3, 0, 2, 1]


def _states(cache, row):
    for state in cache.states:
        yield state["recurrent_state"][row]
        yield from (c[row] for c in state["conv_state"])


class _EagerGraph:
    """Stands in for a CUDA graph on the CPU: capturing runs the step once, a replay runs it again
    (on whatever the bucket's tensors then hold, as a graph would)."""

    def __init__(self, run):
        run()
        self.replay = run


@pytest.mark.parametrize(
    ("preset", "graphs"), [("tiny-efla", False), ("tiny-gated-efla", False), ("tiny-deltanet", False), ("tiny-efla", True)]
)
def test_pieces_in_padded_rows_equal_whole_prompts(preset, graphs, monkeypatch):
    """With ``graphs`` the engine pads to its bucket shapes and captures each bucket on first use
    (through a stand-in for CUDA graphs)."""
    model = tiny(preset).double()
    engine = DecodeEngine(model, use_cuda_graph=False)
    engine.reserve(4)
    if graphs:
        engine.use_graphs = True
        monkeypatch.setattr(engine, "_captured", _EagerGraph)
    for state in engine.cache.states:  # rows that held other sequences: a fresh piece must not read them
        for tensor in (state["recurrent_state"], *state["conv_state"]):
            tensor.normal_()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]
    last_logits = {}
    for pieces in ROUNDS:
        logits = engine.prefill_rows(
            [prompts[i][a:b] for i, a, b in pieces], [SLOTS[i] for i, _, _ in pieces], [a == 0 for _, a, _ in pieces]
        )
        assert logits.shape == (len(pieces), 256) and logits.dtype == torch.float32
        last_logits.update({i: row for (i, _, b), row in zip(pieces, logits) if b == LENGTHS[i]})
    assert sorted(last_logits) == [0, 1, 2, 3]
    assert sorted(engine.prefill_buckets) == ([(2, 64), (4, 32)] if graphs else [])
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model(torch.tensor([prompt]), use_cache=True)
        torch.testing.assert_close(last_logits[i], out.logits[0, -1].float(), rtol=1e-6, atol=1e-6)
        for got, want in zip(_states(engine.cache, SLOTS[i]), _states(out.past_key_values, 0), strict=True):
            torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-10, atol=1e-10)


def test_the_final_convolution_state_of_right_padded_rows_ends_at_their_last_real_input():
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4).double()
    x, cache = torch.randn(3, 9, 6, dtype=torch.float64), torch.randn(3, 6, 4, dtype=torch.float64)
    real = torch.tensor([9, 2, 0])
    mask = (torch.arange(9) < real[:, None]).to(torch.float64)[..., None]
    _, state = conv(x * mask, cache=cache, output_final_state=True, mask=mask)
    for row, n in enumerate(real.tolist()):
        alone = conv(x[row : row + 1, :n], cache=cache[row : row + 1], output_final_state=True)[1][0] if n else cache[row]
        torch.testing.assert_close(state[row], alone, rtol=0, atol=0)
