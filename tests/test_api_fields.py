"""OpenAI API conformance of the request fields and the logprobs shapes, against vLLM's
OpenAI server as the reference, through HTTP on one in-process tiny engine.

Claims: completions' top_logprobs always hold the sampled token (k + 1 entries when it
is not among the top k) and chat's top_logprobs list starts with it (vLLM's order); a
logprob of -inf goes out as -9999.0, never as JSON-invalid -Infinity; a body that is not
declared application/json is vLLM's 400; the max_completion_tokens errors name it; every
OpenAI field the server does not implement is a 400 naming it, those that ask for nothing
are taken, fields nobody defines are warned about and ignored (vLLM's rule); a seed or
priority outside int64 is a 400; the server serves on after each refusal."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest

from conftest import tiny_async_engine
from chat_format import parse_messages
from protocol import ApiError, parse_sampling
from tokenizer import ByteTokenizer
from tool_parsers import ToolCallStream, ToolChoice

C, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def post():
    """post(path, body, headers=None, raw=None) -> (status, text): one request to the app
    on one tiny engine (test_request_metrics' shapes: its programs are cached)."""
    from aiohttp.test_utils import TestClient, TestServer

    import server

    with tiny_async_engine() as (loop, engine):
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())

        async def one(path: str, body: object, headers: dict | None, raw: bytes | None) -> tuple[int, str]:
            if raw is None:
                resp = await client.post(path, json=body)
            else:
                resp = await client.post(path, data=raw, headers=headers or {})
            return resp.status, await resp.text()

        yield lambda path, body=None, headers=None, raw=None: loop.run_until_complete(
            asyncio.wait_for(one(path, body, headers, raw), 300))
        loop.run_until_complete(client.close())


