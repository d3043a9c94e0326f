"""Where does a step's time go: weight matmuls, attention, sampling, KV writes, host, idle?

    python bench/step_profile.py                          # every section (~20 min on 2 busy cores)
    python bench/step_profile.py --sections roofline,parts  # the table of docs/PERFORMANCE.md

Sections (--sections), side by side in one run:
  roofline  this machine's memory copy GB/s and f32 matmul GFLOP/s: every step below is also
            a fraction of them, so on a GPU the script reads as a roofline.
  host      the host-only step (schedule, build the step's arrays, update, stats) with the
            device programs stubbed, per decode bucket. Target: <= 0.5 ms at 256 sequences.
  parts     smollm2 (the real model) decoding 1, 8, 32 and 64 sequences, a mixed step and
            prefill chunks of 64-512 tokens: the whole step program (device time from a watcher
            thread), then each part as its own jitted program over the real weights at that
            step's shapes: weight matmuls, LM head, attention, KV writes, sampling; `other` is
            the step less the parts (norms, RoPE, embedding, residuals), host_idle the wall
            time less the device's. Useful FLOPs (real tokens, sampling rows) vs computed
            (bucket padding and every LM-head row included), against the roofline.
  warmup    warm-up of a SmolLM2-135M-shaped model (30 layers), cold and from the cache, in
            fresh processes; with --baseline DIR also DIR's code cold. Targets: <= 40 s, <= 10 s.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root first (structured.py)

from report import machine_info, results_dir, timer, write_json  # noqa: E402

SECTIONS = ("roofline", "host", "parts", "warmup")
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
BASELINE = ""  # --baseline DIR: another checkout whose cold warm-up runs beside this one's

# SmolLM2-135M's shape (the server's default model): 30 layers, width 576.
SMOL = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
# The engine's defaults: 32 sequences, max_model_len 2048 => 7 decode + 8 token buckets.
WARMUP_ENGINE = dict(max_num_seqs=32, max_model_len=2048, num_kv_blocks=256)


def register_model(name: str, **overrides) -> str:
    """A random-weight model of SMOL's shape (with overrides) under a built-in name."""
    import model as model_lib

    model_lib.BUILTIN_MODELS[name] = model_lib.ModelConfig(**{**SMOL, **overrides})
    return name


HOST_SEQS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def run_steps(eng, steps: int) -> None:
    for _ in range(steps):  # each step's deltas dropped at once, as a server's loop drops them
        eng.step()


# ---- roofline ----------------------------------------------------------------------------

LIMITS: dict[str, float] = {}


