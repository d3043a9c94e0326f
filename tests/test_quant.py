"""Weight-only quantization (quant.py): the codes and scales against NumPy references, the
GGUF block layouts against the `gguf` library's own quantizer and dequantizer, the
quantized linears against a float matmul, start-up errors, and no compilation after
warm-up with quantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import count_compilations, fresh_step_programs

from config import EngineConfig
from llm import LLM, SamplingParams


def _spec_dequantize(raw: np.ndarray, kind: str, n_in: int) -> np.ndarray:
    """GGUF Q8_0 / Q4_0 / Q4_1 rows, dequantized from ggml-common.h's block layouts with
    plain per-block loops (the reference: no code shared with quant.py)."""
    out = np.zeros((raw.shape[0], n_in), np.float32)
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    for r in range(raw.shape[0]):
        for b in range(n_in // 32):
            blk = raw[r, b * size:(b + 1) * size]
            d = float(np.frombuffer(blk[:2].tobytes(), np.float16)[0])
            if kind == "Q8_0":
                vals = d * np.frombuffer(blk[2:].tobytes(), np.int8).astype(np.float32)
            else:
                m = float(np.frombuffer(blk[2:4].tobytes(), np.float16)[0]) if kind == "Q4_1" else 0.0
                qs = blk[4:] if kind == "Q4_1" else blk[2:]
                codes = np.array([qs[j] & 15 for j in range(16)] + [qs[j] >> 4 for j in range(16)], np.float32)
                vals = d * codes + m if kind == "Q4_1" else d * (codes - 8)
            out[r, b * 32:(b + 1) * 32] = vals
    return out


def _filled_linear(parts: dict[str, np.ndarray], scheme: str, n_in: int, n_out: int):
    from quant import QuantLinear

    lin = QuantLinear(n_in, n_out, False, np.float32, scheme)
    for name, arr in parts.items():
        getattr(lin, name).set_value(np.asarray(arr))
    return lin


def test_int8_per_channel_codes_bound_the_error_and_the_matmul_equals_numpy():
    from quant import encode

    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 96)).astype(np.float32) * rng.uniform(0.01, 3, size=(48, 1)).astype(np.float32)
    w[5] = 0.0  # an all-zero output channel
    parts = encode(w, "int8")  # w is [out, in], as checkpoints store it
    q, s = parts["kernel"], parts["scale"]
    assert q.dtype == np.int8 and q.shape == (96, 48) and s.shape == (48,)
    np.testing.assert_allclose(s, np.abs(w).max(axis=1) / 127 + (np.abs(w).max(axis=1) == 0), rtol=1e-6)
    assert np.all(np.abs(q.astype(np.float32) * s - w.T) <= s / 2 + 1e-7)
    assert np.abs(q).max() == 127
    lin = _filled_linear(parts, "int8", 96, 48)
    x = rng.normal(size=(7, 96)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lin(x)), x @ (q.astype(np.float32) * s), rtol=1e-5, atol=1e-5)


def test_int8_channels_of_tiny_values_get_a_positive_scale():
    """A channel whose absmax / 127 underflows float32 (subnormal weights) gets scale 1 and
    zero codes, as an all-zero one: no 0/0, no NaN cast to int8 (-128, outside the codes)."""
    import warnings

    from quant import quantize_int8

    w = np.zeros((4, 3), np.float32)
    w[:, 1] = [1e-45, -3e-45, 0.0, 2e-45]
    w[:, 2] = [1.0, -0.5, 0.25, 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q, scale = quantize_int8(w)
    assert (scale > 0).all() and np.abs(q).max() <= 127
    np.testing.assert_array_equal(q[:, :2], 0)
    assert np.abs(q * scale - w).max() <= 3e-45 + scale[2] / 2


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_parse_as_the_format_says_and_the_jitted_unpacking_matches(kind):
    import gguf
    import jax

    from quant import encode, parse_gguf_blocks

    rng = np.random.default_rng(1)
    w = rng.normal(size=(24, 128)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    ref = _spec_dequantize(raw, kind, 128)
    np.testing.assert_array_equal(ref, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
    blocks = parse_gguf_blocks(raw, kind, (24, 128))
    np.testing.assert_allclose(blocks.dequantize(), ref, rtol=1e-6, atol=1e-7)
    scheme = kind.lower()
    parts = encode(blocks, scheme)
    bits = 8 if kind == "Q8_0" else 4
    assert parts["kernel"].nbytes == 24 * 128 * bits // 8  # Q4: two codes per byte
    lin = _filled_linear(parts, scheme, 128, 24)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda: lin.dequantized_kernel(np.float32))()), ref.T,
                               rtol=1e-6, atol=1e-7)
    x = rng.normal(size=(5, 128)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lin(x)), x @ ref.T, rtol=1e-4, atol=1e-4)
    # rows rearranged (llama.cpp's q/k permutation undone) move codes and scales together
    perm = rng.permutation(24)
    np.testing.assert_array_equal(blocks.map_rows(lambda r: r[perm]).dequantize(), blocks.dequantize()[perm])


def test_quantization_values_and_combinations_are_checked_at_start_up():
    from cli_args import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--quantization", "int8"])).quantization == "int8"
    assert engine_config(build_parser().parse_args([])).quantization is None
    with pytest.raises(ValueError, match="quantization"):
        engine_config(build_parser().parse_args(["--quantization", "int4"]))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM("tiny", log=lambda _: None, quantization="gguf", warmup=False, num_kv_blocks=8, max_model_len=32)
    from quant import weight_quant_for

    with pytest.raises(ValueError, match="Q4_K"):  # a K-quant file: nothing to serve natively
        weight_quant_for("gguf", {"layers.mlp.up_proj": {"Q4_K"}, "layers.mlp.down_proj": {"Q6_K", "Q4_K"}})
    mixed = weight_quant_for("gguf", {"layers.mlp.up_proj": {"Q4_1"}, "layers.mlp.down_proj": {"Q8_0", "Q4_1"}})
    assert mixed.schemes == (("layers.mlp.up_proj", "q4_1"),)  # a mixed linear is dequantized


def test_int8_weights_shrink_the_measured_bytes_keep_the_tokens_and_never_recompile():
    """tiny with int8 linears: the weights' device bytes (measured from the arrays) drop
    by what the codes save, greedy tokens follow the float model's, and after warm-up a
    mixed workload compiles nothing."""
    kw = dict(log=lambda _: None, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32, num_kv_blocks=32)
    ref = LLM("tiny", warmup=False, **kw)
    fresh_step_programs()  # the int8 engine's warm-up compiles, whatever engines this process built before
    prompts = [[1, 5, 9, 13, 17], [1] + list(range(40, 80)), [1, 300, 200]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    llm = LLM("tiny", quantization="int8", warmup=False, **kw)
    with count_compilations() as warm:
        llm.engine.runner.warmup(lambda _: None)
    assert warm and llm.stats.num_compilations == len(warm)
    with count_compilations() as after:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0.8, seed=1, prompt_logprobs=2))
    assert after == []
    assert got == want
    cfg = llm.engine.model_config
    linear = cfg.num_hidden_layers * cfg.hidden_size * (2 * cfg.num_attention_heads * cfg.head_dim
                                                          + 2 * cfg.num_key_value_heads * cfg.head_dim
                                                          + 3 * cfg.intermediate_size)
    # one f32 scale per output channel: q, k, v, o, gate, up, down
    scales = cfg.num_hidden_layers * 4 * (cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads
                                          * cfg.head_dim + cfg.hidden_size + 2 * cfg.intermediate_size
                                          + cfg.hidden_size)
    assert ref.stats.weight_bytes - llm.stats.weight_bytes == 3 * linear - scales
    assert llm.stats.kv_cache_bytes == ref.stats.kv_cache_bytes > 0
