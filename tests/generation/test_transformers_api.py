"""transformers' own entry points on an EFLA model keep working beside efla.generation: the
``text-generation`` pipeline gives the tokens of ``generate`` without a cache, and a streamer sees
the prompt and then exactly the new tokens, through transformers' ``generate`` and through ours."""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

from efla.generation import generate
from efla.models import EFLAForCausalLM, get_preset_config

transformers.logging.set_verbosity_error()
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from efla.data.tokenizer import train_bpe_tokenizer

    text = "".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "efla").rglob("*.py")))[:20_000]
    tokenizer = train_bpe_tokenizer([text], vocab_size=300, save_dir=str(tmp_path_factory.mktemp("tok")))
    torch.manual_seed(0)
    model = EFLAForCausalLM(get_preset_config("tiny-efla", vocab_size=len(tokenizer), initializer_range=0.1)).eval()
    return model, tokenizer


class Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.detach().cpu().reshape(-1))  # batch 1: the tokens, in order

    def end(self):
        self.ended = True


def test_pipeline_gives_the_tokens_of_generate_without_cache(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = "def forward(self, x):"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    want = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        use_cache=False,
        pad_token_id=0,
    )
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    out = pipe(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, return_full_text=False, pad_token_id=0)
    assert out[0]["generated_text"] == tokenizer.decode(want[0, ids.shape[1] :])


@pytest.mark.parametrize("through", ["transformers", "efla"])
def test_streamer_sees_the_prompt_then_the_new_tokens(model_and_tokenizer, through):
    model, tokenizer = model_and_tokenizer
    ids = tokenizer("import torch", return_tensors="pt")["input_ids"]
    streamer = Recorder()
    if through == "transformers":
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    else:
        out = generate(model, ids, max_new_tokens=10, eos_token_id=[], streamer=streamer)
    assert streamer.ended
    assert torch.equal(streamer.chunks[0], ids[0])
    streamed = torch.cat(streamer.chunks[1:])
    assert torch.equal(streamed, out[0, ids.shape[1] :])
    assert streamed.numel() == 10