def section_roofline() -> dict:
    import jax
    import jax.numpy as jnp

    n = 64 << 20  # 256 MiB of f32
    x = jnp.ones((n,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)  # reads and writes every byte once
    t = timer(lambda: copy(x).block_until_ready())  # best of 5: the first call compiles
    gbs = 2 * 4 * n / t / 1e9
    m = 2048
    a, mm = jnp.ones((m, m), jnp.float32), jax.jit(lambda u, v: u @ v)
    t = timer(lambda: mm(a, a).block_until_ready(), reps=9)
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


def fill(eng, n: int, prompt_len: int = 64, start: int = 0, **params) -> None:
    """n requests that never finish during the measurement; run until all decode."""
    from config import SamplingParams

    for i in range(n):
        eng.add_request(f"fill-{start + i}", [5 + (i + j) % 200 for j in range(prompt_len)], SamplingParams(
            **{"max_tokens": eng.config.max_model_len - prompt_len, "ignore_eos": True, **params}))
    while eng.scheduler.num_waiting or any(not s.is_decode for s in eng.scheduler.running):
        eng.step()


def host_decode_ms(n: int, async_scheduling: bool) -> float:
    eng = make_engine("tiny", max(n, 1), async_scheduling, warmup=False, max_model_len=2048)
    stub_device(eng.runner)
    fill(eng, n)
    steps = 200
    ms = 1e3 * timer(lambda: run_steps(eng, steps), reps=3) / steps
    del eng
    gc.collect()  # the next measurement's collections must not walk this engine's objects
    return ms


def section_host() -> dict:
    out: dict = {"decode": {}}
    for n in HOST_SEQS:
        sync, asyn = host_decode_ms(n, False), host_decode_ms(n, True)
        out["decode"][n] = dict(sync_ms=sync, async_ms=asyn)
        target = "  (target <= 0.5 ms)" if n == 256 else ""
        print(f"host    decode, {n:3d} sequences: {sync:.3f} ms/step sync, {asyn:.3f} ms async{target}")
    return out


# ---- parts: where a smollm2 step goes ----------------------------------------------------

class Watcher:
    """Wraps runner.execute: records each step's dispatch time, and on a thread of its own
    waits for each step's result and records when it was ready."""

    def __init__(self, runner):
        import queue
        import threading

        self.runner, self.inner, self.q = runner, runner.execute, queue.Queue()
        self.dispatched: list[float] = []
        self.ready: list[float] = []
        runner.execute = self.execute
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def execute(self, *args):
        self.q.put(step := self.inner(*args))
        self.dispatched.append(time.perf_counter())
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


PART_SEQS = (1, 8, 32, 64)
PART_CHUNKS = (64, 128, 256, 512)


def part_programs(eng) -> dict:
    """Each part of a step as its own jitted program over the model's real weights (passed
    as arguments, not baked in as constants), at the shapes of the step just run."""
    import jax
    import jax.numpy as jnp

    from sampler import sample

    m, cfg, backend = eng.loaded.model, eng.model_config, eng.runner.backend
    at, mlp = m.layers.self_attn, m.layers.mlp
    ws = tuple(x.kernel[...] for x in (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj,
                                       mlp.down_proj))
    L, scale = cfg.num_hidden_layers, cfg.head_dim ** -0.5

    def matmuls(x, ws):  # the seven weight matmuls of every layer on T rows
        def body(x, w):
            q, k, v, o, g, u, d = w
            kv = jnp.sum(x @ k) + jnp.sum(x @ v)  # their outputs feed attention, timed on its own
            return 0.5 * x + (x @ q) @ o + (jax.nn.silu(x @ g) * (x @ u)) @ d + 1e-9 * kv, None
        return jax.lax.scan(body, x, ws)[0]

    def attention(q, kv, bt, kv_lens, cu_q_lens):  # every layer's paged attention over the step's context
        (k_all, v_all), nb = (c.reshape(-1, *c.shape[2:]) for c in kv), kv[0].shape[1]

        def body(acc, l):
            if cu_q_lens is None:
                return acc + backend.decode(q, k_all, v_all, bt + l * nb, kv_lens, scale=scale), None
            return acc + backend.ragged(q, k_all, v_all, bt + l * nb, cu_q_lens, kv_lens, scale=scale), None
        return jax.lax.scan(body, jnp.zeros_like(q), jnp.arange(L))[0]

    def kv_writes(kv, new, slots):  # every layer's K and V rows of the step into the paged cache
        shape = kv[0].shape

        def body(c, l):
            return tuple(x.at[slots + l * shape[1] * shape[2]].set(new) for x in c), None
        flat = tuple(c.reshape(-1, *shape[3:]) for c in kv)
        return tuple(c.reshape(shape) for c in jax.lax.scan(body, flat, jnp.arange(L))[0])

    lm_head = jax.jit(lambda h, e: jnp.einsum("nh,vh->nv", h, e, preferred_element_type=jnp.float32))  # tied
    return dict(ws=ws, emb=m.embed_tokens.embedding[...], matmuls=jax.jit(matmuls), attention=jax.jit(attention),
                kv_writes=jax.jit(kv_writes, donate_argnums=0), sample=jax.jit(sample), lm_head=lm_head)


def step_flops(cfg, args: tuple, decode: bool, idle: int) -> dict:
    """Useful (real tokens, sampling rows) and computed (padded rows included) FLOPs of the step
    whose inputs are `args`; attention counted once, over the real context (padding rows have none)."""
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    body = L * (H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
                + cfg.num_attention_heads * cfg.head_dim * H + 3 * H * cfg.intermediate_size)
    head = cfg.vocab_size * H
    kv_lens, sample_slot = args[5], args[-2 if decode else -3]
    real = int((kv_lens > 0).sum()) if decode else int(args[6][-1])
    q = (kv_lens > 0) if decode else args[6][1:] - args[6][:-1]
    ctx = sum(k * n - n * (n - 1) // 2 for k, n in zip(kv_lens.tolist(), q.astype(int).tolist()))  # causal: each query its prefix
    attn = 4 * L * cfg.num_attention_heads * cfg.head_dim * ctx
    T, R, sampled = len(args[0]), len(kv_lens), int((sample_slot != idle).sum())
    return dict(real=real, T=T, sampled=sampled, R=R, body=2 * body, useful=2 * body * real + 2 * head * sampled + attn,
                computed=2 * body * T + 2 * head * R + attn)


def profile_step(eng, progs: dict, run_step, label: str) -> dict:
    """Run the step (run_step() schedules it and returns its wall seconds), then time each
    part at its shapes; `other` = the whole program less the parts (norms, RoPE, embedding,
    residuals, the step's gathers)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from distributed import DECODE

    r, cfg = eng.runner, eng.model_config
    seen: dict = {}
    inner = r._run
    r._run = lambda kind, rows, T, args: seen.update(args=args, kind=kind) or inner(kind, rows, T, args)
    w = Watcher(r)
    wall = min(run_step() for _ in range(3))
    d, rd = w.stop()
    r._run = inner
    device = min(b - a for a, b in zip(d, rd))
    args, decode = seen["args"], seen["kind"] == DECODE
    f = step_flops(cfg, args, decode, r._idle)
    T, R = f["T"], f["R"]
    ready = jax.block_until_ready
    x = jnp.asarray(np.random.default_rng(0).normal(0, 0.1, (T, cfg.hidden_size)), jnp.float32)
    q = jnp.asarray(np.random.default_rng(1).normal(0, 1, (T, cfg.num_attention_heads, cfg.head_dim)), jnp.float32)
    new = jnp.zeros((T, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)
    bt, kv_lens = jnp.asarray(args[4]), jnp.asarray(args[5])
    cu = None if decode else jnp.asarray(args[6])
    logits = progs["lm_head"](x[:R], progs["emb"])
    sampling = args[-1] if decode else args[-2]

    def kv() -> None:
        r.kv_caches = ready(progs["kv_writes"](r.kv_caches, new, jnp.asarray(args[3])))

    parts = {"matmuls": lambda: ready(progs["matmuls"](x, progs["ws"])),
             "lm_head": lambda: ready(progs["lm_head"](x[:R], progs["emb"])),
             "attention": lambda: ready(progs["attention"](q, r.kv_caches, bt, kv_lens, cu)),
             "kv_writes": kv, "sampling": lambda: ready(progs["sample"](logits, sampling))}
    ms = {name: 1e3 * timer(fn, reps=6) for name, fn in parts.items()}  # best of 6: the first call compiles
    ms.update(step=1e3 * device, other=1e3 * device - sum(ms.values()), wall=1e3 * wall)
    ms["host_idle"] = ms["wall"] - ms["step"]
    row = dict(label=label, ms=ms, **f, gflops_useful=f["useful"] / device / 1e9, waste=1 - f["useful"] / f["computed"],
               matmul_gflops_here=f["body"] * T / ms["matmuls"] / 1e6)  # the matmul program's own rate
    lim = f", {row['gflops_useful'] / LIMITS['matmul_gflops']:.0%} of the matmul rate" if LIMITS else ""
    print(f"parts   {label:24s} T {f['real']}/{T}, head rows {f['sampled']}/{R}: " +
          ", ".join(f"{k} {v:.1f}" for k, v in ms.items()) + f" ms; useful {row['gflops_useful']:.1f} GFLOP/s{lim} "
          f"({row['matmul_gflops_here']:.0f} in the matmul program), padding waste {row['waste']:.0%}")
    return row


def section_parts() -> dict:
    """smollm2 at the issue's server shape (max_num_batched_tokens 512), greedy."""
    from config import SamplingParams

    seqs = max(PART_SEQS)
    eng = make_engine("smollm2", seqs, False, warmup=False, max_model_len=1024, max_num_batched_tokens=512,
                      num_kv_blocks=seqs * 20 + 64)
    progs = part_programs(eng)
    greedy = dict(temperature=0.0, ignore_eos=True)
    rows, k = [], [0]

    def timed_step() -> float:
        t0 = time.perf_counter()
        eng.step()
        return time.perf_counter() - t0

    def prefill(n: int) -> float:  # one fresh prompt of n tokens, computed in one step
        k[0] += 1
        # distinct first tokens: no prefix-cache hit on fill()'s prompts or each other
        eng.add_request(f"prefill-{k[0]}", [1000 + (131 * k[0] + j) % 40000 for j in range(n)],
                        SamplingParams(max_tokens=1, **greedy))
        return timed_step()

    for n in PART_SEQS:
        fill(eng, n, prompt_len=192, start=1000 * n, temperature=0.0, max_tokens=64)
        rows.append(profile_step(eng, progs, timed_step, f"decode {n} seqs"))
        if n == 32:  # the workload's typical mixed step: 32 decodes and a 100-token chunk (bucket 256)
            rows.append(profile_step(eng, progs, lambda: prefill(100), "mixed 32 + 100-token chunk"))
        [eng.abort(s.request_id) for s in list(eng.scheduler.running)]
        while eng.has_unfinished():
            eng.step()
    for t in PART_CHUNKS:
        rows.append(profile_step(eng, progs, lambda: prefill(t), f"prefill {t} tokens"))
    return {"rows": rows, "limits": dict(LIMITS)}

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
    with tempfile.TemporaryDirectory() as d30:
        cold = _warmup_run(30, d30)
        restart = _warmup_run(30, d30)
    print(f"warmup  30 layers ({cold['programs']} programs): cold {cold['warmup_s']:.1f}s wall, "
          f"{cold['warmup_cpu_s']:.1f}s CPU (target <= 40), restart from the cache {restart['warmup_s']:.1f}s wall, "
          f"{restart['warmup_cpu_s']:.1f}s CPU (target <= 10)")
    res = dict(cold=cold, restart=restart)
    if BASELINE:  # the same cold 30-layer warm-up by another checkout (e.g. the unrolled layers), same run
        with tempfile.TemporaryDirectory() as d:
            base = _warmup_run(30, d, BASELINE)
        res["baseline_cold"] = base
        print(f"warmup  baseline {BASELINE}: 30 layers cold {base['warmup_s']:.1f}s wall, {base['warmup_cpu_s']:.1f}s "
              f"CPU ({base['warmup_cpu_s'] / cold['warmup_cpu_s']:.1f}x this tree's CPU)")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=results_dir("step_profile.json"))
    ap.add_argument("--baseline", default="", help="warmup: also time a cold 30-layer warm-up of this checkout")
    ap.add_argument("--_warmup-child", nargs=3, metavar=("LAYERS", "CACHE_DIR", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._warmup_child:
        _warmup_child(int(args._warmup_child[0]), args._warmup_child[1], args._warmup_child[2])
        return
    global BASELINE
    BASELINE = args.baseline

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
