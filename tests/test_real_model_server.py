"""The server on the built-in real model (smollm2) and its real tokenizer, where text is
text: multi-byte prompts and answers arrive whole, a stream carries exactly the whole
answer's text and logprobs, and stop strings (multi-byte ones included) cut the text
the same way streamed or not. The tiny model's byte tokenizer cannot show these: most
of its tokens are not characters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_server import Server, assert_same_logprobs, request, running_server, sse

# test_real_model's, test_structured's and test_serving_path's shapes: one set of programs
# for smollm2, compiled once in a run (the persistent cache serves the others).
FLAGS = ["--model", "smollm2", "--max-num-seqs", "4", "--max-model-len", "512", "--max-num-batched-tokens", "128",
         "--num-kv-blocks", "96", "--no-warmup"]
# Its answer (greedy) has accented characters: 'Je suis à la café, je suis à la café.'
FRENCH = [{"role": "user", "content": "Translate to French: I would like a coffee at the café, please."}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server(*FLAGS, "--api-key", "test-key") as s:
        yield s


def chat(server: Server, **body) -> dict:
    status, out = request(server, "POST", "/v1/chat/completions", {"temperature": 0.0, "max_tokens": 48} | body)
    assert status == 200, out
    return out


def streamed_chat(server: Server, **body) -> tuple[str, list[dict], str]:
    events = sse(server, "/v1/chat/completions", {"temperature": 0.0, "max_tokens": 48} | body)
    choices = [e["choices"][0] for e in events]
    pieces = [c["delta"].get("content", "") for c in choices]
    assert not any("\ufffd" in p for p in pieces), pieces  # never half a character
    lps = [x for c in choices if c["logprobs"] for x in c["logprobs"]["content"]]
    return "".join(pieces), lps, choices[-1]["finish_reason"]


def test_a_multibyte_answer_streams_exactly_the_whole_answers_text_and_logprobs(server: Server) -> None:
    whole = chat(server, messages=FRENCH, logprobs=True, top_logprobs=3)
    text = whole["choices"][0]["message"]["content"]
    assert len(text.encode()) > len(text), f"the answer should have multi-byte characters: {text!r}"
    assert whole["choices"][0]["finish_reason"] == "stop" and "<|im_end|>" not in text
    got, lps, reason = streamed_chat(server, messages=FRENCH, logprobs=True, top_logprobs=3)
    assert (got, reason) == (text, "stop")
    assert_same_logprobs(lps, whole["choices"][0]["logprobs"]["content"])


def test_a_multibyte_prompt_is_answered_whole_and_streamed_alike(server: Server) -> None:
    body = {"prompt": "Grüße aus Köln 😀, 你好世界! Résumé:", "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 2}
    status, whole = request(server, "POST", "/v1/completions", body)
    assert status == 200, whole
    events = sse(server, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    keys = ("tokens", "token_logprobs", "top_logprobs")
    assert_same_logprobs({k: [x for e in events for x in e["choices"][0]["logprobs"][k]] for k in keys},
                         {k: whole["choices"][0]["logprobs"][k] for k in keys})
    assert whole["usage"]["completion_tokens"] == 24


def test_multibyte_stop_strings_cut_the_text_the_same_whole_or_streamed(server: Server) -> None:
    free = chat(server, messages=FRENCH)["choices"][0]["message"]["content"]
    i = next(i for i, ch in enumerate(free) if ord(ch) > 127)
    stops = [free[i:i + 2], free[i - 3:i + 4]]  # a multi-byte character and the next one; one spanning tokens
    for stop in stops:
        want = free[:free.find(stop)]
        whole = chat(server, messages=FRENCH, stop=[stop])["choices"][0]
        assert (whole["message"]["content"], whole["finish_reason"]) == (want, "stop"), stop
        got, _, reason = streamed_chat(server, messages=FRENCH, stop=stop)
        assert (got, reason) == (want, "stop"), stop  # nothing of the stop string leaked
