"""The attention backend cannot crash the engine: on a GPU, `auto` serves the Pallas
kernels only after they pass a start-up check at the engine's shapes, and falls back to
`xla` with one log line otherwise; `pallas` raises. The GPU path runs here on CPU
(jax.default_backend patched to say "gpu") with the kernels interpreted or the `pallas`
registration replaced by one whose functions are broken."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import pytest

import attention_backend as ab
import kernels_pallas as kp

SHAPE = ab.AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")


def _failing(*args, **kwargs):
    raise RuntimeError("Triton compilation failed: out of shared memory\nsecond line of the report")


ref_decode = jax.jit(kp.paged_decode_attention_ref, static_argnames="scale")
ref_ragged = jax.jit(kp.ragged_paged_attention_ref, static_argnames="scale")


def _off_by_a_little(*args, **kwargs):
    """The reference's answer plus an error a real bug would make (a dropped block moves
    outputs by ~0.1); one that stays non-finite-free and shape-correct."""
    out = ref_decode(*args, scale=kwargs["scale"])
    return out + jnp.asarray(0.1, out.dtype)


def _decode_ref(*args, scale, **knobs):  # the (jitted) reference, accepting the kernel's knobs
    return ref_decode(*args, scale=scale)


def _ragged_ref(*args, scale, **knobs):
    return ref_ragged(*args, scale=scale)


@pytest.fixture(autouse=True)
def on_gpu(monkeypatch):
    """The selection sees a GPU; the kernels themselves run wherever JAX runs."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.fixture
def kernels(monkeypatch):
    """kernels(decode=..., ragged=...) replaces the `pallas` registration's functions,
    keeping everything it declares."""
    def install(decode=_decode_ref, ragged=_ragged_ref):
        spec = dataclasses.replace(ab.BACKENDS["pallas"], build=lambda interpret: (decode, ragged))
        monkeypatch.setitem(ab.BACKENDS, "pallas", spec)
        return spec
    return install


def _selected(caplog, name, shape=SHAPE):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="taxirank.attention"):
        be = ab.select_attention_backend(name, shape)
    return be, [r.getMessage() for r in caplog.records if r.name == "taxirank.attention"]


def test_real_kernels_pass_the_probe_interpreted():
    """The probe's inputs are valid for the real kernels: interpreted, they pass and are served."""
    spec = ab.BACKENDS["pallas"]
    assert ab.probe_kernels(SHAPE, spec.make(interpret=True), spec.decode_variants) is None


def test_a_correct_candidate_is_served(caplog, kernels):
    kernels()
    be, logs = _selected(caplog, "auto")
    assert be.name == "pallas" and be.decode is _decode_ref and not logs


@pytest.mark.parametrize("which", ["decode", "ragged"])
def test_a_kernel_that_raises_falls_back_to_xla_with_one_line(caplog, kernels, which):
    kernels(**{which: _failing})
    be, logs = _selected(caplog, "auto")
    assert be.name == "xla" and be.decode is kp.paged_decode_attention_ref
    assert len(logs) == 1 and "\n" not in logs[0]
    assert f"{which} kernel raised RuntimeError: Triton compilation failed" in logs[0]
    assert "serving with the xla backend" in logs[0]
    with pytest.raises(RuntimeError, match=f"pallas: .*{which} kernel raised"):
        ab.select_attention_backend("pallas", SHAPE)


def test_a_kernel_with_a_wrong_result_falls_back(caplog, kernels):
    kernels(decode=_off_by_a_little)
    be, logs = _selected(caplog, "auto")
    assert be.name == "xla"
    assert len(logs) == 1 and "decode kernel differs from the reference by 0.1" in logs[0]
    with pytest.raises(RuntimeError, match="differs from the reference"):
        ab.select_attention_backend("pallas", SHAPE)


def test_a_wrong_result_only_with_one_split_is_caught(caplog, kernels):
    """Large batches run the decode kernel with one split (its own output path)."""
    def decode(*args, num_splits=None, **kw):
        out = _decode_ref(*args, **kw)
        return out * 0 if num_splits == 1 else out

    kernels(decode=decode)
    be, logs = _selected(caplog, "auto")
    assert be.name == "xla" and "decode kernel (one split) differs" in logs[0]


def test_nan_output_falls_back(caplog, kernels):
    kernels(ragged=lambda q, *a, **k: jnp.full_like(q, jnp.nan))
    be, logs = _selected(caplog, "auto")
    assert be.name == "xla" and "ragged kernel gave non-finite values" in logs[0]


@pytest.mark.parametrize("field,value", [("head_dim", 96), ("block_size", 12)])
def test_non_power_of_two_shapes_fall_back_before_compiling(caplog, field, value):
    shape = dataclasses.replace(SHAPE, **{field: value})
    be, logs = _selected(caplog, "auto", shape=shape)  # real kernels: never run
    assert be.name == "xla" and f"power-of-two {field}, got {value}" in logs[0]
    with pytest.raises(RuntimeError, match=f"power-of-two {field}"):
        ab.select_attention_backend("pallas", shape)


def test_missing_triton_backend_is_a_clear_error_not_mosaic(monkeypatch, caplog, kernels):
    """Without jax.experimental.pallas.triton the kernels must not fall through to Mosaic GPU."""
    monkeypatch.setattr(kp, "_pl_triton", None)
    monkeypatch.setattr(kp, "_TRITON_IMPORT_ERROR", "ImportError: no module named triton")
    kernels()
    be, logs = _selected(caplog, "auto")
    assert be.name == "xla" and "pallas.triton failed to import" in logs[0]
    with pytest.raises(RuntimeError, match="failed to import"):
        ab.select_attention_backend("pallas", SHAPE)
    # and the kernel itself, compiled (not interpreted), says the same at trace time
    q = jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((9, 16, 2, 64), jnp.bfloat16)
    bt = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(RuntimeError, match="failed to import.*--attention-backend xla"):
        jax.eval_shape(functools.partial(kp.paged_decode_attention, scale=0.1), q, kc, kc, bt, lens)


def test_off_gpu_and_explicit_names(monkeypatch, kernels):
    kernels(_failing, _failing)
    assert ab.select_attention_backend("xla", SHAPE).name == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert ab.select_attention_backend("auto", SHAPE).name == "xla"
    assert ab.select_attention_backend("pallas", SHAPE).name == "pallas"  # interpreted, unchecked
    with pytest.raises(ValueError, match="attention_backend must be auto, xla or pallas, got 'cuda'"):
        ab.select_attention_backend("cuda", SHAPE)


def test_config_validation_asks_the_registry(monkeypatch):
    from config import EngineConfig

    with pytest.raises(ValueError, match="attention_backend must be auto, xla or pallas, got 'cuda'"):
        EngineConfig(attention_backend="cuda")
    monkeypatch.setitem(ab.BACKENDS, "cuda", dataclasses.replace(ab.REFERENCE, name="cuda"))
    assert EngineConfig(attention_backend="cuda").attention_backend == "cuda"
