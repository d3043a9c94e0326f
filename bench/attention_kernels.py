"""Paged-attention kernels on the GPU: how close do they come to the HBM roofline?

    python bench/attention_kernels.py [--out results.json] [--skip-step] [--quick] [--sweep] [--smoke]

What each part measures and how: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import (checked, out_path, positive, positive_float, positive_ints, require_gpu, sections,  # noqa: E402
                    timer, write_json)


FLAGS = (  # flag, type (bool: a switch), default, help
    ("out", str, None, "JSON path (default: $OUT/kernels.json if $OUT is set)"),
    ("batches", positive_ints, [1, 16, 64, 256], None), ("contexts", positive_ints, [512, 2048, 8192], None),
    ("backends", str, "pallas,ref", "of the kernel benches: pallas,ref"),
    ("peak-tbps", positive_float, 4.8, "peak HBM TB/s (H200 datasheet: 4.8)"),
    ("skip-decode", bool, False, None), ("skip-ragged", bool, False, None), ("skip-step", bool, False, None),
    ("step-batches", positive_ints, [1, 32, 256], None), ("step-context", positive, 1024, None),
    ("step-backends", str, "pallas", "pallas,xla"), ("step-iters", positive, 10, None),
    ("smoke", bool, False, "only the compile smoke test: both kernels vs the references on small inputs"),
    ("sweep", bool, False, "tune the decode kernel on the judged cases over the --sweep-* lists"),
    ("sweep-warps", positive_ints, [4, 8], None), ("sweep-stages", positive_ints, [2, 3, 4], None),
    ("sweep-keys", positive_ints, [64, 128], "keys per inner-loop step"),
    ("judge-gib", checked(float, lambda x: x >= 0, "a number >= 0"), 0.5,
     "decode cases reading at least this much KV are judged (and swept)"),
    ("copy-gib", positive_float, 2.0, "buffer of the copy-bandwidth measurement"), ("skip-copy", bool, False, None),
    ("quick", bool, False, "toy shapes, a smoke run of every part (on CPU the kernels are interpreted)"),
    ("require-gpu", bool, False, "fail at once when JAX sees no GPU"))


def parse_args() -> argparse.Namespace:
    """The flags of sys.argv, the --backends lists as lists."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default, what in FLAGS:
        ap.add_argument(f"--{flag}", help=what, **(dict(action="store_true") if kind is bool else dict(
            type=kind, default=default)))
    if "--quick" in sys.argv[1:]:  # toy shapes, unless given; every case judged: the sweep path runs
        ap.set_defaults(batches=[1, 4], contexts=[64], step_batches=[1, 4], step_context=64, step_iters=2,
                        judge_gib=0.0, copy_gib=1 / 16, sweep_warps=[4], sweep_stages=[2])
    args = ap.parse_args()
    args.backends = sections(ap, args.backends, ("pallas", "ref"), "--backends")
    args.step_backends = sections(ap, args.step_backends, ("pallas", "xla"), "--step-backends")
    return args


if __name__ == "__main__":
    parse_args()  # --help and a refused flag answer before JAX loads (seconds)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import attention_backend as ab  # noqa: E402
import kernels_pallas as kp  # noqa: E402
from attention_backend import AttentionShape  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = jnp.bfloat16
ITEMSIZE = jnp.dtype(DTYPE).itemsize
LLAMA3_8B_HF = dict(  # Meta-Llama-3-8B's config.json, the fields that shape the step
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, hidden_act="silu")
# --quick: every code path on toy shapes, the step on a 2-layer scaled-down model
TOY_HF = dict(LLAMA3_8B_HF, num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32, bos_token_id=1, eos_token_id=2)
ROTATE_BYTES = 256 << 20


class Results:
    """Collects rows and rewrites the JSON after each, so a timeout keeps what ran."""

    def __init__(self, path: str | None, meta: dict[str, Any]):
        self.path, self.data = path, {"meta": meta}

    def add(self, part: str, row: dict[str, Any], line: str | None = None) -> None:
        self.data.setdefault(part, []).append(row)
        if self.path:
            write_json(self.path, self.data)
        if line:
            print(line, flush=True)


def timed(fn: Callable[[], Any], runs: int = 5) -> float:
    """Median seconds of fn() (which returns device arrays), after one warm-up call."""
    return timer(lambda: jax.block_until_ready(fn()), runs, warmup=True, stat=statistics.median)


