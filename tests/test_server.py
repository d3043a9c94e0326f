"""The OpenAI-compatible server, end to end: a real `python server.py` subprocess serving
the built-in tiny model, driven by the real `openai` client and by raw HTTP."""

from __future__ import annotations

import contextlib
import functools
import http.client
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chat_format import parse_messages
from metrics import wait_reasons
from protocol import ApiError, parse_prompts, parse_sampling, token_text
from sampling_params import SamplingParams
from tokenizer import IncrementalDetokenizer
from tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
MAX_MODEL_LEN = 4096
# Small shapes keep warm-up short on a CPU (token buckets 16..256, 4 slots), while a
# long max_model_len lets a request run for seconds, so tests can watch it in flight.
# A server stopped at the end of a test aborts what still runs at once (the shutdown
# tests give their own --shutdown-timeout).
SMALL = ["--model", "tiny", "--max-num-seqs", "4", "--max-model-len", str(MAX_MODEL_LEN), "--enable-chunked-prefill",
         "--max-num-batched-tokens", "256", "--block-size", "16", "--num-kv-blocks", "1024", "--shutdown-timeout", "0"]
LONG = MAX_MODEL_LEN - 16  # max_tokens of a request meant to be still running when looked at
# For the small Hugging Face checkpoints of conftest (max_position_embeddings 2048).
HF_SMALL = ["--max-model-len", "128", "--max-num-batched-tokens", "128", "--num-kv-blocks", "64", "--no-warmup"]


@dataclass
class Server:
    port: int
    proc: subprocess.Popen
    log_path: str

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return Path(self.log_path).read_text()


def request(server: Server, method: str, path: str, body: object = None, key: str | None = API_KEY,
            raw: bytes | None = None) -> tuple[int, dict | str]:
    """One plain HTTP request; returns (status, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, text


@contextlib.contextmanager
def running_server(*flags: str, startup_timeout: float = 600, env: dict[str, str] | None = None) -> Iterator[Server]:
    """`python server.py --port 0 ...` in a subprocess: the server binds a free port itself
    (no pick-release-bind race) and its 'ready' log line says which; ready once /health
    answers 200. It inherits the tests' JAX compilation cache (conftest) unless `env`
    replaces the environment."""
    log = tempfile.NamedTemporaryFile("w", prefix="taxirank-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--port", "0", *SMALL, *flags],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=(os.environ if env is None else env) | {"PYTHONUNBUFFERED": "1"})
    server = Server(0, proc, log.name)
    try:
        deadline = time.monotonic() + startup_timeout
        while not (ready := re.search(r"ready: http://127\.0\.0\.1:(\d+)", server.log())):
            assert proc.poll() is None, f"server exited during start-up:\n{server.log()}"
            assert time.monotonic() < deadline, f"server not ready in {startup_timeout}s:\n{server.log()}"
            time.sleep(0.2)
        server.port = int(ready.group(1))
        assert request(server, "GET", "/health")[0] == 200
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        os.unlink(log.name)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--api-key", API_KEY, "--max-waiting-requests", "1", "--enable-prompt-tokens-details") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    """Every /metrics sample, keyed by (name, sorted labels), through Prometheus' own parser."""
    status, text = request(server, "GET", "/metrics", key=None)
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """A sample of the server's, whose series all carry vLLM's model_name and engine labels."""
    return samples[("taxirank:" + name, tuple(sorted((labels | {"model_name": "tiny", "engine": "0"}).items())))]


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def wait_idle(server: Server) -> None:
    def idle() -> bool:
        m = scrape(server)
        return metric(m, "num_requests_running") == metric(m, "num_requests_waiting") == 0
    wait_for(idle)


@contextlib.contextmanager
def open_stream(server: Server, body: dict) -> Iterator[Iterator[dict]]:
    """A raw SSE stream (so the test controls when the connection drops): yields events."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(body | {"stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()

    def events() -> Iterator[dict]:
        for line in resp:
            line = line.strip()
            if line == b"data: [DONE]":
                return
            if line.startswith(b"data: "):
                yield json.loads(line[6:])
        raise AssertionError("the stream ended without its data: [DONE] terminator")
    try:
        yield events()
    finally:
        conn.close()  # mid-stream: the client is gone


def sse(server: Server, path: str, body: dict) -> list[dict]:
    """A whole SSE stream read to its end: its events, after checking that it ended with
    OpenAI's `data: [DONE]` terminator and that every line was an event."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, body=json.dumps(body | {"stream": True}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    try:
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        lines = [line for line in resp.read().decode().split("\n\n") if line]
    finally:
        conn.close()
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: {") for line in lines[:-1]), lines
    return [json.loads(line[6:]) for line in lines[:-1]]


def assert_same_logprobs(got: object, want: object) -> None:
    """The same JSON structure, strings and token ids equal, logprob values equal up to
    float noise (two runs of one request may batch it into differently shaped steps, or
    read its prompt from the prefix cache)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (got, want)
        for k in want:
            assert_same_logprobs(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            assert_same_logprobs(g, w)
    else:
        assert got == want


def greedy_body(kw: dict) -> dict:
    """The openai-client keyword arguments of a request as a raw JSON body."""
    return {k: v for k, v in kw.items() if k != "extra_body"} | kw.get("extra_body", {})


@functools.cache
def tiny_reference():
    """The served model offline (LLM.generate), at the server's shapes."""
    from llm import LLM

    return LLM("tiny", log=lambda *_: None, max_num_seqs=4, max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
               max_num_batched_tokens=256, num_kv_blocks=1024, warmup=False)


def greedy(**kw) -> dict:
    return dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True}) | kw


