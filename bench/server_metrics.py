"""What a server's Prometheus /metrics say while bench/mixed.py runs: the series it knows
(taxirank's, vLLM's, SGLang's, TGI's or llama.cpp's names), sampled ~10x a second, and the
timeline and peaks made from them.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp

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


def known_metrics(text: str) -> bool:
    """Whether a /metrics text has any series the timeline knows."""
    m = parse_metrics(text)
    return any(n in m for names in METRIC_ALIASES.values() for n in names)


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
