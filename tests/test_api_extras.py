"""vLLM's extra request fields of the OpenAI server, through HTTP on one in-process tiny
engine, against vLLM's behaviour as the reference and independent references (the
tokenizer's own encoding, transformers' logits).

Claims: the response id is `cmpl-<id>` / `chatcmpl-<id>` from the X-Request-Id header, else
the body's request_id, and two requests with one id run side by side in the engine (each
its own internal id); --enable-request-id-headers echoes X-Request-Id (or a fresh one) on
every response; truncate_prompt_tokens keeps the last (or first) k of the tokenizer's ids,
after the chat template; echo puts the prompt (chat: the last message of the answer's role)
before the answer, its logprobs transformers' log-softmax, the first null; return_token_ids
are the tokenizer's encoding of the text; return_tokens_as_token_ids names logprobs' tokens
"token_id:N"; LLM.generate's stop_reason is vLLM's; every bad value is a 400 naming its field."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from typing import Any

import pytest

from conftest import tiny_async_engine

C, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def app():
    """(post, post_many): post(path, body, headers=None, flagged=False) -> (status, body text,
    headers), one request to the app (--enable-request-id-headers; flagged: the app with
    --return-tokens-as-token-ids too) on one tiny engine; post_many(requests) sends several at once."""
    from aiohttp.test_utils import TestClient, TestServer

    import server

    with tiny_async_engine() as (loop, engine):
        client, flagged_client = (
            TestClient(TestServer(server.build_app(engine, ["tiny"], request_id_headers=True,
                                                   return_tokens_as_token_ids=flagged)), loop=loop)
            for flagged in (False, True))
        loop.run_until_complete(client.start_server())
        loop.run_until_complete(flagged_client.start_server())

        async def one(path: str, body: object, headers: dict | None, flagged: bool = False) -> tuple[int, str, Any]:
            resp = await (flagged_client if flagged else client).post(path, json=body, headers=headers or {})
            return resp.status, await resp.text(), resp.headers.copy()  # case-insensitive

        def post(path: str, body: object, headers: dict | None = None, flagged: bool = False) -> tuple[int, str, Any]:
            return loop.run_until_complete(asyncio.wait_for(one(path, body, headers, flagged), 300))

        def post_many(requests: list[tuple[str, object, dict | None]]) -> list[tuple[int, str, Any]]:
            async def many() -> list[tuple[int, str, Any]]:
                return await asyncio.gather(*(one(*r) for r in requests))
            return loop.run_until_complete(asyncio.wait_for(many(), 300))

        yield post, post_many
        loop.run_until_complete(client.close())
        loop.run_until_complete(flagged_client.close())


def events(text: str) -> list[dict]:
    """An SSE body's JSON events, [DONE] left out."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ---- request_id and X-Request-Id ------------------------------------------------------------

def test_the_response_id_is_the_client_s_request_id_as_vllm(app) -> None:
    post, _ = app
    base = {"max_tokens": 2, "temperature": 0.0}
    status, text, headers = post(C, {"prompt": "ab", "request_id": "my-id-1"} | base)
    assert status == 200 and json.loads(text)["id"] == "cmpl-my-id-1", text
    # the header wins over the body (vLLM's _base_request_id), and comes back as a header
    status, text, headers = post(CHAT, {"messages": MESSAGES, "request_id": "body-id"} | base,
                                 {"X-Request-Id": "hdr-7"})
    assert status == 200 and json.loads(text)["id"] == "chatcmpl-hdr-7" and headers["X-Request-Id"] == "hdr-7"
    status, text, headers = post(CHAT, {"messages": MESSAGES, "stream": True} | base, {"X-Request-Id": "s-1"})
    chunks = events(text)
    assert status == 200 and headers["X-Request-Id"] == "s-1" and {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    # neither: a fresh uuid4 hex, and the echoed header is another fresh one (vLLM's middleware)
    status, text, headers = post(C, {"prompt": "ab"} | base)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", json.loads(text)["id"]), text
    assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]) and headers["X-Request-Id"] not in text
    # errors carry it too
    status, text, headers = post(C, {"prompt": "ab", "max_tokens": 0}, {"X-Request-Id": "bad-1"})
    assert status == 400 and headers["X-Request-Id"] == "bad-1"