# ---- the happy paths, through the openai client ----------------------------------------

def test_health_and_models_list_the_served_model(server: Server, client: openai.OpenAI) -> None:
    assert request(server, "GET", "/health", key=None) == (200, {"status": "ok"})
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, listed = request(server, "GET", "/v1/models")
    card = listed["data"][0]
    # vLLM's ModelCard and the ModelPermission its show_available_models gives every card
    assert status == 200 and set(card) == {"id", "object", "created", "owned_by", "root", "parent",
                                           "max_model_len", "permission"}
    assert (card["parent"], card["max_model_len"]) == (None, MAX_MODEL_LEN)
    [permission] = card["permission"]
    assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
    assert {k: v for k, v in permission.items() if k not in ("id", "object", "created")} == {
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}


def test_completion_carries_text_usage_and_length_finish(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt="Hello", max_tokens=8, logprobs=0, **greedy())
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].finish_reason == "length"
    # the 8 tokens LLM.generate gives for the same prompt: the same text (mostly not
    # characters, on the byte tokenizer) and the same tokens, told apart by their logprobs
    ref = tiny_reference().generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                               logprobs=0))[0].outputs[0]
    assert out.choices[0].text == ref.text and len(ref.token_ids) == 8
    text = functools.partial(token_text, tiny_reference().tokenizer)  # each read after the 4 tokens before it
    assert out.choices[0].logprobs.tokens == [text(t, context=ref.token_ids[max(i - 4, 0):i])
                                              for i, t in enumerate(ref.token_ids)]
    assert out.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(b"Hello") + 1, 8)  # + bos
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_prompt_as_token_ids(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt=[256, 72, 105], max_tokens=4, **greedy())
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(server: Server) -> None:
    """The tiny model's bytes are mostly not text, so the tokens are compared by their
    logprobs (each token's value and its top 3): a different token shows there."""
    body = dict(model="tiny", prompt="The taxi rank", max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    status, whole = request(server, "POST", "/v1/completions", body)
    assert status == 200, whole
    events = sse(server, "/v1/completions", body | {"stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}})
    chunks, usage_chunk = events[:-1], events[-1]
    choices = [c["choices"][0] for c in chunks]
    want = whole["choices"][0]
    assert "".join(c["text"] for c in choices) == want["text"]
    # text_offset too: a chunk whose text is held back (half a character) must not shift the next ones
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    assert_same_logprobs({k: sum((c["logprobs"][k] for c in choices), []) for k in keys},
                         {k: want["logprobs"][k] for k in keys})
    # vLLM's continuous_usage_stats: every chunk counts the tokens streamed up to it
    assert [c["usage"]["completion_tokens"] for c in chunks] == \
        list(itertools.accumulate(len(c["logprobs"]["tokens"]) for c in choices))
    assert len(want["logprobs"]["token_logprobs"]) == 24
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the rerun may hit the prefix cache
    assert usage_chunk["choices"] == [] and [usage_chunk["usage"][k] for k in counts] == \
        [whole["usage"][k] for k in counts]
    assert whole["usage"]["completion_tokens"] == 24


def test_chat_completion_whole_and_streamed(server: Server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = dict(model="tiny", messages=messages, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True,
                top_logprobs=2)
    status, whole = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, whole
    msg = whole["choices"][0]
    assert msg["message"]["role"] == "assistant" and msg["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12 and len(msg["logprobs"]["content"]) == 12

    events = sse(server, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # role first, then content
    choices = [e["choices"][0] for e in events[1:-1]]
    assert "".join(c["delta"].get("content", "") for c in choices) == msg["message"]["content"]
    assert_same_logprobs(sum((c["logprobs"]["content"] for c in choices if c["logprobs"]), []),
                         msg["logprobs"]["content"])
    assert choices[-1]["finish_reason"] == "length"
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the rerun may hit the prefix cache
    assert events[-1]["choices"] == []
    assert [events[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> tuple[str, list[float]]:
        out = client.completions.create(model="tiny", prompt="Once", max_tokens=16, temperature=1.0, seed=1234,
                                        logprobs=1, extra_body={"ignore_eos": True})
        return out.choices[0].text, out.choices[0].logprobs.token_logprobs
    first, second = sample(), sample()
    assert first == second and len(first[1]) == 16


def test_logprobs_cover_each_sampled_token(client: openai.OpenAI) -> None:
    out = client.completions.create(prompt="abc", max_tokens=5, logprobs=3, **greedy())
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    ref = tiny_reference().generate(["abc"], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                                                             ignore_eos=True))[0].outputs[0]
    text = functools.partial(token_text, tiny_reference().tokenizer)
    for j, (tok, v, top, want) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ref.logprobs)):
        before = ref.token_ids[max(j - 4, 0):j]  # what a token that ends part of a character is read after
        assert tok == text(want.token_id, context=before) and v == pytest.approx(want.logprob, abs=1e-5) and v < 0
        assert want.top[0][0] == want.token_id  # greedy: the chosen token is the top one
        # the top 3 by text (tokens that decode alike, such as lone UTF-8 bytes, share a key)
        assert top == pytest.approx({text(i, context=before): x for i, x in want.top}, abs=1e-5)
    # each token's text starts where the previous one's ends, from 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert out.choices[0].stop_reason is None  # a length cut (vLLM's stop_reason)
    # A stop_token_id ends it there, and is vLLM's stop_reason (the engine's own stop, no text match)
    k = next(i for i, t in enumerate(ref.token_ids) if t not in ref.token_ids[:i] and i > 0)
    stopped = client.completions.create(prompt="abc", max_tokens=5, **greedy(extra_body={
        "ignore_eos": True, "stop_token_ids": [ref.token_ids[k]]}))
    assert (stopped.choices[0].finish_reason, stopped.choices[0].stop_reason,
            stopped.usage.completion_tokens) == ("stop", ref.token_ids[k], k + 1)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          logprobs=True, top_logprobs=2, **greedy())
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_prompt_logprobs_score_the_prompt_and_a_stream_is_refused_them_as_vllm(server: Server) -> None:
    """vLLM's extra field: per prompt token (the first None) its logprob, rank and top N,
    equal to the offline engine's. A stream that asks for them is a 400 (vLLM's message) that
    starts no engine request; prompt_logprobs=0 streams, as vLLM's check is `> 0 or == -1`."""
    body = greedy_body(greedy(prompt="score me", max_tokens=2, prompt_logprobs=2))
    status, whole = request(server, "POST", "/v1/completions", body)
    assert status == 200, whole
    got = whole["choices"][0]["prompt_logprobs"]
    ref = tiny_reference().generate(["score me"], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert len(got) == whole["usage"]["prompt_tokens"] == len(ref.prompt_token_ids) and got[0] is None
    for entry, want in zip(got[1:], ref.prompt_logprobs[1:]):
        assert entry[str(want.token_id)]["logprob"] == pytest.approx(want.logprob, abs=1e-5)
        assert entry[str(want.token_id)]["rank"] == want.rank >= 1
        assert all(str(t) in entry for t, _ in want.top) and len(want.top) == 2
    wait_idle(server)
    def finished() -> dict[str, float]:
        m = scrape(server)
        return {r: metric(m, "request_success_total", finished_reason=r) for r in ("stop", "length", "abort")}

    before = finished()
    for n in (2, -1):
        status, refused = request(server, "POST", "/v1/completions", body | {"stream": True, "prompt_logprobs": n})
        assert status == 400 and refused["error"]["param"] == "prompt_logprobs", refused
        assert refused["error"]["message"] == "`prompt_logprobs` are not available when `stream=True`."
    events = sse(server, "/v1/completions", body | {"stream": True, "prompt_logprobs": 0})
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    wait_idle(server)
    after = finished()
    assert {r: after[r] - before[r] for r in after} == {"stop": 0, "length": 1, "abort": 0}  # it alone ran


def test_stop_string_across_token_boundaries_is_cut_and_never_partly_streamed(client: openai.OpenAI) -> None:
    # One byte per token (the tiny model's tokenizer): every multi-character stop string
    # spans token boundaries. Take the stop string from the run without one.
    kw = dict(model="tiny", prompt="Stop here", max_tokens=64, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = next((text[i:i + 3] for i in range(1, len(text) - 3) if "\ufffd" not in text[i:i + 3]), text[1:3])
    assert len(stop.encode()) >= 2, f"the sample text is too short to pick a stop string: {text!r}"
    expected = text[:text.find(stop)]

    whole = client.completions.create(stop=[stop], **kw).choices[0]
    assert (whole.text, whole.finish_reason, whole.stop_reason) == (expected, "stop", stop)  # vLLM's stop_reason
    chunks = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected  # nothing of the stop string leaked
    assert (chunks[-1].choices[0].finish_reason, chunks[-1].choices[0].stop_reason) == ("stop", stop)


def test_a_stop_string_finish_counts_as_a_stop_not_an_abort(server: Server, client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="Count me", max_tokens=64, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = next((text[i:i + 2] for i in range(1, len(text) - 2) if "\ufffd" not in text[i:i + 2]), text[1:3])
    wait_idle(server)
    before = scrape(server)
    assert client.completions.create(stop=[stop], **kw).choices[0].finish_reason == "stop"
    wait_idle(server)
    after = scrape(server)
    moved = {r: metric(after, "request_success_total", finished_reason=r)
             - metric(before, "request_success_total", finished_reason=r) for r in ("stop", "abort", "length")}
    assert moved == {"stop": 1, "abort": 0, "length": 0}


# ---- errors: status, OpenAI error JSON, and the next request still served ----------------

TOO_LONG = list(range(1, 201))  # + max_tokens 3900 = 4100 > 4096
BAD_REQUESTS = [  # (path, body or raw bytes, status, param)
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("/v1/completions", b'["a", "list"]', 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 3900}, 400, "input_tokens"),  # vLLM names the prompt
    ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}, 400, "input_tokens"),  # vLLM's: no room for a token
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, 400, "top_k"),  # 0 disables it, as in vLLM
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": [1, 2, 100_000]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}', 413, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (_, _, _, p) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_a_clear_error_and_the_next_request_is_served(
        server: Server, client: openai.OpenAI, path: str, body: object, status: int, param: str | None) -> None:
    got, err = request(server, "POST", path, **({"raw": body} if isinstance(body, bytes) else {"body": body}))
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    # vLLM's ErrorInfo: the status as `code`, and create_error_response's type (else the status's phrase)
    vllm_type = {400: "BadRequestError", 404: "NotFoundError"}.get(status, HTTPStatus(status).phrase)
    assert (err["error"]["param"], err["error"]["code"], err["error"]["type"]) == (param, status, vllm_type)
    assert client.completions.create(prompt="ok", max_tokens=1, **greedy()).choices[0].finish_reason == "length"


def test_an_empty_model_name_is_the_served_model(server: Server) -> None:
    """vLLM's _is_model_supported: a request whose model is "" (or null, or left out) is
    the served model's, answered under its name; a name it does not serve is a 404."""
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        for model in ("", None):
            status, out = request(server, "POST", path, body | {"model": model})
            assert (status, out.get("model")) == (200, "tiny"), out
    assert request(server, "POST", "/tokenize", {"prompt": "hi", "model": ""})[0] == 200
    assert request(server, "POST", "/tokenize", {"prompt": "hi", "model": "tiny2"})[0] == 404


def test_too_long_says_both_numbers(server: Server) -> None:
    _, err = request(server, "POST", "/v1/completions", {"prompt": TOO_LONG, "max_tokens": 3900})
    assert "You passed 200 input tokens and requested 3900 output tokens. However, the model's context length is only " \
        f"{MAX_MODEL_LEN} tokens" in err["error"]["message"], err


def test_requests_as_large_as_the_whole_kv_cache_take_turns_and_a_larger_one_is_a_400() -> None:
    """A cache of 8 usable blocks (128 tokens) at max_model_len 128, the smallest the
    engine accepts (one whole sequence must fit). Two requests of exactly 128 tokens
    each need all of it: they take turns, both finish, nothing hangs. One token more is
    refused where it enters, streamed or not, before any status line."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from async_engine import AsyncEngine
    from engine import EngineConfig
    from server import build_app

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model="tiny", max_num_seqs=2, max_model_len=128, max_num_batched_tokens=128,
                                          num_kv_blocks=9, warmup=False), log=lambda *_: None)
        await engine.start()
        try:
            async with TestClient(TestServer(build_app(engine, ["tiny"]))) as client:
                async def complete(prompt: list[int], max_tokens: int, **extra) -> tuple[int, dict]:
                    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
                    resp = await client.post("/v1/completions", json=body | extra)
                    return resp.status, json.loads(await resp.text())
                whole = [list(range(3, 103)), list(range(103, 203))]  # 100 prompt tokens + 28 = 128
                outs = await asyncio.wait_for(asyncio.gather(*(complete(p, 28) for p in whole)), 300)
                assert [(status, o["usage"]["completion_tokens"], o["choices"][0]["finish_reason"])
                        for status, o in outs] == [(200, 28, "length")] * 2, outs
                for extra in ({}, {"stream": True}):
                    status, err = await complete(whole[0], 29, **extra)
                    # vLLM's renderer names the prompt, with the room it would have had
                    assert status == 400 and err["error"]["param"] == "input_tokens", (extra, err)
                    assert "You passed 100 input tokens and requested 29 output tokens" in err["error"]["message"]
                    assert "only 128 tokens, resulting in a maximum input length of 99" in err["error"]["message"]
        finally:
            await engine.shutdown()
        assert engine.engine.scheduler.allocator.num_used == 0

    asyncio.run(main())


def test_api_key_missing_or_wrong_gets_401(server: Server) -> None:
    for key in (None, "wrong"):
        status, err = request(server, "POST", "/v1/completions", {"prompt": "hi"}, key=key)
        assert status == 401 and (err["error"]["type"], err["error"]["code"]) == ("Unauthorized", 401)
        assert request(server, "GET", "/v1/models", key=key)[0] == 401
    assert request(server, "GET", "/metrics", key=None)[0] == 200  # only /v1/* is guarded
    # vLLM asks no key of OPTIONS (a CORS preflight or not): the route answers, here its 405
    status, err = request(server, "OPTIONS", "/v1/models", key=None)
    assert status == 405 and err["error"]["code"] == 405


def test_full_queue_answers_503_at_once(server: Server, client: openai.OpenAI) -> None:
    long = {"model": "tiny", "prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    with contextlib.ExitStack() as stack:
        for i in range(4):  # fill the 4 slots, one admission at a time
            stack.enter_context(open_stream(server, long))
            wait_for(lambda: metric(scrape(server), "num_requests_running") == i + 1)
        stack.enter_context(open_stream(server, long))  # the one that may wait
        wait_for(lambda: metric(scrape(server), "num_requests_waiting") == 1)
        status, err = request(server, "POST", "/v1/completions", long)
        assert status == 503 and err["error"]["code"] == 503 and "at capacity" in err["error"]["message"]
    wait_idle(server)
    assert client.completions.create(prompt="ok", max_tokens=1, **greedy()).choices[0].finish_reason == "length"


# ---- disconnects and metrics ------------------------------------------------------------

def test_client_disconnect_aborts_and_frees_slot_and_blocks(server: Server) -> None:
    wait_idle(server)
    before = scrape(server)
    # logprobs: every token makes an event, even one whose text is held back.
    with open_stream(server, {"prompt": "go on", "max_tokens": LONG, "ignore_eos": True, "logprobs": 0}) as events:
        for _ in range(3):
            next(events)
        m = scrape(server)
        assert metric(m, "num_requests_running") == 1
        assert metric(m, "kv_cache_usage_perc") > metric(before, "kv_cache_usage_perc")
    # The connection dropped: the engine aborts the request, frees its slot and blocks.
    wait_idle(server)
    after = scrape(server)
    assert metric(after, "kv_cache_usage_perc") == metric(before, "kv_cache_usage_perc")
    assert metric(after, "request_success_total", finished_reason="abort") == \
        metric(before, "request_success_total", finished_reason="abort") + 1
    assert metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total") < LONG


def test_metrics_endpoint_exports_exactly_the_pinned_families(server: Server) -> None:
    from test_metrics import EXPORTED

    status, text = request(server, "GET", "/metrics", key=None)
    assert status == 200
    families = {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(text)}
    assert families == EXPORTED
    m = scrape(server)
    assert {dict(labels)["reason"] for name, labels in m if name.endswith("by_wait_reason")} == set(wait_reasons())
    assert 0.0 <= metric(m, "kv_cache_usage_perc") <= 1.0
    assert metric(m, "num_kv_blocks") == 1024 - 1  # --num-kv-blocks counts the null block


def test_counters_move_by_exactly_what_was_served(server: Server, client: openai.OpenAI) -> None:
    wait_idle(server)
    before = scrape(server)
    usages = [client.completions.create(prompt="count me", max_tokens=n, **greedy()).usage for n in (3, 7)]
    usages.append(client.chat.completions.create(messages=[{"role": "user", "content": "and me"}],
                                                 max_tokens=5, **greedy()).usage)
    usages.append(list(client.completions.create(prompt="streamed", max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}, **greedy()))[-1].usage)

    def delta(name: str, **labels: str) -> float:
        return metric(scrape(server), name, **labels) - metric(before, name, **labels)
    wait_for(lambda: delta("request_success_total", finished_reason="length") == 4)
    assert delta("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("generation_tokens_total") == sum(u.completion_tokens for u in usages) == 3 + 7 + 5 + 4
    assert delta("e2e_request_latency_seconds_count") == 4


def test_prefix_cache_hits_show_in_cached_tokens_and_metrics_and_reset_forgets_them(
        server: Server, client: openai.OpenAI) -> None:
    wait_idle(server)
    assert request(server, "POST", "/reset_prefix_cache", key=None)[0] == 401  # --api-key guards it too
    for query, word in [("reset_running_requests=maybe", "boolean"), ("reset_external=true", "KV connector"),
                        ("reset_running_requests=1&reset_running_requests=0", "boolean"), ("bogus=1", "unknown")]:
        status, body = request(server, "POST", f"/reset_prefix_cache?{query}")
        assert status == 400 and word in body["error"]["message"], (query, body)
    assert request(server, "POST", "/reset_prefix_cache?reset_external=false") == (200, "")
    before = scrape(server)
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks of 16 can be reused, never the last token

    def cached() -> int:
        return client.completions.create(prompt=prompt, max_tokens=2, **greedy()).usage.prompt_tokens_details.cached_tokens
    assert [cached(), cached()] == [0, 32]
    after = scrape(server)
    assert metric(after, "prefix_cache_queries_total") - metric(before, "prefix_cache_queries_total") == 80
    assert metric(after, "prefix_cache_hits_total") - metric(before, "prefix_cache_hits_total") == 32
    with open_stream(server, {"model": "tiny", "prompt": "x", "max_tokens": LONG, "ignore_eos": True}) as events:
        next(events)  # in flight: it holds KV blocks, so nothing may be reset
        status, body = request(server, "POST", "/reset_prefix_cache")
        assert status == 409 and "hold KV blocks" in body["error"]["message"]
    wait_idle(server)
    assert request(server, "POST", "/reset_prefix_cache") == (200, "")
    assert cached() == 0


def test_a_reset_that_preempts_the_running_requests_lets_them_go_on_with_the_same_tokens(server: Server) -> None:
    """vLLM's ?reset_running_requests=true: a running request is preempted (counted), its
    K/V computed again, and its greedy text goes on as if nothing happened."""
    wait_idle(server)
    before = scrape(server)
    body = {"model": "tiny", "prompt": "reset me", "max_tokens": LONG, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    text, tokens = "", 0
    with open_stream(server, body) as events:
        for event in events:
            text, tokens = text + event["choices"][0]["text"], event["usage"]["completion_tokens"]
            if tokens == 3:
                assert request(server, "POST", "/reset_prefix_cache?reset_running_requests=true") == (200, "")
            if tokens >= 40:
                break
    assert metric(scrape(server), "num_preemptions_total") - metric(before, "num_preemptions_total") == 1
    status, whole = request(server, "POST", "/v1/completions",
                            {k: v for k, v in body.items() if k != "stream_options"} | {"max_tokens": tokens})
    assert status == 200 and text and whole["choices"][0]["text"].startswith(text)


def test_a_cache_salt_shares_cached_tokens_only_with_its_own_salt_on_both_endpoints(server: Server) -> None:
    """vLLM's cache_salt: the same prompt hits the prefix cache only under a salt (or no
    salt) it was served with before, and is the same greedy text under every salt; a salt
    that is not a non-empty string is a 400 naming it, and the server serves on."""
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 can be reused

    def completion(salt: str | None) -> tuple[int, str]:
        status, out = request(server, "POST", "/v1/completions", greedy_body(greedy(
            prompt=prompt, max_tokens=4, cache_salt=salt)))
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]
    got = [completion(salt) for salt in (None, "tenant-a", "tenant-b", "tenant-a", None)]
    assert [cached for cached, _ in got] == [0, 0, 0, 32, 32] and len({text for _, text in got}) == 1
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "salted " * 20}], "max_tokens": 1}

    def chat_cached(salt: str) -> int:
        status, out = request(server, "POST", "/v1/chat/completions", chat | {"cache_salt": salt})
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert chat_cached("tenant-a") == 0 and chat_cached("tenant-a") > 0 and chat_cached("tenant-b") == 0
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
        for salt in ("", 5, []):
            status, err = request(server, "POST", path, body | {"cache_salt": salt})
            assert status == 400 and err["error"]["param"] == "cache_salt", err
        assert request(server, "POST", path, body | {"max_tokens": 1, "cache_salt": None})[0] == 200


# ---- shutdown ---------------------------------------------------------------------------

def test_sigterm_aborts_in_flight_with_a_final_event_and_exits_cleanly() -> None:
    """Three streams and a non-streaming request in flight (all 4 slots), a short
    --shutdown-timeout: once it has passed, each stream ends with a final "abort" event, the non-streaming request gets its whole response with
    finish_reason "abort", and the process exits 0."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"prompt": "long", "max_tokens": LONG, "ignore_eos": True, "logprobs": 0}
    # A grace period far shorter than these requests take: they are aborted when it ends.
    with running_server("--api-key", API_KEY, "--no-warmup", "--shutdown-timeout", "0.2") as srv, \
            ThreadPoolExecutor(1) as pool:
        with contextlib.ExitStack() as stack:
            streams = [stack.enter_context(open_stream(srv, body)) for _ in range(3)]
            for events in streams:
                next(events)
            whole = pool.submit(request, srv, "POST", "/v1/completions", body)
            wait_for(lambda: metric(scrape(srv), "num_requests_running") == 4)
            srv.proc.send_signal(signal.SIGTERM)
            lasts = [list(events)[-1] for events in streams]
        status, out = whole.result(timeout=60)
        assert [last["choices"][0]["finish_reason"] for last in lasts] == ["abort"] * 3
        assert status == 200 and out["choices"][0]["finish_reason"] == "abort", out
        assert 0 < out["usage"]["completion_tokens"] < LONG
        assert srv.proc.wait(60) == 0, srv.log()


def sse_events(resp: http.client.HTTPResponse) -> tuple[list[dict], bool]:
    """Every event of an SSE stream read to its end, and whether it ended with [DONE]."""
    events, done = [], False
    for line in resp:
        line = line.strip()
        if not line:
            continue
        assert not done, f"data after [DONE]: {line!r}"
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
    return events, done


def test_sigterm_lets_requests_in_flight_finish_refuses_new_ones_and_a_second_signal_aborts_the_rest() -> None:
    """Two streams in flight at SIGTERM, a long grace period: new requests and /health get
    503 at once; the short stream gets every one of its tokens; the long one keeps running
    until a second SIGTERM aborts it (a final "abort" event, then [DONE]); exit code 0."""
    short, long_ = ({"prompt": p, "max_tokens": n, "ignore_eos": True, "logprobs": 0, "stream": True}
                    for p, n in (("short", 200), ("long", LONG)))
    with running_server("--api-key", API_KEY, "--no-warmup", "--shutdown-timeout", "600") as srv:
        conns, resps, firsts = [], [], []
        for body in (short, long_):
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
            conns.append(conn)
            resps.append(conn.getresponse())
            assert resps[-1].status == 200
            firsts.append(json.loads(resps[-1].readline()[len(b"data: "):]))  # the first event: it runs
        srv.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: request(srv, "GET", "/health", key=None)[0] == 503)
        status, err = request(srv, "POST", "/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert status == 503 and err["error"]["type"] == "Service Unavailable", err
        wait_for(lambda: "2 in flight get up to 600 s to finish" in srv.log())  # both were running at SIGTERM

        events, done = sse_events(resps[0])
        assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in [firsts[0], *events]
                   if e["choices"][0]["logprobs"]) == 200
        assert srv.proc.poll() is None  # the long one is still being served

        srv.proc.send_signal(signal.SIGTERM)
        events, done = sse_events(resps[1])
        assert done and events[-1]["choices"][0]["finish_reason"] == "abort"
        assert srv.proc.wait(60) == 0, srv.log()
        for conn in conns:
            conn.close()


# ---- Hugging Face checkpoints: their tokenizer and chat template, or none -----------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_a_checkpoint_is_served_with_its_tokenizer_and_chat_template_and_transformers_logprobs(hf_checkpoint) -> None:
    """The served numbers are transformers' numbers: every chosen token's logprob and the
    top 5 equal a NumPy log_softmax of transformers' logits on the same checkpoint, in the
    completion format and in the chat format, whole and streamed. And the length rules
    at max_model_len 128: prompt + max_tokens exactly 128 runs to the end, one more is a
    400; chat without max_tokens gets the rest of the context (vLLM's default);
    max_completion_tokens is chat's newer name for max_tokens."""
    from conftest import hf_greedy, hf_logits
    from transformers import AutoTokenizer

    path = hf_checkpoint("llama2", tokenizer=True)
    tok = AutoTokenizer.from_pretrained(path)
    templated = "<|im_start|>user\nthe lazy dog<|im_end|>\n<|im_start|>assistant\n"  # conftest's ChatML
    chat_prompt = tok.encode(templated, add_special_tokens=False)
    prompt = [1, 5, 17, 42, 99, 7, 256, 31, 64, 11]
    messages = [{"role": "user", "content": "the lazy dog"}]
    with running_server("--model", path, *HF_SMALL) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        kw = dict(model=model, temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})
        whole = client.completions.create(prompt="the quick brown fox", **kw)
        streamed = sse(srv, "/v1/completions", dict(prompt="the quick brown fox", **greedy_body(kw)))
        assert "".join(c["choices"][0]["text"] for c in streamed) == whole.choices[0].text
        chat = client.chat.completions.create(messages=messages, **kw)
        lp_whole = request(srv, "POST", "/v1/completions", dict(prompt=prompt, logprobs=5, **greedy_body(kw)))[1]
        lp_stream = sse(srv, "/v1/completions", dict(prompt=prompt, logprobs=5, **greedy_body(kw)))
        chat_lp = request(srv, "POST", "/v1/chat/completions",
                          dict(messages=messages, logprobs=True, top_logprobs=5, **greedy_body(kw)))[1]
        chat_stream = sse(srv, "/v1/chat/completions",
                          dict(messages=messages, logprobs=True, top_logprobs=5, **greedy_body(kw)))
        exact = request(srv, "POST", "/v1/completions", {"prompt": list(range(3, 103)), "max_tokens": 28,
                                                         "ignore_eos": True})
        over = request(srv, "POST", "/v1/completions", {"prompt": list(range(3, 103)), "max_tokens": 29})
        chat_default = request(srv, "POST", "/v1/chat/completions", {"messages": messages, "ignore_eos": True})[1]
        newer = request(srv, "POST", "/v1/chat/completions", {"messages": messages, "ignore_eos": True,
                                                              "max_completion_tokens": 5, "max_tokens": 9})[1]
    assert chat.usage.prompt_tokens == len(chat_prompt) and chat.usage.completion_tokens == 12

    def reference(prompt_ids: list[int]) -> tuple[list[int], np.ndarray]:
        ids = hf_greedy(path, prompt_ids, 12)
        return ids, log_softmax(hf_logits(path, prompt_ids + ids))[len(prompt_ids) - 1:-1]
    ids, lsm = reference(prompt)
    want_chosen = [lsm[i, t] for i, t in enumerate(ids)]
    want_top = [np.sort(row)[::-1][:5] for row in lsm]
    lp = lp_whole["choices"][0]["logprobs"]
    def assert_texts(tokens: list[str], ids: list[int]) -> None:
        """Each token's own decode; one that ends part of a character: "" or the character it ends (vLLM's)."""
        for text, t in zip(tokens, ids, strict=True):
            own = tok.decode([t])
            assert not text.endswith("\ufffd") if own.endswith("\ufffd") else text == own, (text, own)
    assert_texts(lp["tokens"], ids)
    np.testing.assert_allclose(lp["token_logprobs"], want_chosen, atol=2e-4)
    for top, want in zip(lp["top_logprobs"], want_top):  # keyed by text: tokens that decode alike share a key
        assert all(np.isclose(want, v, atol=2e-4).any() for v in top.values()) and len(top) <= 5
    keys = ("tokens", "token_logprobs", "top_logprobs")
    streamed_lp = [c["choices"][0]["logprobs"] for c in lp_stream]
    assert_same_logprobs({k: sum((x[k] for x in streamed_lp), []) for k in keys}, {k: lp[k] for k in keys})

    ids, lsm = reference(chat_prompt)
    content = chat_lp["choices"][0]["logprobs"]["content"]
    assert_texts([c["token"] for c in content], ids)
    np.testing.assert_allclose([c["logprob"] for c in content], [lsm[i, t] for i, t in enumerate(ids)], atol=2e-4)
    np.testing.assert_allclose([[x["logprob"] for x in c["top_logprobs"]] for c in content],
                               [np.sort(row)[::-1][:5] for row in lsm], atol=2e-4)
    assert_same_logprobs(sum((c["choices"][0]["logprobs"]["content"] for c in chat_stream
                              if c["choices"][0]["logprobs"]), []), content)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chat_stream) == \
        chat_lp["choices"][0]["message"]["content"]

    assert exact[0] == 200 and exact[1]["usage"]["completion_tokens"] == 28, exact
    assert exact[1]["choices"][0]["finish_reason"] == "length"
    assert over[0] == 400 and over[1]["error"]["param"] == "input_tokens" and "maximum input length of 99" in \
        over[1]["error"]["message"]
    assert chat_default["usage"]["completion_tokens"] == 128 - len(chat_prompt), chat_default
    assert chat_default["choices"][0]["finish_reason"] == "length"
    assert newer["usage"]["completion_tokens"] == 5, newer


