"""Online bench: the seed's exercise against an OpenAI-compatible server.

    python bench/mixed.py                      # start taxirank servers (bench model, CPU), every variant
    python bench/mixed.py --quick              # a smaller mix and lengths: 5-10 minutes on 2 cores
    python bench/mixed.py --url http://host:8000 --vocab-size 128256   # measure a running server (any)

Workload (fixed seed): --num-requests requests (default 100), half max_tokens=--short (16),
half --long (512), shuffled, prompts of --prompt-len random token ids (32,256), greedy,
ignore_eos (so output lengths are exact), streamed. All sent at once (a burst), or as a
Poisson process with --rate. Per request class (short / long): TTFT, inter-token latency,
end-to-end latency; output tokens/s overall. While it runs, /metrics is sampled ~10x a
second: running, waiting (and by reason), KV usage, preemptions (taxirank's names, else
vLLM's, SGLang's, TGI's or llama.cpp's where the server has them).

Variants (each one a taxirank server started with its flags, one at a time):
  continuous, static        max_num_seqs 32, max_model_len 2048, the server's default KV cache
  <mode>/full, <mode>/half  continuous under each KV admission mode (on-demand, reserve,
                            reserve-max-len) at max_model_len 2048 and 1024, all with the same
                            tight KV budget (--kv-budget-seqs 8 sequences of 2048 tokens = 1024
                            blocks of 16): the seed's "rerun with --max-model-len cut in half".
With --url, one variant: whatever that server runs.

Writes to --out (default bench/results/<timestamp>/): results.json, report.md (the table,
the answer to the seed's question, the settings, the machine), cdf_short_e2e.png,
timeline-<variant>.png, and each server's log.

Duration (bench model, 2 idle CPU cores): each variant runs 1-2 minutes, plus its server's
start: ~15 s, or 1-2 minutes where the warm-up compiles a new set of shapes (cached across
variants and runs in --jax-cache). The default run takes 10-20 minutes, --quick 5-10; a
busy machine takes longer (and skews the timings: see the report's "server cores").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Request, machine_info, seed_mix, summarize  # noqa: E402
from mixed_report import analyze, print_table, write_plots, write_report  # noqa: E402

ADMISSION_MODES = ("on-demand", "reserve", "reserve-max-len")
BUILTIN_VOCAB = {"tiny": 512, "bench": 32000}
SAMPLE_PERIOD_S = 0.1  # /metrics every 100 ms

# What each timeline series is called by the servers we know: first name found wins.
# (vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; both are 0..1.)
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
WAITING_BY_REASON = "taxirank:num_requests_waiting_by_reason"


@dataclass
class Variant:
    name: str  # also a file-name part: letters, digits, '-' and '_' (a '/' becomes '-')
    flags: dict[str, Any] = field(default_factory=dict)  # server flags (EngineConfig fields)
    admission: str | None = None  # the (3) comparison: KV admission mode ...
    length: str | None = None  # ... and "full" or "half" max_model_len


def build_variants(args: argparse.Namespace) -> list[Variant]:
    """(1) continuous, (2) static, (3) each admission mode at full and half max_model_len,
    under one tight KV budget: --kv-budget-seqs sequences of the full length."""
    full, half = args.max_model_len, args.max_model_len // 2
    base = {"model": args.model, "max_num_seqs": args.max_num_seqs, "max_model_len": full,
            "block_size": args.block_size}
    budget = args.kv_budget_seqs * math.ceil(full / args.block_size) + 1  # + the null block
    out = [Variant("continuous", base | {"scheduling": "continuous"}),
           Variant("static", base | {"scheduling": "static"})]
    for mode in ADMISSION_MODES:
        for length, mml in (("full", full), ("half", half)):
            out.append(Variant(f"{mode}/{length}", base | {"kv_admission": mode, "max_model_len": mml,
                                                            "num_kv_blocks": budget}, mode, length))
    if args.variants:
        keep = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(keep) - {v.name for v in out})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {[v.name for v in out]}")
        out = [v for v in out if v.name in keep]
    return out


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    argv = []
    for k, v in flags.items():
        opt = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv.append(opt if v else "--no-" + k.replace("_", "-"))
        elif v is not None:
            argv += [opt, str(v)]
    return argv


def vocab_size_of(model: str) -> int:
    if model in BUILTIN_VOCAB:
        return BUILTIN_VOCAB[model]
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 32000


# ---- the server under test ---------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """taxirank's server.py as a subprocess on a free loopback port; its log to a file."""

    def __init__(self, variant: Variant, extra_argv: list[str], log_path: str, jax_cache: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, os.path.join(ROOT, "server.py"), "--host", "127.0.0.1", "--port", str(self.port),
                     *flags_to_argv(variant.flags), *extra_argv]
        env = dict(os.environ)
        if jax_cache:  # warm-up compiles once per set of shapes, not once per variant
            env |= {"JAX_COMPILATION_CACHE_DIR": jax_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting: "
                                   f"{tail(self.log_path)}")
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {timeout:.0f}s (see {self.log_path})")

    def cpu_seconds(self) -> float | None:
        """The server process's CPU time so far (Linux): with wall time, how much of the
        machine it got, which shows when something else was competing for the cores."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def tail(path: str, n: int = 1500) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


# ---- metrics -----------------------------------------------------------------------

_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}; labelled samples also as 'name{k=v,...}'. Labelled
    samples of one name are summed under the bare name (vLLM labels by model_name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if labels:
            out[name + "{" + ",".join(f"{k}={x}" for k, x in _LABEL.findall(labels)) + "}"] = v
            out[name] = out.get(name, 0.0) + v
        else:
            out[name] = v
    return out


def pick(metrics: dict[str, float]) -> dict[str, Any]:
    """One timeline sample: the series METRIC_ALIASES names, plus waiting by reason."""
    s: dict[str, Any] = {}
    for key, names in METRIC_ALIASES.items():
        s[key] = next((metrics[n] for n in names if n in metrics), None)
    prefix = WAITING_BY_REASON + "{reason="
    s["waiting_by_reason"] = {k[len(prefix):-1]: v for k, v in metrics.items() if k.startswith(prefix)}
    return s


async def sample_metrics(session: aiohttp.ClientSession, url: str, t0: float, samples: list[dict],
                         stop: asyncio.Event) -> None:
    """GET /metrics every SAMPLE_PERIOD_S until `stop`, then once more."""
    while True:
        t = time.perf_counter()
        try:
            async with session.get(url + "/metrics") as r:
                if r.status == 200:
                    samples.append({"t": t - t0} | pick(parse_metrics(await r.text())))
        except aiohttp.ClientError:
            pass
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, SAMPLE_PERIOD_S - (time.perf_counter() - t)))
        except asyncio.TimeoutError:
            pass


# ---- the client --------------------------------------------------------------------

@dataclass
class Record:
    """One request as the client saw it; times in seconds from the variant's start."""

    cls: str  # "short" | "long"
    max_tokens: int
    prompt_len: int
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None