def test_two_requests_with_one_id_run_side_by_side(app) -> None:
    """The id is the client's; the engine's is unique per request (vLLM's random suffix),
    so a retry or a client's fixed id never collides with the one still running."""
    _, post_many = app
    body = {"prompt": "abc", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "request_id": "same"}
    results = post_many([(C, body, None), (C, body | {"stream": True}, None), (C, body, {"X-Request-Id": "same"})])
    assert [r[0] for r in results] == [200, 200, 200], results
    whole = [json.loads(results[0][1]), json.loads(results[2][1])]
    streamed = events(results[1][1])
    assert [w["id"] for w in whole] == ["cmpl-same", "cmpl-same"] and {c["id"] for c in streamed} == {"cmpl-same"}
    texts = [w["choices"][0]["text"] for w in whole] + ["".join(c["choices"][0]["text"] for c in streamed if
                                                                c["choices"])]
    assert all(w["usage"]["completion_tokens"] == 12 for w in whole) and len(set(texts)) == 1, texts


@pytest.mark.parametrize("value", [3, "", "x" * 257, "a\nb", ["id"]])
def test_a_bad_request_id_is_a_400_naming_it(app, value) -> None:
    post, _ = app
    status, text, _ = post(C, {"prompt": "ab", "max_tokens": 1, "request_id": value})
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == "request_id" and "request_id" in err["message"], text
    status, text, _ = post(C, {"prompt": "ab", "max_tokens": 1, "request_id": "x" * 256})
    assert status == 200 and json.loads(text)["id"] == "cmpl-" + "x" * 256


def test_a_bad_x_request_id_header_is_a_400_naming_it(app) -> None:
    post, _ = app
    status, text, _ = post(C, {"prompt": "ab", "max_tokens": 1}, {"X-Request-Id": "x" * 300})
    assert status == 400 and "X-Request-Id" in json.loads(text)["error"]["message"], text


# ---- truncate_prompt_tokens, truncation_side ----------------------------------------------

LONG = "The quick brown fox jumps over the lazy dog; " * 3  # 135 bytes: 136 ids with BOS, over 128


def kept_prompt(choice: dict) -> list[int]:
    """The prompt's token ids as the engine saw them, read off the prompt_logprobs of a
    choice (a chat response's: the response) (each entry has the prompt token first; the
    first entry, None, is the first token)."""
    return [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]]


@pytest.mark.parametrize("side", ["left", "right", None])
def test_truncate_prompt_tokens_keeps_the_last_or_first_k_tokens_as_vllm(app, side) -> None:
    from tokenizer import ByteTokenizer

    post, _ = app
    ids = ByteTokenizer().encode(LONG)
    k = 40
    kept = ids[:k] if side == "right" else ids[-k:]  # vLLM's default side: left
    greedy = {"max_tokens": 6, "temperature": 0.0, "prompt_logprobs": 0}
    side_field = {} if side is None else {"truncation_side": side}
    status, text, _ = post(C, {"prompt": LONG, "truncate_prompt_tokens": k} | side_field | greedy)
    assert status == 200, text
    out = json.loads(text)
    assert out["usage"]["prompt_tokens"] == k and kept_prompt(out["choices"][0]) == kept[1:]
    # the same answer as the kept tokens sent as the prompt
    status, text, _ = post(C, {"prompt": kept} | greedy)
    assert json.loads(text)["choices"][0]["text"] == out["choices"][0]["text"]
    # a prompt already within k is left whole
    status, text, _ = post(C, {"prompt": "abc", "truncate_prompt_tokens": k} | side_field | greedy)
    assert json.loads(text)["usage"]["prompt_tokens"] == 4


