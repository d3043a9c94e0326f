"""Where does a step's time go: weight matmuls, attention, sampling, KV writes, host, idle?

    python bench/step_profile.py                            # every section (~40 min on 2 busy cores)
    python bench/step_profile.py --sections roofline,parts  # the table of docs/PERFORMANCE.md

  roofline  f32 matmul GFLOP/s (2048^3) and memory GB/s: copy, read (a sum), a KV-block gather.
  host      the host-only step (device programs stubbed) per decode bucket; target <= 0.5 ms at 256.
  parts     smollm2 decoding 1-64 sequences, a mixed step, prefill chunks: the step's device time, then
            each part as its own jitted program at its shapes (weight matmuls, LM head, attention, KV
            writes, sampling; `other` = the rest), with its FLOPs, bytes and roofline bound (the slower
            of FLOPs at the matmul rate and bytes at the read rate); useful vs padded FLOPs.
  settings  XLA_FLAGS and dtypes on the decode-32 and prefill-256 steps: fresh processes, alternating.
  padding   the engine's counters (computed vs useful token rows) over a chat-like mix (32 requests,
            16 x 16 + 16 x 128 tokens, prompts of 20-120 words) and the short/long mix, the device stubbed.
  warmup    a SmolLM2-shaped model's warm-up, cold and from the cache (--baseline DIR: DIR's code too).
  stops     256 smollm2 sequences decoding with and without stop strings, the device stubbed: the host
            step, and the server's share (generation.Generation turning the same steps' deltas into text);
            with --baseline DIR, DIR's code measured alike, alternating, in fresh processes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.dirname(HERE)]  # the repo root first (structured.py)
from report import machine_info, positive, results_dir, sections, timer, write_json  # noqa: E402

SECTIONS = ("roofline", "host", "parts", "settings", "padding", "warmup", "stops")
ARGS = argparse.Namespace(baseline="", repeats=2, settings=["default"])
# SmolLM2-135M's shape (the server's default model): 30 layers, width 576.
SMOL = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
WARMUP_ENGINE = dict(max_num_seqs=32, max_model_len=2048, num_kv_blocks=256)  # the defaults: 7 decode + 8 token buckets
SERVER = dict(max_model_len=1024, max_num_batched_tokens=512)  # a serving shape: 1024-token context, 512-token chunks
# settings: name -> (XLA_FLAGS added, EngineConfig overrides). Every flag exists in jax 0.10's XLA.
SETTINGS = {"default": ("", {}), "fast-math": ("--xla_cpu_enable_fast_math=true", {}),
            "no-multi-thread-eigen": ("--xla_cpu_multi_thread_eigen=false", {}),
            "xnnpack": ("--xla_cpu_use_xnnpack=true", {}), "onednn": ("--xla_cpu_use_onednn=true", {}),
            "no-thunk-runtime": ("--xla_cpu_use_thunk_runtime=false", {}),
            "llvm-ir-emitters": ("--xla_cpu_use_fusion_emitters=false", {}),  # XLA:CPU's older fusion emitters
            "ynn-fusion": ("--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce", {}),  # YNNPACK fusions
            "bf16 weights": ("", {"dtype": "bfloat16"}), "int8 weights": ("", {"quantization": "int8"}),
            "int8 KV": ("", {"kv_cache_dtype": "int8"})}
LIMITS: dict[str, float] = {}

def parse_args() -> argparse.Namespace:
    """The flags of sys.argv, --sections and --settings as lists."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=results_dir("step_profile.json"))
    ap.add_argument("--baseline", default="", help="warmup, stops: also measure this checkout's code")
    ap.add_argument("--repeats", type=positive, default=2, help="settings: fresh processes per setting")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="settings: which (the first is the reference)")
    ap.add_argument("--_child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sections = sections(ap, args.sections, SECTIONS)
    args.settings = sections(ap, args.settings, SETTINGS, "--settings")
    if args.baseline and not ({"warmup", "stops"} & {*args.sections} and os.path.isfile(f"{args.baseline}/engine.py")):
        ap.error(f"--baseline wants a checkout (DIR/engine.py) and the warmup or stops section, got {args.baseline!r}")
    return args

if __name__ == "__main__":
    parse_args()  # --help and a refused flag answer before JAX loads (seconds)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

def child(*args: str, flags: str | None = None) -> dict:  # this script's --_child in a fresh process: its programs
    env = None if flags is None else os.environ | {"XLA_FLAGS": flags}  # and its own XLA flags, if given
    out = subprocess.run([sys.executable, HERE, "--_child", *args], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])