async def stream_one(session: aiohttp.ClientSession, url: str, model: str | None, req: Request,
                     timing: str, t0: float, rec: Record) -> Record:
    """POST one streaming completion; record when each token arrived."""
    body: dict[str, Any] = {"prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if timing == "logprobs":
        body["logprobs"] = 0
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
                    rec.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    continue
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    lp = choice.get("logprobs")
                    n = len(lp["tokens"]) if timing == "logprobs" and lp else int(bool(choice.get("text")))
                    if n:
                        if last is None:
                            rec.ttft = now - rec.start
                        else:  # a chunk of n tokens: its gap shared among them
                            rec.itl += [(now - last) / n] * n
                        last, rec.tokens = now, rec.tokens + n
                    if choice.get("finish_reason"):
                        rec.e2e = now - rec.start
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    if usage and usage.get("completion_tokens") is not None:
        rec.tokens = usage["completion_tokens"]
    if rec.error is None and rec.e2e is None:
        rec.error = "the stream ended without a finish_reason"
    return rec


async def probe(session: aiohttp.ClientSession, url: str, model: str | None, req: Request) -> str:
    """How to time tokens on this server (and a warm-up request): "text" when every token
    arrives as a chunk with text; "logprobs" when some tokens decode to no text (random
    weights: most ids of the bench model's vocabulary have none) and asking for logprobs=0
    makes the server send each one; "chunks" (approximate) otherwise."""
    req = Request(req.prompt_token_ids[:8], 8)
    for timing in ("text", "logprobs"):
        rec = await stream_one(session, url, model, req, timing, time.perf_counter(), Record("probe", 8, 8))
        if rec.error:
            raise RuntimeError(f"probe request failed: {rec.error}")
        if rec.tokens == 8 and len(rec.itl) == 7:
            return timing
    return "chunks"


async def served_model(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    try:
        async with session.get(url + "/v1/models") as r:
            data = (await r.json()).get("data") or [{}]
            return data[0]
    except (aiohttp.ClientError, ValueError):
        return {}


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    """0 for a burst; else a Poisson process of `rate` requests/s (first at 0)."""
    if not rate:
        return [0.0] * n
    rng, t, out = random.Random(seed + 2), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_variant(session: aiohttp.ClientSession, url: str, model: str | None, requests: list[Request],
                      args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Send the workload, sample /metrics meanwhile; the variant's figures."""
    timing = await probe(session, url, model, requests[0])
    arrivals = arrival_times(len(requests), args.rate, args.seed)
    samples: list[dict] = []
    stop = asyncio.Event()
    bar = tqdm(total=len(requests), desc=f"{name:>20}", unit="req", mininterval=1.0, file=sys.stderr)
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_metrics(session, url, t0, samples, stop))

    async def one(req: Request, at: float) -> Record:
        await asyncio.sleep(at)
        rec = Record("short" if req.max_tokens == args.short else "long", req.max_tokens, len(req.prompt_token_ids))
        await stream_one(session, url, model, req, timing, t0, rec)
        bar.update(1)
        return rec

    records = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals)))
    duration = time.perf_counter() - t0
    stop.set()
    await sampler
    bar.close()
    return summarize_variant(records, samples, duration, timing)