def paged_inputs(rng: np.random.Generator, n: int, S: int, W: int, T: int, seed: int) -> tuple[jax.Array, ...]:
    """n block tables [S, W] over disjoint shuffled blocks 1..n*S*W (block 0 = null), random
    K and V caches of those blocks, and T random queries."""
    nb = n * S * W + 1
    tables = rng.permutation(np.arange(1, nb)).astype(np.int32).reshape(n, S, W)
    key = jax.random.key(seed)
    return (jnp.asarray(tables), jax.random.normal(key, (nb, BS, HKV, D), DTYPE),
            jax.random.normal(jax.random.fold_in(key, 1), (nb, BS, HKV, D), DTYPE),
            jax.random.normal(jax.random.fold_in(key, 2), (T, HQ, D), DTYPE))


def error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def per_call(attn: Callable[..., jax.Array], reps: int, q: jax.Array, tables: jax.Array, kv: tuple,
             pick: Callable[[jax.Array, Any], jax.Array] = lambda t, i: t[0]) -> dict[str, Any]:
    """{"s": seconds per call} of attn(q, *kv[:2], table, *kv[2:]) run reps times in one jitted
    loop, each output the next query and pick(tables, i) the i-th call's block table; or
    {"error": ...}: a failure is a result too, and the bench goes on."""

    @jax.jit
    def run(q, tables, kc, vc, *rest):
        return jax.lax.fori_loop(0, reps, lambda i, q: attn(q, kc, vc, pick(tables, i), *rest, scale=D ** -0.5), q)

    try:
        return {"s": timed(lambda: run(q, tables, *kv)) / reps}
    except Exception as e:
        return {"error": error(e)}


DEFAULT_CONFIG = (4, 2, 64)  # the decode kernel's tuning knobs: Triton warps, pipeline stages, keys per inner step


def bench_copy(res: Results, gib: float, peak: float) -> float:
    """Copy (x -> x + 1, bytes read + written) and read-only (a sum) bandwidth measured here:
    the ceilings the attention kernel is judged against besides the datasheet. Returns the
    copy bandwidth in bytes/s."""
    n = int(gib * 2**30) // 2
    reps = 10

    @functools.partial(jax.jit, donate_argnums=0)
    def copy(x):
        return jax.lax.fori_loop(0, reps, lambda i, x: x + jnp.asarray(1, x.dtype), x)

    @jax.jit
    def read(x):  # "+ i": a loop-invariant sum could be hoisted out of the loop
        return jax.lax.fori_loop(
            0, reps, lambda i, a: a + jnp.sum(x + i.astype(x.dtype), dtype=jnp.float32), jnp.float32(0))

    box = [jnp.zeros((n,), DTYPE)]  # the copy donates its input: each call's output is the next input

    def run_copy():
        box[0] = copy(box[0])
        return box[0]

    copy_s = timed(run_copy) / reps
    read_s = timed(lambda: read(box[0])) / reps
    nbytes = n * 2
    row = dict(bytes=nbytes, copy_gbps=2 * nbytes / copy_s / 1e9, read_gbps=nbytes / read_s / 1e9)
    row["copy_pct_peak"] = 100 * row["copy_gbps"] * 1e9 / peak
    res.add("copy", row, f"copy    {nbytes / 2**30:.1f} GiB buffer: copy {row['copy_gbps']:7.0f} GB/s (read + "
            f"written, {row['copy_pct_peak']:.0f}% of peak) | read-only {row['read_gbps']:7.0f} GB/s")
    return row["copy_gbps"] * 1e9