def test_chat_is_truncated_after_its_template(app) -> None:
    from tokenizer import ByteTokenizer

    post, _ = app
    messages = [{"role": "user", "content": LONG}]
    tok = ByteTokenizer()
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    status, text, _ = post(CHAT, {"messages": messages, "truncate_prompt_tokens": 30, "max_tokens": 2,
                                  "prompt_logprobs": 0})
    assert status == 200, text
    out = json.loads(text)
    assert out["usage"]["prompt_tokens"] == 30 and kept_prompt(out) == ids[-29:]  # (chat's: the response's)


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_leaves(app) -> None:
    post, _ = app
    status, text, _ = post(C, {"prompt": LONG, "max_tokens": 4})
    assert status == 400 and json.loads(text)["error"]["param"] == "input_tokens", text  # 136 >= 128: vLLM names the prompt
    status, text, _ = post(C, {"prompt": LONG, "max_tokens": 4, "truncate_prompt_tokens": -1})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == 124, text
    # completions' max_tokens default (16) counts, as vLLM's
    status, text, _ = post(C, {"prompt": LONG, "truncate_prompt_tokens": -1})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == 112, text


@pytest.mark.parametrize("extra,param", [
    ({"truncate_prompt_tokens": 125, "max_tokens": 4}, "truncate_prompt_tokens"),  # > 128 - 4: vLLM's 400
    ({"truncate_prompt_tokens": 113}, "truncate_prompt_tokens"),  # > 128 - 16 (the default max_tokens)
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 5.5}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side"),
    ({"truncate_prompt_tokens": 5, "truncation_side": 1}, "truncation_side"),
])
def test_bad_truncation_is_a_400_naming_the_field(app, extra, param) -> None:
    post, _ = app
    status, text, _ = post(C, {"prompt": LONG} | extra)
    err = json.loads(text)["error"]
    assert status == 400 and err["param"] == param and param in err["message"], text


@pytest.mark.parametrize("extra,want", [({"truncate_prompt_tokens": 125, "max_tokens": 4}, (125, "max_tokens", 124)),
                                        ({"truncate_prompt_tokens": 113}, (113, "max_tokens", 112))])
def test_a_truncation_past_the_context_is_vllm_s_400_in_its_words(app, extra, want) -> None:
    """vLLM's renderer (TokenizeParams) words, with its VLLMValidationError's tail."""
    post, _ = app
    status, text, _ = post(C, {"prompt": LONG} | extra)
    k, limit, room = want
    assert status == 400 and json.loads(text)["error"]["message"] == (
        f"truncate_prompt_tokens={k} cannot be greater than max_model_len - {limit} = {room}. Please request a "
        f"smaller truncation size. (parameter=truncate_prompt_tokens, value={k})"), text


# ---- integers sent as numbers -----------------------------------------------------------------
def test_an_integer_sent_as_a_number_with_no_fraction_is_that_integer_as_vllms_pydantic(app) -> None:
    """vLLM's request models take `2.0` where an integer is due (pydantic's lax mode): every
    integer field and list of ids, sent as whole numbers, gives the answer its integers give."""
    post, _ = app
    ints = {"prompt": [5, 17, 42, 99], "n": 2, "max_tokens": 6, "seed": 7, "top_k": 20, "logprobs": 2,
            "min_tokens": 2, "stop_token_ids": [250], "allowed_token_ids": list(range(40, 300)),
            "prompt_logprobs": 1, "truncate_prompt_tokens": 3, "temperature": 1.0}
    floats = {k: ([float(t) for t in v] if isinstance(v, list) else float(v)) for k, v in ints.items()}
    answers = []
    for body in (ints, floats):
        status, text, _ = post(C, body)
        assert status == 200, text
        answers.append(json.loads(text))
    # the same tokens; logprobs to float noise (the second request reads the first's cached prefix)
    assert [(c["text"], c["logprobs"]["tokens"], c["finish_reason"]) for c in answers[0]["choices"]] == \
        [(c["text"], c["logprobs"]["tokens"], c["finish_reason"]) for c in answers[1]["choices"]]
    assert [c["logprobs"]["token_logprobs"] for c in answers[1]["choices"]] == \
        [pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-5) for c in answers[0]["choices"]]
    assert answers[0]["usage"] == answers[1]["usage"] and answers[0]["usage"]["prompt_tokens"] == 3
    assert len(answers[0]["choices"]) == 2 and all(len(c["logprobs"]["tokens"]) == 6 for c in answers[0]["choices"])
    status, text, _ = post("/detokenize", {"tokens": [40.0, 41.0]})
    assert status == 200 and json.loads(text) == json.loads(post("/detokenize", {"tokens": [40, 41]})[1]), text


