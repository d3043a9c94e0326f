"""Online bench: how do TTFT, ITL and e2e of short and long streaming requests compare across
scheduling, KV admission and max_model_len, or across OpenAI-compatible servers?

    python bench/mixed.py                      # taxirank servers (bench model, CPU), every variant
    python bench/mixed.py --quick              # a smaller mix and lengths: 5-10 minutes on 2 cores
    python bench/mixed.py --url http://host:8000                   # a running server (any)
    python bench/mixed.py --url a=http://host:8000 --url b=http://host:8001    # two, side by side
    python bench/mixed.py --peer --compare "taxirank=python server.py --model DIR --max-model-len 1024 \
        --max-num-seqs 32 --port {port}" --compare "hf=transformers serve DIR --continuous-batching \
        --dtype float32 --port {port}"      # started in turn, at their defaults (docs/PERFORMANCE.md)

taxirank variants (one server at a time; random token-id prompts, ignore_eos):
  continuous, static        max_num_seqs 32, max_model_len 2048, the server's default KV cache
  <mode>/full, <mode>/half  continuous under each KV admission mode at max_model_len 2048 and
                            1024, one tight KV budget (--kv-budget-seqs sequences of 2048)
  kv-auto, kv-fp8, kv-int8  continuous at the bytes of that budget in the model dtype, the cache
                            stored in the model dtype, fp8 or int8

Other servers (--url, --compare) get prose prompts, and a probe first finds what each takes
(docs/BENCHMARKS.md). Writes to --out: results.json, report.md, cdf_short_e2e.png,
timeline-<variant>.png and each started server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from client import Record, Refused, Server, complete, probe, sample_metrics, server_view  # noqa: E402
from report import (checked, flags_to_argv, machine_info, mixed_report, positive, positive_float,  # noqa: E402
                    redraw, summarize, write_json)
from workload import Request, arrival_times, short_long_mix, vocab_size_of  # noqa: E402

# The engine's modules (JAX: seconds to import) are imported where they are used, after the
# flags are parsed: --help answers at once.
sys.path.insert(0, ROOT)

ADMISSION_MODES = ("on-demand", "reserve", "reserve-max-len")


@dataclass
class Target:
    """A server that is not one of taxirank's variants: running at `url`, or started from
    `command` (with {port} in it) for its turn only."""

    name: str
    url: str | None = None
    command: str | None = None


@dataclass
class Variant:
    """One of taxirank's variants: server.py with `flags` (EngineConfig fields)."""

    name: str  # also a file-name part (a '/' becomes '-')
    flags: dict[str, Any] = field(default_factory=dict)
    admission: str | None = None  # the KV admission mode ...
    length: str | None = None  # ... and "full" or "half" max_model_len


def kv_budget_blocks(args: argparse.Namespace) -> int:
    """--kv-budget-seqs sequences of the full max_model_len, + the null block."""
    return args.kv_budget_seqs * math.ceil(args.max_model_len / args.block_size) + 1


