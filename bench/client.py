"""One OpenAI client for every bench: completions timed per token (streamed) or per request,
the probe that finds what a server takes before the workload runs (docs/BENCHMARKS.md), a
server subprocess, and what the server's Prometheus /metrics say meanwhile.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import signal
import socket
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from workload import Request

PROBE_TOKENS = 8
HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the run's start."""

    cls: str  # "short" | "long"
    max_tokens: int
    prompt_len: int  # token ids, or words for a text prompt
    start: float = 0.0
    ttft: float | None = None  # None when not streamed
    e2e: float | None = None
    tokens: int = 0  # from usage when the server sent it, else counted from the stream
    tokens_from_usage: bool = False
    prompt_tokens: int | None = None  # from usage only
    chunks: int = 0  # streamed chunks that carried text or tokens
    text: str = ""
    finish_reason: str | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class Capabilities:
    """What a server took in the probe, and so how each request is sent and timed."""

    model: str | None = None  # the name its /v1/models gives (None: the field is left out)
    prompts: str = "text"  # "text" | "ids"
    stream: bool = True  # False: one JSON response per request, e2e and usage only
    ignore_eos: bool = False  # sent with every request (vLLM extension)
    include_usage: bool = False  # stream_options.include_usage sent
    usage: bool = False  # the server's answer carried usage in the probe
    logprobs: bool = False  # logprobs=0 sent, to time tokens that decode to no text
    timing: str = "chunks"  # "text" | "logprobs" (one chunk per token) | "chunks" (per chunk) | "none"
    metrics: bool = False  # /metrics answered with a series the bench knows
    refused: dict[str, str] = field(default_factory=dict)  # field -> the server's answer

    def body(self, req: Request, max_tokens: int | None = None) -> dict[str, Any]:
        """The request body for `req` as this server takes it (greedy)."""
        optional = {"model": self.model or None,
                    "stream_options": {"include_usage": True} if self.include_usage else None,
                    "ignore_eos": True if self.ignore_eos else None, "logprobs": 0 if self.logprobs else None}
        return {"prompt": req.prompt_token_ids if self.prompts == "ids" else req.prompt_text,
                "max_tokens": max_tokens or req.max_tokens, "temperature": 0.0, "stream": self.stream} | {
            k: v for k, v in optional.items() if v is not None}


class Refused(RuntimeError):
    """The server refuses what the workload cannot do without (its prompts)."""


def _error_text(err: Any) -> str:
    return str(err.get("message", err) if isinstance(err, dict) else err)[:300]