def test_a_checkpoint_without_tokenizer_takes_token_ids_and_answers_empty_text(hf_server: Server) -> None:
    for path_, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        status, err = request(hf_server, "POST", path_, body)
        assert status == 400 and "tokenizer" in err["error"]["message"]
    for field_, value in (("stop", "x"), ("bad_words", ["x"])):  # text to match or tokenize: the engine's 400
        status, err = request(hf_server, "POST", "/v1/completions", {"prompt": [1, 5, 7], field_: value})
        assert status == 400 and err["error"]["param"] == field_ and "no tokenizer" in err["error"]["message"], err
    status, out = request(hf_server, "POST", "/v1/completions",
                          {"prompt": [1, 5, 7], "max_tokens": 4, "ignore_eos": True, "logprobs": 0})
    assert status == 200, out
    assert out["choices"][0]["text"] == "" and out["usage"]["completion_tokens"] == 4
    assert all(t.startswith("token_id:") for t in out["choices"][0]["logprobs"]["tokens"])


# ---- the pieces, without a server ---------------------------------------------------------

def detokenize(steps: list[bytes], stop: list[str] = ()) -> tuple[list[str], bool]:
    """Feed byte tokens step by step (the last step is final); the text each step sent."""
    detok, sent = IncrementalDetokenizer(ByteTokenizer(), [ByteTokenizer.bos_token_id], list(stop)), []
    for i, step in enumerate(steps):
        text, stopped = detok.push(list(step), final=i == len(steps) - 1)
        sent.append(text)
        if stopped:
            return sent, True
    return sent, False