def build_variants(args: argparse.Namespace) -> list[Variant]:
    """continuous, static, each admission mode at full and half max_model_len under one tight
    KV budget, and each --kv-cache-dtype in that budget's bytes."""
    full, budget = args.max_model_len, kv_budget_blocks(args)
    base = {"model": args.model, "max_num_seqs": args.max_num_seqs, "max_model_len": full,
            "block_size": args.block_size}
    out = [Variant(s, base | {"scheduling": s}) for s in ("continuous", "static")]
    out += [Variant(f"{mode}/{length}", base | {"kv_admission": mode, "max_model_len": mml, "num_kv_blocks": budget},
                    mode, length) for mode in ADMISSION_MODES for length, mml in (("full", full), ("half", full // 2))]
    from kvcache import kv_cache_bytes_per_block
    from model_loader import BUILTIN_MODELS

    if args.model in BUILTIN_MODELS:
        kv_bytes = (budget - 1) * kv_cache_bytes_per_block(BUILTIN_MODELS[args.model], args.block_size, "float32")
        out += [Variant(f"kv-{d}", base | {"kv_cache_memory": kv_bytes, "kv_cache_dtype": d})
                for d in ("auto", "fp8", "int8")]
    if args.variants is not None:
        keep = [v.strip() for v in args.variants.split(",") if v.strip()]
        unknown = sorted(set(keep) - {v.name for v in out})
        if unknown:
            raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(v.name for v in out)}")
        out = [v for v in out if v.name in keep]
    return out


def class_stats(records: list[Record]) -> dict[str, Any]:
    """TTFT, ITL, TPOT ((e2e - TTFT) / (tokens - 1), vLLM's), e2e and output tokens of one class."""
    ok = [r for r in records if r.error is None]
    return {"n": len(records), "n_ok": len(ok),
            "ttft": summarize([r.ttft for r in ok if r.ttft is not None]),
            "itl": summarize([x for r in ok for x in r.itl]),
            "tpot": summarize([(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.ttft is not None and r.tokens > 1]),
            "e2e": summarize([r.e2e for r in ok]),
            "output_tokens": summarize([float(r.tokens) for r in ok])}


async def measure(session: aiohttp.ClientSession, url: str, entry: dict[str, Any], requests: list[Request],
                  args: argparse.Namespace, name: str, server: Server | None) -> None:
    """Probe the server at `url`, send it the workload as it takes it (sampling /metrics meanwhile
    where it has them), and add the figures to `entry`."""
    caps = await probe(session, url, requests[0], prompts=args.prompt_kind, extensions=args.send_extensions,
                       stream=not args.no_stream)
    if args.extensions == "on" and "ignore_eos" in caps.refused:
        raise Refused(f"the server refuses ignore_eos ({caps.refused['ignore_eos']}); --extensions auto or off "
                      "measures it with output lengths that follow the model")
    print(f"   {name}: model {caps.model or '(not named)'}, {caps.prompts} prompts, token timing {caps.timing}"
          + (f", refused {sorted(caps.refused)}" if caps.refused else "")
          + ("" if caps.metrics else ", no /metrics") + ("" if caps.usage else ", no usage"), flush=True)
    cpu0, load0 = server.cpu_seconds() if server else None, os.getloadavg()[0]
    samples: list[dict] = []
    stop = asyncio.Event()
    bar = tqdm(total=len(requests), desc=f"{name:>20}", unit="req", mininterval=1.0, file=sys.stderr)
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_metrics(session, url, t0, samples, stop)) if caps.metrics else None

    async def one(req: Request, at: float) -> Record:
        await asyncio.sleep(at)
        rec = Record("short" if req.max_tokens == args.short else "long", req.max_tokens,
                     len(req.prompt_token_ids) if caps.prompts == "ids" else len(req.prompt_text.split()))
        await complete(session, url, caps.body(req), caps.timing, t0, rec)
        bar.update(1)
        return rec

    arrivals = arrival_times(len(requests), args.rate, args.seed)
    records = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals)))
    duration = time.perf_counter() - t0
    stop.set()
    if sampler:
        await sampler
    bar.close()
    cpu1 = server.cpu_seconds() if server else None
    ok = [r for r in records if r.error is None]
    span = max((r.start + r.e2e for r in ok), default=0.0) - min((r.start for r in ok), default=0.0)
    tokens, from_usage = sum(r.tokens for r in ok), [r.tokens_from_usage for r in ok]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]  # only what usage reports
    errors = [r.error for r in records if r.error]
    entry |= {"duration_s": round(duration, 2), "token_timing": caps.timing, "capabilities": asdict(caps),
              "requests": len(records), "errors": len(errors), "first_errors": errors[:3],
              "exact_lengths": all(r.tokens == r.max_tokens for r in ok),
              "tokens_counted_from": "usage" if all(from_usage) else "chunks" if not any(from_usage) else "mixed",
              "output_tokens": tokens, "output_tokens_per_s": tokens / span if span > 0 else 0.0,
              "prompt_tokens": summarize([float(x) for x in prompt_tokens]) | {"total": sum(prompt_tokens)}
              if prompt_tokens else None,
              "short": class_stats([r for r in records if r.cls == "short"]),
              "long": class_stats([r for r in records if r.cls == "long"])} | server_view(samples) | {
        "per_request": [{"class": r.cls, "max_tokens": r.max_tokens, "prompt_len": r.prompt_len,
                         "prompt_tokens": r.prompt_tokens, "start": round(r.start, 4), "ttft": r.ttft, "e2e": r.e2e,
                         "tokens": r.tokens, "finish_reason": r.finish_reason, "text": r.text, "error": r.error}
                        for r in records],
        "load": {"loadavg_1m_start": load0, "loadavg_1m_end": os.getloadavg()[0], "cores": os.cpu_count(),
                 "server_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 2)}}


async def bench(args: argparse.Namespace, variants: list[Variant], requests: list[Request],
                results: dict[str, Any]) -> None:
    """Each taxirank variant, or each target, in turn: one server up at a time."""
    t_start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=args.request_timeout)
    extra = shlex.split(args.server_args)
    env = dict(os.environ) | ({"JAX_COMPILATION_CACHE_DIR": args.jax_cache,  # compile once per set of shapes
                               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"} if args.jax_cache else {})
    server_py = [sys.executable, os.path.join(ROOT, "server.py"), "--host", "127.0.0.1", "--port", "{port}"]
    # one server's turn: (name, its results entry, the argv that starts it or None, its url, env, cwd)
    runs = [(v.name, {"flags": v.flags, "extra_server_args": extra, "admission": v.admission, "length": v.length},
             [*server_py, *flags_to_argv(v.flags), *extra], None, env, ROOT) for v in variants]
    runs += [(t.name, {"flags": {}, "admission": None, "length": None, "url": t.url, "command": t.command},
              shlex.split(t.command) if t.command else None, t.url, None, None) for t in args.targets]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        for name, entry, argv, url, server_env, cwd in runs:
            results["variants"][name] = entry
            server = None
            try:
                if argv:
                    log = os.path.join(args.out, f"server-{name.replace('/', '-')}.log")
                    server = Server(argv, log, server_env, cwd=cwd)
                    entry["url"] = url = server.url
                print(f"== {name}: {' '.join(server.argv) if server else url}", flush=True)
                if server:
                    entry["startup_s"] = round(await server.wait_ready(session, args.startup_timeout), 1)
                await measure(session, url, entry, requests, args, name, server)
            except Exception as e:  # one broken server must not lose the others' figures
                entry["error"] = f"{type(e).__name__}: {e}"
                print(f"   {name} failed: {entry['error']}", flush=True)
            finally:
                if server:
                    server.stop()
            # what is done so far, should a later server hang or the run be stopped: --report renders it
            write_json(os.path.join(args.out, "results.json"), results | {
                "partial": True, "total_s": round(time.perf_counter() - t_start, 1), "loadavg_end": os.getloadavg()})


def shell_words(text: str) -> bool:
    """Whether a shell splits `text` into words (no quote left open), as a server's argv is split."""
    try:
        return shlex.split(text) is not None
    except ValueError:
        return False


class TargetAction(argparse.Action):
    """--url [NAME=]URL and --compare NAME=COMMAND, into one list in the order given."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option: str | None = None) -> None:
        m = re.match(r"^([A-Za-z0-9_.-]+)=(.+)$", value)
        if option == "--compare":
            if not m or "{port}" not in m.group(2) or not shell_words(m.group(2)):
                parser.error(f"--compare wants NAME=COMMAND, a command a shell can split with {{port}} in it (the "
                             f"bench picks a free port), got {value!r}")
            target = Target(m.group(1), command=m.group(2))
        else:
            name, url = (m.group(1), m.group(2)) if m else (None, value)
            if not re.match(r"^https?://[^/\s]+", url):
                parser.error(f"--url wants [NAME=]http://host:port, got {value!r}")
            target = Target(name, url=url.rstrip("/"))
        setattr(ns, self.dest, list(getattr(ns, self.dest) or []) + [target])


FLAGS = [  # (flag, type, default, help) of the plain options
    ("--model", str, "bench", "taxirank model to serve: tiny, bench, smollm2, an HF directory or a .gguf file"),
    ("--vocab-size", positive, None,
     "prompt token ids are drawn below it (default: --model's; 32000 with --url/--compare)"),
    ("--num-requests", checked(int, lambda x: x >= 2, "an integer >= 2 (a short and a long half)"), 100, None),
    ("--short", positive, 16, "max_tokens of the short half"),
    ("--long", positive, 512, "max_tokens of the long half"),
    ("--prompt-len", str, "32,256", "prompt lengths: MIN,MAX random token ids, or words of text prompts"),
    ("--rate", positive_float, None, "requests/s as a Poisson process (default: all at once)"),
    ("--seed", int, 0, None),
    ("--max-num-seqs", positive, 32, None),
    ("--max-model-len", positive, 2048, "the full length; variants /half run half"),
    ("--block-size", positive, 16, None),
    ("--kv-budget-seqs", positive, 8, "the admission variants' KV budget, in sequences of the full max_model_len"),
    ("--variants", str, None, "comma-separated subset, e.g. continuous,static,reserve-max-len/half"),
    ("--server-args", checked(str, shell_words, "flags a shell can split"), "",
     "extra flags for every taxirank server, e.g. '--enable-chunked-prefill'"),
    ("--startup-timeout", positive_float, 900.0, "seconds to wait for a started server's /health (or /v1/models)"),
    ("--request-timeout", positive_float, 900.0, "seconds of silence before a request fails"),
    ("--jax-cache", str, os.path.join(ROOT, "bench", "results", ".jax-cache"),
     "persistent compilation cache for the servers ('' for none)"),
    ("--out", str, None, "output directory (default bench/results/<timestamp>/)"),
]
PRESETS = {  # --quick and --peer: (what, the options they set unless given)
    "quick": ("a smaller mix", {"num_requests": 40, "long": 128, "prompt_len": "16,64", "max_model_len": 512}),
    "peer": ("the side by side of docs/PERFORMANCE.md", {"num_requests": 32, "short": 16, "long": 128,
                                                         "prompt_len": "20,120"})}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=Formatter)
    ap.add_argument("--url", dest="targets", action=TargetAction, metavar="[NAME=]URL", default=[],
                    help="measure this running OpenAI-compatible server instead of starting taxirank; repeat it "
                    "(or mix it with --compare) to measure several side by side")
    ap.add_argument("--compare", dest="targets", action=TargetAction, metavar="NAME=COMMAND", default=[],
                    help="start this server command, with {port} replaced by a free port, measure it and stop "
                    "it before the next; repeatable, e.g. 'hf=transformers serve DIR --continuous-batching "
                    "--port {port}'")
    ap.add_argument("--prompts", default="auto", choices=("auto", "text", "ids"),
                    help="auto: random token ids for taxirank variants, text for --url/--compare servers")
    ap.add_argument("--extensions", default="auto", choices=("auto", "on", "off"),
                    help="vLLM's ignore_eos (exact output lengths). auto: to taxirank variants and to a lone "
                    "--url/--compare server that takes it; none side by side, so every server gets identical "
                    "requests. on: a server that refuses it fails. off: never")
    ap.add_argument("--no-stream", action="store_true", help="with --url/--compare: requests with \"stream\": "
                    "false; e2e and usage from the one response (TTFT and ITL are not measured)")
    for flag, type_, default, help_ in FLAGS:
        ap.add_argument(flag, type=type_, default=default, help=help_)
    for preset, (what, values) in PRESETS.items():
        ap.add_argument("--" + preset, action="store_true", help=f"{what}: " + ", ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in values.items()) + " (unless given)")
    ap.add_argument("--report", metavar="DIR", help="no run: rewrite DIR's analysis, report.md and plots from "
                    "its results.json")
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    args = ap.parse_args(argv)
    if args.report:
        if given - {"--report"}:
            ap.error(f"--report re-renders DIR's results.json and takes no other option, got {sorted(given)}")
        if not os.path.isfile(path := os.path.join(args.report, "results.json")):
            ap.error(f"--report: no {path}")
        return args
    if args.no_stream and not args.targets:
        ap.error("--no-stream measures --url/--compare servers; taxirank's variants are compared by TTFT and ITL")
    if args.targets and args.variants is not None:
        ap.error("--variants picks taxirank variants; with --url or --compare the servers given are measured")
    if args.variants is not None and not args.variants.replace(",", "").strip():
        ap.error("--variants wants a comma-separated list of variant names, got none")
    from gguf_loader import BUILTIN_GGUF
    from model_loader import BUILTIN_MODELS

    if not args.targets and not (args.model in BUILTIN_MODELS or args.model in BUILTIN_GGUF
                                 or os.path.exists(args.model)):
        ap.error(f"--model {args.model!r}: not one of {', '.join([*BUILTIN_MODELS, *BUILTIN_GGUF])}, "
                 "nor a checkpoint directory or .gguf file")
    unnamed = [t for t in args.targets if t.name is None]
    for i, t in enumerate(unnamed, 1):
        t.name = "server" if len(args.targets) == 1 else f"server{i}"
    if len({t.name for t in args.targets}) != len(args.targets):
        ap.error(f"server names must differ: {[t.name for t in args.targets]}")
    if args.quick and args.peer:
        ap.error("--quick and --peer are two presets: give one")
    preset = "quick" if args.quick else "peer" if args.peer else None
    for opt, value in PRESETS[preset][1].items() if preset else ():
        if "--" + opt.replace("_", "-") not in given:
            setattr(args, opt, value)
    try:
        lo, hi = (int(x) for x in args.prompt_len.split(","))
    except ValueError:
        ap.error(f"--prompt-len wants MIN,MAX, got {args.prompt_len!r}")
    if not 1 <= lo <= hi:
        ap.error(f"--prompt-len wants 1 <= MIN <= MAX, got {args.prompt_len!r}")
    args.prompt_range = (lo, hi)
    args.prompt_kind = args.prompts if args.prompts != "auto" else "text" if args.targets else "ids"
    args.send_extensions = {"on": True, "off": False, "auto": len(args.targets) <= 1}[args.extensions]
    if not args.targets and hi + max(args.short, args.long) > args.max_model_len // 2:
        ap.error(f"the halved max_model_len ({args.max_model_len // 2}) must hold the longest request "
                 f"({hi} prompt + {max(args.short, args.long)} output tokens): raise --max-model-len")
    try:  # the variants' names are checked here, before a folder is made or a server started
        args.built_variants = [] if args.targets else build_variants(args)
    except ValueError as e:
        ap.error(str(e))
    args.out = args.out or os.path.join(ROOT, "bench", "results", time.strftime("%Y%m%d-%H%M%S"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.report:
        return redraw("--report", os.path.join(args.report, "results.json"),
                      lambda r: mixed_report(r, args.report) or r, "a results.json of bench/mixed.py")
    os.makedirs(args.out, exist_ok=True)
    vocab = args.vocab_size or vocab_size_of(args.model)
    requests = short_long_mix(args.num_requests, vocab, short=args.short, long=args.long,
                              prompt_len=args.prompt_range, seed=args.seed, text=args.prompt_kind == "text")
    settings = {k: v for k, v in vars(args).items() if k not in ("prompt_range", "targets", "built_variants")} | {
        "vocab_size": vocab, "targets": [asdict(t) for t in args.targets]}
    if not args.targets:
        settings["kv_budget_blocks"] = kv_budget_blocks(args)
        settings["kv_budget_tokens"] = (settings["kv_budget_blocks"] - 1) * args.block_size
    results: dict[str, Any] = {"machine": machine_info(), "settings": settings, "loadavg_start": os.getloadavg(),
                               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "variants": {}}
    t0 = time.perf_counter()
    asyncio.run(bench(args, args.built_variants, requests, results))
    results["total_s"] = round(time.perf_counter() - t0, 1)
    results["loadavg_end"] = os.getloadavg()
    mixed_report(results, args.out)
    return results


if __name__ == "__main__":
    main()