def bench_decode(res: Results, batches: list[int], contexts: list[int], peak: float,
                 interpret: bool, backends: list[str], sweep: list[tuple[int, int, int]] | None = None,
                 judge_bytes: int = 1 << 29, copy_bw: float | None = None) -> None:
    """The decode grid. Cases reading at least judge_bytes of KV are *judged* (smaller
    ones measure launch and tail effects, not bandwidth) and, with `sweep`, run every
    kernel configuration (warps, stages, keys) in it; the best is the row's pallas figure."""
    rng = np.random.default_rng(0)
    for ctx in contexts:
        for S in batches:
            W = -(-ctx // BS)
            kv_bytes = S * ctx * HKV * D * 2 * ITEMSIZE  # K and V, each read once
            n_tables = int(min(64, max(1, -(-ROTATE_BYTES // kv_bytes))))
            tables, kc, vc, q = paged_inputs(rng, n_tables, S, W, S, ctx * 1000 + S)
            lens = jnp.full((S,), ctx, jnp.int32)
            reps = max(n_tables, 10)
            judged = kv_bytes >= judge_bytes
            row: dict[str, Any] = dict(batch=S, context=ctx, kv_bytes=kv_bytes, reps=reps,
                                       rotated_tables=n_tables, judged=judged)

            def measure(attn):  # rotating among the tables
                r = per_call(attn, reps, q, tables, (kc, vc, lens), lambda t, i: t[i % t.shape[0]])
                if "error" in r:
                    return r
                bw = kv_bytes / r["s"]
                return dict(us=r["s"] * 1e6, gbps=bw / 1e9, pct_peak=100 * bw / peak) | (
                    dict(pct_copy=100 * bw / copy_bw) if copy_bw else {})

            for name in backends:
                if name != "pallas":
                    row[name] = measure(kp.paged_decode_attention_ref)
                    continue
                tried = [dict(config=f"w{w}/s{st}/k{k}", **measure(functools.partial(
                    kp.paged_decode_attention, interpret=interpret, num_warps=w, num_stages=st,
                    pages_per_iter=max(1, k // BS))))
                    for w, st, k in (sweep if sweep and judged else [DEFAULT_CONFIG])]
                ok = [t for t in tried if "us" in t]
                row[name] = min(ok, key=lambda t: t["us"]) if ok else tried[0]
                if len(tried) > 1:
                    row["sweep"] = tried
            if "pallas" in row and "ref" in row and "us" in row["pallas"] and "us" in row["ref"]:
                row["speedup_vs_ref"] = row["ref"]["us"] / row["pallas"]["us"]
            res.add("decode", row, _decode_line(row))
            del kc, vc


def best_configs(res: Results) -> None:
    """How often each configuration was the best of a swept shape (each shape's best is on its decode line)."""
    wins = collections.Counter(r["pallas"]["config"] for r in res.data.get("decode", [])
                               if "sweep" in r and "config" in r.get("pallas", {}))
    if wins:
        res.add("best_config_wins", dict(wins), "best    wins (warps/stages/keys per step): "
                + ", ".join(f"{k} x{v}" for k, v in wins.most_common()))


def _decode_line(r: dict[str, Any]) -> str:
    def cell(x):
        if not isinstance(x, dict):
            return f"{'-':>28}"
        if "error" in x:
            return f"{'ERROR':>28}"
        copy = f" {x['pct_copy']:4.0f}% copy" if "pct_copy" in x else ""
        return f"{x['us']:9.1f} us {x['gbps']:7.0f} GB/s {x['pct_peak']:4.0f}% peak{copy}"
    sp = r.get("speedup_vs_ref")
    best = r.get("pallas", {}).get("config")
    return (f"decode  batch {r['batch']:4d} ctx {r['context']:5d}  KV {r['kv_bytes'] / 2**20:8.1f} MiB"
            f"{' *' if r.get('judged') else '  '}| pallas {cell(r.get('pallas'))}"
            f"{' best of %d: %s' % (len(r['sweep']), best) if 'sweep' in r else ''} | "
            f"ref {cell(r.get('ref'))} | {'x%.2f' % sp if sp else ''}")


RAGGED_CASES = {  # label: (q_lens, kv_lens) per sequence
    "prefill 1x2048": ([2048], [2048]),
    "chunk 512 + 63 decodes @2k": ([512] + [1] * 63, [1024] + [2048] * 63),
}
TOY_RAGGED_CASES = {"prefill 1x32": ([32], [32]), "chunk 8 + 3 decodes": ([8, 1, 1, 1], [24, 40, 40, 40])}


def bench_ragged(res: Results, interpret: bool, backends: list[str],
                 cases: dict[str, tuple[list[int], list[int]]] = RAGGED_CASES) -> None:
    """Prompt-carrying steps, one layer's attention."""
    rng = np.random.default_rng(1)
    for label, (q_lens, kv_lens) in cases.items():
        S, T = len(q_lens), sum(q_lens)
        tables, kc, vc, q = paged_inputs(rng, 1, S, -(-max(kv_lens) // BS), T, 7)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        lens = jnp.asarray(kv_lens, jnp.int32)
        # causal FLOPs: each query row attends to (its position + 1) keys; QK^T and PV
        flops = 4 * HQ * D * sum(sum(k - ql + i + 1 for i in range(ql)) for ql, k in zip(q_lens, kv_lens))
        row: dict[str, Any] = dict(case=label, tokens=T, seqs=S, attn_flops=flops)
        for name in backends:
            attn = (functools.partial(kp.ragged_paged_attention, interpret=interpret)
                    if name == "pallas" else kp.ragged_paged_attention_ref)
            r = per_call(attn, 10, q, tables, (kc, vc, cu, lens))
            row[name] = r if "error" in r else dict(us=r["s"] * 1e6, tflops=flops / r["s"] / 1e12)
        res.add("ragged", row, f"ragged  {label:28s} | " + " | ".join(
            f"{n} " + (f"{row[n]['us']:9.1f} us {row[n]['tflops']:6.1f} TFLOP/s" if "us" in row[n] else "ERROR")
            for n in backends))


def bench_step(res: Results, batches: list[int], context: int, peak: float,
               backends: list[str], steps: int, hf_config: dict[str, Any] = LLAMA3_8B_HF) -> None:
    """The whole decode step of a Llama-3-8B-shaped model (model.py, imported here only)."""
    from flax import nnx

    import model as model_lib

    cfg, t0 = model_lib.ModelConfig.from_hf(hf_config), time.perf_counter()
    graphdef, state = nnx.split(model_lib.init_model(cfg, DTYPE, 0))
    params = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(state)]
    weight_bytes = sum(x.nbytes for _, x in params)
    embed_bytes = sum(x.nbytes for p, x in params if "embed" in p) if not cfg.tie_word_embeddings else 0
    print(f"step    model: {weight_bytes / 1e9:.2f} GB of weights ({len(params)} arrays), "
          f"init {time.perf_counter() - t0:.1f}s", flush=True)
    L, hkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    for name in backends:
        backend = ab.get_attention_backend(name if name == "pallas" else "xla")

        @functools.partial(jax.jit, donate_argnums=(2,))
        def step(state, tokens, kv_caches, attn):
            m = nnx.merge(graphdef, state)
            hidden, kv_caches = m(tokens, attn.kv_lens - 1, kv_caches, attn, backend)
            return jnp.argmax(m.compute_logits(hidden), axis=-1).astype(jnp.int32), kv_caches

        for S in batches:
            W, pos = -(-context // BS), context - 1
            bt = (1 + np.arange(S * W, dtype=np.int32)).reshape(S, W)
            attn = model_lib.AttentionInputs(
                slot_mapping=jnp.asarray(bt[:, pos // BS] * BS + pos % BS),
                block_tables=jnp.asarray(bt), kv_lens=jnp.full((S,), context, jnp.int32))
            box: list[Any] = []  # tokens and the KV cache: the step donates the cache it is given

            def run(n: int) -> None:
                for _ in range(n):
                    box[0], box[1] = step(state, box[0], box[1], attn)
                jax.block_until_ready(box[0])

            try:  # random K/V (timing on zeros can flatter): one random block pattern, tiled
                pattern = jax.random.normal(jax.random.key(S), (S * W + 1, BS, hkv, hd), DTYPE)
                tiled = jnp.broadcast_to(pattern, (L, *pattern.shape))
                box += [jnp.zeros((S,), jnp.int32), (tiled + 0, tiled * 0.5)]
                del pattern, tiled
                compile_s = timer(lambda: run(1), 1)
                sec = timer(lambda: run(steps), 3, stat=statistics.median) / steps
            except Exception as e:
                res.add("step", dict(backend=name, batch=S, context=context, error=error(e)),
                        f"step    {name:6s} batch {S:4d}: ERROR {error(e)}")
                continue
            finally:
                box.clear()
            kv_bytes = L * S * context * hkv * hd * 2 * ITEMSIZE
            w_read = weight_bytes - embed_bytes + S * cfg.hidden_size * ITEMSIZE
            floor = (w_read + kv_bytes) / peak
            row = dict(backend=name, batch=S, context=context, step_ms=sec * 1e3,
                       tokens_per_s=S / sec, weight_bytes_read=w_read, kv_bytes_read=kv_bytes,
                       roofline_ms=floor * 1e3, pct_roofline=100 * floor / sec,
                       first_call_s=compile_s)
            res.add("step", row, f"step    {name:6s} batch {S:4d} ctx {context:5d} | {sec * 1e3:8.2f} ms/step "
                    f"{S / sec:9.0f} tok/s | roofline {floor * 1e3:6.2f} ms ({(w_read + kv_bytes) / 1e9:.1f} GB) -> "
                    f"{100 * floor / sec:5.1f}% | first call {compile_s:.0f}s")


SMOKE_SHAPES = [  # (q heads, kv heads, head_dim, block_size, dtype) of models people serve
    AttentionShape(32, 8, 128, 16, "bfloat16"),    # Llama-3-8B
    AttentionShape(28, 4, 128, 16, "bfloat16"),    # Qwen2-7B: a GQA group of 7, padded to 8
    AttentionShape(32, 32, 128, 16, "bfloat16"),   # Llama-2-7B: no GQA
    AttentionShape(16, 8, 64, 32, "float32"),      # f32, head_dim 64, block 32
]


def bench_smoke(res: Results, interpret: bool, shapes: list[AttentionShape]) -> None:
    """Compile (or interpret) both kernels on small inputs of each shape and check them
    against the references: the engine's own start-up probe (attention_backend.py)."""
    for shape in shapes:
        t0 = time.perf_counter()
        spec = ab.BACKENDS["pallas"]
        reason = None if interpret else ab.unsupported_reason(spec, shape)
        if reason is None:
            reason = ab.probe_kernels(shape, spec.make(interpret), spec.decode_variants)
        seconds = round(time.perf_counter() - t0, 2)
        res.add("smoke", dict(shape=dataclasses.asdict(shape), ok=reason is None, reason=reason, seconds=seconds),
                f"smoke   {shape}: {'ok' if reason is None else 'FAILED: ' + str(reason)} ({seconds}s)")
    if not interpret:  # what `--attention-backend auto` serves for the first shape
        chosen = ab.select_attention_backend("auto", shapes[0]).name
        res.add("smoke_auto", dict(shape=dataclasses.asdict(shapes[0]), backend=chosen),
                f"smoke   --attention-backend auto serves: {chosen}")


def main() -> None:
    args = parse_args()
    on_gpu = require_gpu(args.require_gpu)
    interpret = not on_gpu
    step_config, ragged_cases = (TOY_HF, TOY_RAGGED_CASES) if args.quick else (LLAMA3_8B_HF, RAGGED_CASES)
    out = out_path(args.out, "kernels.json")
    dev = jax.devices()[0]
    meta = dict(jax=jax.__version__, python=platform.python_version(), backend=jax.default_backend(),
                device=getattr(dev, "device_kind", str(dev)), peak_tbps=args.peak_tbps,
                peak_note="vendor datasheet peak HBM bandwidth (H200: 4.8 TB/s), not a measured ceiling",
                lowering="pallas_call + Triton backend" if on_gpu else "pallas interpret mode (CPU)",
                shape=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, block_size=BS, dtype="bfloat16"),
                time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if not on_gpu:
        print("note: no GPU; the Pallas kernels run in interpret mode: these numbers say nothing "
              "about GPU performance", flush=True)
    print(f"# {meta['device']}  jax {meta['jax']}  peak {args.peak_tbps} TB/s  ({meta['lowering']})",
          flush=True)
    res = Results(out, meta)
    peak = args.peak_tbps * 1e12
    if args.smoke:
        bench_smoke(res, interpret, SMOKE_SHAPES[:2] if args.quick else SMOKE_SHAPES)
    if not (args.skip_decode or args.smoke):
        copy_bw = None if args.skip_copy else bench_copy(res, args.copy_gib, peak)
        sweep = [(w, st, k) for w in args.sweep_warps for st in args.sweep_stages for k in args.sweep_keys]
        bench_decode(res, args.batches, args.contexts, peak, interpret, args.backends, sweep if args.sweep else None,
                     int(args.judge_gib * 2**30), copy_bw)
        best_configs(res)
    if not (args.skip_ragged or args.smoke):
        bench_ragged(res, interpret, args.backends, ragged_cases)
    if not (args.skip_step or args.smoke):
        bench_step(res, args.step_batches, args.step_context, peak,
                   args.step_backends, args.step_iters, step_config)
    if out:
        print(f"wrote {out}")
    if args.smoke:
        sys.exit(0 if all(r["ok"] for r in res.data["smoke"]) else 1)


if __name__ == "__main__":
    main()
