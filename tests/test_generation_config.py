"""--generation-config / --override-generation-config, as vLLM: the sampling defaults a
model's generation_config.json recommends apply to requests that leave them out.

Claims: offline, LLM.generate without SamplingParams samples with the file's top_k and
max_new_tokens (top_k 1: transformers' greedy tokens, exactly max_new_tokens of them);
"vllm" ignores the file; the override wins over it; over HTTP a request's own fields win,
and the file's max_new_tokens caps a larger max_tokens (vLLM's get_max_tokens); a bad
value is refused at start-up naming the file or the flag."""

from __future__ import annotations

import json
import os

import pytest
from conftest import hf_greedy, make_hf_checkpoint

from config import EngineConfig
from hf_config import generation_sampling_defaults
from llm import LLM, SamplingParams
from protocol import parse_sampling

SHAPES = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=16, warmup=False)
PROMPT = [1, 5, 9, 13]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """A random llama checkpoint whose generation_config.json recommends greedy, 5 tokens."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("gencfg"))
    gen = os.path.join(path, "generation_config.json")
    with open(gen) as f:
        cfg = json.load(f)
    with open(gen, "w") as f:  # do_sample is not read (vLLM does not either); temperature is kept but top_k 1 wins
        json.dump(cfg | {"top_k": 1, "temperature": 0.7, "max_new_tokens": 5, "do_sample": True}, f)
    return path


def test_offline_defaults_come_from_the_generation_config_and_the_flags_change_them(checkpoint):
    greedy = hf_greedy(checkpoint, PROMPT, 5)
    llm = LLM(checkpoint, log=lambda *_: None, **SHAPES)
    assert llm.engine.sampling_defaults == {"top_k": 1, "temperature": 0.7, "max_tokens": 5}
    # vLLM's LLM.get_default_sampling_params: the file's values over SamplingParams' own
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.7, max_tokens=5)
    assert llm.generate([PROMPT])[0].outputs[0].token_ids == greedy
    del llm
    llm = LLM(checkpoint, log=lambda *_: None, generation_config="vllm", **SHAPES)
    assert llm.engine.sampling_defaults == {} and len(llm.generate([PROMPT])[0].outputs[0].token_ids) == 16  # vLLM's 16
    assert llm.get_default_sampling_params() == SamplingParams()
    del llm
    llm = LLM(checkpoint, log=lambda *_: None, override_generation_config='{"max_new_tokens": 3}', **SHAPES)
    assert llm.generate([PROMPT])[0].outputs[0].token_ids == greedy[:3]


def test_a_request_field_wins_and_max_new_tokens_caps_max_tokens():
    defaults = {"temperature": 0.7, "top_k": 1, "max_tokens": 5, "repetition_penalty": 1.2}
    p = parse_sampling({}, 4, 64, True, defaults=defaults)
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p, p.repetition_penalty) == (0.7, 1, 5, 1.0, 1.2)
    p = parse_sampling({"temperature": 0.0, "top_k": 0, "max_tokens": 40}, 4, 64, True, defaults=defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, -1, 5)
    p = parse_sampling({"max_tokens": 3}, 4, 64, False, defaults=defaults)
    assert p.max_tokens == 3
    p = parse_sampling({}, 4, 64, False)  # no generation config: OpenAI's and vLLM's defaults
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, -1, 16)


def test_bad_defaults_are_refused_where_they_enter(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        EngineConfig(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="override_generation_config: top_p must be in"):
        EngineConfig(override_generation_config={"top_p": 2})
    with pytest.raises(ValueError, match="override_generation_config: presence_penalty not among"):
        EngineConfig(override_generation_config='{"presence_penalty": 1.1, "top_p": 0.5}')
    with pytest.raises(ValueError, match="override_generation_config: repetition_penalty must be a finite number"):
        EngineConfig(override_generation_config='{"repetition_penalty": 0}')
    with pytest.raises(ValueError, match="override_generation_config is not valid JSON"):
        EngineConfig(override_generation_config="{top_p")
    bad = make_hf_checkpoint(tmp_path / "bad")
    with open(os.path.join(bad, "generation_config.json"), "w") as f:
        json.dump({"temperature": -1, "eos_token_id": 2}, f)
    with pytest.raises(ValueError, match="generation_config.json: temperature must be a finite number >= 0"):
        LLM(bad, log=lambda *_: None, **SHAPES)
    LLM(bad, log=lambda *_: None, generation_config="vllm", **SHAPES)  # the file's defaults unread


REFUSED = [  # (generation_config.json's key, value, what the error says after the file's path)
    ("top_k", 10**400, "top_k must be a 64-bit integer, got 10"),  # unchecked: loaded
    ("top_k", 2**63, "top_k must be a 64-bit integer, got 9223372036854775808"),  # unchecked: loaded
    ("max_new_tokens", 10**400, "max_new_tokens must be a 64-bit integer, got 10"),  # unchecked: failed each generate()
    ("max_new_tokens", -2**63 - 1, "max_new_tokens must be a 64-bit integer, got -9223372036854775809"),
    ("max_new_tokens", -3, "max_new_tokens must be an integer >= 1, got -3"),  # unchecked: named max_tokens
    ("max_new_tokens", "5", "max_new_tokens must be an integer >= 1, got '5'"),
    ("max_new_tokens", 5.0, "max_new_tokens must be an integer >= 1, got 5.0"),
    ("top_k", -5, "top_k must be -1 or 0 (disabled) or >= 1, got -5"),
    ("top_k", True, "top_k must be -1 or 0 (disabled) or >= 1, got True"),
    ("temperature", 10**400, "temperature must be a finite number >= 0, got 10"),
    ("top_p", "0.5", "top_p must be in (0, 1], got '0.5'"),
]


@pytest.mark.parametrize("key,value,says", REFUSED, ids=[f"{k}={v!r:.12}" for k, v, _ in REFUSED])
def test_an_absurd_default_is_a_load_error_naming_the_file_key_and_value(checkpoint, tmp_path, key, value, says):
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(os.path.join(checkpoint, "config.json"), folder / "config.json")
    path = folder / "generation_config.json"
    path.write_text(json.dumps({key: value}))
    with pytest.raises(ValueError) as e:
        generation_sampling_defaults(EngineConfig(model=str(folder)))
    assert str(e.value).startswith(f"{path}: {says}") and len(str(e.value)) <= 300


def test_the_server_answers_with_the_defaults_unless_the_request_sets_them(checkpoint):
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    import server
    from async_engine import AsyncEngine

    async def run() -> list[int]:
        engine = AsyncEngine(EngineConfig(model=checkpoint, **SHAPES), log=lambda *_: None)
        await engine.start()
        try:
            async with TestClient(TestServer(server.build_app(engine, ["m"]))) as client:
                out = []
                for body in ({}, {"max_tokens": 2}, {"max_tokens": 50, "top_k": 50, "seed": 1}):
                    resp = await client.post("/v1/completions", json={"prompt": PROMPT} | body)
                    assert resp.status == 200, await resp.text()
                    out.append((await resp.json())["usage"]["completion_tokens"])
                return out
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == [5, 2, 5]  # the file's 5; the request's 2; 50 capped at 5
