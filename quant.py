"""Weight-only quantization: the decoder layers' linear kernels stored in 8 or 4 bits.

Schemes (a `QuantLinear` holds one; model.py declares the arrays beside each linear):
  int8  --quantization int8: symmetric int8 per output channel, `scale` [out] f32
        (w = q * scale). The scale commutes with the dot, so the matmul reads the int8
        kernel converted to the activation dtype and multiplies its [T, out] result:
        dequantization in the dot's epilogue.
  q8_0  GGUF Q8_0 served as the file stores it: int8 in blocks of 32 input features,
        `block_scale` [in/32, out] float16, the file's own scales (w = q * d): 8.5 bits
        a weight.
  q4_0  GGUF Q4_0: 4-bit codes packed two per byte, kernel uint8 [in/2, out], in the
        file's nibble order (byte k of a block: element k low, element k+16 high),
        w = (q - 8) * d: 4.5 bits a weight.
  q4_1  GGUF Q4_1: packed as q4_0, w = q * d + m (`block_min` [in/32, out] float16):
        5 bits a weight.
A block scale varies along the dot's reduction axis, so the blocked schemes unpack and
scale one layer's kernel inside the jitted step, just before its dot (the layers run
in a lax.scan: one layer's float kernel is live at a time, never the model's).

The embedding and the LM head stay in the model dtype (as vLLM's weight-only methods
leave them); RMSNorm weights and biases too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

GGUF_BLOCK = 32  # input features per GGUF Q8_0 / Q4_0 / Q4_1 block
SCHEMES = ("int8", "q8_0", "q4_0", "q4_1")
BLOCKED = ("q8_0", "q4_0", "q4_1")
PACKED = ("q4_0", "q4_1")


@dataclass(frozen=True)
class WeightQuant:
    """Which linear layers are quantized, and how: (nnx attribute path, scheme) pairs,
    e.g. ("layers.self_attn.q_proj", "int8"). Hashable: it shapes the model's arrays."""

    schemes: tuple[tuple[str, str], ...]
    method: str  # the --quantization value it came from (for the start-up line)

    def __post_init__(self) -> None:
        for path, scheme in self.schemes:
            assert scheme in SCHEMES, (path, scheme)

    def scheme(self, path: str) -> str | None:
        return dict(self.schemes).get(path)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for _, s in self.schemes:
            counts[s] = counts.get(s, 0) + 1
        return f"{self.method}: " + ", ".join(f"{n} linear(s) {s}" for s, n in sorted(counts.items()))


