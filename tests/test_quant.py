"""Weight-only quantization (quant.py): the codes and scales against NumPy references (FP8
against the e4m3 format's table of values), an fp8 checkpoint against transformers, the
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


def _e4m3_values() -> np.ndarray:
    """Every finite float8_e4m3fn value, from its bit patterns: sign, 4 exponent bits (bias
    7), 3 mantissa bits; exponent 0 is subnormal, S.1111.111 is NaN (no infinities)."""
    vals = []
    for bits in range(256):
        sign, e, m = -1.0 if bits >> 7 else 1.0, (bits >> 3) & 15, bits & 7
        if e == 15 and m == 7:
            continue
        vals.append(sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)))
    return np.unique(vals)


def test_fp8_codes_are_the_nearest_e4m3_values_of_w_over_one_per_tensor_scale():
    """vLLM's online FP8 (scaled_fp8_quant): scale = max |w| / 448 over the whole tensor,
    codes = w * (1 / scale) rounded to nearest even; the largest |w| saturates at +-448."""
    import jax
    import ml_dtypes

    from quant import encode

    rng = np.random.default_rng(3)
    w = rng.normal(size=(40, 64)).astype(np.float32) * rng.uniform(1e-3, 2, size=(40, 1)).astype(np.float32)
    w.flat[rng.integers(w.size)] = -7.5  # the absmax, negative
    parts = encode(w, "fp8_e4m3")  # [out, in] as checkpoints store it
    q, s = parts["kernel"], parts["tensor_scale"]
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (64, 40) and s.shape == () and s.dtype == np.float32
    assert s == np.float32(7.5) / np.float32(448)
    x = np.clip(w.T * (np.float32(1) / s), -448, 448)
    want = x.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))
    assert q.astype(np.float32).min() == -448 and np.sum(q.astype(np.float32) == -448) == 1
    # ml_dtypes' rounding is the nearest value of the format's table, ties to the even code
    table = _e4m3_values()
    dist = np.abs(x.astype(np.float64)[..., None] - table)
    nearest = dist.min(-1)
    assert np.array_equal(np.abs(q.astype(np.float64) - x), nearest)
    ties = (dist == nearest[..., None]).sum(-1) > 1
    assert np.all(q.view(np.uint8)[ties] % 2 == 0)
    # dequantized: within half a step of e4m3 (3 mantissa bits: |w| / 16; 2**-10 of the scale below 2**-6)
    lin = _filled_linear(parts, "fp8_e4m3", 64, 40)
    deq = np.asarray(jax.jit(lambda: lin.scheme.dequantize(lin.arrays(), np.float32))())
    np.testing.assert_array_equal(deq, q.astype(np.float32) * s)
    assert np.all(np.abs(deq - w.T) <= np.maximum(np.abs(w.T) / 16, s * 2.0 ** -10) * (1 + 1e-6))
    assert np.abs(deq - w.T).max() > 0
    x_in = rng.normal(size=(6, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lin(x_in)), x_in @ deq, rtol=1e-5, atol=1e-5)


def test_fp8_all_zero_and_vanishing_weights_get_scale_1_and_zero_codes():
    """A tensor whose max |w| / 448 is 0 or subnormal: scale 1 (1 / scale stays finite, no
    NaN codes), codes 0, so the weight dequantizes to (nearly) itself."""
    import warnings

    from quant import quantize_fp8

    for w in (np.zeros((5, 3), np.float32), np.array([[1e-40, -3e-42], [0.0, 2e-39]], np.float32)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q, scale = quantize_fp8(w)
        assert scale == 1 and not np.isnan(q.astype(np.float32)).any()
        assert np.all(q.astype(np.float32) == 0)


def test_fp8_weights_are_transformers_on_the_fp8_rounded_checkpoint(tmp_path):
    """`--quantization fp8` on a float checkpoint: prompt logprobs within 1e-4 of transformers
    run on the same checkpoint with every decoder-layer linear rounded to e4m3 with one
    scale per tensor (NumPy, ml_dtypes), farther from the float model, and the same greedy
    tokens; the weight bytes shrink by 3 of every 4 bytes of those linears (less one f32 scale each)."""
    import ml_dtypes
    from conftest import hf_rounded_reference, make_hf_checkpoint, prompt_logprob_gap

    def fp8_rounded(name: str, w: np.ndarray) -> np.ndarray | None:
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            return None
        w = w.astype(np.float32)
        scale = np.float32(np.abs(w).max() / np.float32(448))
        codes = np.clip(w * (np.float32(1) / scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return codes.astype(np.float32) * scale

    path = make_hf_checkpoint(tmp_path / "ckpt", "llama2")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 300, n).tolist() for n in (13, 7)]
    floats, want, want_tokens = hf_rounded_reference(path, prompts, 6, fp8_rounded)
    kw = dict(log=lambda _: None, max_num_seqs=4, num_kv_blocks=64, block_size=4, max_model_len=64, warmup=False)
    llm = LLM(path, quantization="fp8", **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=0))
    assert prompt_logprob_gap(outs, prompts, want) < 1e-4
    assert prompt_logprob_gap(outs, prompts, floats) > 1e-3  # the rounding shows
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    ref = LLM(path, **kw)
    cfg = llm.engine.model_config
    layers = llm.engine.loaded.model.layers
    linear = sum(np.prod(lin.kernel[...].shape) for lin in (
        layers.self_attn.q_proj, layers.self_attn.k_proj, layers.self_attn.v_proj, layers.self_attn.o_proj,
        layers.mlp.gate_proj, layers.mlp.up_proj, layers.mlp.down_proj))
    assert ref.stats.weight_bytes - llm.stats.weight_bytes == 3 * linear - 7 * 4 * cfg.num_hidden_layers


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
    np.testing.assert_allclose(np.asarray(jax.jit(lambda: lin.scheme.dequantize(lin.arrays(), np.float32))()), ref.T,
                               rtol=1e-6, atol=1e-7)
    x = rng.normal(size=(5, 128)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lin(x)), x @ ref.T, rtol=1e-4, atol=1e-4)
    # rows rearranged (llama.cpp's q/k permutation undone) move codes and scales together
    perm = rng.permutation(24)
    np.testing.assert_array_equal(blocks.map_rows(lambda r: r[perm]).dequantize(), blocks.dequantize()[perm])


def test_quantization_values_and_combinations_are_checked_at_start_up(capsys):
    from cli_args import build_parser, engine_config

    for name in ("int8", "fp8", "gguf"):
        assert engine_config(build_parser().parse_args(["--quantization", name])).quantization == name
        assert EngineConfig(quantization=name).quantization == name
        assert f"{name} (" in " ".join(build_parser().format_help().split())  # --help: each with its summary
    assert engine_config(build_parser().parse_args([])).quantization is None
    with pytest.raises(SystemExit) as exit_:  # the flag's choices are the registered methods
        build_parser().parse_args(["--quantization", "int4"])
    assert exit_.value.code == 2 and "--quantization/-q: invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
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
