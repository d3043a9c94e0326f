"""Where does a step's time go: host or device, with async scheduling on and off, and start-up?

    python bench/step_profile.py                        # every section (the warm-up runs alone are ~15 min)
    python bench/step_profile.py --sections host,steps  # some of them
    python bench/step_profile.py --quick                # decode buckets 1, 32, 256; a 40-request mix

Sections (--sections), side by side in one run:
  roofline  this machine's memory copy GB/s and f32 matmul GFLOP/s: every step below is also
            a fraction of them, so on a GPU the script reads as a roofline.
  host      the host-only step (schedule, build the step's arrays, update, stats) with the
            device programs stubbed: steady decode per decode bucket, prefill steps of a few
            sizes; with --baseline DIR also DIR's code, alternating fresh processes. Target:
            <= 0.5 ms at 256 sequences.
  steps     the real programs (`bench` model) per decode bucket and prefill size: device time,
            the host share of a synchronous step, and the device idle gap between programs
            with async scheduling on and off. Target: async idle < 5% at 32 and 256.
  warmup    warm-up of a SmolLM2-135M-shaped model (30 layers): cold and from the cache, then
            4 vs 32 layers cold, each in a fresh process. Targets: <= 40 s, <= 10 s, ratio <= 2.
  e2e       output tokens/s on the seed's mix (bench/offline.py's run, 32 sequences), async on
            vs off. Target: on >= off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import machine_info, results_dir, timer, write_json  # noqa: E402

SECTIONS = ("roofline", "host", "steps", "warmup", "e2e")
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
BASELINE = ""  # --baseline DIR: another checkout whose cold warm-up runs beside this one's

# SmolLM2-135M's shape (the server's default model): 30 layers, width 576.
SMOL = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
# The engine's defaults: 32 sequences, max_model_len 2048 => 6 decode + 8 token buckets.
WARMUP_ENGINE = dict(max_num_seqs=32, max_model_len=2048, num_kv_blocks=256)


def register_model(name: str, **overrides) -> str:
    """A random-weight model of SMOL's shape (with overrides) under a built-in name."""
    import model as model_lib

    model_lib.BUILTIN_MODELS[name] = model_lib.ModelConfig(**{**SMOL, **overrides})
    return name


QUICK = False  # --quick: fewer buckets and a smaller mix


def run_steps(eng, steps: int) -> None:
    """`steps` engine steps, each step's deltas dropped at once as a server's loop drops
    them after delivery (keeping 200 steps x 256 deltas alive would time the garbage
    collector walking them, not the step)."""
    for _ in range(steps):
        eng.step()


# ---- roofline ----------------------------------------------------------------------------

LIMITS: dict[str, float] = {}


def section_roofline() -> dict:
    import jax
    import jax.numpy as jnp

    n = 64 << 20  # 256 MiB of f32
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)  # reads and writes every byte once
    copy(x).block_until_ready()
    t = timer(lambda: copy(x).block_until_ready())
    gbs = 2 * 4 * n / t / 1e9
    m = 2048
    a = jnp.ones((m, m), jnp.float32)
    mm = jax.jit(lambda u, v: u @ v)
    mm(a, a).block_until_ready()
    t = timer(lambda: mm(a, a).block_until_ready())
    gflops = 2 * m ** 3 / t / 1e9
    LIMITS.update(copy_gbs=gbs, matmul_gflops=gflops)
    print(f"roofline  memory copy {gbs:.1f} GB/s (read + write), matmul {gflops:.1f} GFLOP/s (f32, {m}^3), "
          f"{jax.devices()[0].platform}")
    return dict(LIMITS)


# ---- engines -----------------------------------------------------------------------------

