"""docs/ARCHITECTURE.md's recipes "Adding an attention backend", "Adding a model
family" and "Adding a quantization method", run from the page's own text: each test executes the recipe's code block as
written, then uses the new name through the ordinary front doors (EngineConfig, LLM,
load_model) with no other edit. A recipe that needs an edit elsewhere fails here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import hf_greedy, hf_rounded_reference, make_hf_checkpoint, prompt_logprob_gap

import attention_backend
import model
import model_loader
from llm import LLM, SamplingParams
from quant_methods import QUANTIZATION_METHODS

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
    tables = (attention_backend.BACKENDS, model.FAMILIES, QUANTIZATION_METHODS)
    saved = [dict(t) for t in tables]
    yield
    for table, entries in zip(tables, saved):
        table.clear()
        table.update(entries)


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


def _int8_rounded(w: np.ndarray) -> np.ndarray:
    """w [out, in] rounded to symmetric int8 per output channel, in float (the reference)."""
    scale = np.abs(w).max(axis=1, keepdims=True) / 127
    scale[scale == 0] = 1
    return np.clip(np.rint(w / scale), -127, 127) * scale


def test_adding_a_quantization_method_as_the_doc_says(registries, tmp_path):
    """The recipe's method stores the MLP's linears in int8 and nothing else: its arrays say
    so, and the prompt logprobs and greedy tokens are transformers' on the checkpoint with
    exactly those weights rounded to int8 (NumPy), not the float model's."""
    from cli_args import build_parser

    code = recipe("Adding a quantization method")
    exec(compile(code, DOC, "exec"), {})
    (name,) = QUANTIZATION_METHODS.keys() - {"int8", "fp8", "gguf"}
    assert name == "int8_mlp" and f'"{name}"' in code
    assert name in build_parser().format_help()

    path = make_hf_checkpoint(tmp_path / "ckpt", "llama2")
    llm = _llm(path, quantization=name)
    layers = llm.engine.loaded.model.layers
    for lin in (layers.mlp.gate_proj, layers.mlp.up_proj, layers.mlp.down_proj):
        assert lin.kernel[...].dtype == np.int8 and lin.scale[...].dtype == np.float32
    for lin in (layers.self_attn.q_proj, layers.self_attn.k_proj, layers.self_attn.v_proj, layers.self_attn.o_proj):
        assert lin.kernel[...].dtype == np.float32 and not hasattr(lin, "scale")

    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 300, n).tolist() for n in (13, 7)]
    floats, want, want_tokens = hf_rounded_reference(
        path, prompts, 6, lambda n, w: _int8_rounded(w) if ".mlp." in n else None)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    assert prompt_logprob_gap(outs, prompts, want) < 1e-4
    assert prompt_logprob_gap(outs, prompts, floats) > 1e-3  # the rounding shows: the MLP really is int8
    assert [o.outputs[0].token_ids for o in outs] == want_tokens


def test_an_unregistered_quantization_name_is_refused_naming_the_registered_ones(capsys):
    from cli_args import build_parser
    from config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be int8, fp8 or gguf, got 'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(SystemExit):  # the flag's choices are the registry's, as every registry's
        build_parser().parse_args(["--quantization", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
