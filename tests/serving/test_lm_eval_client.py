"""lm-evaluation-harness as a real client of `efla serve`: its ``local-completions`` model scores a
multiple-choice task and runs a generate-until task (token-id prompts and text prompts), equal to its
``hf`` model on the same model directory; ``local-chat-completions`` runs the generate-until task
through /v1/chat/completions. The tasks are YAMLs over JSONL files written into a temporary folder
(the ``datasets`` json builder reads local files; nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from .conftest import MODEL_NAME, http_stack, serve

http_stack()
for _name in ("lm_eval", "datasets", "aiohttp", "tenacity", "requests"):  # lm-eval and its api extra, not imported yet
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed (pip install 'lm-eval[api]')", allow_module_level=True)

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
MC_TASK, GEN_TASK = "efla_local_mc", "efla_local_gen"
MC_DOCS = [
    {"question": "import torch\nx = torch.", "choices": ["zeros(3)", "ones(3)", "randn(2, 2)", "tensor([1])"], "answer": 0},
    {"question": "def forward(self, x):\n    return", "choices": ["self.proj(x)", "x", "None"], "answer": 1},
    {"question": "class EFLA(nn.", "choices": ["Module):", "Linear):", "Sequential):"], "answer": 0},
    {"question": "for i in", "choices": ["range(n):", "enumerate(xs):", "items:", "zip(a, b):"], "answer": 2},
    {"question": "from __future__ import", "choices": ["annotations", "division", "print_function"], "answer": 0},
    {"question": "if __name__ ==", "choices": ['"__main__":', "'__main__':"], "answer": 1},
]
GEN_DOCS = [
    {"prompt": "def forward(self, x):", "target": "\n"},
    {"prompt": "import torch\nimport", "target": " numpy"},
    {"prompt": "class Scheduler:", "target": "\n"},
    {"prompt": "return self.", "target": "model"},
]


def _write_task(folder, name: str, docs: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    head = (
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        "  data_files:\n"
        f"    test: {json.dumps(str(data))}\n"
        f"  cache_dir: {json.dumps(str(folder / 'datasets-cache'))}\n"
        "test_split: test\n"
    )
    (folder / f"{name}.yaml").write_text(head + body + "metadata:\n  version: 1.0\n", encoding="utf-8")


@pytest.fixture(scope="module")
def offline():
    """No download: the hub and datasets offline for this module's tests (the model and the tasks' data
    files are local). Both libraries read the variables when first imported, so their flags are set too."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")
        patch.setenv("TOKENIZERS_PARALLELISM", "false")
        patch.delenv("OPENAI_API_KEY", raising=False)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def task_manager(offline, tmp_path_factory):
    """Two tasks over local JSONL files: a multiple-choice one and a greedy generate-until one."""
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    _write_task(
        folder,
        MC_TASK,
        MC_DOCS,
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n",
    )
    _write_task(
        folder,
        GEN_TASK,
        GEN_DOCS,
        "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{target}}"\n'
        "generation_kwargs:\n"
        '  until: ["\\n\\n"]\n'
        "  max_gen_toks: 10\n"
        "  do_sample: false\n"
        "  temperature: 0\n"
        "metric_list:\n"
        "  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
    )
    return TaskManager(include_path=str(folder))