def strict_json(text: str) -> dict:
    """JSON as the spec has it: NaN and +-Infinity are not numbers there."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def served(post) -> None:
    status, text = post(C, {"prompt": [5, 6], "max_tokens": 1, "temperature": 0.0})
    assert status == 200, text


# ---- logprobs ------------------------------------------------------------------------------

LETTERS = {"structured_outputs": {"regex": "[a-z]{12}"}, "max_tokens": 12}  # ASCII tokens: one text per id


def test_completion_top_logprobs_hold_the_sampled_token(post) -> None:
    """OpenAI's "logprobs + 1": each position's dict has the sampled token with its
    logprob; k entries when the sampled token is among the top k, else k + 1, the sampled
    one the least likely. Sampled at temperature 1 over 26 letters, the tiny model's
    near-uniform choice falls outside the top 2 at some position."""
    k = 2
    status, text = post(C, {"prompt": "go", "temperature": 1.0, "seed": 3, "logprobs": k} | LETTERS)
    assert status == 200, text
    lp = strict_json(text)["choices"][0]["logprobs"]
    outside = 0
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == v  # the sampled token is always there, with its own logprob
        others = sorted((x for t, x in top.items() if t != tok), reverse=True)
        if len(top) == k + 1:  # outside the top k: every other entry is at least as likely
            outside += 1
            assert all(x >= v for x in others)
        else:  # among the top k: the dict is exactly the top k
            assert len(top) == k
    assert outside > 0, "no sampled token fell outside the top k: pick another seed"
    # greedy: the sampled token is the top one, so exactly k entries, it the largest
    status, text = post(C, {"prompt": "go", "temperature": 0.0, "logprobs": k} | LETTERS)
    lp = strict_json(text)["choices"][0]["logprobs"]
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) == k and top[tok] == v == max(top.values())
    # logprobs 0: the sampled token alone (vLLM)
    status, text = post(C, {"prompt": "go", "temperature": 1.0, "seed": 3, "logprobs": 0} | LETTERS)
    lp = strict_json(text)["choices"][0]["logprobs"]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_chat_top_logprobs_start_with_the_sampled_token_as_vllm(post) -> None:
    """vLLM's chat list: top_logprobs entries, the sampled token first, then the most
    likely others in order; greedy, that is the top k."""
    k = 3
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": k} | LETTERS
    for temperature in (1.0, 0.0):
        status, text = post(CHAT, body | {"temperature": temperature, "seed": 5})
        assert status == 200, text
        content = strict_json(text)["choices"][0]["logprobs"]["content"]
        moved = 0
        for c in content:
            top = c["top_logprobs"]
            assert len(top) == k and top[0] == {"token": c["token"], "logprob": c["logprob"], "bytes": c["bytes"]}
            rest = [x["logprob"] for x in top[1:]]
            assert rest == sorted(rest, reverse=True) and c["token"] not in [x["token"] for x in top[1:]]
            moved += any(x > c["logprob"] for x in rest)  # a more likely token than the sampled one
        assert (moved > 0) == (temperature > 0), content


def test_a_ruled_out_token_s_logprob_is_minus_9999_never_minus_infinity(post) -> None:
    """Under a grammar the masked tokens' logprobs are -inf; with two letters allowed, the
    top 5 has three of them. JSON has no -Infinity: OpenAI and vLLM send -9999.0."""
    ab = {"structured_outputs": {"regex": "[ab]{4}"}, "max_tokens": 4, "temperature": 0.0}
    status, text = post(C, {"prompt": "go", "logprobs": 5} | ab)
    assert status == 200 and "Infinity" not in text, text
    tops = strict_json(text)["choices"][0]["logprobs"]["top_logprobs"]
    assert all(-9999.0 in top.values() for top in tops), tops
    status, text = post(CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 5} | ab)
    assert status == 200 and "Infinity" not in text, text
    content = strict_json(text)["choices"][0]["logprobs"]["content"]
    assert all(sorted(x["logprob"] for x in c["top_logprobs"])[:3] == [-9999.0] * 3 for c in content)


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_character_split_across_tokens_and_chunks_is_its_last_tokens_text_as_vllm(post, path) -> None:
    """vLLM's logprob tokens: a byte token that alone is part of a character is "", and the
    one that completes it carries the whole character (and its bytes), so the tokens join
    into the text; streamed a token a chunk, the completing token's chunk gets the same
    from the bytes the earlier chunks sent. A grammar writes "é" (two bytes) four times."""
    body = {"structured_outputs": {"regex": "é{4}"}, "max_tokens": 8, "temperature": 0.0} | (
        {"messages": MESSAGES, "logprobs": True} if path == CHAT else {"prompt": "go", "logprobs": 0})

    def tokens(choice: dict) -> list[str]:
        lp = choice["logprobs"]
        if path == C:
            return lp["tokens"]
        assert all(bytes(c["bytes"]) == c["token"].encode() for c in lp["content"])
        return [c["token"] for c in lp["content"]]
    status, text = post(path, body)
    assert status == 200, text
    assert tokens(strict_json(text)["choices"][0]) == ["", "é"] * 4
    status, text = post(path, body | {"stream": True, "stream_interval": 1})
    chunks = [c for e in sse(text) for c in e["choices"] if c["logprobs"]]
    assert len(chunks) == 8 and sum((tokens(c) for c in chunks), []) == ["", "é"] * 4


def test_an_echoed_prompt_whose_first_character_is_split_keeps_it_in_its_logprobs_tokens(post) -> None:
    """Echo with logprobs: the prompt's first token has no logprob, yet it is the context of
    the second, which completes the character they split ("é", two bytes), so the tokens
    join into the echoed text, whole and streamed."""
    prompt = list("é".encode()) + list(b"hi")  # the byte tokenizer's ids are the bytes
    body = {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 1, "temperature": 0.0}
    status, text = post(C, body)
    assert status == 200, text
    choice = strict_json(text)["choices"][0]
    assert choice["logprobs"]["tokens"][:4] == ["", "é", "h", "i"] and choice["text"].startswith("éhi")
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    status, text = post(C, body | {"stream": True})
    streamed = [t for e in sse(text) for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == choice["logprobs"]["tokens"]


# ---- the body's media type -------------------------------------------------------------------

def test_a_body_not_declared_json_is_vllm_s_400(post) -> None:
    raw = json.dumps({"prompt": [5, 6], "max_tokens": 1}).encode()
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}, {}):
        for path in (C, CHAT):
            status, text = post(path, raw=raw, headers=headers)
            err = strict_json(text)["error"]
            assert status == 400 and err == {"message": "Unsupported Media Type: Only 'application/json' is allowed",
                                             "type": "Bad Request", "param": None, "code": 400}  # vLLM's handler
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):  # what clients send
        status, text = post(C, raw=raw, headers={"Content-Type": ctype})
        assert status == 200, (ctype, text)


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_schema_number_past_a_float_s_range_is_a_400_saying_so(post, path) -> None:
    """1e400 in a response_format schema: a 400 naming response_format that says a number is
    out of range (Python's JSON reads it as Infinity, which llguidance would call no value)."""
    body = '{"max_tokens": 2, %s, "response_format": {"type": "json_schema", "json_schema": ' \
           '{"name": "n", "schema": {"type": "number", "maximum": 1e400}}}}' % (
               '"messages": [{"role": "user", "content": "hi"}]' if path == CHAT else '"prompt": [5, 6]')
    status, text = post(path, raw=body.encode(), headers={"Content-Type": "application/json"})
    err = strict_json(text)["error"]
    assert status == 400 and err["param"] == "response_format", text
    assert "number out of range (Infinity)" in err["message"] and "expected value" not in err["message"], text
    served(post)


# ---- max_completion_tokens ------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -1, 1000, "5"])
def test_max_completion_tokens_errors_name_it(post, value) -> None:
    status, text = post(CHAT, {"messages": MESSAGES, "max_completion_tokens": value, "max_tokens": 4})
    err = strict_json(text)["error"]
    assert status == 400 and err["param"] == "max_completion_tokens", text
    assert "max_completion_tokens" in err["message"] and "max_tokens" not in err["message"].replace(
        "max_completion_tokens", "")
    served(post)


# ---- fields: implemented, refused, taken as no-ops, unknown ----------------------------------

REFUSED = [  # (path, field, value): OpenAI's (or vLLM's) and not implemented here
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "prediction", {"type": "content", "content": "hello"}),
    (CHAT, "web_search_options", {}),
    (CHAT, "moderation", {"model": "omni-moderation-latest"}),
    (CHAT, "prompt_cache_retention", "24h"),
    (CHAT, "service_tier", "fast"),
    (CHAT, "service_tier", "flex"),
    (CHAT, "service_tier", "priority"),
    (CHAT, "store", True),
    (CHAT, "store", 0),  # JSON's 0 is not false
    (CHAT, "verbosity", "low"),
    (CHAT, "function_call", {"name": "f"}),
    (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "reasoning_effort", "extreme"),
    (CHAT, "return_prompt_text", True),
    (CHAT, "kv_transfer_params", {"do_remote_prefill": True}),  # vLLM's disaggregated serving
    (C, "ec_transfer_params", {}),
    (C, "vllm_xargs", {"k": 1}),
    (CHAT, "cache_salt", ""),  # vLLM's: a non-empty string
    (C, "cache_salt", 5),
    (CHAT, "cache_salt", []),
    (CHAT, "metadata", "not an object"),
    (CHAT, "parallel_tool_calls", "no"),
    (C, "max_completion_tokens", 5),  # chat's field: on completions it would be ignored
    (C, "top_logprobs", 2),
    (C, "suffix", "tail"),
    (C, "best_of", 2),
    (C, "best_of", True),  # nor is true 1
    (C, "use_beam_search", 1),  # a boolean
    (C, "length_penalty", 0.5),  # beam search's (use_beam_search: true), or nothing
    (C, "stream_options", {"include_usage": True, "include_typo": True}),
    (C, "seed", 2**63),
    (C, "seed", -2**63 - 1),
    (C, "priority", 2**63),
]