# The decoder layers' linears (nnx attribute paths), the ones a WeightQuant may name.
LAYER_LINEARS = tuple(f"layers.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def int8_everywhere() -> WeightQuant:
    return WeightQuant(tuple((p, "int8") for p in LAYER_LINEARS), "int8")


# ---- the layer ----------------------------------------------------------------------

class QuantLinear(nnx.Module):
    """x [T, in] @ W [in, out] (+ bias) with W stored quantized (see the module doc).
    Parameters are placeholders until loading fills them (model_loader.model_from_hf_tensors)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, scheme: str):
        assert scheme in SCHEMES, scheme
        self.scheme, self.n_in = scheme, n_in
        if scheme in BLOCKED and n_in % GGUF_BLOCK:
            raise ValueError(f"{scheme} needs input features in blocks of {GGUF_BLOCK}, got {n_in} (a linear's input "
                             "features: hidden_size, intermediate_size, or num_attention_heads x head_dim)")
        rows = n_in // 2 if scheme in PACKED else n_in
        self.kernel = nnx.Param(jnp.zeros((rows, n_out), jnp.uint8 if scheme in PACKED else jnp.int8))
        if scheme == "int8":
            self.scale = nnx.Param(jnp.ones((n_out,), jnp.float32))
        else:
            self.block_scale = nnx.Param(jnp.ones((n_in // GGUF_BLOCK, n_out), jnp.float16))
        if scheme == "q4_1":
            self.block_min = nnx.Param(jnp.zeros((n_in // GGUF_BLOCK, n_out), jnp.float16))
        self.bias = nnx.Param(jnp.zeros((n_out,), dtype)) if bias else None

    def dequantized_kernel(self, dtype: jnp.dtype) -> jax.Array:
        """W [in, out] in `dtype` (the blocked schemes' per-layer unpacking; a test reference)."""
        q = self.kernel[...]
        if self.scheme == "int8":
            return (q.astype(jnp.float32) * self.scale[...]).astype(dtype)
        nb, n_out = self.n_in // GGUF_BLOCK, q.shape[-1]
        if self.scheme in PACKED:
            p = q.reshape(nb, GGUF_BLOCK // 2, n_out)
            q = jnp.concatenate([p & 15, p >> 4], axis=1)  # [nb, 32, out]
        q = q.reshape(nb, GGUF_BLOCK, n_out).astype(jnp.float32)
        if self.scheme == "q4_0":
            q = q - 8.0
        w = q * self.block_scale[...].astype(jnp.float32)[:, None, :]
        if self.scheme == "q4_1":
            w = w + self.block_min[...].astype(jnp.float32)[:, None, :]
        return w.reshape(self.n_in, n_out).astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.scheme == "int8":
            y = jnp.dot(x, self.kernel[...].astype(x.dtype), preferred_element_type=jnp.float32) * self.scale[...]
        else:
            y = jnp.dot(x, self.dequantized_kernel(x.dtype), preferred_element_type=jnp.float32)
        y = y.astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


# ---- encoding (host, at load time) ---------------------------------------------------------

@dataclass
class GGUFBlocks:
    """A GGUF Q8_0 / Q4_0 / Q4_1 tensor as stored, unpacked to [out, in] codes (HF's
    layout): q int8 (Q8_0) or uint8 0..15 (Q4), d and m [out, in/32] (float16 values, as float32)."""

    kind: str  # "q8_0", "q4_0", "q4_1"
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def map_rows(self, f: Callable[[np.ndarray], np.ndarray]) -> GGUFBlocks:
        """The same tensor with its output rows rearranged by f (q/k unpermuting)."""
        return GGUFBlocks(self.kind, f(self.q), f(self.d), None if self.m is None else f(self.m))

    def dequantize(self) -> np.ndarray:
        out, n_in = self.q.shape
        q = self.q.reshape(out, n_in // GGUF_BLOCK, GGUF_BLOCK).astype(np.float32)
        if self.kind == "q4_0":
            q = q - 8.0
        w = q * self.d[..., None]
        if self.kind == "q4_1":
            w = w + self.m[..., None]
        return w.reshape(out, n_in)


_GGUF_KINDS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}


def gguf_native_kind(type_name: str) -> str | None:
    """The scheme that serves a GGUF tensor type as stored, None if it is dequantized."""
    return _GGUF_KINDS.get(type_name)


def parse_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GGUFBlocks:
    """A GGUF tensor's bytes (uint8 [out, bytes per row]) as codes and scales, from the
    block layouts of ggml-common.h: Q8_0 {f16 d; int8 qs[32]}, Q4_0 {f16 d; u8 qs[16]},
    Q4_1 {f16 d, m; u8 qs[16]}, a 4-bit block's element k in qs[k]'s low nibble, k+16 in its high."""
    kind = _GGUF_KINDS[type_name]
    out, n_in = shape
    nb = n_in // GGUF_BLOCK
    b = np.ascontiguousarray(raw).reshape(out, nb, -1)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "q8_0":
        return GGUFBlocks(kind, b[..., 2:34].copy().view(np.int8).reshape(out, n_in), d)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "q4_1" else None
    qs = b[..., 4:20] if kind == "q4_1" else b[..., 2:18]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(out, n_in)
    return GGUFBlocks(kind, q, d, m)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [in, out] -> (int8 [in, out], f32 scale [out]): symmetric per output channel,
    scale = max |w| / 127 (a channel whose scale would be 0 gets 1)."""
    w = np.asarray(w, np.float32)
    scale = (np.abs(w).max(axis=0) / np.float32(127.0)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))  # (a subnormal absmax / 127 underflows to 0 too)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def encode(x: np.ndarray | GGUFBlocks, scheme: str) -> dict[str, np.ndarray]:
    """A checkpoint tensor [out, in] (float, or GGUF blocks) -> a QuantLinear's arrays
    ({"kernel", "scale" | "block_scale" [, "block_min"]}, kernels [in, out])."""
    if scheme == "int8":
        q, scale = quantize_int8((x.dequantize() if isinstance(x, GGUFBlocks) else np.asarray(x, np.float32)).T)
        return {"kernel": q, "scale": scale}
    if not isinstance(x, GGUFBlocks) or x.kind != scheme:
        got = x.kind if isinstance(x, GGUFBlocks) else "a float tensor"
        raise ValueError(f"a {scheme} kernel is read from GGUF {scheme.upper()} blocks, got {got}")
    # the file's scales are float16: kept so, exactly
    parts = {"block_scale": x.d.T.astype(np.float16)}
    if scheme == "q4_1":
        parts["block_min"] = x.m.T.astype(np.float16)
    q = x.q
    if scheme in PACKED:
        out, n_in = q.shape
        halves = q.reshape(out, n_in // GGUF_BLOCK, 2, GGUF_BLOCK // 2).astype(np.uint8)
        q = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out, n_in // 2)
    return {"kernel": np.ascontiguousarray(q.T), **parts}


def weight_quant_for(method: str | None, gguf_types: dict[str, set[str]] | None) -> WeightQuant | None:
    """The WeightQuant of --quantization `method` for a checkpoint; gguf_types: a GGUF
    file's tensor types per linear (LAYER_LINEARS path -> the types of its layers), None
    for any other checkpoint. gguf keeps a linear in its blocks when every layer stores
    it as one of Q8_0, Q4_0, Q4_1 (a stacked parameter has one layout); others are
    dequantized to the model dtype."""
    if method is None:
        return None
    if method == "int8":
        return int8_everywhere()
    assert method == "gguf", method
    if gguf_types is None:
        raise ValueError("--quantization gguf serves a GGUF file's quantized tensors; this model is not a .gguf file "
                         "(use --quantization int8 for any checkpoint)")
    schemes = []
    for path in LAYER_LINEARS:
        types = gguf_types.get(path, set())
        kind = gguf_native_kind(next(iter(types))) if len(types) == 1 else None
        if kind is not None:
            schemes.append((path, kind))
    if not schemes:
        found = sorted(set().union(*gguf_types.values())) if gguf_types else []
        raise ValueError(f"--quantization gguf serves Q8_0, Q4_0 and Q4_1 linears natively; this file's linears are "
                         f"{', '.join(found) or 'none'}. Drop --quantization to dequantize them, or use "
                         "--quantization int8")
    return WeightQuant(tuple(schemes), "gguf")