def evaluate(model: str, model_args: dict, task_manager, tasks: list[str], **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` with every sample's responses logged (``results["samples"]``)."""
    from lm_eval import simple_evaluate

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager,
        bootstrap_iters=0,
        log_samples=True,
        verbosity="WARNING",
        **kwargs,
    )


def per_doc(results: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in results["samples"][task]}


def scores(results: dict, task: str) -> dict:
    """The task's metrics (``acc,none``...), without their standard errors."""
    return {k: v for k, v in results["results"][task].items() if "," in k and "stderr" not in k}


@pytest.fixture(scope="module")
def hf_results(model_dir, task_manager):
    """lm-eval's own ``hf`` model on the model directory (float32 on the CPU, one request at a time)."""
    args = {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu", "batch_size": 1}
    return evaluate("hf", args, task_manager, [MC_TASK, GEN_TASK])


@pytest.fixture(scope="module")
def lm_server(loaded):
    with serve(*loaded, chat_template=TEMPLATE, prefill_chunk=32) as served:
        yield served


def completions_args(server, model_dir, **extra) -> dict:
    return {
        "model": MODEL_NAME,
        "base_url": f"{server.url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(model_dir),
        "max_retries": 1,
        "timeout": 60,
        **extra,
    }


def assert_same_loglikelihoods(served: dict, hf: dict) -> None:
    assert scores(served, MC_TASK) == scores(hf, MC_TASK)
    ours, theirs = per_doc(served, MC_TASK), per_doc(hf, MC_TASK)
    assert sorted(ours) == sorted(theirs) == list(range(len(MC_DOCS)))
    for doc_id, sample in ours.items():
        lls = [ll for ((ll, _greedy),) in sample["resps"]]
        expected = [ll for ((ll, _greedy),) in theirs[doc_id]["resps"]]
        assert len(lls) == len(MC_DOCS[doc_id]["choices"])
        assert lls == pytest.approx(expected, abs=1e-4), doc_id
        assert [g for ((_ll, g),) in sample["resps"]] == [g for ((_ll, g),) in theirs[doc_id]["resps"]], doc_id


def assert_same_generations(served: dict, hf: dict) -> None:
    assert scores(served, GEN_TASK) == scores(hf, GEN_TASK)
    ours, theirs = per_doc(served, GEN_TASK), per_doc(hf, GEN_TASK)
    assert sorted(ours) == sorted(theirs) == list(range(len(GEN_DOCS)))
    for doc_id, sample in ours.items():
        assert sample["filtered_resps"] == theirs[doc_id]["filtered_resps"], doc_id


def test_local_completions_with_token_id_prompts_scores_as_the_hf_model(lm_server, model_dir, task_manager, hf_results):
    served = evaluate("local-completions", completions_args(lm_server, model_dir), task_manager, [MC_TASK, GEN_TASK])
    assert_same_loglikelihoods(served, hf_results)
    assert_same_generations(served, hf_results)
    status = lm_server.wait_idle()
    assert status["slots_free"] == status["slots_total"]


def test_local_completions_with_text_prompts_scores_as_the_hf_model(lm_server, model_dir, task_manager, hf_results):
    """``tokenized_requests=False``: lm-eval decodes its token ids and sends text, which the server
    tokenizes again (the same ids for these prompts: checked first), batched four prompts a request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for doc in MC_DOCS:
        for choice in doc["choices"]:
            context = tokenizer(doc["question"], add_special_tokens=False)["input_ids"]
            ids = context + tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            assert tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] == ids
    args = completions_args(lm_server, model_dir, tokenized_requests=False, batch_size=4)
    served = evaluate("local-completions", args, task_manager, [MC_TASK, GEN_TASK])
    assert_same_loglikelihoods(served, hf_results)
    assert_same_generations(served, hf_results)


def test_local_chat_completions_runs_the_generate_until_task(lm_server, task_manager, reference):
    """The messages go as JSON; the server renders them with its chat template and answers greedily."""
    args = {"model": MODEL_NAME, "base_url": f"{lm_server.url}/v1/chat/completions", "max_retries": 1, "timeout": 60}
    served = evaluate("local-chat-completions", args, task_manager, [GEN_TASK], apply_chat_template=True)
    assert set(scores(served, GEN_TASK)) == {"exact_match,none"}
    samples = per_doc(served, GEN_TASK)
    assert sorted(samples) == list(range(len(GEN_DOCS)))
    tokenizer = reference.tokenizer
    for doc_id, sample in samples.items():
        messages = [{"role": "user", "content": GEN_DOCS[doc_id]["prompt"]}]
        text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
        new = reference.tokens(tokenizer(text, add_special_tokens=False)["input_ids"], 10)
        expected = tokenizer.decode(new, skip_special_tokens=True).split("\n\n")[0]
        assert sample["filtered_resps"] == [expected], doc_id