@pytest.mark.parametrize("path,name,value", REFUSED, ids=[f"{p[4:8]}-{n}" for p, n, _ in REFUSED])
def test_an_openai_field_not_implemented_is_a_400_naming_it_and_the_server_serves_on(post, path, name, value) -> None:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": [5, 6]}
    stream = {"stream": True} if name == "stream_options" else {}
    status, text = post(path, base | {"max_tokens": 1, name: value} | stream)
    assert status == 400, text
    err = strict_json(text)["error"]
    assert err["param"] == name and name in err["message"], err
    served(post)


ACCEPTED = [  # fields that ask for nothing a client depends on, and the neutral values of the rest
    {"user": "alice", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
     "prompt_cache_key": "abc", "prompt_cache_options": {"mode": "implicit"}, "safety_identifier": "u1",
     "prompt_cache_retention": "in_memory", "modalities": ["text"], "verbosity": "medium",
     "reasoning_effort": "low", "function_call": "none", "functions": [], "logit_bias": {}, "n": 1},
    {"seed": 2**63 - 1}, {"seed": -2**63}, {"cache_salt": "pepper"}, {"cache_salt": None},
    {"length_penalty": 1.0},  # its default: asks nothing without beam search (README)
    {"stream_interval": 1, "session_id": "conversation-7"},  # vLLM's: a chunk per token, a routing hint
    {"stream_interval": 4},  # vLLM's output stage reads it for a stream only
]


@pytest.mark.parametrize("extra", ACCEPTED)
def test_fields_that_ask_nothing_are_taken(post, extra) -> None:
    status, text = post(CHAT, {"messages": MESSAGES, "max_tokens": 2} | extra)
    assert status == 200, text


@pytest.mark.parametrize("extra,words", [({"stream_interval": 0}, "stream_interval must be at least 1, got 0."),
                                         ({"stream_interval": 0, "stream": True}, "must be at least 1"),
                                         ({"stream_interval": 2.5, "stream": True}, "must be an integer")])
def test_stream_interval_is_at_least_1_as_vllms(post, extra, words) -> None:
    """vLLM's SamplingParams refuses a stream_interval under 1 on any request."""
    status, text = post(CHAT, {"messages": MESSAGES, "max_tokens": 1} | extra)
    err = strict_json(text)["error"]
    assert status == 400 and err["param"] == "stream_interval" and words in err["message"], text


