"""Prefix-aware routing vs power-of-two choices over taxirank replicas under Ray Serve.

    python bench/ray_routing.py [--model bench] [--num-requests 96]

The workload and why each replica holds half the prompts: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any

import aiohttp

from client import Capabilities, Record, Server, complete, parse_metrics
from report import md_table, model_name, positive, results_dir, summarize, text_table, write_json, write_text
from workload import Request, shared_prefix, vocab_size_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HITS, QUERIES = "taxirank:prefix_cache_hits_total", "taxirank:prefix_cache_queries_total"  # prompt tokens, fleet-wide


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The Ray app's /metrics: labelled samples are also summed over the replicas under the bare name."""
    async with session.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


async def wait_replicas(session: aiohttp.ClientSession, url: str, n: int, timeout: float = 300) -> None:
    """Until /metrics carries n replicas (each announces itself to the Ingress on start)."""
    deadline = time.monotonic() + timeout
    while sum(k.startswith("taxirank:num_kv_blocks{") for k in await scrape(session, url)) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} replicas did not show in /metrics within {timeout:.0f}s")
        await asyncio.sleep(0.5)


async def run_requests(session: aiohttp.ClientSession, url: str, requests: list[Request],
                       concurrency: int) -> list[Record]:
    t0, gate = time.perf_counter(), asyncio.Semaphore(concurrency)
    caps = Capabilities(prompts="ids", ignore_eos=True, logprobs=True, timing="logprobs")

    async def one(req: Request) -> Record:
        async with gate:
            return await complete(session, url, caps.body(req), caps.timing, t0,
                                  Record("shared", req.max_tokens, len(req.prompt_token_ids)))
    return await asyncio.gather(*(one(r) for r in requests))


def start(script: str, args: argparse.Namespace, extra: list[str], log_dir: str, name: str) -> Server:
    """`script` (server.py or serve_ray.py) with the engine flags both share, and `extra`."""
    flags = ["--model", args.model, "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", "512", "--block-size", "16",
             "--num-kv-blocks", str(args.num_kv_blocks)]
    return Server([sys.executable, script, *flags, *extra, "--port", "{port}"],
                  os.path.join(log_dir, f"{name}.log"), env=os.environ | {"PYTHONUNBUFFERED": "1"}, cwd=ROOT)


async def measure(args: argparse.Namespace, routing: str, requests: list[Request], log_dir: str) -> dict[str, Any]:
    launched = time.perf_counter()
    server = start("serve_ray.py", args, ["--num-replicas", str(args.num_replicas), "--routing", routing,
                                          "--replica-cpus", "0"], log_dir, f"ray-{routing}")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
            await server.wait_ready(session, timeout=1800)
            await wait_replicas(session, server.url, args.num_replicas)
            startup = time.perf_counter() - launched  # every replica serving
            before, t0 = await scrape(session, server.url), time.perf_counter()
            records = await run_requests(session, server.url, requests, args.concurrency)
            wall, after = time.perf_counter() - t0, await scrape(session, server.url)
    finally:  # the launcher alone first: serve_ray.py then shuts Ray Serve and Ray down in order
        server.stop(grace_s=90)
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{routing}: {len(errors)} requests failed, e.g. {errors[0]} (see {server.log_path})")
    return {"routing": routing, "startup_s": startup, "wall_s": wall,
            "hit_rate": (after[HITS] - before[HITS]) / max(after[QUERIES] - before[QUERIES], 1),
            "ttft": summarize([r.ttft for r in records]), "e2e": summarize([r.e2e for r in records])}