# ---- figures -----------------------------------------------------------------------

def class_stats(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    return {"n": len(records), "n_ok": len(ok),
            "ttft": summarize([r.ttft for r in ok if r.ttft is not None]),
            "itl": summarize([x for r in ok for x in r.itl]),
            "e2e": summarize([r.e2e for r in ok])}


def timeline(samples: list[dict]) -> dict[str, Any]:
    """Columns of the /metrics samples; preemptions counted from the first sample."""
    tl: dict[str, Any] = {"t": [round(s["t"], 3) for s in samples]}
    for key in ("running", "waiting", "kv_usage"):
        tl[key] = [s[key] for s in samples]
    p0 = next((s["preemptions"] for s in samples if s["preemptions"] is not None), None)
    tl["preemptions"] = [None if s["preemptions"] is None else s["preemptions"] - p0 for s in samples]
    reasons = sorted({r for s in samples for r in s["waiting_by_reason"]})
    tl["waiting_by_reason"] = {r: [s["waiting_by_reason"].get(r, 0.0) for s in samples] for r in reasons}
    return tl


def metric_figures(tl: dict[str, Any], samples: list[dict]) -> dict[str, Any]:
    """Peaks and means of the timeline; request-seconds spent waiting, by reason."""
    def vals(key: str) -> list[float]:
        return [v for v in tl[key] if v is not None]

    dt = [b - a for a, b in zip(tl["t"], tl["t"][1:])] + [0.0]
    by_reason = {r: round(sum(n * d for n, d in zip(col, dt)), 2) for r, col in tl["waiting_by_reason"].items()}
    waiting_s = round(sum((w or 0.0) * d for w, d in zip(tl["waiting"], dt)), 2)
    dominant = max(by_reason, key=by_reason.get) if by_reason and max(by_reason.values()) > 0 else None
    kv, pre = vals("kv_usage"), vals("preemptions")
    return {"samples": len(samples),
            "series": [k for k in ("running", "waiting", "kv_usage", "preemptions") if vals(k)]
            + (["waiting_by_reason"] if by_reason else []),
            "num_kv_blocks": next((s["num_kv_blocks"] for s in samples if s["num_kv_blocks"] is not None), None),
            "max_running": max(vals("running"), default=None), "max_waiting": max(vals("waiting"), default=None),
            "mean_kv_usage": sum(kv) / len(kv) if kv else None, "max_kv_usage": max(kv, default=None),
            "preemptions": pre[-1] if pre else None, "waiting_request_s": waiting_s,
            "waiting_by_reason_s": by_reason, "dominant_wait_reason": dominant}


def summarize_variant(records: list[Record], samples: list[dict], duration: float, timing: str) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    span = max((r.start + r.e2e for r in ok), default=0.0) - min((r.start for r in ok), default=0.0)
    tokens = sum(r.tokens for r in ok)
    tl = timeline(samples)
    errors = [r.error for r in records if r.error]
    return {"duration_s": round(duration, 2), "token_timing": timing, "requests": len(records),
            "errors": len(errors), "first_errors": errors[:3],
            "exact_lengths": all(r.tokens == r.max_tokens for r in ok),
            "output_tokens": tokens, "output_tokens_per_s": tokens / span if span > 0 else 0.0,
            "short": class_stats([r for r in records if r.cls == "short"]),
            "long": class_stats([r for r in records if r.cls == "long"]),
            "metrics": metric_figures(tl, samples), "timeline": tl,
            "per_request": [{"class": r.cls, "max_tokens": r.max_tokens, "prompt_len": r.prompt_len,
                             "start": round(r.start, 4), "ttft": r.ttft, "e2e": r.e2e, "tokens": r.tokens,
                             "error": r.error} for r in records]}


# ---- main --------------------------------------------------------------------------

async def bench(args: argparse.Namespace, variants: list[Variant], requests: list[Request],
                results: dict[str, Any]) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        if args.url:
            info = await served_model(session, args.url)
            results["server"] = {"url": args.url, "model": info}
            res = await run_variant(session, args.url, info.get("id"), requests, args, "server")
            results["variants"]["server"] = {"flags": {}, "admission": None, "length": None} | res
            return
        extra = shlex.split(args.server_args)
        for v in variants:
            entry: dict[str, Any] = {"flags": v.flags, "extra_server_args": extra, "admission": v.admission,
                                     "length": v.length}
            results["variants"][v.name] = entry
            server = Server(v, extra, os.path.join(args.out, f"server-{v.name.replace('/', '-')}.log"), args.jax_cache)
            try:
                print(f"== {v.name}: {' '.join(flags_to_argv(v.flags) + extra)}", flush=True)
                entry["startup_s"] = round(await server.wait_ready(session, args.startup_timeout), 1)
                cpu0, load0 = server.cpu_seconds(), os.getloadavg()[0]
                entry |= await run_variant(session, server.url, None, requests, args, v.name)
                cpu1 = server.cpu_seconds()
                entry["load"] = {"loadavg_1m_start": load0, "loadavg_1m_end": os.getloadavg()[0],
                                 "server_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 1),
                                 "cores": os.cpu_count()}
            except Exception as e:  # one broken variant must not lose the others' figures
                entry["error"] = f"{type(e).__name__}: {e}"
                print(f"   {v.name} failed: {entry['error']}", flush=True)
            finally:
                server.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=Formatter)
    ap.add_argument("--url", help="measure this running OpenAI-compatible server instead of starting taxirank")
    ap.add_argument("--model", default="bench", help="taxirank model to serve: tiny, bench or an HF directory")
    ap.add_argument("--vocab-size", type=int,
                    help="prompt token ids are drawn below it (default: --model's; 32000 for --url)")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--short", type=int, default=16, help="max_tokens of the short half")
    ap.add_argument("--long", type=int, default=512, help="max_tokens of the long half")
    ap.add_argument("--prompt-len", default="32,256", help="prompt lengths: MIN,MAX random token ids")
    ap.add_argument("--rate", type=float, help="requests/s as a Poisson process (default: all at once)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048, help="the full length; variants /half run half")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-budget-seqs", type=int, default=8,
                    help="the admission variants' KV budget, in sequences of the full max_model_len")
    ap.add_argument("--variants", help="comma-separated subset, e.g. continuous,static,reserve-max-len/half")
    ap.add_argument("--server-args", default="", help="extra flags for every taxirank server, e.g. "
                    "'--enable-chunked-prefill'")
    ap.add_argument("--quick", action="store_true", help="40 requests, --long 128, --prompt-len 16,64, "
                    "--max-model-len 512 (unless given)")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("--request-timeout", type=float, default=900.0, help="seconds of silence before a request fails")
    ap.add_argument("--jax-cache", default=os.path.join(ROOT, "bench", "results", ".jax-cache"),
                    help="persistent compilation cache for the servers ('' for none)")
    ap.add_argument("--out", help="output directory (default bench/results/<timestamp>/)")
    ap.add_argument("--report", metavar="DIR", help="no run: rewrite DIR's analysis, report.md and plots from "
                    "its results.json")
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    args = ap.parse_args(argv)
    args.url = args.url.rstrip("/") if args.url else None
    if args.report:
        return args
    if args.quick:
        for opt, value in (("num_requests", 40), ("long", 128), ("prompt_len", "16,64"), ("max_model_len", 512)):
            if "--" + opt.replace("_", "-") not in given:
                setattr(args, opt, value)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    args.prompt_range = (lo, hi)
    need = hi + max(args.short, args.long)
    if not args.url and need > args.max_model_len // 2:
        ap.error(f"the halved max_model_len ({args.max_model_len // 2}) must hold the longest request "
                 f"({hi} prompt + {max(args.short, args.long)} output tokens): raise --max-model-len")
    args.out = args.out or os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S"))
    return args