def test_a_stream_sends_stream_interval_tokens_a_chunk_as_vllms_output_stage() -> None:
    """vLLM's --stream-interval (here a server of 3) and a request's own stream_interval,
    which may raise the server's but not lower it (vLLM's RequestState.from_new_request takes
    the larger): a chunk once that many tokens have come since the last one sent, the first
    token's and the last chunk at once (vLLM's RequestState.make_request_output). The chunks
    add up to the whole response: its tokens, text and logprobs."""
    from aiohttp.test_utils import TestClient, TestServer

    import server

    with tiny_async_engine(stream_interval=3) as (loop, engine):
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())

        async def one(body: dict) -> str:
            resp = await client.post(C, json=body)
            assert resp.status == 200
            return await resp.text()
        try:
            body = {"prompt": [5, 6], "temperature": 0, "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
            for max_tokens, extra, sizes in ((10, {}, [1, 3, 3, 3]), (9, {}, [1, 3, 3, 2]),
                                             (10, {"stream_interval": 4}, [1, 4, 4, 1]),
                                             (7, {"stream_interval": 1}, [1, 3, 3])):
                whole = strict_json(loop.run_until_complete(one(body | extra | {"max_tokens": max_tokens})))
                whole = whole["choices"][0]
                stream = [e["choices"][0] for e in sse(loop.run_until_complete(one(
                    body | extra | {"max_tokens": max_tokens, "stream": True})))
                    if e["choices"]]
                assert [len(c["token_ids"]) for c in stream] == sizes, (extra, stream)
                assert [len(c["logprobs"]["tokens"]) for c in stream] == sizes
                assert sum((c["token_ids"] for c in stream), []) == whole["token_ids"]
                assert "".join(c["text"] for c in stream) == whole["text"]
                assert sum((c["logprobs"]["token_logprobs"] for c in stream), []) == \
                    whole["logprobs"]["token_logprobs"]
                assert [c["finish_reason"] for c in stream] == [None] * (len(sizes) - 1) + ["length"]
        finally:
            loop.run_until_complete(client.close())


def test_a_whole_chat_response_carries_every_field_of_vllms_null_where_unused(post) -> None:
    """vLLM dumps its ChatCompletionResponse whole, None fields too: the message's refusal,
    annotations, audio, function_call and reasoning as null (tool_calls left out when there
    are none, by ChatMessage's serializer); the choice's token_ids null unless asked for and
    routed_experts; the response's service_tier, system_fingerprint, prompt_logprobs,
    prompt_token_ids, prompt_text, kv_transfer_params, ec_transfer_params and metrics, where a
    chat response's prompt_logprobs and prompt_token_ids go (not on the choice)."""
    status, text = post(CHAT, {"messages": MESSAGES, "max_tokens": 2})
    out = strict_json(text)
    choice = out["choices"][0]
    message = choice["message"]
    assert status == 200 and list(message) == ["role", "content", "refusal", "annotations", "audio", "function_call",
                                               "reasoning"], message
    assert message["role"] == "assistant" and \
        all(message[k] is None for k in ("refusal", "annotations", "audio", "function_call", "reasoning"))
    assert {"index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"} <= set(choice)
    assert choice["token_ids"] is None and choice["logprobs"] is None and choice["routed_experts"] is None
    unused = ("service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids", "prompt_text",
              "kv_transfer_params", "ec_transfer_params", "metrics")
    assert all(k in out and out[k] is None for k in unused), out
    status, text = post(CHAT, {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True})
    out = strict_json(text)
    prompt = out["usage"]["prompt_tokens"]
    assert len(out["prompt_token_ids"]) == len(out["prompt_logprobs"]) == prompt and out["prompt_logprobs"][0] is None
    assert "prompt_logprobs" not in out["choices"][0] and len(out["choices"][0]["token_ids"]) == 2
    # a stream's choices have no such field either (vLLM's ChatCompletionResponseStreamChoice)
    status, text = post(CHAT, {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0, "stream": True})
    assert status == 200 and all("prompt_logprobs" not in c for e in sse(text) for c in e["choices"]), text


def test_a_whole_completion_response_carries_every_field_of_vllms_null_where_unused(post) -> None:
    """vLLM dumps its CompletionResponse whole (model_dump()), None fields too: the choice's
    token_ids, prompt_logprobs, prompt_token_ids and routed_experts, the response's
    service_tier, system_fingerprint, kv_transfer_params, ec_transfer_params and metrics."""
    status, text = post(C, {"prompt": [5, 6], "max_tokens": 2})
    out = strict_json(text)
    (choice,) = out["choices"]
    assert status == 200 and all(k in choice and choice[k] is None for k in (
        "logprobs", "token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts")), choice
    assert {"index", "text", "finish_reason", "stop_reason"} <= set(choice)
    assert all(k in out and out[k] is None for k in ("service_tier", "system_fingerprint", "kv_transfer_params",
                                                     "ec_transfer_params", "metrics")), out
    status, text = post(C, {"prompt": [5, 6], "max_tokens": 2, "prompt_logprobs": 0, "return_token_ids": True})
    (choice,) = strict_json(text)["choices"]
    assert choice["prompt_token_ids"] == [5, 6] and len(choice["token_ids"]) == 2, choice
    assert len(choice["prompt_logprobs"]) == 2 and choice["prompt_logprobs"][0] is None, choice


COMPLETION_STREAM_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
                            "token_ids"]