async def server_startup(args: argparse.Namespace, log_dir: str) -> float:
    server = start("server.py", args, [], log_dir, "server")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            return await server.wait_ready(session, timeout=1800)
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=model_name, default="tiny")
    p.add_argument("--num-replicas", type=positive, default=2)
    p.add_argument("--num-prefixes", type=positive, default=16, help="distinct system prompts")
    p.add_argument("--prefix-len", type=positive, default=1024, help="tokens per system prompt")
    p.add_argument("--suffix-len", type=positive, default=32, help="tokens of each request's own question")
    p.add_argument("--num-requests", type=positive, default=256)
    p.add_argument("--max-tokens", type=positive, default=8)
    p.add_argument("--concurrency", type=positive, default=8, help="requests in flight")
    p.add_argument("--max-num-seqs", type=positive, default=8)
    p.add_argument("--num-kv-blocks", type=positive,
                   help="per replica; default: room for half the system prompts and one more, plus the "
                        "in-flight requests' own tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    blocks_per_request = -(-(args.prefix_len + args.suffix_len + args.max_tokens) // 16)
    own_blocks = -(-(args.suffix_len + args.max_tokens) // 16) + 1  # beyond the shared prefix's full blocks
    if args.num_kv_blocks is None:
        args.num_kv_blocks = 1 + blocks_per_request * (args.num_prefixes // 2 + 1) + own_blocks * args.max_num_seqs
    args.max_model_len = 16 * blocks_per_request  # the workload's longest request, in whole blocks
    if args.num_kv_blocks <= blocks_per_request:
        p.error(f"--num-kv-blocks {args.num_kv_blocks} cannot hold one request of {blocks_per_request} blocks")

    requests = shared_prefix(args.num_requests, vocab_size_of(args.model), prefix_len=args.prefix_len,
                             suffix_len=args.suffix_len, max_tokens=args.max_tokens, seed=args.seed,
                             num_prefixes=args.num_prefixes)
    log_dir = tempfile.mkdtemp(prefix="taxirank-ray-routing-")
    # server.py first fills the compilation cache, so every start-up timed below compiles
    # nothing: the figures compare what each launcher adds, not compile times.
    cold = asyncio.run(server_startup(args, log_dir))
    runs = [asyncio.run(measure(args, routing, requests, log_dir)) for routing in ("prefix", "power-of-two")]
    plain = asyncio.run(server_startup(args, log_dir))

    prefix, pow2 = runs
    rows = [["routing", "prefix-cache hit rate", "TTFT p50", "TTFT p90", "e2e p50", "wall", "start-up"]]
    for r in runs:
        rows.append([r["routing"], f"{r['hit_rate']:.1%}", f"{r['ttft']['p50']:.3f} s", f"{r['ttft']['p90']:.3f} s",
                     f"{r['e2e']['p50']:.3f} s", f"{r['wall_s']:.1f} s", f"{r['startup_s']:.1f} s"])
    rows.append(["server.py (1 engine, no Ray)", "", "", "", "", "", f"{plain:.1f} s"])
    caption = (f"start-up: launch until every engine serves (/health 200; the Ray app: every replica in "
               f"/metrics), with the compilation cache warm (server.py's first start: {cold:.1f} s)")
    hit_ratio = prefix["hit_rate"] / pow2["hit_rate"] if pow2["hit_rate"] else float("inf")
    ttft_ratio = pow2["ttft"]["p50"] / prefix["ttft"]["p50"]
    summary = "; ".join(f"{name}: {x:.2f}x (target {target}: {'PASS' if ok else 'MISS'})" for name, x, target, ok in (
        ("prefix / power-of-two hit rate", hit_ratio, ">= 1.5x", hit_ratio >= 1.5),
        ("TTFT p50 power-of-two / prefix", ttft_ratio, "> 1", ttft_ratio > 1)))
    setting = (f"{args.num_replicas} replicas of {args.model}, {args.num_requests} requests over {args.num_prefixes} "
               f"system prompts of {args.prefix_len} tokens (+{args.suffix_len}, {args.max_tokens} out), "
               f"{args.concurrency} in flight, {args.num_kv_blocks} KV blocks of 16 per replica")
    print(setting + "\n\n" + text_table(rows) + "\n" + caption + "\n\n" + summary)
    out = results_dir("ray_routing")
    write_text(os.path.join(out, "report.md"), f"# Ray Serve routing\n\n{setting}\n\n{md_table(rows)}\n\n{caption}\n\n"
               f"{summary}\n")
    write_json(os.path.join(out, "results.json"), {"args": vars(args), "runs": runs, "server_startup_s": plain,
                                                   "server_cold_startup_s": cold, "hit_ratio": hit_ratio,
                                                   "ttft_p50_ratio": ttft_ratio})
    print(f"\nwritten to {out}/ (servers' logs in {log_dir})")


if __name__ == "__main__":
    main()
