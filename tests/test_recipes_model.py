"""docs/ARCHITECTURE.md's recipes "Adding an attention backend" and "Adding a model
family", run from the page's own text: each test executes the recipe's code block as
written, then uses the new name through the ordinary front doors (EngineConfig, LLM,
load_model) with no other edit. A recipe that needs an edit elsewhere fails here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import hf_greedy, make_hf_checkpoint

import attention_backend
import model
import model_loader
from llm import LLM, SamplingParams

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "ARCHITECTURE.md")


def recipe(title: str) -> str:
    """The first python code block under the heading `### {title}`."""
    with open(DOC) as f:
        text = f.read()
    section = text.split(f"\n### {title}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def registries():
    """The recipes register into the process-wide tables; leave them as they were."""
    backends, families = dict(attention_backend.BACKENDS), dict(model.FAMILIES)
    yield
    attention_backend.BACKENDS.clear()
    attention_backend.BACKENDS.update(backends)
    model.FAMILIES.clear()
    model.FAMILIES.update(families)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, log=lambda *_: None, max_num_seqs=4, num_kv_blocks=64, block_size=4,
               max_model_len=64, warmup=False, **kw)


def test_adding_an_attention_backend_as_the_doc_says(registries):
    code = recipe("Adding an attention backend")
    namespace: dict = {}
    exec(compile(code, DOC, "exec"), namespace)
    (name,) = attention_backend.BACKENDS.keys() - {"xla", "pallas"}
    assert name == "wrapped-ref" and f'"{name}"' in code

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 19, 11)]
    params = [_greedy(n) for n in (6, 4, 8)]
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=16)  # chunks, mixed steps, decodes
    ref = _llm("tiny", attention_backend="xla", **kw)
    new = _llm("tiny", attention_backend=name, **kw)
    assert new.engine.runner.backend.name == name
    assert [o.outputs[0].token_ids for o in new.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in ref.generate(prompts, params)]


def test_adding_a_model_family_as_the_doc_says(registries, tmp_path):
    code = recipe("Adding a model family")
    exec(compile(code, DOC, "exec"), {})
    (name,) = model.FAMILIES.keys() - {"llama", "mistral", "qwen2", "qwen3"}
    assert name == "my_llama" and f'"{name}"' in code

    path = make_hf_checkpoint(tmp_path / "ckpt", "llama2")
    prompt = np.random.default_rng(1).integers(3, 300, 12).tolist()
    want = hf_greedy(path, prompt, 8)  # transformers, reading it as a Llama
    config = os.path.join(path, "config.json")
    with open(config) as f:
        hf = json.load(f)
    with open(config, "w") as f:
        json.dump({**hf, "model_type": name}, f)

    assert model_loader.load_model(path).config.architecture == name
    (out,) = _llm(path).generate([prompt], [_greedy(8)])
    assert out.outputs[0].token_ids == want
