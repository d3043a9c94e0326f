"""Beam search served to careless or hostile clients: a search the server admitted runs to
its end whatever other clients send, and nothing it leaves behind (slot, KV block, waiting
place) outlives it."""

from __future__ import annotations

import http.client
import json
import signal
import threading
from typing import Iterator

import pytest
from test_server import API_KEY, Server, metric, request, running_server, scrape, wait_for


def post(port: int, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_concurrent_searches_are_refused_before_they_start_or_run_to_their_end():
    """Each step of a search adds one request per live beam. With --max-waiting-requests 4,
    searches of n = 4 and plain requests sent together: each answer is either a 503 before
    any byte (the client can retry) or, once admitted (a stream's 200 is out), the whole
    search: never a search refused at a later step, its work thrown away. Then the server
    is idle, its KV cache empty."""
    with running_server("--max-waiting-requests", "4", "--no-warmup") as s:
        answers: list[tuple[str, int, str]] = []

        def search(i: int, stream: bool) -> None:
            answers.append(("search", *post(s.port, {
                "prompt": [5 + i, 6, 7], "use_beam_search": True, "n": 4, "max_tokens": 24, "ignore_eos": True,
                "stream": stream})))

        def plain(i: int) -> None:
            answers.append(("plain", *post(s.port, {"prompt": [9, i], "max_tokens": 8})))

        before = metric(scrape(s), "generation_tokens_total")
        threads = [threading.Thread(target=search, args=(i, i % 2 == 1)) for i in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: metric(scrape(s), "generation_tokens_total") > before)  # a search was admitted
        threads += [threading.Thread(target=plain, args=(i,)) for i in range(4)]
        for t in threads[8:]:
            t.start()
        for t in threads:
            t.join()
        for kind, status, text in answers:
            assert status in (200, 503), (kind, status, text)
            if status == 503:
                assert "at capacity" in json.loads(text)["error"]["message"], text
            else:
                assert '"error"' not in text, (kind, text)
        searches = [status for kind, status, _ in answers if kind == "search"]
        assert 200 in searches, answers

        def idle() -> bool:
            m = scrape(s)
            return metric(m, "num_requests_running") == metric(m, "num_requests_waiting") == 0 and \
                metric(m, "kv_cache_usage_perc") == 0
        wait_for(idle)
        # the waiting places the searches held are free again: a search of the whole width runs
        status, answer = request(s, "POST", "/v1/completions", {
            "prompt": [5, 6, 7], "use_beam_search": True, "n": 4, "max_tokens": 4})
        assert status == 200 and len(answer["choices"]) == 4, answer


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # a waiting queue that one search of n = 4 fills: a place a search leaves held shows
    with running_server("--no-warmup", "--shutdown-timeout", "0", "--max-waiting-requests", "4") as s:
        yield s


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [5, 6], "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": [5, 6], "structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_an_output_constraint_refused_with_beam_search_names_the_field_sent(server, path, body, param):
    status, answer = request(server, "POST", path, body | {"use_beam_search": True, "n": 2, "max_tokens": 3})
    assert status == 400, answer
    assert answer["error"]["param"] == param and f"'{param}' is not supported with use_beam_search" in \
        answer["error"]["message"], answer


def test_sigterm_mid_search_ends_it_with_a_clear_answer_and_the_server_exits_cleanly():
    """Two long searches in flight (one streamed) at SIGTERM with no grace period: each
    client gets its answer (a 503 for the whole one, an error event then [DONE] for the
    stream, whose 200 is out), and the process exits 0."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server import LONG, open_stream

    body = {"prompt": [5, 6, 7], "use_beam_search": True, "n": 4, "max_tokens": LONG, "ignore_eos": True}
    with running_server("--no-warmup", "--shutdown-timeout", "0") as s, ThreadPoolExecutor(1) as pool:
        before = metric(scrape(s), "generation_tokens_total")
        whole = pool.submit(post, s.port, body | {"prompt": [8, 9]})
        with open_stream(s, body) as events:
            wait_for(lambda: metric(scrape(s), "generation_tokens_total") > before + 8)  # both past their first step
            s.proc.send_signal(signal.SIGTERM)
            streamed = list(events)
        status, text = whole.result(timeout=120)
        assert status == 503 and json.loads(text)["error"]["type"] == "Service Unavailable", text
        assert streamed and streamed[-1]["error"]["code"] == 503, streamed
        assert s.proc.wait(60) == 0, s.log()


def test_a_client_gone_mid_search_without_a_stream_stops_it(server):
    """A whole (not streamed) answer's client leaves after the search's first step: the
    search stops there, and no request, slot, KV block or waiting place is left behind."""
    import socket
    import time

    before = metric(scrape(server), "generation_tokens_total")
    steps, width = 200, 4
    payload = json.dumps({"prompt": [5, 6, 7], "use_beam_search": True, "n": width, "max_tokens": steps,
                          "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_for(lambda: metric(scrape(server), "generation_tokens_total") > before)
    last: list[float] = []

    def settled() -> bool:  # idle, and still idle a moment later (between two steps nothing runs)
        last.append(metric(scrape(server), "generation_tokens_total"))
        time.sleep(0.5)
        m = scrape(server)
        return metric(m, "num_requests_running") == metric(m, "num_requests_waiting") == 0 and \
            metric(m, "generation_tokens_total") == last[-1]
    wait_for(settled)
    assert last[-1] - before < 1 + (steps - 1) * width  # stopped before its last step
    assert metric(scrape(server), "kv_cache_usage_perc") == 0
    # its 4 waiting places are freed: a search as wide as the queue is admitted. They are freed
    # once the loop has done the search's aborts (AsyncEngine.release_waiting), which on busy
    # cores may come after the counters above have settled: until then a full queue's 503.
    answers: list[tuple[int, str]] = []

    def admitted() -> bool:
        answers.append(post(server.port, {"prompt": [5, 6, 7], "use_beam_search": True, "n": width, "max_tokens": 2}))
        status, text = answers[-1]
        assert status == 200 or (status == 503 and "at capacity" in json.loads(text)["error"]["message"]), answers[-1]
        return status == 200
    deadline = time.monotonic() + 60
    while not admitted():
        assert time.monotonic() < deadline, f"the search's waiting places were never freed: {answers[-1]}"
        time.sleep(0.05)
