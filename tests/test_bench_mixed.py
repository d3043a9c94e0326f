"""bench/mixed.py at a tiny size against real servers (taxirank's, transformers') and fake ones
whose answers are known: the figures must match the requests sent (per-class counts, exact
lengths, numpy's percentiles of the raw samples), and a server gets only what it takes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading

import numpy as np
import pytest
from conftest import load_bench


def _load():
    return load_bench("mixed")


def test_parse_metrics_reads_taxirank_and_vllm_names():
    _load()
    import client as mixed  # bench/ is on sys.path once mixed.py is loaded

    taxirank = mixed.pick(mixed.parse_metrics(
        "# HELP taxirank:num_requests_running Requests in the running batch.\n"
        "taxirank:num_requests_running 3.0\ntaxirank:num_requests_waiting 5.0\n"
        "taxirank:kv_cache_usage_perc 0.5\ntaxirank:num_preemptions_total 2.0\ntaxirank:num_kv_blocks 1024.0\n"
        'taxirank:num_requests_waiting_by_wait_reason{reason="kv_blocks"} 4.0\n'
        'taxirank:num_requests_waiting_by_wait_reason{reason="max_num_seqs"} 1.0\n'))
    assert taxirank == {"running": 3.0, "waiting": 5.0, "kv_usage": 0.5, "preemptions": 2.0, "num_kv_blocks": 1024.0,
                        "waiting_by_reason": {"kv_blocks": 4.0, "max_num_seqs": 1.0}}
    vllm = mixed.pick(mixed.parse_metrics(
        'vllm:num_requests_running{model_name="m"} 7.0\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\nvllm:num_preemptions_total{model_name="m"} 0.0\n'))
    assert vllm == {"running": 7.0, "waiting": 1.0, "kv_usage": 0.25, "preemptions": 0.0, "num_kv_blocks": None,
                    "waiting_by_reason": {}}


def test_the_results_table_counts_the_failed_requests_its_figures_leave_out():
    """As vLLM's summary does beside its figures (which leave failed requests out too)."""
    _load()
    from report import table_rows  # bench/ is on sys.path once mixed.py is loaded

    v = {"output_tokens_per_s": 12.0, "errors": 2, "requests": 6, "short": {}, "long": {}}
    header, row = table_rows({"variants": {"a": v}})
    assert dict(zip(header, row))["failed"] == "2 of 6"


VARIANTS = ["continuous", "static", "reserve-max-len/full", "reserve-max-len/half"]


