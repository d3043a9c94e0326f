"""Where a step's time goes: host vs device, and what start-up costs.

    python bench/step_profile.py                       # every section (~10 min on 2 CPU cores)
    python bench/step_profile.py --sections warmup     # one section

Sections (--sections, comma separated):
  warmup  warm-up (every step program compiled) of a SmolLM2-135M-shaped model (30 layers,
          random weights): cold (an empty compilation cache) and a restart from the cache,
          then 4 vs 32 layers of the same width, cold. Each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SECTIONS = ("warmup",)
HERE = os.path.abspath(__file__)

# SmolLM2-135M's shape (the model issue 9 makes the default): 30 layers, width 576.
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


# ---- warmup ------------------------------------------------------------------------------

def _warmup_child(layers: int, cache_dir: str) -> None:
    """In a fresh process: build the engine, report warm-up seconds and programs as JSON."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from engine import EngineConfig, LLMEngine

    name = register_model(f"smol-{layers}", num_hidden_layers=layers)
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=name, warmup=False, compilation_cache_dir="", **WARMUP_ENGINE), log=lambda *_: None)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.runner.warmup(log=lambda *_: None)
    print(json.dumps(dict(layers=layers, warmup_s=time.perf_counter() - t0, build_s=built,
                          programs=eng.stats.num_compilations)))


def _warmup_run(layers: int, cache_dir: str) -> dict:
    out = subprocess.run([sys.executable, HERE, "--_warmup-child", str(layers), cache_dir], capture_output=True,
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
    print(f"warmup  30 layers ({cold['programs']} programs): cold {cold['warmup_s']:.1f}s (target <= 40), "
          f"restart from the cache {restart['warmup_s']:.1f}s (target <= 10)")
    print(f"warmup  cold, 4 layers {four['warmup_s']:.1f}s, 32 layers {thirty_two['warmup_s']:.1f}s: "
          f"ratio {ratio:.2f} (target <= 2)")
    return dict(cold=cold, restart=restart, layers4=four, layers32=thirty_two, ratio_32_4=ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "step_profile.json"))
    ap.add_argument("--_warmup-child", nargs=2, metavar=("LAYERS", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._warmup_child:
        _warmup_child(int(args._warmup_child[0]), args._warmup_child[1])
        return
    from common import machine_info

    results: dict = {"machine": machine_info(), "load_before": os.getloadavg()}
    for name in args.sections.split(","):
        if name not in SECTIONS:
            raise SystemExit(f"unknown section {name!r} (choose from {', '.join(SECTIONS)})")
        results[name] = globals()[f"section_{name}"]()
    results["load_after"] = os.getloadavg()
    print(f"load average before/after: {results['load_before'][0]:.2f} / {results['load_after'][0]:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
