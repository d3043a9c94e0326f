"""The periodic stats log (metrics.LoggingStatLogger, vLLM's): driven with known counter
deltas and a fake clock, so every figure on the line is known exactly; and the server's
--disable-log-stats, which turns it off."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

import cli_args
import server
from metrics import EngineStats, LoggingStatLogger


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[tuple[int, str]]:
        out = [(r.levelno, r.getMessage()) for r in self.records]
        self.records.clear()
        return out


@pytest.fixture
def logger() -> tuple[logging.Logger, Lines]:
    lg = logging.getLogger("taxirank.test_stats_log")
    lg.setLevel(logging.DEBUG)
    lines = Lines()
    lg.addHandler(lines)
    yield lg, lines
    lg.removeHandler(lines)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_line_reports_each_intervals_deltas_and_the_gauges_as_vllms(logger):
    lg, lines = logger
    stats, clock = EngineStats(), Clock()
    stats.prompt_tokens, stats.generation_tokens = 500, 70  # before the logger: not in its interval
    stat_logger = LoggingStatLogger(stats, lg, clock)

    # 10 s: 1234 prompt tokens computed (vLLM's throughput: the 120 the cache held are not
    # counted), 456 generated, 3 preemptions, 2 requests looked up 300 tokens, 120 hit
    clock.now += 10.0
    stats.prompt_tokens += 1354
    stats.prompt_tokens_cached += 120
    stats.generation_tokens += 456
    stats.num_preemptions += 3
    stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits = 2, 300, 120
    stats.num_requests_running, stats.num_requests_waiting, stats.kv_cache_usage = 4, 7, 0.4567
    stat_logger.log()
    assert lines.take() == [(logging.INFO, "Engine 000: Avg prompt throughput: 123.4 tokens/s, Avg generation "
                             "throughput: 45.6 tokens/s, Running: 4 reqs, Waiting: 7 reqs, Preemptions: 3, GPU KV "
                             "cache usage: 45.7%, Prefix cache hit rate: 40.0%")]

    # 4 s: decode only, no preemption (the field leaves), 1 request with 100 tokens all hit:
    # the window holds both intervals, 220 / 400
    clock.now += 4.0
    stats.generation_tokens += 10
    stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits = 3, 400, 220
    stats.num_requests_running, stats.num_requests_waiting, stats.kv_cache_usage = 1, 0, 0.0
    stat_logger.log()
    assert lines.take() == [(logging.INFO, "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                             "throughput: 2.5 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: "
                             "0.0%, Prefix cache hit rate: 55.0%")]

    # idle after activity: still INFO (the interval before was not idle); then DEBUG, as vLLM's
    for level in (logging.INFO, logging.DEBUG, logging.DEBUG):
        clock.now += 10.0
        stat_logger.log()
        assert lines.take() == [(level, "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                 "throughput: 0.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: "
                                 "0.0%, Prefix cache hit rate: 55.0%")]
    # no time passed: no rate rather than a division by zero
    stats.generation_tokens += 5
    stat_logger.log()
    assert "Avg generation throughput: 0.0 tokens/s" in lines.take()[0][1]


def test_the_prefix_cache_hit_rate_covers_the_most_recent_requests():
    """vLLM's CachingMetrics rule, by interval: the oldest intervals leave while the window
    holds more than max_recent_requests requests (the newest always stays)."""
    stats, clock = EngineStats(), Clock()
    stat_logger = LoggingStatLogger(stats, logging.getLogger("taxirank.test_stats_log.quiet"), clock,
                                    max_recent_requests=10)
    rate = lambda: stat_logger.window_hits / stat_logger.window_queries  # noqa: E731
    # per interval: (requests, queries, hits, prefix cache resets) looked up, and the window's rate after it
    for requests, queries, hits, resets, want in ((6, 100, 100, 0, 1.0),  # window: 6 requests
                                                  (0, 0, 0, 0, 1.0),      # nothing looked up: kept as it was
                                                  (4, 100, 0, 0, 0.5),    # 10 requests: both stay
                                                  (1, 100, 50, 0, 0.25),  # 11: the first interval leaves
                                                  (20, 100, 10, 0, 0.1),  # over the limit alone: only it stays
                                                  (1, 10, 9, 0, 0.9),     # 21: the 20 leave
                                                  (1, 10, 10, 1, 1.0)):   # the cache was reset: the window restarts
        clock.now += 10.0
        stats.prefix_cache_requests += requests
        stats.prefix_cache_queries += queries
        stats.prefix_cache_hits += hits
        stats.prefix_cache_resets += resets
        stat_logger.log()
        assert rate() == pytest.approx(want)


def test_speculative_decoding_adds_vllms_acceptance_line_for_intervals_that_verified_drafts(logger):
    lg, lines = logger
    stats, clock = EngineStats(), Clock()
    stats.spec_decode_num_accepted_tokens_per_pos = [0, 0, 0]  # k = 3 (startup sets it)
    stat_logger = LoggingStatLogger(stats, lg, clock)
    # 5 s: 4 proposals of 3 tokens; accepted 3, 2, 1 and 0 of them
    clock.now += 5.0
    stats.generation_tokens += 4 + 6
    stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens = 4, 12, 6
    stats.spec_decode_num_accepted_tokens_per_pos = [3, 2, 1]
    stat_logger.log()
    assert lines.take()[1] == (logging.INFO, "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted "
                               "throughput: 1.20 tokens/s, Drafted throughput: 2.40 tokens/s, Accepted: 6 tokens, "
                               "Drafted: 12 tokens, Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft "
                               "acceptance rate: 50.0%")
    clock.now += 10.0  # no proposal verified: the stats line alone
    stats.generation_tokens += 1
    stat_logger.log()
    assert [m.split(":")[0] for _, m in lines.take()] == ["Engine 000"]


def fake_engine() -> SimpleNamespace:
    """What build_app reads of an AsyncEngine, without a model."""
    return SimpleNamespace(model_name="fake", stats=EngineStats(), tokenizer=None,
                           config=SimpleNamespace(reasoning_parser=None, speculative_config=None))


@pytest.mark.parametrize("flags", [[], ["--disable-log-stats"]])
def test_the_server_logs_stats_unless_disable_log_stats(flags, monkeypatch):
    """vLLM's default is on; the flag leaves no stats logger and no logging task."""
    from aiohttp.test_utils import TestServer

    monkeypatch.setattr(server, "LOG_STATS_INTERVAL", 0.0)  # a line at every turn of the event loop
    args = cli_args.build_parser().parse_args(flags)
    assert args.disable_log_stats == bool(flags)
    lines = Lines()
    server.log.addHandler(lines)
    monkeypatch.setattr(server.log, "level", logging.DEBUG)

    async def main() -> None:
        app = server.app_from_args(fake_engine(), args)
        assert (app["stat_logger"] is None) == bool(flags)
        async with TestServer(app):
            for _ in range(100):  # the logging task's turns, when it runs
                await asyncio.sleep(0)
        stats_lines = [r for r in lines.records if r.getMessage().startswith("Engine 000: Avg prompt throughput")]
        assert bool(stats_lines) != bool(flags)

    try:
        asyncio.run(main())
    finally:
        server.log.removeHandler(lines)


