"""What does tensor parallelism cost and save? Memory per device and tokens/s at TP 1/2/4 on
forced CPU devices, and start-up from safetensors vs an orbax checkpoint.

    python bench/tp.py [--model tiny --tp 1,2 --requests 4 --max-tokens 8]

Why it is a memory figure, not a speed claim, on CPU: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from report import positive, positive_ints, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench", help="a built-in model")
    p.add_argument("--tp", type=positive_ints, default="1,2,4")
    p.add_argument("--requests", type=positive, default=8)
    p.add_argument("--prompt-len", type=positive, default=64)
    p.add_argument("--max-tokens", type=positive, default=32)
    args = p.parse_args()
    from model_loader import BUILTIN_MODELS  # JAX: loaded once --help and the other flags have answered

    if args.model not in BUILTIN_MODELS:
        p.error(f"argument --model: invalid choice: {args.model!r} (choose from {', '.join(sorted(BUILTIN_MODELS))})")
    return args


if __name__ == "__main__":
    parse_args()  # --help and a refused flag answer before JAX loads (seconds)

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import checkpoint  # noqa: E402
from llm import LLM, SamplingParams  # noqa: E402
from model_loader import BUILTIN_MODELS, hf_state_dict, load_model  # noqa: E402
from offline import hf_config  # noqa: E402
from parallel import bytes_per_device  # noqa: E402


def timed_load(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(jax.tree.leaves(nnx.state(fn().model, nnx.Param)))
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
          f"load {os.getloadavg()[0]:.1f}")
    prompts = [[1] + [(7 * i + 3 * j) % 500 + 3 for j in range(args.prompt_len - 1)] for i in range(args.requests)]
    params, ref = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), None
    print(f"{'tp':>3} {'weights/device MiB':>19} {'KV/device MiB':>14} {'KV blocks':>9} {'tok/s':>8} {'same as tp1':>11}")
    for tp in args.tp:
        llm = LLM(args.model, log=lambda s: None, tensor_parallel_size=tp, max_num_seqs=args.requests,
                  max_model_len=args.prompt_len + args.max_tokens, compilation_cache_dir="", warmup=False)
        w = max(bytes_per_device(nnx.state(llm.engine.loaded.model, nnx.Param)).values())
        kv = max(bytes_per_device(llm.engine.runner.kv_caches).values())
        llm.generate(prompts, params)  # compiles the programs this workload uses
        t0 = time.perf_counter()
        toks = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        dt, ref = time.perf_counter() - t0, ref or toks
        print(f"{tp:>3} {w / 2**20:>19.2f} {kv / 2**20:>14.2f} {llm.engine.num_kv_blocks:>9} "
              f"{sum(map(len, toks)) / dt:>8.1f} {str(toks == ref):>11}", flush=True)
        del llm
    with tempfile.TemporaryDirectory() as d:
        st, ob = os.path.join(d, "safetensors"), os.path.join(d, "orbax")
        write_json(os.path.join(st, "config.json"), hf_config(BUILTIN_MODELS[args.model]))  # (makes the folder)
        save_file(hf_state_dict(load_model(args.model).model), os.path.join(st, "model.safetensors"))
        checkpoint.main(["convert", st, ob])
        loads = [(timed_load(lambda: load_model(st)), timed_load(lambda: checkpoint.load(ob))) for _ in range(2)]
        a, b = (min(x) for x in zip(*loads))  # alternating, the best of 2 of each
        print(f"start-up (weights to device, best of 2): safetensors {a:.2f}s, orbax {b:.2f}s, "
              f"orbax/safetensors {b / a:.2f}x (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
