"""The KV cache is updated in place: the compiled decode and ragged step programs alias
every cache argument to an output (donated) and never copy a cache-sized buffer.

A copy would cost a whole cache of HBM traffic per step -- more than the step itself at
any realistic cache size -- and would double the cache's memory; nothing else in the
engine would show it. Read off the optimised HLO that XLA compiles for this machine
(CPU here: the buffer assignment differs by backend, but donation and the scatter's
aliasing are decided the same way)."""

from __future__ import annotations

import math
import re

import jax
import pytest

from config import EngineConfig
from metrics import EngineStats
from model_loader import load_model
from runner import ModelRunner

NUM_BLOCKS = 129  # large enough that no per-step temporary (gathered blocks, scores) is cache-sized


@pytest.fixture(scope="module", params=[("float32", "auto"), ("float32", "int8"), ("float32", "fp8"),
                                        ("float32", "fp8_e5m2"), ("bfloat16", "auto")], ids="-".join)
def compiled_steps(request):
    """{program: (optimised HLO text, [cache leaf shapes])} for the runner's two programs,
    compiled with the exact arguments the runner passes (captured from idle steps); for
    a cache in the model dtype (f32, bf16) and 8-bit ones (values and scales, each updated in place)."""
    dtype, kv_cache_dtype = request.param
    cfg = EngineConfig(model="tiny", dtype=dtype, max_num_seqs=4, max_model_len=64, num_kv_blocks=NUM_BLOCKS,
                       warmup=False, kv_cache_dtype=kv_cache_dtype).resolved(2048)
    runner = ModelRunner(cfg, load_model("tiny", dtype), NUM_BLOCKS, EngineStats())
    captured = {}
    for name in ("_decode", "_ragged"):
        jitted = getattr(runner, name)

        def spy(*args, jitted=jitted, name=name):
            captured[name] = (jitted, args)
            return jitted(*args)

        setattr(runner, name, spy)
    runner.idle_step(decode_rows=4)
    runner.idle_step(tokens=16)
    leaves = jax.tree.leaves(runner.kv_caches)
    shapes = [tuple(x.shape) for x in leaves]
    values = max(leaves, key=lambda x: x.size)  # K's values (or the whole K in the model dtype)
    out = {}
    for name, (jitted, args) in captured.items():
        lowered = jitted.lower(*args)
        out[name] = (lowered.as_text(), lowered.compile().as_text(), shapes, (values.size, values.dtype))
    return out


def _entry_params(hlo: str) -> dict[int, tuple[int, ...]]:
    """ENTRY computation parameter number -> shape."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    return {int(n): tuple(int(d) for d in dims.split(",") if d)
            for dims, n in re.findall(r"= \w+\[([\d,]*)\]\S*\s+parameter\((\d+)\)", entry)}


@pytest.mark.parametrize("program", ["_decode", "_ragged"])
def test_cache_is_donated_and_aliased_to_the_output(compiled_steps, program):
    stablehlo, hlo, cache_shapes, _ = compiled_steps[program]
    # donated at the JAX level: each cache argument carries an output alias, and so does the
    # logits buffer the forward writes, and the ragged forward's hidden-state buffer (the
    # prompt-logprob program reads it; last_tokens is donated to the sample program, compilation.py)
    buffers = 2 if program == "_ragged" else 1
    assert stablehlo.count("tf.aliasing_output") == len(cache_shapes) + buffers
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", hlo)
    assert alias, "the compiled program aliases no argument to an output"
    aliased = {int(p) for p in re.findall(r"\{[\d,]*\}:\s*\((\d+),", alias.group(1))}
    params = _entry_params(hlo)
    cache_params = {n for n, s in params.items() if s in cache_shapes}
    assert len(cache_params) == len(cache_shapes), (cache_params, cache_shapes)
    assert cache_params <= aliased, f"cache parameters {sorted(cache_params - aliased)} are not aliased"


@pytest.mark.parametrize("program", ["_decode", "_ragged"])
def test_no_cache_sized_copy(compiled_steps, program):
    _, hlo, cache_shapes, _ = compiled_steps[program]
    cache_elems = min(math.prod(s) for s in cache_shapes)
    copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy(?:-start)?\(", hlo)
    assert copies, "the pattern finds XLA's copies (some small ones always exist)"
    big = [c for c in copies if math.prod(int(d) for d in c.split(",") if d) >= cache_elems]
    assert not big, f"{program} copies cache-sized buffers: {big}"


@pytest.mark.parametrize("program", ["_decode", "_ragged"])
def test_no_cache_sized_array_in_another_type(compiled_steps, program):
    """Nothing the size of the cache's values is computed in another element type than the
    one they are held in: XLA:CPU, which has no scatter or gather on floats narrower than 32
    bits, would convert the whole fp8 or bf16 cache to f16/f32 and back around every layer's
    write and read (a pass over the whole cache each), and a bitcast of the whole cache to
    another type is a pass over it too."""
    _, hlo, _, (value_elems, value_dtype) = compiled_steps[program]
    types = {"float32": "f32", "int8": "s8", "uint8": "u8", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
             "bfloat16": "bf16", "uint16": "u16"}
    arrays = re.findall(r"= (\w+)\[([\d,]*)\]", hlo)
    assert any(t == types[str(value_dtype)] for t, _ in arrays)
    big = {t for t, dims in arrays if math.prod(int(d) for d in dims.split(",") if d) >= value_elems}
    assert big == {types[str(value_dtype)]}, f"{program} computes cache-sized arrays of {sorted(big)}"