def test_a_failing_interval_is_logged_and_the_next_one_still_logs(monkeypatch):
    """An exception from the stats logger is logged with its traceback, and the task goes
    on: the next interval's line comes."""
    from aiohttp.test_utils import TestServer

    monkeypatch.setattr(server, "LOG_STATS_INTERVAL", 0.0)
    lines = Lines()
    server.log.addHandler(lines)
    monkeypatch.setattr(server.log, "level", logging.DEBUG)
    calls = []

    async def main() -> None:
        app = server.app_from_args(fake_engine(), cli_args.build_parser().parse_args([]))
        real_log = app["stat_logger"].log

        def log_once_failing() -> None:
            calls.append(len(calls))
            if len(calls) == 1:
                raise RuntimeError("stats went wrong")
            real_log()

        app["stat_logger"].log = log_once_failing
        async with TestServer(app):
            for _ in range(100):  # the logging task's turns
                await asyncio.sleep(0)
                if len(calls) >= 3:
                    break

    try:
        asyncio.run(main())
    finally:
        server.log.removeHandler(lines)
    assert len(calls) >= 3, calls
    errors = [r for r in lines.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info and "stats went wrong" in str(errors[0].exc_info[1])
    after = lines.records[lines.records.index(errors[0]) + 1:]
    assert any(r.getMessage().startswith("Engine 000: Avg prompt throughput") for r in after)


@pytest.mark.parametrize("flags", [[], ["--enable-log-requests", "--max-log-len", "2"]])
def test_the_server_logs_each_request_only_with_enable_log_requests(flags, monkeypatch):
    """vLLM's default is off; on, each request's id and parameters at info, its prompt's
    first --max-log-len token ids at debug."""
    from conftest import tiny_async_engine

    args = cli_args.build_parser().parse_args(flags)
    lines = Lines()
    server.log.addHandler(lines)
    monkeypatch.setattr(server.log, "level", logging.DEBUG)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}

    async def main(engine) -> str:
        from aiohttp.test_utils import TestClient, TestServer

        async with TestClient(TestServer(server.app_from_args(engine, args))) as c:
            resp = await c.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
            return (await resp.json())["id"]

    try:
        with tiny_async_engine() as (loop, engine):
            rid = loop.run_until_complete(main(engine))
    finally:
        server.log.removeHandler(lines)
    logged = [(r.levelno, r.getMessage()) for r in lines.records if rid in r.getMessage()]
    if not flags:
        assert logged == []
        return
    assert logged[0] == (logging.DEBUG, f"Request {rid} details: prompt_token_ids: [5, 6].")
    assert logged[1][0] == logging.INFO and logged[1][1].startswith(f"Received request {rid}: params: SamplingParams(")
    assert "max_tokens=2" in logged[1][1] and len(logged) == 2


def test_max_log_len_is_checked_where_it_enters(capsys):
    with pytest.raises(SystemExit):
        cli_args.build_parser().parse_args(["--max-log-len", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


def test_the_engine_counts_the_prefix_cache_resets_that_emptied_it():
    from llm import LLM, SamplingParams

    llm = LLM("tiny", max_num_seqs=2, max_model_len=64, num_kv_blocks=16, warmup=False, log=lambda *_: None)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
    assert llm.reset_prefix_cache() and llm.stats.prefix_cache_resets == 1
    assert llm.stats.prefix_cache_requests == 1 and llm.stats.prefix_cache_queries == 4