@pytest.mark.parametrize("name,value", [("n", 2.5), ("max_tokens", 4.5), ("seed", 3.25), ("top_k", -0.5),
                                        ("stop_token_ids", [3, 4.5]), ("allowed_token_ids", [4.5]), ("prompt", [1, 2.5])])
def test_a_number_with_a_fraction_where_an_integer_is_due_is_a_400_naming_its_field(app, name, value) -> None:
    post, _ = app
    status, text, _ = post(C, {"prompt": "hi", "max_tokens": 2} | {name: value})
    assert status == 400 and json.loads(text)["error"]["param"] == name, text


# ---- echo -----------------------------------------------------------------------------------

def test_completions_echo_puts_the_prompt_before_the_completion_as_vllm(app) -> None:
    from tokenizer import ByteTokenizer

    post, _ = app
    greedy = {"max_tokens": 6, "temperature": 0.0}
    plain = json.loads(post(C, {"prompt": "Hello"} | greedy)[1])["choices"][0]["text"]
    status, text, _ = post(C, {"prompt": "Hello", "echo": True} | greedy)
    out = json.loads(text)
    assert status == 200 and out["choices"][0]["text"] == "Hello" + plain, text
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["prompt_logprobs"] is None
    status, text, _ = post(C, {"prompt": "Hello", "echo": True, "stream": True} | greedy)
    chunks = [c["choices"][0]["text"] for c in events(text) if c["choices"]]
    assert chunks[0].startswith("Hello") and "".join(chunks) == "Hello" + plain
    # token ids: their text, special tokens included (vLLM decodes the prompt); truncated: the kept part
    ids = [ByteTokenizer.bos_token_id, *b"Hello"]
    status, text, _ = post(C, {"prompt": ids, "echo": True} | greedy)
    assert json.loads(text)["choices"][0]["text"] == ByteTokenizer().decode(ids, skip_special_tokens=False) + plain
    status, text, _ = post(C, {"prompt": "xyzHello", "echo": True, "truncate_prompt_tokens": 5} | greedy)
    kept = json.loads(post(C, {"prompt": list(b"Hello")} | greedy)[1])["choices"][0]["text"]
    assert json.loads(text)["choices"][0]["text"] == "Hello" + kept
    status, text, _ = post(C, {"prompt": "Hello", "echo": "yes"} | greedy)
    assert status == 400 and json.loads(text)["error"]["param"] == "echo"


def test_completions_echo_with_logprobs_prepends_the_prompt_s_as_vllm(app) -> None:
    """The prompt's tokens first (the first with null logprob and top_logprobs, OpenAI's and
    vLLM's), then the completion's exactly as without echo; text_offset runs over both."""
    post, _ = app
    body = {"prompt": "Hi there", "max_tokens": 4, "temperature": 0.0, "logprobs": 2}
    plain = json.loads(post(C, body)[1])["choices"][0]["logprobs"]
    for stream in (False, True):
        status, text, _ = post(C, body | {"echo": True, "stream": stream})
        assert status == 200, text
        if stream:
            parts = [c["choices"][0]["logprobs"] for c in events(text) if c["choices"]]
            lp = {k: [x for p in parts for x in p[k]] for k in parts[0]}
        else:
            lp = json.loads(text)["choices"][0]["logprobs"]
        n = 9  # BOS + 8 bytes
        assert lp["tokens"][:n] == ["<|bos|>", *"Hi there"] and lp["tokens"][n:] == plain["tokens"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][n:] == plain["token_logprobs"] and lp["top_logprobs"][n:] == plain["top_logprobs"]
        for tok, v, top in zip(lp["tokens"][1:n], lp["token_logprobs"][1:n], lp["top_logprobs"][1:n]):
            assert top[tok] == v and len(top) in (2, 3) and v <= 0  # the prompt token beside the top 2
        assert lp["text_offset"] == list(itertools.accumulate((len(t) for t in lp["tokens"]), initial=0))[:-1]