def one_byte_each(text: str) -> list[bytes]:
    return [bytes([b]) for b in text.encode()]


def test_detokenizer_never_sends_half_a_character() -> None:
    sent, _ = detokenize(one_byte_each("héllo 世界!"))
    assert "".join(sent) == "héllo 世界!" and not any("\ufffd" in t for t in sent)


def test_detokenizer_cuts_a_stop_string_split_across_tokens_without_sending_any_of_it() -> None:
    sent, stopped = detokenize(one_byte_each("abc STOP def"), ["STOP"])
    assert stopped and "".join(sent) == "abc "


def test_text_held_back_as_a_maybe_stop_string_goes_out_once_it_is_not_one() -> None:
    sent, stopped = detokenize(one_byte_each("ab STxy"), ["STOP"])
    assert not stopped and sent == ["a", "b", " ", "", "", "STx", "y"]
    sent, _ = detokenize(one_byte_each("ab ST"), ["STOP"])
    assert "".join(sent) == "ab ST"  # the last token flushes it


def test_the_earliest_stop_string_wins_within_one_step() -> None:
    assert detokenize([b"xx END yy STOP zz"], ["STOP", "END"]) == (["xx "], True)


def test_without_a_tokenizer_text_prompts_and_chat_are_refused() -> None:
    refused = [lambda: parse_prompts({"prompt": "hi"}, None, 512),
               lambda: parse_messages({"messages": [{"role": "user", "content": "hi"}]}, None)]
    for call in refused:
        with pytest.raises(ApiError) as e:
            call()
        assert e.value.status == 400 and "tokenizer" in str(e.value)
    assert parse_prompts({"prompt": [1, 2, 3]}, None, 512) == ([[1, 2, 3]], [[1, 2, 3]])
    assert IncrementalDetokenizer(None, [1], []).push([5], final=True) == ("", False)