def test_a_completion_stream_choice_carries_every_field_of_vllms_null_where_unused(post) -> None:
    """vLLM sets every field of its CompletionResponseStreamChoice on each chunk (dumped with
    exclude_unset): prompt_token_ids null but on a choice's first chunk, where return_token_ids
    or echo puts the prompt's ids; token_ids null unless asked; no prompt_logprobs (the
    stream choice has none, prompt_logprobs 0 included)."""
    body = {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True, "stream": True, "n": 2}
    for extra, first_ids in (({}, None), ({"prompt_logprobs": 0}, None), ({"echo": True}, [5, 6]),
                             ({"return_token_ids": True}, [5, 6])):
        status, text = post(C, body | extra)
        choices = [c for e in sse(text) for c in e["choices"]]
        assert status == 200 and all(list(c) == COMPLETION_STREAM_CHOICE for c in choices), (extra, text)
        for i in range(2):
            mine = [c for c in choices if c["index"] == i]
            assert mine[0]["prompt_token_ids"] == first_ids and all(c["prompt_token_ids"] is None for c in mine[1:])
            assert all((c["token_ids"] is None) != ("return_token_ids" in extra) for c in mine), (extra, mine)
            assert [c["stop_reason"] for c in mine] == [None] * len(mine) and mine[-1]["finish_reason"] == "length"


def test_a_chat_stream_choice_carries_vllms_fields_on_vllms_chunks(post) -> None:
    """vLLM's chat stream: each choice's role chunk is {index, delta, logprobs, finish_reason}
    with the response's prompt_token_ids and prompt_text beside it (null unless asked); its
    other chunks carry token_ids (null unless asked), the last one stop_reason too."""
    body = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "stream": True, "n": 2}
    for extra in ({}, {"return_token_ids": True}):
        status, text = post(CHAT, body | extra)
        events = sse(text)
        assert status == 200, text
        for i in range(2):
            mine = [(e, c) for e in events for c in e["choices"] if c["index"] == i]
            (role_event, role), rest = mine[0], [c for _, c in mine[1:]]
            assert list(role) == ["index", "delta", "logprobs", "finish_reason"] and role["delta"]["content"] == ""
            assert role_event["prompt_text"] is None and (role_event["prompt_token_ids"] is None) != bool(extra)
            assert all(list(c) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
                       for c in rest[:-1])
            assert list(rest[-1]) == ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
            assert rest[-1]["finish_reason"] == "length" and rest[-1]["stop_reason"] is None
            assert all((c["token_ids"] is None) != bool(extra) for c in rest), rest
            assert all("prompt_token_ids" not in e for e, _ in mine[1:])


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_stream_sends_a_chunk_per_step_whose_text_is_held_back_as_vllm(post, path) -> None:
    """vLLM streams a chunk for every engine step that made tokens, its text "" when the
    detokenizer holds it back (here the first byte of a two-byte character): the continuous
    usage counts up one token a chunk."""
    body = {"structured_outputs": {"regex": "\u00e9{3}"}, "max_tokens": 6, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}} | (
        {"messages": MESSAGES} if path == CHAT else {"prompt": "go"})
    status, text = post(path, body)
    chunks = [e for e in sse(text) if e["choices"] and (path == C or "role" not in e["choices"][0]["delta"])]
    assert status == 200 and [e["usage"]["completion_tokens"] for e in chunks] == [1, 2, 3, 4, 5, 6], text
    texts = [e["choices"][0]["text"] if path == C else e["choices"][0]["delta"]["content"] for e in chunks]
    assert texts == ["", "\u00e9"] * 3, texts


def test_a_field_nobody_defines_is_warned_about_and_ignored_as_vllm(post, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="taxirank.server"):
        status, text = post(C, {"prompt": [5, 6], "max_tokens": 1, "frobnicate": 1})
    assert status == 200, text
    assert any("ignored: frobnicate" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="taxirank.server"):
        post(C, {"prompt": [5, 6], "max_tokens": 1})
    assert not any("ignored" in r.getMessage() for r in caplog.records)


def test_a_messages_name_reaches_the_template_as_vllm() -> None:
    """vLLM's parse_chat_messages keeps a message's (string) name for the template, which
    may render it (a participant's name, a tool's)."""
    seen = []

    class Template(ByteTokenizer):
        def apply_chat_template(self, chat, add_generation_prompt=True, tokenize=False, **variables):
            seen.append(chat)
            return super().apply_chat_template(chat, add_generation_prompt, tokenize)

    parse_messages({"messages": [{"role": "user", "content": "hi", "name": "bob"}, {"role": "user", "content": "x"}]},
                   Template())
    assert seen == [[{"role": "user", "content": "hi", "name": "bob"}, {"role": "user", "content": "x"}]]