@pytest.mark.timeout(300)
def test_tiny_run_reports_per_class_figures_that_match_the_requests_sent(tmp_path):
    """6 requests (3 x 2 and 3 x 8 tokens) against a server per variant: the smallest run with
    both schedules and one admission mode at both lengths. A KV budget of 2 sequences of 32
    tokens is 4 usable blocks: under reserve-max-len a request holds 2 blocks at
    max_model_len 32 (2 run at once) and 1 at 16 (4 run, as many as the slots). The servers
    start without a warm-up: each compiles (or loads from the cache) only the programs its
    requests run, and nothing here times a step; a step budget of 16 is one token bucket
    (one ragged program per shape)."""
    pytest.importorskip("matplotlib")
    mixed = _load()
    mixed.main(["--model", "tiny", "--num-requests", "6", "--short", "2", "--long", "8", "--prompt-len", "4,8",
                      "--max-model-len", "32", "--max-num-seqs", "4", "--kv-budget-seqs", "2",
                      "--variants", ",".join(VARIANTS), "--server-args", "--max-num-batched-tokens 16 --no-warmup",
                      "--out", str(tmp_path), "--jax-cache", os.environ["JAX_COMPILATION_CACHE_DIR"]])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert list(on_disk["variants"]) == VARIANTS and on_disk["settings"]["kv_budget_blocks"] == 5
    for name, v in on_disk["variants"].items():
        assert "error" not in v and v["errors"] == 0 and v["exact_lengths"], (name, v.get("first_errors"))
        reqs = v["per_request"]
        assert sorted(r["max_tokens"] for r in reqs) == [2, 2, 2, 8, 8, 8]
        assert [r["tokens"] for r in reqs] == [r["max_tokens"] for r in reqs]  # ignore_eos: exact lengths
        assert v["output_tokens"] == 3 * 2 + 3 * 8
        span = max(r["start"] + r["e2e"] for r in reqs) - min(r["start"] for r in reqs)
        assert 30 / v["output_tokens_per_s"] == pytest.approx(span, abs=2e-4)  # starts are rounded to 0.1 ms
        for cls, n in (("short", 2), ("long", 8)):
            mine = [r for r in reqs if r["max_tokens"] == n]
            assert all(r["class"] == cls for r in mine) and v[cls]["n"] == v[cls]["n_ok"] == 3
            for metric in ("ttft", "e2e"):
                raw = [r[metric] for r in mine]
                for q in (50, 90, 99):
                    assert v[cls][metric][f"p{q}"] == pytest.approx(np.percentile(raw, q)), (name, cls, metric)
            assert all(0 < r["ttft"] <= r["e2e"] for r in mine)
        m = v["metrics"]
        assert m["samples"] == len(v["timeline"]["t"]) >= 2 and m["max_running"] <= 4
        assert set(m["series"]) == {"running", "waiting", "kv_usage", "preemptions", "waiting_by_reason"}
        assert v["load"]["server_cpu_s"] is not None and v["startup_s"] > 0
    full, half = (on_disk["variants"][f"reserve-max-len/{n}"] for n in ("full", "half"))
    assert (full["flags"]["max_model_len"], half["flags"]["max_model_len"]) == (32, 16)
    assert full["metrics"]["num_kv_blocks"] == half["metrics"]["num_kv_blocks"] == 4
    assert full["metrics"]["max_running"] <= 2
    assert on_disk["variants"]["continuous"]["metrics"]["num_kv_blocks"] > 4  # the server's default cache
    h = on_disk["analysis"]["halving"]["reserve-max-len"]
    e2e_p99 = [np.percentile([r["e2e"] for r in v["per_request"] if r["max_tokens"] == 2], 99) for v in (full, half)]
    assert h["fall"] == pytest.approx(e2e_p99[0] / e2e_p99[1])
    assert on_disk["plots"] == ["cdf_short_e2e.png"] + [f"timeline-{n.replace('/', '-')}.png" for n in VARIANTS]
    for p in on_disk["plots"]:
        assert (tmp_path / p).stat().st_size > 1000, p
    report = (tmp_path / "report.md").read_text()
    assert "## Answer" in report and "reserve-max-len: short-request p99 e2e" in report and "## Machine" in report
    (tmp_path / "report.md").unlink()
    again = mixed.main(["--report", str(tmp_path)])  # re-rendered from results.json alone
    assert json.loads(json.dumps(again["analysis"])) == on_disk["analysis"]
    assert (tmp_path / "report.md").read_text() == report