def test_chat_add_generation_prompt_continue_final_message_and_template_kwargs_reach_the_template() -> None:
    """vLLM's chat extras (LLM.chat's arguments), never silently ignored: continue_final_message
    (with add_generation_prompt false) leaves the last message open for the model to go on."""
    seen = []

    class Template(ByteTokenizer):  # a template that reads one variable of its own
        def apply_chat_template(self, chat, **kw):
            seen.append(kw.pop("enable_thinking", None))
            return super().apply_chat_template(chat, **kw)

    tok = Template()
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    ids = parse_messages({"messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
                          "chat_template_kwargs": {"enable_thinking": False}}, tok)
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is"
    assert seen == [False]
    ids = parse_messages({"messages": msgs[:1], "add_generation_prompt": False}, tok)
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n"
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),  # with the default True
                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                         ({"add_generation_prompt": "no"}, "add_generation_prompt")):
        with pytest.raises(ApiError) as e:
            parse_messages({"messages": msgs} | extra, tok)
        assert e.value.status == 400 and e.value.param == param
    with pytest.raises(ApiError) as e:  # a request's own template: refused, as vLLM without its trust flag
        parse_messages({"messages": msgs, "chat_template": "{{ messages }}"}, tok)
    assert e.value.param == "chat_template"


def test_chat_text_content_parts_are_joined_by_newlines_as_vllm() -> None:
    parts = [{"type": "text", "text": "Translate:"}, {"type": "text", "text": "bonjour"}]
    ids = parse_messages({"messages": [{"role": "user", "content": parts}]}, ByteTokenizer())
    assert ByteTokenizer().decode(ids) == "<|im_start|>user\nTranslate:\nbonjour<|im_end|>\n<|im_start|>assistant\n"