def test_echo_with_max_tokens_0_answers_the_prompt_alone_as_vllm(app) -> None:
    """Scoring a text (lm-eval's loglikelihood): vLLM generates one token and answers with
    the prompt's text and logprobs only."""
    post, _ = app
    body = {"prompt": "Hi there", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0.0}
    with_one = json.loads(post(C, body | {"max_tokens": 1})[1])["choices"][0]
    for stream in (False, True):
        status, text, _ = post(C, body | {"stream": stream})
        assert status == 200, text
        choices = [c["choices"][0] for c in events(text) if c["choices"]] if stream else \
            [json.loads(text)["choices"][0]]
        assert len(choices) == 1 and choices[0]["text"] == "Hi there" and choices[0]["finish_reason"] == "length"
        lp = choices[0]["logprobs"]
        assert {k: v[:9] for k, v in with_one["logprobs"].items()} == lp and len(lp["tokens"]) == 9
    # without echo, max_tokens 0 stays a 400; vLLM's room for the prompt counts max_tokens 0
    status, text, _ = post(C, {"prompt": "Hi", "max_tokens": 0})
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"
    status, text, _ = post(C, {"prompt": "Hi", "max_tokens": 0, "echo": True, "truncate_prompt_tokens": 120})
    assert status == 200, text


def test_echoed_prompt_logprobs_are_transformers_log_softmax(hf_checkpoint) -> None:
    """The echoed prompt's logprobs against transformers' logits of the same checkpoint
    (no tokenizer: tokens come back as token_id:N)."""
    import numpy as np
    from aiohttp.test_utils import TestClient, TestServer

    import server
    from async_engine import AsyncEngine
    from conftest import hf_logits
    from engine import EngineConfig

    path = hf_checkpoint("llama2")
    prompt = [1, 17, 42, 99, 7, 250, 3, 64]
    loop = asyncio.new_event_loop()
    # test_logprobs_mode's shapes on this checkpoint (its programs are cached)
    engine = AsyncEngine(EngineConfig(model=path, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=128,
                                      num_kv_blocks=64, warmup=False), log=lambda *_: None)
    loop.run_until_complete(engine.start())
    try:
        async def go() -> dict:
            async with TestClient(TestServer(server.build_app(engine, ["m"]))) as client:
                resp = await client.post(C, json={"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "echo": True,
                                                  "logprobs": 3})
                assert resp.status == 200, await resp.text()
                return (await resp.json())["choices"][0]["logprobs"]
        lp = loop.run_until_complete(go())
    finally:
        loop.run_until_complete(engine.shutdown())
        loop.close()
    x = hf_logits(path, prompt).astype(np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(-1, keepdims=True))
    assert lp["tokens"][:len(prompt)] == [f"token_id:{t}" for t in prompt] and lp["token_logprobs"][0] is None
    for i in range(1, len(prompt)):
        np.testing.assert_allclose(lp["token_logprobs"][i], ref[i - 1, prompt[i]], atol=2e-4)
        top = np.argsort(-ref[i - 1])[:3]
        want = {f"token_id:{t}": ref[i - 1, t] for t in [prompt[i], *top.tolist()]}
        assert set(lp["top_logprobs"][i]) == set(want)
        np.testing.assert_allclose([lp["top_logprobs"][i][k] for k in want], list(want.values()), atol=2e-4)


def test_chat_echo_puts_the_last_message_before_the_answer_when_its_role_is_the_answer_s(app) -> None:
    post, _ = app
    greedy = {"max_tokens": 4, "temperature": 0.0}
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    for messages, extra, prefix in (
            (MESSAGES, {}, ""),  # the answer's role is the assistant's, the last message the user's: nothing
            (turn, {}, "Sure, "),  # a new assistant turn after an assistant message
            (turn, {"add_generation_prompt": False, "continue_final_message": True}, "Sure, "),  # continued
            ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
             {"add_generation_prompt": False}, "a\nb")):  # the answer takes the user's role: its parts joined
        body = {"messages": messages} | extra | greedy
        plain = json.loads(post(CHAT, body)[1])["choices"][0]["message"]["content"]
        status, text, _ = post(CHAT, body | {"echo": True})
        assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == prefix + plain, text
        status, text, _ = post(CHAT, body | {"echo": True, "stream": True})
        deltas = [c["choices"][0]["delta"].get("content", "") for c in events(text) if c["choices"]]
        assert "".join(deltas) == prefix + plain and (not prefix or deltas[1] == prefix), deltas
    # n choices (sampled: greedy n > 1 is refused): vLLM's first chunks are every choice's role,
    # then every choice's echo
    status, text, _ = post(CHAT, {"messages": turn, "echo": True, "stream": True, "n": 2, "max_tokens": 4,
                                  "temperature": 1.0, "seed": 3})
    firsts = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in events(text)[:4]]
    assert firsts == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
                      (0, {"content": "Sure, "}), (1, {"content": "Sure, "})], firsts