async def complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timing: str, t0: float,
                   rec: Record) -> Record:
    """POST one completion; record its text, finish reason, usage and e2e, and, streamed, when
    each token arrived: `timing` "logprobs" counts a chunk's logprob tokens, "text" one token
    per chunk with text, "chunks" one per non-empty chunk (approximate)."""
    rec.start = time.perf_counter() - t0
    last, usage = None, None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return rec
            if not body.get("stream"):
                data = await r.json(content_type=None)
                rec.e2e = time.perf_counter() - t0 - rec.start
                choice = (data.get("choices") or [{}])[0]
                rec.text, rec.finish_reason = choice.get("text") or "", choice.get("finish_reason")
                usage = data.get("usage")
                if "error" in data:
                    rec.error = _error_text(data["error"])
                elif not usage:
                    rec.error = "the response carries no usage: its output tokens cannot be counted"
            else:
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    now = time.perf_counter() - t0
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        rec.error = _error_text(chunk["error"])
                        continue
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        text, lp = choice.get("text") or "", choice.get("logprobs")
                        n = len(lp["tokens"]) if timing == "logprobs" and lp and lp.get("tokens") else int(bool(text))
                        rec.text += text
                        if n:
                            if last is None:
                                rec.ttft = now - rec.start
                            elif timing == "chunks":
                                rec.itl.append(now - last)
                            else:  # a chunk of n tokens: its gap shared among them
                                rec.itl += [(now - last) / n] * n
                            last, rec.tokens, rec.chunks = now, rec.tokens + n, rec.chunks + 1
                        if choice.get("finish_reason"):
                            rec.e2e, rec.finish_reason = now - rec.start, choice["finish_reason"]
    except (*HTTP_ERRORS, ValueError, AttributeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if usage and usage.get("completion_tokens") is not None:
        rec.tokens, rec.tokens_from_usage = int(usage["completion_tokens"]), True
        rec.prompt_tokens = usage.get("prompt_tokens")
    if rec.error is None and (rec.e2e is None or rec.finish_reason is None):
        rec.error = "the answer ended without a finish_reason"
    return rec


async def probe(session: aiohttp.ClientSession, url: str, req: Request, *, prompts: str, extensions: bool,
                stream: bool = True) -> Capabilities:
    """Find what this server takes, with short greedy requests (which also warm it up): first
    all it wants (stream_options.include_usage when streaming, ignore_eos when `extensions`);
    on a 4xx none of them, then one at a time, so a refused field is named and the others kept.
    Raises `Refused` when even the bare request fails (token-id prompts, or a broken server)."""
    words = (req.prompt_text or "").split()[:PROBE_TOKENS]
    req = Request(req.prompt_token_ids[:PROBE_TOKENS], PROBE_TOKENS, " ".join(words) if words else None)
    caps = Capabilities(prompts=prompts, stream=stream)
    with suppress(*HTTP_ERRORS, ValueError, AttributeError):  # the first model /v1/models names (None: none)
        async with session.get(url + "/v1/models") as r:
            data = ((await r.json(content_type=None)).get("data") or [{}]) if r.status == 200 else [{}]
        caps.model = data[0].get("id") if isinstance(data[0], dict) else None
    with suppress(*HTTP_ERRORS, UnicodeDecodeError):
        async with session.get(url + "/metrics") as r:
            known = parse_metrics(await r.text()) if r.status == 200 else {}  # any series the timeline knows?
            caps.metrics = any(n in known for names in METRIC_ALIASES.values() for n in names)
    wanted = (["include_usage"] if stream else []) + (["ignore_eos"] if extensions else [])

    async def attempt(timing: str = "text", **kw: bool) -> Record:
        c = Capabilities(model=caps.model, prompts=prompts, stream=stream, **kw)
        return await complete(session, url, c.body(req, PROBE_TOKENS), timing, time.perf_counter(),
                              Record("probe", PROBE_TOKENS, 0))

    rec = await attempt(**{w: True for w in wanted})
    if rec.error:
        bare = await attempt()
        if bare.error:
            what = "token-id prompts" if prompts == "ids" else "a plain text completion"
            raise Refused(f"the server refuses {what}: {bare.error}")
        rec, kept = bare, {}
        for w in wanted:
            one = await attempt(**kept, **{w: True})
            if one.error:
                caps.refused[w] = one.error
            else:
                rec, kept = one, kept | {w: True}
        wanted = list(kept)
    caps.include_usage, caps.ignore_eos = "include_usage" in wanted, "ignore_eos" in wanted
    caps.usage = rec.tokens_from_usage
    # Token timing: one text chunk per token (what usage counts) is exact. Otherwise some
    # tokens came without text (random weights) or merged: logprobs=0 makes a server send
    # each token's entry. Without usage no count can be checked, so chunks it is.
    if not stream:
        caps.timing = "none"
    elif caps.usage and rec.tokens > 1 and rec.chunks == rec.tokens:
        caps.timing = "text"
    elif caps.usage:
        lp = await attempt("logprobs", include_usage=caps.include_usage, ignore_eos=caps.ignore_eos, logprobs=True)
        if lp.error:
            caps.refused["logprobs"] = lp.error
        elif lp.tokens > 1 and len(lp.itl) + 1 == lp.tokens:
            caps.logprobs, caps.timing = True, "logprobs"
    return caps


# ---- a server subprocess -------------------------------------------------------------------

class Server:
    """A server as a subprocess (its own session, so stopping it stops its children too) on a free
    loopback port, put for {port} in its argv; its log to a file."""

    def __init__(self, argv: list[str], log_path: str, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.log_path, self.url = log_path, f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        try:
            self.proc = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError:
            self._log.close()
            raise

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float) -> float:
        """Seconds until /health (or, for servers without it, /v1/models) answers 200."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                with open(self.log_path, errors="replace") as f:
                    raise RuntimeError(f"the server exited with {self.proc.returncode} while starting: "
                                       f"{f.read()[-1500:]}")
            for path in ("/health", "/v1/models"):
                try:
                    async with session.get(self.url + path) as r:
                        if r.status == 200:
                            return time.perf_counter() - t0
                except HTTP_ERRORS:
                    break  # not listening yet
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f}s (see {self.log_path})")

    def cpu_seconds(self) -> float | None:
        """The CPU time so far of the server's session (Linux): its process and every process it
        started (a launcher may serve from a child, as `transformers serve` does), beside the wall
        time, how much of the machine it got."""
        ticks, found = 0, False
        for path in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(path) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == self.proc.pid:  # its session (start_new_session: it leads one)
                    ticks += sum(int(x) for x in fields[11:15])  # utime, stime and its reaped children's
                    found = True
            except (OSError, ValueError, IndexError):
                continue
        return ticks / os.sysconf("SC_CLK_TCK") if found else None

    def stop(self, grace_s: float = 0.0) -> None:
        """SIGTERM to the process alone first when `grace_s` (a launcher that shuts its
        children down in order), then to its whole session."""
        if grace_s and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


# ---- what the server's /metrics say ----------------------------------------------------------

SAMPLE_PERIOD_S = 0.1  # /metrics every 100 ms

# What each timeline series is called by the servers we know (taxirank, vLLM, SGLang, TGI,
# llama.cpp): first name found wins. vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc.
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "running": ("taxirank:num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs",
                "tgi_batch_current_size", "llamacpp:requests_processing"),
    "waiting": ("taxirank:num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs",
                "tgi_queue_size", "llamacpp:requests_deferred"),
    "kv_usage": ("taxirank:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "sglang:token_usage", "llamacpp:kv_cache_usage_ratio"),
    "preemptions": ("taxirank:num_preemptions_total", "vllm:num_preemptions_total"),
    "num_kv_blocks": ("taxirank:num_kv_blocks",),
}
WAITING_BY_REASON = "taxirank:num_requests_waiting_by_wait_reason"
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')  # a comment line never matches
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}; labelled samples also as 'name{k=v,...}', and summed under
    the bare name (vLLM labels by model_name, a Ray app by replica). Read line by line, with a
    regex rather than prometheus_client's parser: a line it cannot read costs only itself, and a
    scrape ten times a second costs the client a sixth of the parser's time."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if labels:
            out[name + "{" + ",".join(f"{k}={x}" for k, x in _LABEL.findall(labels)) + "}"] = v
        out[name] = out.get(name, 0.0) + v if labels else v
    return out


def pick(metrics: dict[str, float]) -> dict[str, Any]:
    """One timeline sample: the series METRIC_ALIASES names, plus waiting by reason."""
    s: dict[str, Any] = {key: next((metrics[n] for n in names if n in metrics), None)
                         for key, names in METRIC_ALIASES.items()}
    s["waiting_by_reason"] = by_reason = {}
    for key, v in metrics.items():  # the reason label wherever it stands (model_name, replica beside it)
        if key.startswith(WAITING_BY_REASON + "{"):
            labels = dict(kv.split("=", 1) for kv in key[len(WAITING_BY_REASON) + 1:-1].split(",") if "=" in kv)
            if "reason" in labels:
                by_reason[labels["reason"]] = by_reason.get(labels["reason"], 0.0) + v
    return s


async def sample_metrics(session: aiohttp.ClientSession, url: str, t0: float, samples: list[dict],
                         stop: asyncio.Event) -> None:
    """GET /metrics every SAMPLE_PERIOD_S until `stop`, then once more."""
    while True:
        t = time.perf_counter()
        with suppress(aiohttp.ClientError):
            async with session.get(url + "/metrics") as r:
                if r.status == 200:
                    samples.append({"t": t - t0} | pick(parse_metrics(await r.text())))
        if stop.is_set():
            return
        with suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_PERIOD_S - (time.perf_counter() - t)))


def server_view(samples: list[dict]) -> dict[str, Any]:
    """The /metrics samples as a timeline of columns (preemptions counted from the first sample),
    and its figures: peaks, request-seconds spent waiting, by reason."""
    tl: dict[str, Any] = {"t": [round(s["t"], 3) for s in samples]} | {
        key: [s[key] for s in samples] for key in ("running", "waiting", "kv_usage")}
    p0 = next((s["preemptions"] for s in samples if s["preemptions"] is not None), None)
    tl["preemptions"] = [None if s["preemptions"] is None else s["preemptions"] - p0 for s in samples]
    reasons = sorted({r for s in samples for r in s["waiting_by_reason"]})
    tl["waiting_by_reason"] = {r: [s["waiting_by_reason"].get(r, 0.0) for s in samples] for r in reasons}
    vals = {k: [v for v in tl[k] if v is not None] for k in ("running", "waiting", "kv_usage", "preemptions")}
    dt = [b - a for a, b in zip(tl["t"], tl["t"][1:])] + [0.0]
    by_reason = {r: round(sum(n * d for n, d in zip(col, dt)), 2) for r, col in tl["waiting_by_reason"].items()}
    return {"metrics": {
        "samples": len(samples),
        "series": [k for k, v in vals.items() if v] + (["waiting_by_reason"] if by_reason else []),
        "num_kv_blocks": next((s["num_kv_blocks"] for s in samples if s["num_kv_blocks"] is not None), None),
        "max_running": max(vals["running"], default=None), "max_kv_usage": max(vals["kv_usage"], default=None),
        "preemptions": vals["preemptions"][-1] if vals["preemptions"] else None,
        "waiting_request_s": round(sum((w or 0.0) * d for w, d in zip(tl["waiting"], dt)), 2),
        "waiting_by_reason_s": by_reason,
        "dominant_wait_reason": max(by_reason, key=by_reason.get) if any(by_reason.values()) else None},
        "timeline": tl}
