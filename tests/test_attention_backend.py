"""The attention backend cannot crash the engine: on a GPU, `auto` serves the Pallas
kernels only after they pass a start-up check at the engine's shapes, and falls back to
`xla` with one log line otherwise; `pallas` raises. The GPU path runs here on CPU with
the kernels interpreted or replaced by injected broken ones (on_gpu=True)."""

from __future__ import annotations

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


def _off_by_a_little(*args, **kwargs):
    """The reference's answer plus an error a real bug would make (a dropped block moves
    outputs by ~0.1); one that stays non-finite-free and shape-correct."""
    out = ab.ref_decode(*args, scale=kwargs["scale"])
    return out + jnp.asarray(0.1, out.dtype)


def _decode_ref(*args, scale, **knobs):  # the (jitted) reference, accepting the kernel's knobs
    return ab.ref_decode(*args, scale=scale)


def _ragged_ref(*args, scale, **knobs):
    return ab.ref_ragged(*args, scale=scale)


def _backend(decode=_decode_ref, ragged=_ragged_ref):
    return kp.AttentionBackend("pallas", decode, ragged)


def _selected(caplog, name, shape=SHAPE, **kw):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="taxirank.attention"):
        be = ab.select_attention_backend(name, shape, on_gpu=True, **kw)
    return be, [r.getMessage() for r in caplog.records if r.name == "taxirank.attention"]


def test_real_kernels_pass_the_probe_interpreted():
    """The probe's inputs are valid for the real kernels: interpreted, they pass and are served."""
    real = kp.get_attention_backend("pallas", interpret=True)
    assert ab.probe_kernels(SHAPE, real) is None


def test_a_correct_candidate_is_served(caplog):
    good = _backend()
    be, logs = _selected(caplog, "auto", candidate=good)
    assert be is good and not logs


@pytest.mark.parametrize("which", ["decode", "ragged"])
def test_a_kernel_that_raises_falls_back_to_xla_with_one_line(caplog, which):
    be, logs = _selected(caplog, "auto", candidate=_backend(**{which: _failing}))
    assert be.name == "xla" and be.decode is kp.paged_decode_attention_ref
    assert len(logs) == 1 and "\n" not in logs[0]
    assert f"{which} kernel raised RuntimeError: Triton compilation failed" in logs[0]
    assert "serving with the xla backend" in logs[0]
    with pytest.raises(RuntimeError, match=f"pallas: .*{which} kernel raised"):
        ab.select_attention_backend("pallas", SHAPE, on_gpu=True, candidate=_backend(**{which: _failing}))


def test_a_kernel_with_a_wrong_result_falls_back(caplog):
    be, logs = _selected(caplog, "auto", candidate=_backend(decode=_off_by_a_little))
    assert be.name == "xla"
    assert len(logs) == 1 and "decode kernel differs from the reference by 0.1" in logs[0]
    with pytest.raises(RuntimeError, match="differs from the reference"):
        ab.select_attention_backend("pallas", SHAPE, on_gpu=True, candidate=_backend(decode=_off_by_a_little))


def test_a_wrong_result_only_with_one_split_is_caught(caplog):
    """Large batches run the decode kernel with one split (its own output path)."""
    def decode(*args, num_splits=None, **kw):
        out = _decode_ref(*args, **kw)
        return out * 0 if num_splits == 1 else out

    be, logs = _selected(caplog, "auto", candidate=_backend(decode=decode))
    assert be.name == "xla" and "decode kernel (one split) differs" in logs[0]


def test_nan_output_falls_back(caplog):
    be, logs = _selected(caplog, "auto",
                         candidate=_backend(ragged=lambda q, *a, **k: jnp.full_like(q, jnp.nan)))
    assert be.name == "xla" and "ragged kernel gave non-finite values" in logs[0]


@pytest.mark.parametrize("field,value", [("head_dim", 96), ("block_size", 12)])
def test_non_power_of_two_shapes_fall_back_before_compiling(caplog, field, value):
    import dataclasses
    shape = dataclasses.replace(SHAPE, **{field: value})
    be, logs = _selected(caplog, "auto", shape=shape)  # real kernels: never run
    assert be.name == "xla" and f"power-of-two {field}, got {value}" in logs[0]
    with pytest.raises(RuntimeError, match=f"power-of-two {field}"):
        ab.select_attention_backend("pallas", shape, on_gpu=True)


def test_missing_triton_backend_is_a_clear_error_not_mosaic(monkeypatch, caplog):
    """Without jax.experimental.pallas.triton the kernels must not fall through to Mosaic GPU."""
    monkeypatch.setattr(kp, "_pl_triton", None)
    monkeypatch.setattr(kp, "_TRITON_IMPORT_ERROR", "ImportError: no module named triton")
    be, logs = _selected(caplog, "auto", candidate=_backend())
    assert be.name == "xla" and "pallas.triton failed to import" in logs[0]
    with pytest.raises(RuntimeError, match="failed to import"):
        ab.select_attention_backend("pallas", SHAPE, on_gpu=True)
    # and the kernel itself, compiled (not interpreted), says the same at trace time
    q = jax.ShapeDtypeStruct((2, 8, 64), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((9, 16, 2, 64), jnp.bfloat16)
    bt = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    lens = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(RuntimeError, match="failed to import.*--attention-backend xla"):
        jax.eval_shape(functools.partial(kp.paged_decode_attention, scale=0.1), q, kc, kc, bt, lens)


def test_off_gpu_and_explicit_names():
    assert ab.select_attention_backend("auto", SHAPE, on_gpu=False).name == "xla"
    assert ab.select_attention_backend("xla", SHAPE, on_gpu=True, candidate=_backend(_failing)).name == "xla"
    assert ab.select_attention_backend("pallas", SHAPE, on_gpu=False).name == "pallas"  # interpreted
    with pytest.raises(ValueError, match="unknown attention backend"):
        ab.select_attention_backend("cuda", SHAPE)