def test_a_chat_echo_scores_the_prompt_in_the_response_s_prompt_logprobs_as_vllm(app) -> None:
    """vLLM's ChatCompletionRequest.to_sampling_params: echo without prompt_logprobs asks
    top_logprobs' (0 when left out, whether or not logprobs is set), so a whole answer's
    top-level prompt_logprobs score each prompt token (the first null) with top_logprobs
    alternatives; a null top_logprobs asks none. Streamed, the same request is served (its
    prompt_logprobs have no place there)."""
    post, _ = app
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}], "echo": True,
            "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
    for extra, top in (({}, 0), ({"logprobs": True, "top_logprobs": 2}, 2)):
        status, text, _ = post(CHAT, body | extra)
        out = json.loads(text)
        assert status == 200 and out["prompt_logprobs"][0] is None, text
        ids, scored = out["prompt_token_ids"], out["prompt_logprobs"][1:]
        assert len(scored) == len(ids) - 1 == out["usage"]["prompt_tokens"] - 1
        for token, entry in zip(ids[1:], scored):
            assert str(token) in entry and len(entry) in (top, top + 1), entry  # the token, and the top ones
            assert entry[str(token)]["logprob"] <= 0 and entry[str(token)]["rank"] >= 1
    status, text, _ = post(CHAT, body | {"top_logprobs": None})
    assert status == 200 and json.loads(text)["prompt_logprobs"] is None, text
    status, text, _ = post(CHAT, body | {"stream": True})
    assert status == 200 and events(text)[-1]["choices"][0]["finish_reason"] == "length", text


# ---- return_token_ids, return_tokens_as_token_ids ---------------------------------------------

ASCII = {"structured_outputs": {"regex": "[a-z]{8}"}, "max_tokens": 8, "temperature": 0.0}  # one byte per token