def test_content_parts_that_are_text_and_an_assistants_reasoning_reach_the_template_as_vllm() -> None:
    """vLLM's parser reads text from "text", "input_text", "output_text", "refusal" and
    "thinking" parts and from plain strings, joined by newlines, and hands an assistant's
    reasoning (or reasoning_content) to the template under both names (Qwen3's template
    shows the earlier turns' thinking from reasoning_content)."""
    seen = []

    class Template(ByteTokenizer):
        def apply_chat_template(self, chat, add_generation_prompt=True, tokenize=False, **variables):
            seen.append(chat)
            return super().apply_chat_template(chat, add_generation_prompt, tokenize)

    parts = ["a", {"type": "text", "text": "b"}, {"type": "input_text", "text": "c"},
             {"type": "output_text", "text": "d"}, {"type": "refusal", "refusal": "e"},
             {"type": "thinking", "thinking": "f"}]
    parse_messages({"messages": [{"role": "ipython", "content": "{}"}]}, Template())  # any role, as vLLM
    assert seen.pop() == [{"role": "ipython", "content": "{}"}]
    parse_messages({"messages": [{"role": "user", "content": parts},
                                 {"role": "assistant", "content": "ok", "reasoning_content": "why"},
                                 {"role": "user", "content": "x"}]}, Template())
    assert seen == [[{"role": "user", "content": "a\nb\nc\nd\ne\nf"},
                     {"role": "assistant", "content": "ok", "reasoning": "why", "reasoning_content": "why"},
                     {"role": "user", "content": "x"}]]
    for content, says in [([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "'image_url' are not"),
                          ([{"type": "refusal", "text": "e"}], "a 'refusal' part needs 'refusal'"),
                          ([{"text": "no type"}], "a string or an object with a string 'type'"), ([5], "'type'")]:
        with pytest.raises(ApiError, match=says):
            parse_messages({"messages": [{"role": "user", "content": content}]}, Template())
    with pytest.raises(ApiError, match=r"messages\[0\].reasoning must be a string"):
        parse_messages({"messages": [{"role": "assistant", "content": "", "reasoning": 5}]}, Template())


def test_a_message_without_content_reaches_the_template_empty_as_vllm() -> None:
    """vLLM's CustomChatCompletionMessageParam leaves 'content' optional for any role and its
    _parse_chat_message_content reads a missing one as no parts: an empty string. A null
    content is still refused for a role other than assistant (no message type takes it)."""
    seen = []

    class Template(ByteTokenizer):
        def apply_chat_template(self, chat, add_generation_prompt=True, tokenize=False, **variables):
            seen.append(chat)
            return super().apply_chat_template(chat, add_generation_prompt, tokenize)

    parse_messages({"messages": [{"role": "system"}, {"role": "user", "content": "x"}]}, Template())
    assert seen == [[{"role": "system", "content": ""}, {"role": "user", "content": "x"}]]
    with pytest.raises(ApiError, match=r"messages\[0\]"):
        parse_messages({"messages": [{"role": "user", "content": None}]}, Template())


def test_reasoning_effort_reaches_a_template_that_reads_it_as_vllm() -> None:
    seen = []

    class Template(ByteTokenizer):  # a Jinja template: any variable may be passed, it reads two
        def apply_chat_template(self, chat, add_generation_prompt=True, tokenize=False, **variables):
            seen.append((variables.get("reasoning_effort"), variables.get("enable_thinking")))
            return super().apply_chat_template(chat, add_generation_prompt, tokenize)

    parse_messages({"messages": MESSAGES, "reasoning_effort": "high"}, Template())
    parse_messages({"messages": MESSAGES, "reasoning_effort": "none"}, Template())
    parse_messages({"messages": MESSAGES, "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
                   Template())
    parse_messages({"messages": MESSAGES}, Template())
    assert seen == [("high", True), ("none", False), ("low", False), (None, None)]
    # a template without variables of its own (ByteTokenizer's) renders as without it
    assert parse_messages({"messages": MESSAGES, "reasoning_effort": "high"}, ByteTokenizer()) == \
        parse_messages({"messages": MESSAGES}, ByteTokenizer())
    with pytest.raises(ApiError) as e:
        parse_messages({"messages": MESSAGES, "reasoning_effort": 3}, Template())
    assert e.value.param == "reasoning_effort"


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed() -> None:
    """vLLM's maybe_filter_parallel_tool_calls: the answer's first call only."""
    tools = ToolChoice("required", {"f": {"type": "object"}, "g": {"type": "object"}})
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": 2}}]'
    for parallel, names in ((True, ["f", "g"]), (False, ["f"])):
        message, reason = ToolCallStream(tools, parallel=parallel).message(text, "stop")
        assert [c["function"]["name"] for c in message["tool_calls"]] == names and reason == "tool_calls"
        stream = ToolCallStream(tools, parallel=parallel)
        deltas = [stream.delta(ch, None)[0] for ch in text[:-1]] + [stream.delta(text[-1], "stop")[0]]
        streamed = [c for d in deltas for c in d.get("tool_calls", [])]
        assert sorted({c["index"] for c in streamed}) == list(range(len(names)))


def test_seed_bounds_are_vllm_s_int64() -> None:
    for seed in (2**63, -2**63 - 1, 10**30):
        with pytest.raises(ApiError) as e:
            parse_sampling({"seed": seed}, 3, 256, chat=False)
        assert e.value.status == 400 and e.value.param == "seed"
    for seed in (2**63 - 1, -2**63, 0, -2):
        assert parse_sampling({"seed": seed}, 3, 256, chat=False).seed == seed
    assert parse_sampling({"seed": -1}, 3, 256, chat=False).seed is None  # vLLM's: -1 is no seed


# ---- stream_options and max_tokens null -------------------------------------------------------

def sse(text: str) -> list[dict]:
    return [strict_json(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", [C, CHAT])
def test_stream_options_without_include_usage_stream_the_usage_as_vllm(post, path) -> None:
    """vLLM's StreamOptions has include_usage true unless set: {} or {"continuous_usage_stats":
    true} alone stream the usage (its null is false; no stream_options, no usage)."""
    body = {"max_tokens": 3, "ignore_eos": True, "stream": True} | (
        {"messages": MESSAGES} if path == CHAT else {"prompt": [5, 6]})
    for options, want in (({}, True), ({"continuous_usage_stats": True}, True), ({"include_usage": None}, False),
                          ({"include_usage": False, "continuous_usage_stats": True}, False), (None, False)):
        status, text = post(path, body | {"stream_options": options})
        assert status == 200, text
        events = sse(text)
        assert (events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3) == want, (options, text)
        continuous = options == {"continuous_usage_stats": True}  # (include_usage true by default)
        assert all(("usage" in e) == continuous for e in events[:-1]), (options, text)


@pytest.mark.parametrize("path", [C, CHAT])
def test_continuous_usage_counts_the_tokens_of_the_chunk_s_own_choice_as_vllm(post, path) -> None:
    """vLLM's continuous_usage_stats with n samples: a chunk of choice i counts choice i's
    tokens so far (previous_num_tokens[i]), the final usage chunk all of them."""
    body = {"max_tokens": 4, "ignore_eos": True, "stream": True, "n": 3, "logprobs": True if path == CHAT else 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}} | (
        {"messages": MESSAGES} if path == CHAT else {"prompt": [5, 6]})
    status, text = post(path, body)
    assert status == 200, text
    events = sse(text)
    seen = {i: 0 for i in range(3)}  # tokens streamed so far per choice, counted by their logprobs
    for e in events[:-1]:
        (choice,) = e["choices"]
        lps = choice["logprobs"]
        seen[choice["index"]] += 0 if lps is None else len(lps["content"] if path == CHAT else lps["tokens"])
        assert e["usage"]["completion_tokens"] == seen[choice["index"]], (seen, e)
        assert e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + seen[choice["index"]]
    assert seen == {i: 4 for i in range(3)} and events[-1]["usage"]["completion_tokens"] == 12


def test_a_completion_s_max_tokens_null_is_its_default_16_as_vllm(post) -> None:
    """vLLM's CompletionRequest: max_tokens left out is 16, and so is an explicit null
    (normalize_null_max_tokens), not the room the context leaves (the tiny engine's 128 here),
    nor a prompt truncated to make room for none."""
    long = [5 + i % 200 for i in range(120)]
    for extra, want in (({}, (2, 16)), ({"max_tokens": None}, (2, 16)),
                        ({"prompt": long, "max_tokens": None, "truncate_prompt_tokens": -1}, (128 - 16, 16))):
        status, text = post(C, {"prompt": [5, 6], "ignore_eos": True} | extra)
        assert status == 200, text
        usage = strict_json(text)["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == want, (extra, text)


# what clients match in vLLM's 400 to fit the prompt or lower max_tokens and retry
TOO_LONG = re.compile(r"You passed (\d+) input tokens and requested (\d+) output tokens\. However, the model's context "
                      r"length is only (\d+) tokens, resulting in a maximum input length of (\d+) tokens\. Please "
                      r"reduce the length of the input prompt\. \(parameter=input_tokens, value=(\d+)\)")
CHAT_PROMPT = len(ByteTokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True))


@pytest.mark.parametrize("path,body,want", [
    (C, {"prompt": [5] * 100, "max_tokens": 29}, (100, 29, 128, 99, 100)),
    (C, {"prompt": [5] * 120}, (120, 16, 128, 112, 120)),  # completions' default max_tokens counts
    (C, {"prompt": [5] * 129, "max_tokens": None}, (129, 16, 128, 112, 129)),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 100, "max_tokens": 3},
     (CHAT_PROMPT, 100, 128, 28, CHAT_PROMPT)),
])
def test_a_prompt_past_the_context_is_vllm_s_400_whose_numbers_clients_read(post, path, body, want) -> None:
    """vLLM's renderer's words (TokenizeParams) for a prompt plus the output asked over
    max_model_len (the tiny engine's 128), naming the prompt (input_tokens): clients parse
    the numbers out of them, so the words are part of the API."""
    status, text = post(path, body)
    err = strict_json(text)["error"]
    assert status == 400 and err["param"] == "input_tokens", text
    assert tuple(map(int, TOO_LONG.fullmatch(err["message"]).groups())) == want, err


@pytest.mark.parametrize("path,body,param", [
    (C, {"prompt": [5], "max_tokens": 129}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 500}, "max_completion_tokens"),
])
def test_a_max_tokens_past_the_context_is_vllm_s_400_naming_it(post, path, body, param) -> None:
    status, text = post(path, body)
    err = strict_json(text)["error"]
    assert status == 400 and err["param"] == param, text
    # vLLM's TokenizeParams writes f"{max_total_tokens=}" after "max_model_len=": clients match the whole spelling
    assert err["message"] == (f"{param}={body[param]} cannot be greater than max_model_len=max_total_tokens=128. "
                              f"Please request fewer output tokens. (parameter={param}, value={body[param]})")