def make_engine(model: str, max_num_seqs: int, async_scheduling: bool, warmup: bool, max_model_len: int = 1024,
                max_num_batched_tokens: int = 2048, num_kv_blocks: int | None = None):
    from engine import EngineConfig, LLMEngine

    blocks = num_kv_blocks or max_num_seqs * (max_model_len // 16) + 1
    return LLMEngine(EngineConfig(model=model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=blocks,
                                  async_scheduling=async_scheduling, warmup=warmup), log=lambda *_: None)


def stub_device(runner) -> None:
    """Replace the jitted programs with instant stand-ins of the same outputs."""
    import numpy as np

    def forward(state, kv_caches, last_tokens, *args):
        return kv_caches, (np.zeros(1, np.float32),)  # logits: the stand-in sample reads none

    def sample(last_tokens, logits, sample_slot, sampling):
        n = sample_slot.shape[0]
        res = (np.full(n, 7, np.int32), np.zeros(n, np.float32), np.zeros((n, 20), np.int32),
               np.zeros((n, 20), np.float32))
        return last_tokens, res

    runner._decode = runner._ragged = forward
    runner._sample = sample


def fill(eng, n: int, prompt_len: int = 64, start: int = 0) -> None:
    """n requests that never finish during the measurement; run until all decode."""
    from config import SamplingParams

    for i in range(n):
        eng.add_request(f"fill-{start + i}", [5 + (i + j) % 200 for j in range(prompt_len)],
                        SamplingParams(max_tokens=eng.config.max_model_len - prompt_len, ignore_eos=True))
    while eng.scheduler.num_waiting or any(not s.is_decode for s in eng.scheduler.running):
        eng.step()


def decode_buckets(max_num_seqs: int) -> list[int]:
    b = [1, 32, 256] if QUICK else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    return [x for x in b if x <= max_num_seqs]


PREFILL_SIZES = (128, 512, 2048)


def host_decode_ms(n: int, async_scheduling: bool) -> float:
    eng = make_engine("tiny", max(n, 1), async_scheduling, warmup=False, max_model_len=2048)
    stub_device(eng.runner)
    fill(eng, n)
    steps = 200
    ms = 1e3 * timer(lambda: run_steps(eng, steps), reps=3) / steps
    del eng
    gc.collect()  # the next measurement's collections must not walk this engine's objects
    return ms


def host_prefill_ms(tokens: int) -> float:
    from config import SamplingParams

    eng = make_engine("tiny", 32, False, warmup=False, max_model_len=4096, max_num_batched_tokens=4096)
    stub_device(eng.runner)
    k = [0]

    def one() -> None:  # one prompt of `tokens`, prefilled in one step, then aborted
        rid = f"p{k[0]}"
        k[0] += 1
        eng.add_request(rid, [5] * tokens, SamplingParams(max_tokens=4, ignore_eos=True))
        eng.step()
        eng.abort(rid)

    one()
    return 1e3 * timer(one, reps=20)


def _host_child(n: int, root: str) -> None:
    """In a fresh process: the synchronous host-only decode step of the code at `root`."""
    sys.path.insert(0, root)
    print(json.dumps(host_decode_ms(n, False)))


def _host_run(n: int, root: str) -> float:
    out = subprocess.run([sys.executable, HERE, "--_host-child", str(n), root], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def section_host() -> dict:
    out: dict = {"decode": {}, "prefill": {}}
    for n in decode_buckets(256):
        sync, asyn = host_decode_ms(n, False), host_decode_ms(n, True)
        out["decode"][n] = dict(sync_ms=sync, async_ms=asyn)
        target = "  (target <= 0.5 ms)" if n == 256 else ""
        print(f"host    decode, {n:3d} sequences: {sync:.3f} ms/step sync, {asyn:.3f} ms async{target}")
    if BASELINE:  # this tree vs another checkout, alternating fresh processes (the machine is shared)
        for n in (32, 256):
            mine, base = [], []
            for _ in range(2):
                base.append(_host_run(n, BASELINE))
                mine.append(_host_run(n, ROOT))
            out["decode"][n].update(sync_ms_fresh=min(mine), baseline_sync_ms=min(base))
            print(f"host    decode, {n:3d} sequences, fresh processes side by side: {min(mine):.3f} ms this tree, "
                  f"{min(base):.3f} ms baseline ({min(base) / min(mine):.2f}x)")
    for t in PREFILL_SIZES:
        out["prefill"][t] = host_prefill_ms(t)
        print(f"host    prefill step of {t} tokens: {out['prefill'][t]:.3f} ms")
    return out


# ---- steps: real programs ----------------------------------------------------------------

class Watcher:
    """Wraps runner.execute: records each step's dispatch time, and on a thread of its own
    waits for each step's result and records when it was ready."""

    def __init__(self, runner):
        import queue
        import threading

        self.runner, self.inner = runner, runner.execute
        self.q: queue.Queue = queue.Queue()
        self.dispatched: list[float] = []
        self.ready: list[float] = []
        runner.execute = self.execute
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def execute(self, *args):
        step = self.inner(*args)
        self.dispatched.append(time.perf_counter())
        self.q.put(step)
        return step

    def watch(self) -> None:
        while (step := self.q.get()) is not None:
            step.block_until_ready()
            self.ready.append(time.perf_counter())

    def stop(self) -> tuple[list[float], list[float]]:
        self.q.put(None)
        self.thread.join()
        self.runner.execute = self.inner
        return self.dispatched, self.ready


def idle_gaps(dispatched: list[float], ready: list[float]) -> tuple[float, float]:
    """(mean device idle between consecutive programs, mean program period), seconds:
    program i+1 can start at max(ready_i, dispatched_{i+1}); the device idles from ready_i
    until then."""
    gaps = [max(0.0, d - r) for r, d in zip(ready[:-1], dispatched[1:])]
    period = (ready[-1] - ready[0]) / max(len(ready) - 1, 1)
    return sum(gaps) / max(len(gaps), 1), period


def step_flops_bytes(eng, rows: int, tokens: int, context: int) -> tuple[float, float]:
    """Model FLOPs (2 x params x tokens + attention) and bytes (weights once + KV read) of a step."""
    from model import param_bytes

    cfg = eng.model_config
    params = param_bytes(eng.loaded.model) / 4  # f32
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * context
    return 2 * params * tokens + attn, params * 4 + kv_per_token * rows * context


def measure(eng, steps: int) -> dict:
    """Run `steps` steps; from the watcher's timestamps: wall per step, device busy per
    program (ready - max(dispatch, previous ready)), device idle between programs."""
    w = Watcher(eng.runner)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    dispatched, ready = w.stop()
    busy = [r - max(d, p) for d, r, p in zip(dispatched, ready, [0.0] + ready[:-1])]
    gap, period = idle_gaps(dispatched, ready)
    return dict(step_ms=1e3 * wall, device_ms=1e3 * sum(busy) / len(busy), idle_ms=1e3 * gap,
                period_ms=1e3 * period, idle_frac=gap / period if period else 0.0)


def section_steps() -> dict:
    from config import SamplingParams

    out: dict = {"decode": {}, "prefill": {}}
    N = 256
    context = 64
    engines = {}
    for on in (False, True):  # the same programs: the second engine's warm-up loads them from the cache
        # contexts stay short (64 + a few dozen tokens each): room for N of them and one 2048-token prompt
        eng = make_engine("bench", N, on, warmup=True, max_model_len=2048, num_kv_blocks=N * 12 + 200)
        engines[on] = eng
    for n in decode_buckets(N):
        row: dict = {}
        for on, eng in engines.items():
            fill(eng, n, prompt_len=context, start=10_000 * n)
            for _ in range(3):
                eng.step()
            row["async" if on else "sync"] = measure(eng, 6 if n >= 128 else 12)
            for rid in [s.request_id for s in list(eng.scheduler.running)]:
                eng.abort(rid)
            while eng.has_unfinished():
                eng.step()
        sync, asyn = row["sync"], row["async"]
        flops, nbytes = step_flops_bytes(engines[False], n, n, context)
        dev = sync["device_ms"] / 1e3
        row.update(gflops=flops / dev / 1e9, gbs=nbytes / dev / 1e9,
                   host_share_sync=1 - sync["device_ms"] / sync["step_ms"],
                   host_share_async=max(0.0, 1 - asyn["device_ms"] / asyn["step_ms"]))
        out["decode"][n] = row
        lim = (f" = {row['gbs'] / LIMITS['copy_gbs']:.0%} of copy GB/s, {row['gflops'] / LIMITS['matmul_gflops']:.0%} "
               "of matmul GFLOP/s") if LIMITS else ""
        target = " (target < 5%)" if n in (32, 256) else ""
        print(f"steps   decode {n:3d} seqs: device {sync['device_ms']:.1f} ms{lim}")
        print(f"          sync  step {sync['step_ms']:.1f} ms, host share {row['host_share_sync']:.0%}, "
              f"device idle {sync['idle_frac']:.1%} of the step")
        print(f"          async step {asyn['step_ms']:.1f} ms, device idle {asyn['idle_frac']:.1%} of the step{target}")
    eng = engines[False]
    for t in PREFILL_SIZES:
        def one() -> None:
            n = min(t, eng.config.max_model_len - 1)  # the prompt plus its one token fit max_model_len
            eng.add_request(f"prefill-{t}-{time.perf_counter()}", [5] * n, SamplingParams(max_tokens=1, ignore_eos=True))
            eng.step()
        one()
        w = Watcher(eng.runner)
        best = timer(one, reps=3)
        d, r = w.stop()
        dev = min(b - a for a, b in zip(d, r))
        flops, _ = step_flops_bytes(eng, 1, t, t // 2)
        out["prefill"][t] = dict(step_ms=1e3 * best, device_ms=1e3 * dev, gflops=flops / dev / 1e9,
                                 host_share=1 - dev / best)
        lim = f" = {flops / dev / 1e9 / LIMITS['matmul_gflops']:.0%} of matmul GFLOP/s" if LIMITS else ""
        print(f"steps   prefill {t:4d} tokens: device {1e3 * dev:.1f} ms{lim}, host share {1 - dev / best:.1%}")
    return out


# ---- warmup ------------------------------------------------------------------------------

def _warmup_child(layers: int, cache_dir: str, root: str) -> None:
    """In a fresh process: build the engine from the code at `root`, report warm-up
    seconds and programs as JSON."""
    sys.path.insert(0, root)
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from engine import EngineConfig, LLMEngine

    name = register_model(f"smol-{layers}", num_hidden_layers=layers)
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=name, warmup=False, compilation_cache_dir="", **WARMUP_ENGINE), log=lambda *_: None)
    built = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    eng.runner.warmup(log=lambda *_: None)
    # CPU seconds too: on a shared machine the wall time mostly measures the neighbours
    print(json.dumps(dict(layers=layers, warmup_s=time.perf_counter() - t0, warmup_cpu_s=time.process_time() - c0,
                          build_s=built, programs=eng.stats.num_compilations)))


def _warmup_run(layers: int, cache_dir: str, root: str = ROOT) -> dict:
    out = subprocess.run([sys.executable, HERE, "--_warmup-child", str(layers), cache_dir, root], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_warmup() -> dict:
    with tempfile.TemporaryDirectory() as d30, tempfile.TemporaryDirectory() as d4, \
            tempfile.TemporaryDirectory() as d32:
        cold = _warmup_run(30, d30)
        restart = _warmup_run(30, d30)
        four = _warmup_run(4, d4)
        thirty_two = _warmup_run(32, d32)
    ratio = thirty_two["warmup_s"] / four["warmup_s"]
    cpu_ratio = thirty_two["warmup_cpu_s"] / four["warmup_cpu_s"]
    print(f"warmup  30 layers ({cold['programs']} programs): cold {cold['warmup_s']:.1f}s wall, "
          f"{cold['warmup_cpu_s']:.1f}s CPU (target <= 40), restart from the cache {restart['warmup_s']:.1f}s wall, "
          f"{restart['warmup_cpu_s']:.1f}s CPU (target <= 10)")
    print(f"warmup  cold, 4 layers {four['warmup_s']:.1f}s ({four['warmup_cpu_s']:.1f}s CPU), 32 layers "
          f"{thirty_two['warmup_s']:.1f}s ({thirty_two['warmup_cpu_s']:.1f}s CPU): ratio {ratio:.2f} wall, "
          f"{cpu_ratio:.2f} CPU (target <= 2)")
    res = dict(cold=cold, restart=restart, layers4=four, layers32=thirty_two, ratio_32_4=ratio,
               cpu_ratio_32_4=cpu_ratio)
    if BASELINE:  # the same cold 30-layer warm-up by another checkout (e.g. the unrolled layers), same run
        with tempfile.TemporaryDirectory() as d:
            base = _warmup_run(30, d, BASELINE)
        res["baseline_cold"] = base
        print(f"warmup  baseline {BASELINE}: 30 layers cold {base['warmup_s']:.1f}s wall, {base['warmup_cpu_s']:.1f}s "
              f"CPU ({base['warmup_cpu_s'] / cold['warmup_cpu_s']:.1f}x this tree's CPU)")
    return res


# ---- e2e ---------------------------------------------------------------------------------

def section_e2e() -> dict:
    from engine import LLM
    from offline import FULL
    from report import timed_generate, warm
    from workload import seed_mix

    sz = replace(FULL, num_requests=40, long=128) if QUICK else FULL
    reqs = seed_mix(sz.num_requests, 32000, short=sz.short, long=sz.long, prompt_len=sz.prompt_len)
    out = {}
    for on in (False, True):
        # as bench/offline.py builds its engines: KV never limits, one untimed request first
        llm = LLM(sz.model, log=lambda *_: None, dtype="float32", max_num_seqs=sz.seqs_throughput,
                  max_model_len=sz.max_model_len, num_kv_blocks=sz.seqs_throughput * (sz.max_model_len // 16) + 1,
                  async_scheduling=on)
        warm(llm)
        r = timed_generate(llm, [q.prompt_token_ids for q in reqs], [q.max_tokens for q in reqs])
        out["async" if on else "sync"] = dict(output_tok_s=r["output_tok_s"], wall_s=r["wall_s"],
                                              ms_per_step=r["ms_per_step"], steps=r["stats"]["num_steps"],
                                              token_ids=r["token_ids"])
        del llm
    same = out["async"].pop("token_ids") == out["sync"].pop("token_ids")
    ratio = out["async"]["output_tok_s"] / out["sync"]["output_tok_s"]
    print(f"e2e     seed mix ({sz.num_requests} requests, {sz.short}/{sz.long} tokens, 32 seqs): "
          f"async {out['async']['output_tok_s']:.1f} tok/s vs sync {out['sync']['output_tok_s']:.1f}: {ratio:.3f}x "
          f"(target >= 1), identical tokens: {same}")
    out.update(ratio=ratio, identical_tokens=same)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=results_dir("step_profile.json"))
    ap.add_argument("--quick", action="store_true", help="fewer buckets, a smaller mix")
    ap.add_argument("--baseline", default="", help="warmup: also time a cold 30-layer warm-up of this checkout")
    ap.add_argument("--_host-child", nargs=2, metavar=("SEQS", "ROOT"), help=argparse.SUPPRESS)
    ap.add_argument("--_warmup-child", nargs=3, metavar=("LAYERS", "CACHE_DIR", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._host_child:
        _host_child(int(args._host_child[0]), args._host_child[1])
        return
    if args._warmup_child:
        _warmup_child(int(args._warmup_child[0]), args._warmup_child[1], args._warmup_child[2])
        return
    global QUICK, BASELINE
    QUICK, BASELINE = args.quick, args.baseline

    results: dict = {"machine": machine_info(), "load_before": os.getloadavg()}
    for name in args.sections.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r} (choose from {', '.join(SECTIONS)})")
        results[name] = globals()[f"section_{name}"]()
    results["load_after"] = os.getloadavg()
    print(f"load average before/after: {results['load_before'][0]:.2f} / {results['load_after'][0]:.2f}")
    write_json(args.out, results)

if __name__ == "__main__":
    main()