def test_chat_top_logprobs_without_logprobs_is_refused_not_ignored() -> None:
    """vLLM's rule: top_logprobs asks for alternatives of logprobs that were not asked for;
    one out of range is named top_logprobs, the field the client sent."""
    for body in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": False}, {"top_logprobs": -1},
                 {"top_logprobs": -2, "logprobs": True}):  # out of range: named as the client wrote it
        with pytest.raises(ApiError) as e:
            parse_sampling(body, 3, 256, chat=True)
        assert e.value.status == 400 and e.value.param == "top_logprobs" and "top_logprobs" in str(e.value)
    assert parse_sampling({"top_logprobs": 2, "logprobs": True}, 3, 256, chat=True).logprobs == 2
    assert parse_sampling({"top_logprobs": 0}, 3, 256, chat=True).logprobs is None


def test_priority_is_an_extra_field_of_both_endpoints_checked_where_it_enters(server: Server) -> None:
    """vLLM's `priority`: an integer; this server runs fcfs, so only 0 (the default) is taken."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("/v1/chat/completions", chat)):
        status, err = request(server, "POST", path, body | {"priority": "high"})
        assert status == 400 and err["error"]["param"] == "priority", err
        status, err = request(server, "POST", path, body | {"priority": 3})
        assert status == 400 and "--scheduling-policy priority" in err["error"]["message"], err
        assert request(server, "POST", path, body | {"priority": 0})[0] == 200