# ---- batched prompts ---------------------------------------------------------------------------

def test_a_batch_of_prompts_is_one_choice_per_sample_in_vllm_s_order(post) -> None:
    """vLLM's batched completions prompt (a list of token-id lists or of strings): prompt k's
    n samples are choices k * n .. k * n + n - 1, sample i what the prompt alone gives seeded
    seed + i; usage counts every prompt once and every sample's tokens."""
    prompts, n = [[5, 6, 7], [8, 9], [10]], 2
    sampled = {"max_tokens": 3, "temperature": 1.0, "ignore_eos": True, "logprobs": 1}
    status, text = post(C, {"prompt": prompts, "n": n, "seed": 11} | sampled)
    assert status == 200, text
    whole = strict_json(text)
    assert [c["index"] for c in whole["choices"]] == list(range(len(prompts) * n))
    for k, prompt in enumerate(prompts):
        for i, c in enumerate(whole["choices"][k * n:(k + 1) * n]):
            (want,) = strict_json(post(C, {"prompt": prompt, "seed": 11 + i} | sampled)[1])["choices"]
            assert (c["text"], c["logprobs"]["tokens"]) == (want["text"], want["logprobs"]["tokens"]), (k, c, want)
            assert c["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    assert whole["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": 6, "completion_tokens": 3 * n * len(prompts), "total_tokens": 6 + 3 * n * len(prompts),
        "prompt_tokens_details": None, "completion_tokens_details": None}