# ---- any OpenAI-compatible server: the probe, portable requests, side by side -------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _fake_app(name: str | None, *, strict: bool, usage: bool, twist: bool, seen: list[dict]):
    """A server that is not taxirank. strict: 422 on any field beyond OpenAI's core ones (so
    ignore_eos and logprobs), 400 on token-id prompts, 404 on another model name, no
    /metrics. usage=False: refuses stream_options and sends no usage, and has no /v1/models.
    Its "model" answers a prompt with words, one chunk each, and stops on its own after
    3 + (words in the prompt) % 5 of them (an EOS), so lengths follow the model. twist: the
    third word differs when the prompt has an odd number of words (to disagree sometimes)."""
    from aiohttp import web

    allowed = {"model", "prompt", "max_tokens", "temperature", "top_p", "stream", "stop", "n", "seed"}
    if usage:
        allowed.add("stream_options")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        unexpected = set(body) - allowed if strict else set() if usage else set(body) & {"stream_options"}
        if unexpected:
            return web.json_response({"detail": f"Unexpected fields in the request: {unexpected}"}, status=422)
        if not isinstance(body.get("prompt"), str):
            return web.json_response({"detail": "prompt must be a string."}, status=400)
        if name and body.get("model", name) != name:
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        n_words = len(body["prompt"].split())
        n = min(body["max_tokens"], 3 + n_words % 5)
        words = [WORDS[(n_words + i) % len(WORDS)] for i in range(n)]
        if twist and n_words % 2 and n >= 3:
            words[2] = "omega"
        finish = "length" if n == body["max_tokens"] else "stop"
        if body.get("stream") is False:  # one response: the whole text and, as OpenAI's always does, usage
            await asyncio.sleep(0.002 * n)
            return web.json_response({"choices": [{"index": 0, "text": "".join(" " + w for w in words),
                                                   "finish_reason": finish}],
                                      "usage": {"prompt_tokens": 2 * n_words, "completion_tokens": n,
                                                "total_tokens": 2 * n_words + n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, w in enumerate(words):
            choice = {"index": 0, "text": " " + w, "finish_reason": None if i < n - 1 else finish}
            chunk = {"choices": [choice]}
            if usage and i == n - 1 and (body.get("stream_options") or {}).get("include_usage"):
                chunk["usage"] = {"prompt_tokens": 2 * n_words, "completion_tokens": n, "total_tokens": 2 * n_words + n}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    if usage:
        app.router.add_get("/v1/models", models)
    return app


@pytest.fixture
def fake_servers():
    """Start fake servers on free loopback ports in a thread of their own; stop them after."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runners = []

    def start(name: str | None, **kw) -> tuple[str, list[dict]]:
        seen: list[dict] = []

        async def up() -> int:
            runner = web.AppRunner(_fake_app(name, seen=seen, **kw))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            return site._server.sockets[0].getsockname()[1]

        port = asyncio.run_coroutine_threadsafe(up(), loop).result(10)
        return f"http://127.0.0.1:{port}", seen

    yield start
    for r in runners:
        asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


WORKLOAD = ["--num-requests", "6", "--short", "3", "--long", "12", "--prompt-len", "4,12"]


def test_text_prompts_are_prose_of_the_asked_length_and_fixed_by_the_seed():
    _load()
    from workload import short_long_mix  # bench/ is on sys.path once mixed.py is loaded

    a = short_long_mix(20, 1000, short=3, long=9, prompt_len=(5, 40), seed=7, text=True)
    assert a == short_long_mix(20, 1000, short=3, long=9, prompt_len=(5, 40), seed=7, text=True)
    assert a != short_long_mix(20, 1000, short=3, long=9, prompt_len=(5, 40), seed=8, text=True)
    assert sorted(r.max_tokens for r in a) == [3] * 10 + [9] * 10
    ids = short_long_mix(20, 1000, short=3, long=9, prompt_len=(5, 40), seed=7)
    assert [r.max_tokens for r in a] == [r.max_tokens for r in ids], "text or ids: the same classes in order"
    for r in a:
        assert r.prompt_token_ids == [] and r.prompt == r.prompt_text
        words = r.prompt_text.split()
        assert 5 <= len(words) <= 40 and all(w.strip(".,").isalpha() for w in words), r.prompt_text


def test_strict_server_gets_only_what_it_takes_and_the_report_says_what_that_cost(tmp_path, fake_servers):
    pytest.importorskip("matplotlib")
    mixed = _load()
    url, seen = fake_servers("fake-strict", strict=True, usage=True, twist=False)
    res = mixed.main(["--url", url, *WORKLOAD, "--rate", "200", "--out", str(tmp_path)])
    v = res["variants"]["server"]
    starts = sorted(r["start"] for r in v["per_request"])  # a Poisson process at 200/s, not a burst
    assert starts[-1] - starts[0] > 0.001 and v["short"]["n"] + v["long"]["n"] == 6
    assert "error" not in v and v["errors"] == 0, v.get("first_errors")
    caps = v["capabilities"]
    assert caps["model"] == "fake-strict" and caps["prompts"] == "text"
    assert set(caps["refused"]) == {"ignore_eos"} and "Unexpected fields" in caps["refused"]["ignore_eos"]
    assert (caps["ignore_eos"], caps["include_usage"], caps["usage"], caps["metrics"]) == (False, True, True, False)
    assert caps["timing"] == "text", "one word per chunk, and usage counts them"
    workload = seen[-6:]  # after the probe's requests
    assert all(set(b) == {"model", "prompt", "max_tokens", "temperature", "stream", "stream_options"} for b in workload)
    assert sorted(b["max_tokens"] for b in workload) == [3, 3, 3, 12, 12, 12]
    # the fake stops on its own: lengths follow the model, counted from its usage
    for r in v["per_request"]:
        n_words = r["prompt_len"]
        assert r["tokens"] == min(r["max_tokens"], 3 + n_words % 5) == len(r["text"].split())
        assert r["prompt_tokens"] == 2 * n_words and r["finish_reason"] in ("stop", "length")
    assert v["tokens_counted_from"] == "usage" and not v["exact_lengths"]
    assert v["prompt_tokens"]["total"] == sum(2 * r["prompt_len"] for r in v["per_request"])
    assert v["metrics"]["samples"] == 0 and v["metrics"]["max_running"] is None
    assert res["plots"] == ["cdf_short_e2e.png", "timeline-server.png"]  # the client's view, without /metrics
    report = (tmp_path / "report.md").read_text()
    assert "refused ignore_eos" in report and "output lengths follow the model" in report
    assert "no /metrics" in report and "| server | " in report

    refused = mixed.main(["--url", url, "--prompts", "ids", "--vocab-size", "100", *WORKLOAD,
                          "--out", str(tmp_path / "ids")])
    err = refused["variants"]["server"]["error"]
    assert "refuses token-id prompts" in err and "prompt must be a string" in err
    assert "not measured" in (tmp_path / "ids" / "report.md").read_text()


def test_no_stream_sends_unstreamed_requests_and_times_each_by_its_one_response(tmp_path, fake_servers):
    pytest.importorskip("matplotlib")
    mixed = _load()
    with pytest.raises(SystemExit):  # taxirank's variants are compared by TTFT and ITL: streamed
        mixed.main(["--no-stream", *WORKLOAD, "--out", str(tmp_path / "variants")])
    url, seen = fake_servers("fake-strict", strict=True, usage=True, twist=False)
    res = mixed.main(["--url", url, "--no-stream", *WORKLOAD, "--out", str(tmp_path)])
    v = res["variants"]["server"]
    assert "error" not in v and v["errors"] == 0, v.get("first_errors")
    assert all(b["stream"] is False and "stream_options" not in b for b in seen), "no stream, so no stream_options"
    caps = v["capabilities"]
    assert (caps["stream"], caps["timing"], caps["usage"], caps["include_usage"]) == (False, "none", True, False)
    for r in v["per_request"]:  # the fake's lengths and its usage's counts, from one response each
        assert r["ttft"] is None and r["e2e"] > 0 and r["finish_reason"] in ("stop", "length")
        assert r["tokens"] == min(r["max_tokens"], 3 + r["prompt_len"] % 5) == len(r["text"].split())
        assert r["prompt_tokens"] == 2 * r["prompt_len"]
    assert v["short"]["ttft"] == {} and v["short"]["itl"] == {} and v["short"]["e2e"]["p50"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "TTFT, ITL and TPOT (--no-stream" in report and "--no-stream: one response per request" in report
    assert "temperature 0, not streamed;" in report


def test_side_by_side_sends_identical_requests_and_marks_a_server_without_usage(tmp_path, fake_servers):
    pytest.importorskip("matplotlib")
    mixed = _load()
    url_a, seen_a = fake_servers("fake-strict", strict=True, usage=True, twist=False)
    url_b, seen_b = fake_servers(None, strict=False, usage=False, twist=True)
    res = mixed.main(["--url", f"a={url_a}", "--url", f"b={url_b}", *WORKLOAD, "--out", str(tmp_path)])
    a, b = res["variants"]["a"], res["variants"]["b"]
    assert a["errors"] == b["errors"] == 0
    # side by side: no vLLM extension to anyone, the same prompts and max_tokens to both
    assert not any("ignore_eos" in body for body in seen_a + seen_b)
    key = sorted((body["prompt"], body["max_tokens"]) for body in seen_a[-6:])
    assert key == sorted((body["prompt"], body["max_tokens"]) for body in seen_b[-6:])
    cb = b["capabilities"]
    assert cb["model"] is None and not any("model" in body for body in seen_b)
    assert "include_usage" in cb["refused"] and not cb["include_usage"] and not cb["usage"]
    assert cb["timing"] == "chunks" and b["tokens_counted_from"] == "chunks" and b["prompt_tokens"] is None
    assert [r["tokens"] for r in b["per_request"]] == [r["tokens"] for r in a["per_request"]]
    comp = res["analysis"]["comparison"]
    assert comp["reference"] == "a" and list(comp["vs"]) == ["b"]
    c = comp["vs"]["b"]
    assert c["output_tokens_per_s"]["ratio"] == pytest.approx(a["output_tokens_per_s"] / b["output_tokens_per_s"])
    for cls in ("short", "long"):
        for m in ("ttft", "itl", "e2e"):
            for q in ("p50", "p99"):
                d = c[cls][m][q]
                assert d["a"] == a[cls][m][q] and d["b"] == b[cls][m][q] and d["ratio"] == pytest.approx(d["b"] / d["a"])
    odd = sum(r["prompt_len"] % 2 == 1 and r["tokens"] >= 3 for r in a["per_request"])
    g = c["greedy_texts"]
    assert g["compared"] == 6 and g["identical"] == 6 - odd and (g["first_difference"] is None) == (odd == 0)
    assert g["prompt_tokens_equal"] is None, "b reports no usage: nothing to compare"
    assert set(res["plots"]) == {"cdf_short_e2e.png", "timeline-a.png", "timeline-b.png", "timeline_side_by_side.png"}
    for p in res["plots"]:
        assert (tmp_path / p).stat().st_size > 1000, p
    report = (tmp_path / "report.md").read_text()
    assert "## Side by side" in report and "### a vs b" in report and "a better by" in report
    assert "Not measured: usage" in report and "per-token ITL" in report
    assert f"greedy texts identical in {6 - odd} of 6 requests" in report


@pytest.fixture(scope="module")
def tiny_hf_checkpoint(tmp_path_factory):
    """A random 2-layer Llama with a 300-token byte-level BPE trained on the bench's own prose,
    from save_pretrained: a real checkpoint directory for a real server, made offline."""
    torch = pytest.importorskip("torch")
    _load()
    from workload import short_long_mix
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = str(tmp_path_factory.mktemp("tiny-hf"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [r.prompt_text for r in short_long_mix(200, 0, prompt_len=(20, 40), seed=1, text=True)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.mark.timeout(300)
def test_against_a_real_transformers_serve_with_continuous_batching(tmp_path, tiny_hf_checkpoint, monkeypatch):
    """transformers' own server (FastAPI, continuous batching) refuses ignore_eos and token-id
    prompts and has no /metrics: the bench starts it, measures it, stops it, and says so."""
    pytest.importorskip("matplotlib")
    for mod in ("fastapi", "uvicorn"):
        pytest.importorskip(mod, reason="transformers[serving] (the test extra) is not installed")
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    assert os.path.exists(cli), "the transformers CLI sits next to the interpreter"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: nothing to download
    mixed = _load()
    # On CPU, transformers sizes its KV cache from free RAM (90% of it: 12 GB here) unless told.
    cmd = (f"{cli} serve {tiny_hf_checkpoint} --continuous-batching --cb-num-blocks 8 --cb-max-batch-tokens 256 "
           "--host 127.0.0.1 --port {port} --device cpu --dtype float32")
    res = mixed.main(["--compare", f"hf={cmd}", *WORKLOAD, "--startup-timeout", "240", "--out", str(tmp_path)])
    v = res["variants"]["hf"]
    assert "error" not in v and v["errors"] == 0, (v.get("error"), v.get("first_errors"))
    # CPU time is read from /proc in clock ticks (10 ms): a fast machine serves this load in less.
    assert v["startup_s"] > 0 and v["url"].startswith("http://127.0.0.1:") and v["load"]["server_cpu_s"] >= 0
    caps = v["capabilities"]
    assert caps["model"] == tiny_hf_checkpoint and caps["prompts"] == "text"
    assert "Unexpected fields" in caps["refused"]["ignore_eos"] and not caps["ignore_eos"]
    # Timing: "text" when each streamed token came with text; random weights can emit a token
    # without any (the probe's greedy answer varies with the peer's batching), and then the
    # peer's per-token logprobs time it, or whole chunks do where it has none.
    assert caps["usage"] and not caps["metrics"] and caps["timing"] in ("text", "chunks", "logprobs")
    assert (caps["timing"] == "logprobs") == bool(caps.get("logprobs"))
    assert v["tokens_counted_from"] == "usage"
    for r in v["per_request"]:  # counts from the server's usage; its finish reason agrees with them
        assert 1 <= r["tokens"] <= r["max_tokens"] and r["prompt_tokens"] >= r["prompt_len"]
        assert r["finish_reason"] == ("length" if r["tokens"] == r["max_tokens"] else "stop")
        assert 0 < r["ttft"] <= r["e2e"]
    assert v["output_tokens"] == sum(r["tokens"] for r in v["per_request"]) and v["output_tokens_per_s"] > 0
    for cls in ("short", "long"):
        assert v[cls]["n_ok"] == 3 and {"p50", "p99"} <= set(v[cls]["ttft"]) and {"p50", "p99"} <= set(v[cls]["e2e"])
    assert res["plots"] == ["cdf_short_e2e.png", "timeline-hf.png"]
    for p in res["plots"]:
        assert (tmp_path / p).stat().st_size > 1000, p
    log = (tmp_path / "server-hf.log").read_text()
    assert "Uvicorn running" in log or "Application startup complete" in log
    report = (tmp_path / "report.md").read_text()
    assert "refused ignore_eos" in report and "no /metrics" in report and f"model `{tiny_hf_checkpoint}`" in report
    with pytest.raises(OSError):  # stopped after its turn
        socket.create_connection(("127.0.0.1", int(v["url"].rsplit(":", 1)[1])), timeout=2)