def section_roofline() -> dict:
    n = 64 << 20  # 256 MiB of f32
    x = jnp.ones((n,), jnp.float32)
    copy, read = jax.jit(lambda a: a + 0.0), jax.jit(jnp.sum)  # a copy writes fresh pages; a sum only reads
    gbs = 2 * 4 * n / timer(lambda: copy(x).block_until_ready()) / 1e9  # best of 5: the first call compiles
    read_gbs = 4 * n / timer(lambda: read(x).block_until_ready()) / 1e9
    # attention's read: 16-token KV blocks [16, 3 heads, 64] gathered from a 256 MiB cache, in random order
    blocks = x[:n // 3072 * 3072].reshape(-1, 16, 3, 64)
    idx = jnp.asarray(np.random.default_rng(0).permutation(blocks.shape[0]).astype(np.int32))
    gather = jax.jit(lambda c, i: jnp.sum(c[i], axis=(0, 1)))
    gather_gbs = 4 * blocks.size / timer(lambda: gather(blocks, idx).block_until_ready()) / 1e9
    m = 2048
    a, mm = jnp.ones((m, m), jnp.float32), jax.jit(lambda u, v: u @ v)
    gflops = 2 * m ** 3 / timer(lambda: mm(a, a).block_until_ready(), reps=9) / 1e9
    LIMITS.update(copy_gbs=gbs, read_gbs=read_gbs, gather_gbs=gather_gbs, matmul_gflops=gflops)
    print(f"roofline  memory copy {gbs:.1f} GB/s (read + write), read {read_gbs:.1f} GB/s, KV-block gather "
          f"{gather_gbs:.1f} GB/s, matmul {gflops:.1f} GFLOP/s (f32, {m}^3), {jax.devices()[0].platform}")
    return dict(LIMITS)

def make_engine(model: str, max_num_seqs: int, **kw):
    from engine import EngineConfig, LLMEngine
    kw = dict(max_model_len=1024, num_kv_blocks=max_num_seqs * 64 + 1, async_scheduling=False, warmup=False) | kw
    return LLMEngine(EngineConfig(model=model, max_num_seqs=max_num_seqs, **kw), log=lambda *_: None)

def stub_device(runner) -> None:  # the jitted programs replaced by instant stand-ins of the same outputs
    res = lambda n: (np.full(n, 7, np.int32), np.zeros(n, np.float32), np.zeros((n, 20), np.int32),
                     np.zeros((n, 20), np.float32))
    runner._decode = runner._ragged = lambda state, kv_caches, *a: (kv_caches, (np.zeros(1, np.float32),) * 2)
    runner._sample = lambda last_tokens, logits, sample_slot, sampling: (last_tokens, res(sample_slot.shape[0]))

def fill(eng, n: int, prompt_len: int = 64, start: int = 0, prompt: Callable[[int], list[int]] | None = None,
         **params) -> None:  # n requests decoding
    from engine import SamplingParams  # (a baseline checkout's, in its child: both layouts' engine.py export it)
    for i in range(n):
        ids = prompt(i) if prompt else [5 + (i + j) % 200 for j in range(prompt_len)]
        eng.add_request(f"fill-{start + i}", ids, SamplingParams(
            **{"max_tokens": eng.config.max_model_len - prompt_len, "ignore_eos": True, **params}))
    while eng.scheduler.num_waiting or any(not s.is_decode for s in eng.scheduler.running):
        eng.step()

def drain(eng) -> None:
    [eng.abort(s.request_id) for s in list(eng.scheduler.running)]
    [eng.step() for _ in iter(eng.has_unfinished, False)]

def steps(eng, k: int) -> None:
    for _ in range(k):  # not a list of the outputs: 200 steps' deltas kept alive would be promoted
        eng.step()  # to the oldest generation and collected there, and the bench would time the collector

def timed(fn) -> tuple[float, float]:  # wall and process-CPU seconds: neighbours inflate the second least
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c

def prefill(eng, n: int, k: int) -> tuple[float, float]:  # a fresh n-token prompt (no prefix hit) in one step
    from sampling_params import SamplingParams
    eng.add_request(f"prefill-{k}", [1000 + (131 * k + j) % 40000 for j in range(n)],
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return timed(eng.step)

def section_host() -> dict:
    out: dict = {"decode": {}}
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        ms = []
        for async_scheduling in (False, True):
            eng = make_engine("tiny", n, async_scheduling=async_scheduling, max_model_len=2048,
                              max_num_batched_tokens=2048, num_kv_blocks=n * 128 + 1)
            stub_device(eng.runner)
            fill(eng, n)
            ms.append(1e3 * timer(lambda: steps(eng, 200), reps=3) / 200)
            del eng
            gc.collect()  # the next measurement's collections must not walk this engine's objects
        out["decode"][n] = dict(sync_ms=ms[0], async_ms=ms[1])
        print(f"host    decode, {n:3d} sequences: {ms[0]:.3f} ms/step sync, {ms[1]:.3f} ms async"
              + ("  (target <= 0.5 ms)" if n == 256 else ""))
    return out

def part_programs(eng) -> dict:  # each part of a step as a jitted program over the real weights (as arguments)
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
                kv_writes=jax.jit(kv_writes, donate_argnums=0), lm_head=lm_head)

def step_work(cfg, args: tuple, sample_slot, decode: bool, idle: int, block_size: int) -> dict:
    """Useful (real rows) and computed (padded) FLOPs; each part's FLOPs and bytes (f32, KV blocks read whole)."""
    H, L, V, D, f = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.head_dim, 4
    body = L * (H * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D
                + cfg.num_attention_heads * D * H + 3 * H * cfg.intermediate_size)
    kv_lens = args[5]
    real = int((kv_lens > 0).sum()) if decode else int(args[6][-1])
    q = ((kv_lens > 0) if decode else args[6][1:] - args[6][:-1]).astype(int).tolist()
    ctx = sum(k * n - n * (n - 1) // 2 for k, n in zip(kv_lens.tolist(), q))  # causal: each query its prefix
    kv_tok = sum(-(-k // block_size) * block_size for k, n in zip(kv_lens.tolist(), q) if n)  # blocks read whole
    attn, kv_row = 4 * L * cfg.num_attention_heads * D * ctx, 2 * L * cfg.num_key_value_heads * D * f
    T, R, sampled = len(args[0]), len(kv_lens), int((sample_slot != idle).sum())
    parts = dict(matmuls=(2 * body * T, f * (body + 2 * T * H * L)), lm_head=(2 * V * H * R, f * V * (H + R)),
                 attention=(attn, kv_row * kv_tok), kv_writes=(0, kv_row * T), sampling=(0, f * V * R))
    return dict(real=real, T=T, sampled=sampled, R=R, body=2 * body, parts=parts,
                useful=2 * body * real + 2 * V * H * sampled + attn, computed=2 * body * T + 2 * V * H * R + attn)

def bound_ms(flops: float, nbytes: float) -> float:  # roofline: FLOPs at the matmul rate or bytes at the read rate
    return max(flops / LIMITS["matmul_gflops"], nbytes / LIMITS["read_gbs"]) / 1e6

def profile_step(eng, progs: dict, run_step, label: str) -> dict:
    """Run the step (run_step() returns its wall seconds), then time each part at its shapes."""
    from distributed import DECODE, RAGGED, SAMPLE
    r, cfg = eng.runner, eng.model_config
    seen, inner, execute, device = {}, r._run, r.execute, []
    r._run = lambda kind, rows, T, args: seen.update({kind: args}) or inner(kind, rows, T, args)  # forward, sampler
    def timed_execute(*a):  # the loop is synchronous: it would wait for this step's results at once
        t0 = time.perf_counter()
        (step := execute(*a)).block_until_ready()
        device.append(time.perf_counter() - t0)
        return step
    r.execute = timed_execute
    wall = min(run_step() for _ in range(3))[0]
    r._run, r.execute, device = inner, execute, min(device)
    decode, sample_slot = DECODE in seen, seen[SAMPLE][0]
    args = seen[DECODE if decode else RAGGED]
    f = step_work(cfg, args, sample_slot, decode, r._idle, eng.config.block_size)
    T, R, ready, rng = f["T"], f["R"], jax.block_until_ready, np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 0.1, (T, cfg.hidden_size)), jnp.float32)
    q = jnp.asarray(rng.normal(0, 1, (T, cfg.num_attention_heads, cfg.head_dim)), jnp.float32)
    new = jnp.zeros((T, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)
    bt, kv_lens, cu = jnp.asarray(args[4]), jnp.asarray(args[5]), None if decode else jnp.asarray(args[6])
    slots = jnp.asarray(args[3])
    parts = {"kv_writes": lambda: setattr(r, "kv_caches", ready(progs["kv_writes"](r.kv_caches, new, slots))),
             "matmuls": lambda: ready(progs["matmuls"](x, progs["ws"])),
             "lm_head": lambda: ready(progs["lm_head"](x[:R], progs["emb"])),
             "attention": lambda: ready(progs["attention"](q, r.kv_caches, bt, kv_lens, cu)),
             "sampling": lambda: setattr(r, "last_tokens", ready(r._sample(r.last_tokens, *r._program(  # the runner's
                 SAMPLE, seen[SAMPLE])[1][1:])[0]))}  # sample program on the step's logits and sampling rows
    ms = {name: 1e3 * timer(fn, reps=6) for name, fn in parts.items()}  # best of 6: the first call compiles
    ms.update(step=1e3 * device, other=1e3 * device - sum(ms.values()), wall=1e3 * wall,
              host_idle=1e3 * (wall - device))
    flops, nbytes = sum(a for a, _ in f["parts"].values()), sum(b for _, b in f["parts"].values())
    bounds = {k: bound_ms(*fb) for k, fb in f["parts"].items()} | {"step": bound_ms(flops, nbytes)}
    row = dict(label=label, ms=ms, **f, bytes=nbytes, bound_ms=bounds, gflops_useful=f["useful"] / device / 1e9,
               waste=1 - f["useful"] / f["computed"], matmul_gflops_here=f["body"] * T / ms["matmuls"] / 1e6)
    print(f"parts   {label:24s} T {f['real']}/{T}, head rows {f['sampled']}/{R}: "
          + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()) + " ms; bound ms (% reached) "
          + ", ".join(f"{k} {b:.1f} ({b / ms[k]:.0%})" for k, b in bounds.items())
          + f"; {nbytes / 1e6:.0f} MB; useful {row['gflops_useful']:.1f} GFLOP/s, padding waste {row['waste']:.0%}")
    return row

def section_parts() -> dict:
    LIMITS or section_roofline()
    eng = make_engine("smollm2", 64, num_kv_blocks=64 * 20 + 64, **SERVER)
    progs, rows, k = part_programs(eng), [], iter(range(1, 1 << 30))
    for n in (1, 8, 32, 64):
        fill(eng, n, prompt_len=192, start=1000 * n, temperature=0.0, max_tokens=64)
        rows.append(profile_step(eng, progs, lambda: timed(eng.step), f"decode {n} seqs"))
        if n == 32:  # the workload's typical mixed step: 32 decodes and a 100-token chunk (bucket 256)
            rows.append(profile_step(eng, progs, lambda: prefill(eng, 100, next(k)), "mixed 32 + 100-token chunk"))
        drain(eng)
    for t in (64, 128, 256, 512):
        rows.append(profile_step(eng, progs, lambda: prefill(eng, t, next(k)), f"prefill {t} tokens"))
    return {"rows": rows, "limits": dict(LIMITS)}

def _settings_child(name: str) -> dict:
    eng = make_engine("smollm2", 32, num_kv_blocks=32 * 20 + 64, **SERVER, **SETTINGS[name][1])
    fill(eng, 32, prompt_len=192, temperature=0.0, max_tokens=64)
    decode = [timed(eng.step) for _ in range(12)][2:]  # the first runs compile
    tokens = [list(s.output_token_ids) for s in sorted(eng.scheduler.running, key=lambda s: s.request_id)]
    drain(eng)
    pre = [prefill(eng, 256, k) for k in range(7)][2:]
    med = lambda xs, i: 1e3 * statistics.median(x[i] for x in xs)
    return dict(decode_ms=med(decode, 0), decode_cpu_ms=med(decode, 1), prefill_ms=med(pre, 0),
                prefill_cpu_ms=med(pre, 1), tokens=tokens)

def section_settings() -> dict:
    runs: dict = {name: [] for name in ARGS.settings}
    for _ in range(ARGS.repeats):
        for name in runs:  # alternating: a neighbour's burst of load falls on every setting alike
            runs[name].append(r := child("settings", name, flags=SETTINGS[name][0]) | {"load": os.getloadavg()[0]})
            same = sum(a == b for a, b in zip(r["tokens"], next(iter(runs.values()))[0]["tokens"]))
            print(f"settings {name:22s} " + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "tokens")
                  + f" (ms); greedy tokens as the first setting's in {same}/{len(r['tokens'])} rows", flush=True)
    return {name: dict(flags=SETTINGS[name][0], engine=SETTINGS[name][1], runs=rs) for name, rs in runs.items()}

def section_padding() -> dict:
    from sampling_params import SamplingParams
    from workload import short_long_mix
    eng, out = make_engine("smollm2", 32, **SERVER), {}
    stub_device(eng.runner)
    chat = short_long_mix(32, 49152, long=128, prompt_len=(20, 120), text=True)
    for label, reqs in (("chat: 16 x 16 + 16 x 128, 20-120 words", chat), ("short/long mix", short_long_mix(100, 49152))):
        s0 = eng.stats.snapshot()
        for i, rq in enumerate(reqs):
            ids = rq.prompt_token_ids or eng.tokenizer.encode(rq.prompt_text)
            eng.add_request(f"{label[:5]}-{i}", ids, SamplingParams(max_tokens=rq.max_tokens, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        keys = ("computed_tokens", "useful_tokens", "computed_logit_rows", "useful_logit_rows", "num_steps")
        out[label] = d = {k: getattr(eng.stats.snapshot(), k) - getattr(s0, k) for k in keys}
        print(f"padding {label}: {d}, {1 - d['useful_tokens'] / d['computed_tokens']:.1%} of the token rows padding")
    return out

def _at_root(root: str, *homes: str):
    """The name at the first of `homes` ("module.name") whose module is a file under root: a
    baseline checkout keeps each name where its own layout put it, and a module it lacks must
    not be read from this tree (the repo root is on sys.path after it)."""
    import importlib
    for home in homes:
        module, name = home.rsplit(".", 1)
        if os.path.isfile(os.path.join(root, module + ".py")):
            return getattr(importlib.import_module(module), name)
    raise ImportError(f"{root} has none of {', '.join(homes)}")

def _warmup_child(cache_dir: str, root: str) -> dict:  # the code at `root`: build, warm up, seconds and programs
    sys.path.insert(0, root)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from engine import EngineConfig, LLMEngine
    from model import ModelConfig
    BUILTIN_MODELS = _at_root(root, "model_loader.BUILTIN_MODELS", "model.BUILTIN_MODELS")
    BUILTIN_MODELS["smol-30"] = ModelConfig(**SMOL)  # random weights of SmolLM2's shape
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model="smol-30", warmup=False, compilation_cache_dir="",
                                 **WARMUP_ENGINE), log=lambda *_: None)
    built = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    eng.runner.warmup(log=lambda *_: None)  # CPU seconds too: on a shared machine the wall measures the neighbours
    return dict(warmup_s=time.perf_counter() - t0, warmup_cpu_s=time.process_time() - c0, build_s=built,
                programs=eng.stats.num_compilations)

def section_warmup() -> dict:
    with tempfile.TemporaryDirectory() as d:
        cold, restart = child("warmup", d, ROOT), child("warmup", d, ROOT)
    print(f"warmup  30 layers ({cold['programs']} programs): cold {cold['warmup_s']:.1f}s wall, "
          f"{cold['warmup_cpu_s']:.1f}s CPU (target <= 40), from the cache {restart['warmup_s']:.1f}s wall, "
          f"{restart['warmup_cpu_s']:.1f}s CPU (<= 10)")
    res = dict(cold=cold, restart=restart)
    if ARGS.baseline:  # the same cold warm-up by another checkout, in the same run
        with tempfile.TemporaryDirectory() as d:
            res["baseline_cold"] = base = child("warmup", d, ARGS.baseline)
        print(f"warmup  baseline {ARGS.baseline}: 30 layers cold {base['warmup_s']:.1f}s wall, "
              f"{base['warmup_cpu_s']:.1f}s CPU ({base['warmup_cpu_s'] / cold['warmup_cpu_s']:.1f}x this tree's)")
    return res

STOPS = ("</answer>", "\n\nUser:")  # typical stop strings, never completed here

def _stops_child(root: str, n: int = 256, k: int = 16) -> dict:  # the code at `root`: host and server CPU ms/step
    sys.path.insert(0, root)
    import asyncio
    from engine import EngineRequest  # (both layouts' engine.py export it)
    Generation = _at_root(root, "generation.Generation", "server.Generation")
    words = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest. " * 4
    out = {}
    for label, stop in (("no stop strings", ()), ("stop strings", STOPS)):
        eng = make_engine("smollm2", n, max_model_len=256, max_num_batched_tokens=2048, num_kv_blocks=n * 5 + 1)
        stub_device(eng.runner)  # its token: the row's last input token, a word of the prompt
        prompt = eng.tokenizer.encode(words, add_special_tokens=False)[:16]
        fill(eng, n, prompt=lambda i: prompt[i % 8:] + prompt[:i % 8], max_tokens=200, stop=stop)
        host = 1e3 * min(timed(lambda: steps(eng, k))[1] for _ in range(3)) / k
        per_request: dict[str, list] = {}
        for _ in range(k):
            for d in eng.step():
                per_request.setdefault(d.request_id, []).append(d)

        async def stream(rid: str):
            for d in per_request[rid]:
                yield d

        engine = types.SimpleNamespace(  # what a Generation reads of an AsyncEngine: these deltas as its stream
            tokenizer=eng.tokenizer, model_config=eng.model_config, abort=lambda rid: None,
            add_request=lambda request: stream(request.request_id))

        async def serve() -> float:
            gens = [Generation(engine, EngineRequest(s.request_id, s.prompt_token_ids, s.params))
                    for s in eng.scheduler.running]
            c0 = time.process_time()
            for g in gens:
                async for _ in g.chunks():
                    pass
            return time.process_time() - c0
        srv = 1e3 * min(asyncio.run(serve()) for _ in range(3)) / k
        out[label] = dict(host_ms=host, server_ms=srv)
        del eng
        gc.collect()
    return out

def section_stops() -> dict:
    roots = {"this tree": ROOT} | ({"baseline": ARGS.baseline} if ARGS.baseline else {})
    runs: dict[str, list[dict]] = {name: [] for name in roots}
    for _ in range(ARGS.repeats):
        for name, root in roots.items():  # alternating: a neighbour's burst falls on both alike
            runs[name].append(child("stops", root))
    best = {name: {label: {key: min(r[label][key] for r in rs) for key in ("host_ms", "server_ms")}
                   for label in rs[0]} for name, rs in runs.items()}
    print("stops   256 smollm2 sequences decoding, device stubbed, CPU ms per step (best of "
          f"{ARGS.repeats} processes): host step + server's detokenizing = total")
    for label in ("no stop strings", "stop strings"):
        print(f"stops   {label:16s} " + " | ".join(
            f"{name}: {b[label]['host_ms']:.2f} + {b[label]['server_ms']:.2f} = "
            f"{b[label]['host_ms'] + b[label]['server_ms']:.2f}" for name, b in best.items()))
    return dict(best=best, runs=runs)

def main() -> None:
    global ARGS
    ARGS = parse_args()
    if ARGS._child:
        kind, *rest = ARGS._child
        children = {"settings": _settings_child, "warmup": _warmup_child, "stops": _stops_child}
        print(json.dumps(children[kind](*rest)))
        return
    results: dict = {"machine": machine_info(), "load_before": os.getloadavg()}
    for name in ARGS.sections:
        results[name] = globals()[f"section_{name}"]()
    results["load_after"] = os.getloadavg()
    print(f"load average before/after: {results['load_before'][0]:.2f} / {results['load_after'][0]:.2f}")
    write_json(ARGS.out, results)

if __name__ == "__main__":
    main()