def test_a_batch_of_texts_echoes_each_prompt_and_streams_each_choice_s_usage(post) -> None:
    texts = ["ab", "cde"]
    status, text = post(C, {"prompt": texts, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, text
    choices = strict_json(text)["choices"]
    assert [c["text"] for c in choices] == texts  # echo with max_tokens 0: each prompt alone
    assert [c["logprobs"]["tokens"][1:] for c in choices] == [list(t) for t in texts]  # (a BOS first)
    status, text = post(C, {"prompt": texts, "max_tokens": 2, "ignore_eos": True, "stream": True,
                            "stream_options": {"continuous_usage_stats": True}})
    assert status == 200, text
    events = sse(text)
    assert {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}
    for e in events[:-1]:  # (each prompt: its BOS and its characters)
        assert e["usage"]["prompt_tokens"] == 1 + len(texts[e["choices"][0]["index"]])
    assert events[-1]["usage"]["prompt_tokens"] == 2 + 5 and events[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("prompt, says", [(["ab", [5, 6]], "one kind"), ([[5], []], "prompt 1 is empty"),
                                          (["ab", ""], "prompt 1 is empty"), ([[5], [10**6]], "prompt 1: token id"),
                                          ([[5]] * 1025, "at most 1024 prompts")])
def test_a_bad_batch_is_a_400_naming_the_prompt(post, prompt, says) -> None:
    status, text = post(C, {"prompt": prompt, "max_tokens": 1})
    err = strict_json(text)["error"]
    assert status == 400 and err["param"] == "prompt" and says in err["message"], text
    status, text = post(C, {"prompt": [[5]] * 9, "n": 128, "max_tokens": 1})
    assert status == 400 and strict_json(text)["error"]["param"] == "n", text
    served(post)
