"""One OpenAI client for every bench: streaming completions timed per token, the probe that
finds what a server takes (token-id prompts, ignore_eos, stream_options, usage) before the
workload runs, and a server subprocess. Why the probe: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from workload import Request

PROBE_TOKENS = 8


@dataclass
class Record:
    """One request as the client saw it; times in seconds from the run's start."""

    cls: str  # "short" | "long"
    max_tokens: int
    prompt_len: int  # token ids, or words for a text prompt
    start: float = 0.0
    ttft: float | None = None
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
    ignore_eos: bool = False  # sent with every request (vLLM extension)
    include_usage: bool = False  # stream_options.include_usage sent
    usage: bool = False  # the server's stream carried usage in the probe
    logprobs: bool = False  # logprobs=0 sent, to time tokens that decode to no text
    timing: str = "chunks"  # "text" | "logprobs" (one chunk per token) | "chunks" (per chunk)
    metrics: bool = False  # /metrics answered with a series the bench knows
    refused: dict[str, str] = field(default_factory=dict)  # field -> the server's answer

    def body(self, req: Request, max_tokens: int | None = None) -> dict[str, Any]:
        """The request body for `req` as this server takes it (greedy, streamed)."""
        prompt = req.prompt_token_ids if self.prompts == "ids" else req.prompt_text
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens or req.max_tokens, "temperature": 0.0,
                                "stream": True}
        if self.model:
            body["model"] = self.model
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.logprobs:
            body["logprobs"] = 0
        return body


class Refused(RuntimeError):
    """The server refuses what the workload cannot do without (its prompts)."""


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timing: str, t0: float,
                     rec: Record) -> Record:
    """POST one streaming completion; record when each token (or chunk) arrived, its text,
    and the usage the server reports. `timing` "logprobs" counts a chunk's logprob tokens,
    "text" one token per chunk with text, "chunks" one per non-empty chunk (approximate)."""
    rec.start = time.perf_counter() - t0
    last, usage = None, None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return rec
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    err = chunk["error"]
                    rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
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
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if usage and usage.get("completion_tokens") is not None:
        rec.tokens, rec.tokens_from_usage = int(usage["completion_tokens"]), True
        rec.prompt_tokens = usage.get("prompt_tokens")
    if rec.error is None and rec.e2e is None:
        rec.error = "the stream ended without a finish_reason"
    return rec


async def served_model(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The first entry of /v1/models ({} when the server has none to give)."""
    try:
        async with session.get(url + "/v1/models") as r:
            if r.status != 200:
                return {}
            data = (await r.json(content_type=None)).get("data") or [{}]
            return data[0] if isinstance(data[0], dict) else {}
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        return {}


async def has_metrics(session: aiohttp.ClientSession, url: str, known: Any) -> bool:
    """Whether GET /metrics answers 200 with a series `known(text)` recognises."""
    try:
        async with session.get(url + "/metrics") as r:
            return r.status == 200 and known(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError):
        return False


async def probe(session: aiohttp.ClientSession, url: str, req: Request, *, prompts: str, extensions: bool,
                metrics_known: Any) -> Capabilities:
    """Find what this server takes, with short greedy requests (which also warm it up).

    Asks first with all it wants (stream_options.include_usage, and ignore_eos when
    `extensions`); on a 4xx, it asks with none of them, then adds one at a time, so a
    refused field is named and the others are kept. Raises `Refused` when even the bare
    request fails (token-id prompts refused, or the server is broken)."""
    words = (req.prompt_text or "").split()[:PROBE_TOKENS]
    req = Request(req.prompt_token_ids[:PROBE_TOKENS], PROBE_TOKENS, " ".join(words) if words else None)
    info = await served_model(session, url)
    caps = Capabilities(model=info.get("id"), prompts=prompts)
    caps.metrics = await has_metrics(session, url, metrics_known)
    wanted = ["include_usage"] + (["ignore_eos"] if extensions else [])

    async def attempt(**kw: bool) -> Record:
        c = Capabilities(model=caps.model, prompts=prompts, **kw)
        return await stream_one(session, url, c.body(req, PROBE_TOKENS), "text", time.perf_counter(),
                                Record("probe", PROBE_TOKENS, 0))

    rec = await attempt(**{w: True for w in wanted})
    if rec.error:
        bare = await attempt()
        if bare.error:
            what = "token-id prompts" if prompts == "ids" else "a plain streamed text completion"
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
    if caps.usage and rec.tokens > 1 and rec.chunks == rec.tokens:
        caps.timing = "text"
    elif caps.usage:
        c = Capabilities(model=caps.model, prompts=prompts, include_usage=caps.include_usage,
                         ignore_eos=caps.ignore_eos, logprobs=True)
        lp = await stream_one(session, url, c.body(req, PROBE_TOKENS), "logprobs", time.perf_counter(),
                              Record("probe", PROBE_TOKENS, 0))
        if lp.error:
            caps.refused["logprobs"] = lp.error
        elif lp.tokens > 1 and len(lp.itl) + 1 == lp.tokens:
            caps.logprobs, caps.timing = True, "logprobs"
    return caps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server as a subprocess (its own session, so stopping it stops its children too) on a
    loopback `port` the caller picked; its log to a file."""

    def __init__(self, argv: list[str], port: int, log_path: str, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.port, self.argv, self.log_path = port, argv, log_path
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        try:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
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
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    break  # not listening yet
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f}s (see {self.log_path})")

    def cpu_seconds(self) -> float | None:
        """The process's CPU time so far (Linux): beside the wall time, how much of the machine
        it got, which shows when something else competed for the cores."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