def test_return_token_ids_are_the_tokenizer_s_encoding_of_the_text_as_vllm(app) -> None:
    from tokenizer import ByteTokenizer

    post, _ = app
    tok = ByteTokenizer()
    status, text, _ = post(C, {"prompt": "go", "return_token_ids": True} | ASCII)
    choice = json.loads(text)["choices"][0]
    assert status == 200 and choice["prompt_token_ids"] == tok.encode("go"), text
    assert len(choice["text"]) == 8 and choice["token_ids"] == tok.encode(choice["text"], add_special_tokens=False)
    # streamed: the prompt's once, on the first chunk; each chunk its own tokens
    status, text, _ = post(C, {"prompt": "go", "return_token_ids": True, "stream": True} | ASCII)
    chunks = [c["choices"][0] for c in events(text) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == tok.encode("go") and all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert all(c["token_ids"] == tok.encode(c["text"], add_special_tokens=False) for c in chunks)
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    # with echo, vLLM leaves the prompt's text out (its ids are there)
    status, text, _ = post(C, {"prompt": "go", "return_token_ids": True, "echo": True} | ASCII)
    assert json.loads(text)["choices"][0]["text"] == choice["text"]
    # chat: the prompt's at the response's top level (the first chunk's when streamed)
    ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    status, text, _ = post(CHAT, {"messages": MESSAGES, "return_token_ids": True} | ASCII)
    out = json.loads(text)
    content = out["choices"][0]["message"]["content"]
    assert out["prompt_token_ids"] == ids and out["choices"][0]["token_ids"] == tok.encode(content, False)
    status, text, _ = post(CHAT, {"messages": MESSAGES, "return_token_ids": True, "stream": True} | ASCII)
    chunks = events(text)
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == out["choices"][0]["token_ids"]
    # off: null, as vLLM dumps its choice whole
    status, text, _ = post(C, {"prompt": "go"} | ASCII)
    choice = json.loads(text)["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None, choice


def test_add_special_tokens_adds_the_tokenizers_own_on_top_of_the_prompt_as_vllm(app) -> None:
    """vLLM's add_special_tokens: a chat request's or /tokenize's messages (default false)
    encode the template's text with the tokenizer's special tokens on top when true (its
    BOS); a completion's prompt (default true) leaves them out when false."""
    from tokenizer import ByteTokenizer

    post, _ = app
    tok = ByteTokenizer()
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    plain, special = tok.encode(text, add_special_tokens=False), tok.encode(text, add_special_tokens=True)
    assert plain != special  # the tokenizer has a special token of its own to add
    chat = {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    for flag, want in (({}, plain), ({"add_special_tokens": False}, plain), ({"add_special_tokens": True}, special)):
        status, text, _ = post("/tokenize", {"messages": MESSAGES} | flag)
        assert status == 200 and json.loads(text)["tokens"] == want, (flag, text)
        status, text, _ = post(CHAT, chat | flag)
        assert status == 200 and json.loads(text)["prompt_token_ids"] == want, (flag, text)
    prompt = {"prompt": "go", "max_tokens": 1, "return_token_ids": True}
    for flag, with_special in (({}, True), ({"add_special_tokens": True}, True),
                               ({"add_special_tokens": False}, False)):
        status, text, _ = post(C, prompt | flag)
        want = tok.encode("go", add_special_tokens=with_special)
        assert status == 200 and json.loads(text)["choices"][0]["prompt_token_ids"] == want, (flag, text)
    for path, body in (("/tokenize", {"messages": MESSAGES}), (CHAT, chat), (C, prompt)):
        status, text, _ = post(path, body | {"add_special_tokens": 1})
        assert status == 400 and json.loads(text)["error"]["param"] == "add_special_tokens", text


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(app) -> None:
    post, _ = app
    body = {"prompt": "go", "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True} | ASCII
    choice = json.loads(post(C, body)[1])["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp["top_logprobs"] for k in top)
    assert lp["text_offset"] == list(itertools.accumulate((len(t) for t in lp["tokens"]), initial=0))[:-1]
    body = {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True} | ASCII
    choice = json.loads(post(CHAT, body)[1])["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert len(content) == len(choice["message"]["content"]) and all(len(c["top_logprobs"]) == 2 for c in content)
    # vLLM's bytes: a sampled token's are its text's (decoded_token), a top entry's its "token_id:N"'s
    assert [c["bytes"] for c in content] == [list(ch.encode()) for ch in choice["message"]["content"]]
    assert all(t["bytes"] == list(t["token"].encode()) for c in content for t in c["top_logprobs"])
    # --return-tokens-as-token-ids: the server's default, which a request's false overrides (vLLM's)
    body = {"prompt": "go", "logprobs": 0, "return_token_ids": True} | ASCII
    choice = json.loads(post(C, body, flagged=True)[1])["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    choice = json.loads(post(C, body | {"return_tokens_as_token_ids": False}, flagged=True)[1])["choices"][0]
    assert choice["logprobs"]["tokens"] == list(choice["text"])


@pytest.mark.parametrize("name", ["return_token_ids", "return_tokens_as_token_ids"])
def test_a_bad_token_ids_flag_is_a_400_naming_it(app, name) -> None:
    post, _ = app
    status, text, _ = post(C, {"prompt": "go", "max_tokens": 1, name: 1})
    assert status == 400 and json.loads(text)["error"]["param"] == name, text


def test_a_bad_field_of_the_answer_starts_no_engine_request() -> None:
    """A 400 for a field that shapes the answer (return_token_ids, return_tokens_as_token_ids)
    comes before the engine gets any request: one started and never read would run to
    max_tokens for nobody, holding its slot and KV blocks."""
    from aiohttp.test_utils import TestClient, TestServer

    import server

    with tiny_async_engine() as (loop, engine):
        added: list[str] = []
        add_request = engine.add_request
        engine.add_request = lambda request: added.append(request.request_id) or add_request(request)
        client = TestClient(TestServer(server.build_app(engine, ["tiny"])), loop=loop)
        loop.run_until_complete(client.start_server())
        try:
            for name, (path, body), stream, n in itertools.product(
                    ["return_token_ids", "return_tokens_as_token_ids"],
                    [(C, {"prompt": "go"}), (CHAT, {"messages": MESSAGES})], [False, True], [1, 2]):
                resp = loop.run_until_complete(client.post(path, json=body | {name: 1, "stream": stream, "n": n,
                                                                              "max_tokens": 64}))
                assert resp.status == 400, (name, path, stream, n)
                assert json.loads(loop.run_until_complete(resp.text()))["error"]["param"] == name
        finally:
            loop.run_until_complete(client.close())
        assert added == []


# ---- stop_reason offline ----------------------------------------------------------------------

def test_offline_stop_reason_is_the_stop_string_or_the_stop_token_id_as_vllm() -> None:
    """LLM.generate's CompletionOutput carries vLLM's stop_reason: the stop string matched, the
    stop_token_ids entry that ended it, None for a length cut or a grammar's end."""
    from llm import LLM, SamplingParams
    from sampling_params import StructuredOutputsParams

    llm = LLM("tiny", max_num_seqs=2, max_model_len=128, warmup=False, log=lambda *_: None)
    letters = dict(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{8}"))
    free = llm.generate(["go"], SamplingParams(**letters))[0].outputs[0]
    assert (free.finish_reason, free.stop_reason, len(free.text)) == ("stop", None, 8)  # the grammar's end
    cut = llm.generate(["go"], SamplingParams(**letters | {"max_tokens": 3}))[0].outputs[0]
    assert (cut.finish_reason, cut.stop_reason) == ("length", None)
    stop = free.text[3:5]
    by_string = llm.generate(["go"], SamplingParams(stop=[stop, "never"], **letters))[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    assert by_string.text == free.text[:free.text.index(stop)]
    token = free.token_ids[4]
    by_token = llm.generate(["go"], SamplingParams(stop_token_ids=[token], **letters))[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
    assert by_token.token_ids == free.token_ids[:free.token_ids.index(token) + 1]


def test_a_stream_sends_no_chunk_for_text_its_parser_holds_back_as_vllms(app) -> None:
    """vLLM's stream skips a token whose text the tool parser holds back (a call's name not
    complete yet): no chunk with an empty delta but the last, which carries the
    finish_reason. What is sent still adds up to the calls the text holds (the tiny model
    writes calls until max_tokens: the whole response, whose last call is cut off, says
    its text as content)."""
    post, _ = app
    body = {"messages": MESSAGES, "temperature": 0.0, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    status, text, _ = post(CHAT, body)
    assert status == 200, text
    first, _ = json.JSONDecoder().raw_decode(json.loads(text)["choices"][0]["message"]["content"], 1)
    status, text, _ = post(CHAT, body | {"stream": True})
    choices = [c for e in events(text) for c in e["choices"]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["delta"] for c in choices[1:-1]) and choices[-1]["finish_reason"] == "length", choices
    deltas = [d for c in choices for d in c["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == first["name"] == "f"
    assert json.loads("".join(d["function"].get("arguments", "") for d in deltas if d["index"] == 0)) == \
        first["parameters"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_function_whose_parameters_are_an_empty_schema_is_called_with_an_object(app, choice) -> None:
    """`parameters: {}`, a common way to declare a function of no parameters, constrains as
    a left-out one: the arguments are a JSON object (vLLM's "required" schema), never the
    number or literal an empty schema would let the model write."""
    post, _ = app
    for seed in range(3):
        body = {"messages": MESSAGES, "temperature": 1.0, "seed": seed, "tool_choice": choice,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
        status, text, _ = post(CHAT, body)
        assert status == 200, text
        message = json.loads(text)["choices"][0]["message"]
        if message.get("tool_calls"):
            assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in message["tool_calls"])
        else:  # (the tiny model ran out of tokens writing "required"'s array): its first call's arguments
            after = message["content"].split('"parameters":', 1)[1]
            assert after.lstrip().startswith("{"), message