def finish(results: dict[str, Any], out: str) -> None:
    """Analysis, plots, results.json, report.md and the terminal table, from the figures."""
    results["analysis"] = analyze(results)
    results["plots"] = write_plots(results, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_report(results, out)
    print_table(results)
    print(f"\nresults: {out}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.report:
        with open(os.path.join(args.report, "results.json")) as f:
            results = json.load(f)
        finish(results, args.report)
        return results
    os.makedirs(args.out, exist_ok=True)
    variants = [] if args.url else build_variants(args)
    vocab = args.vocab_size or vocab_size_of(args.model)
    requests = seed_mix(args.num_requests, vocab, short=args.short, long=args.long, prompt_len=args.prompt_range,
                        seed=args.seed)
    settings = {k: v for k, v in vars(args).items() if k not in ("prompt_range",)} | {"vocab_size": vocab}
    if not args.url:
        settings["kv_budget_blocks"] = args.kv_budget_seqs * math.ceil(args.max_model_len / args.block_size) + 1
        settings["kv_budget_tokens"] = (settings["kv_budget_blocks"] - 1) * args.block_size
    results: dict[str, Any] = {"machine": machine_info(), "settings": settings, "loadavg_start": os.getloadavg(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "variants": {}}
    t0 = time.perf_counter()
    asyncio.run(bench(args, variants, requests, results))
    results["total_s"] = round(time.perf_counter() - t0, 1)
    results["loadavg_end"] = os.getloadavg()
    finish(results, args.out)
    return results


if __name__ == "__main__":
    main()
