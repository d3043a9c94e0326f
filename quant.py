"""Weight-only quantization: the decoder layers' linear kernels stored in 8 or 4 bits.

Which linears, in which scheme, is a method's choice (quant_methods.py, `--quantization`).
A scheme is one object in SCHEMES: its arrays (model.py declares each beside its linear,
for parallel.py's sharding), its host encoding from a checkpoint tensor, and its matmul.
  int8  symmetric int8 per output channel, `scale` [out] f32 (w = q * scale). The scale
        commutes with the dot, so the matmul reads the int8 kernel converted to the
        activation dtype and multiplies its [T, out] result: dequantization in the
        dot's epilogue.
  fp8_e4m3  float8_e4m3fn codes with one f32 `tensor_scale` per linear (w = q * scale),
        vLLM's online FP8: scale = absmax / 448, q = w * (1 / scale) clamped to +-448 and
        rounded to nearest even. Dequantized in the epilogue as int8; the codes convert
        exactly to float32, bfloat16 or float16, so the activations stay in the model dtype
        (weight-only, as vLLM's Marlin path on GPUs without FP8 compute).
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

from quant_methods import GGUF_NATIVE, LAYER_LINEARS, QUANTIZATION_METHODS, GGUFTypes, WeightQuant

GGUF_BLOCK = 32  # input features per GGUF Q8_0 / Q4_0 / Q4_1 block
Arrays = dict[str, tuple[tuple[int, ...], type]]  # a scheme's arrays: name -> (shape, numpy dtype)


# ---- the schemes ------------------------------------------------------------------------

@dataclass(frozen=True)
class Scheme:
    """How a QuantLinear stores its kernel W [in, out] (hashable: a static of the model)."""

    name: str

    def arrays(self, n_in: int, n_out: int) -> Arrays:
        """The linear's parameters besides its bias, kernel first."""
        raise NotImplementedError

    def encode(self, x: np.ndarray | GGUFBlocks) -> dict[str, np.ndarray]:
        """A checkpoint tensor [out, in] (float, or GGUF blocks) -> the arrays (kernel [in, out]), on the host."""
        raise NotImplementedError

    def dequantize(self, a: dict[str, jax.Array], dtype: jnp.dtype) -> jax.Array:
        """W [in, out] in `dtype`, in the jitted step."""
        raise NotImplementedError

    def matmul(self, x: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
        """x [T, in] @ W, float32 [T, out]."""
        return jnp.dot(x, self.dequantize(a, x.dtype), preferred_element_type=jnp.float32)

    def input_features(self, kernel_rows: int) -> int:
        return kernel_rows


@dataclass(frozen=True)
class EpilogueScaled(Scheme):
    """Codes [in, out] times a scale that does not vary along the dot's reduction axis
    (per output channel, or one per tensor), from a float tensor: the dot reads the codes
    converted to the activation dtype and the scale multiplies its [T, out] result."""

    scale: str = "scale"  # the scale array's name: model.py declares how it is sharded

    def quantize(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """w [in, out] float32 -> (codes [in, out], scale)."""
        raise NotImplementedError

    def encode(self, x: np.ndarray | GGUFBlocks) -> dict[str, np.ndarray]:
        q, scale = self.quantize((x.dequantize() if isinstance(x, GGUFBlocks) else np.asarray(x, np.float32)).T)
        return {"kernel": q, self.scale: scale}

    def dequantize(self, a: dict[str, jax.Array], dtype: jnp.dtype) -> jax.Array:
        return (a["kernel"].astype(jnp.float32) * a[self.scale]).astype(dtype)

    def matmul(self, x: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
        return jnp.dot(x, a["kernel"].astype(x.dtype), preferred_element_type=jnp.float32) * a[self.scale]


@dataclass(frozen=True)
class PerChannelInt8(EpilogueScaled):
    def arrays(self, n_in: int, n_out: int) -> Arrays:
        return {"kernel": ((n_in, n_out), np.int8), self.scale: ((n_out,), np.float32)}

    def quantize(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return quantize_int8(w)


@dataclass(frozen=True)
class PerTensorFP8(EpilogueScaled):
    scale: str = "tensor_scale"

    def arrays(self, n_in: int, n_out: int) -> Arrays:
        return {"kernel": ((n_in, n_out), jnp.float8_e4m3fn), self.scale: ((), np.float32)}

    def quantize(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return quantize_fp8(w)


@dataclass(frozen=True)
class GGUFBlockScheme(Scheme):
    """A GGUF block type kept as stored: per block of 32 input features a float16 scale d
    (and minimum m), codes q; w = (q - offset) * d (+ m). Block layouts from ggml-common.h:
    Q8_0 {f16 d; int8 qs[32]}, Q4_0 {f16 d; u8 qs[16]}, Q4_1 {f16 d, m; u8 qs[16]}, a 4-bit
    block's element k in qs[k]'s low nibble, k+16 in its high."""

    bits: int = 8  # 8: int8 codes; 4: uint8 codes 0..15, two a byte
    offset: float = 0.0
    has_min: bool = False

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def input_features(self, kernel_rows: int) -> int:
        return kernel_rows * self.per_byte

    def arrays(self, n_in: int, n_out: int) -> Arrays:
        if n_in % GGUF_BLOCK:
            raise ValueError(f"{self.name} needs input features in blocks of {GGUF_BLOCK}, got {n_in} (a linear's "
                             "input features: hidden_size, intermediate_size, or num_attention_heads x head_dim)")
        blocks = ((n_in // GGUF_BLOCK, n_out), np.float16)
        kernel = ((n_in // self.per_byte, n_out), np.int8 if self.bits == 8 else np.uint8)
        return {"kernel": kernel, "block_scale": blocks} | ({"block_min": blocks} if self.has_min else {})

    def parse(self, raw: np.ndarray, shape: tuple[int, int]) -> GGUFBlocks:
        """A tensor's bytes (uint8 [out, bytes per row]) as codes and scales."""
        out, n_in = shape
        b = np.ascontiguousarray(raw).reshape(out, n_in // GGUF_BLOCK, -1)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if self.has_min else None
        head = 4 if self.has_min else 2
        qs = b[..., head:head + GGUF_BLOCK // self.per_byte]
        if self.bits == 8:
            return GGUFBlocks(self, qs.copy().view(np.int8).reshape(out, n_in), d)
        return GGUFBlocks(self, np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(out, n_in), d, m)

    def encode(self, x: np.ndarray | GGUFBlocks) -> dict[str, np.ndarray]:
        if not isinstance(x, GGUFBlocks) or x.scheme != self:
            got = x.kind if isinstance(x, GGUFBlocks) else "a float tensor"
            raise ValueError(f"a {self.name} kernel is read from GGUF {self.name.upper()} blocks, got {got}")
        # the file's scales are float16: kept so, exactly
        parts = {"block_scale": x.d.T.astype(np.float16)}
        if self.has_min:
            parts["block_min"] = x.m.T.astype(np.float16)
        q = x.q
        if self.bits == 4:
            out, n_in = q.shape
            halves = q.reshape(out, n_in // GGUF_BLOCK, 2, GGUF_BLOCK // 2).astype(np.uint8)
            q = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out, n_in // 2)
        return {"kernel": np.ascontiguousarray(q.T), **parts}

    def dequantize(self, a: dict[str, jax.Array], dtype: jnp.dtype) -> jax.Array:
        q = a["kernel"]
        n_in, n_out = self.input_features(q.shape[0]), q.shape[-1]
        nb = n_in // GGUF_BLOCK
        if self.bits == 4:
            p = q.reshape(nb, GGUF_BLOCK // 2, n_out)
            q = jnp.concatenate([p & 15, p >> 4], axis=1)  # [nb, 32, out]
        q = q.reshape(nb, GGUF_BLOCK, n_out).astype(jnp.float32)
        if self.offset:
            q = q - self.offset
        w = q * a["block_scale"].astype(jnp.float32)[:, None, :]
        if self.has_min:
            w = w + a["block_min"].astype(jnp.float32)[:, None, :]
        return w.reshape(n_in, n_out).astype(dtype)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    PerChannelInt8("int8"),
    PerTensorFP8("fp8_e4m3"),
    GGUFBlockScheme("q8_0"),
    GGUFBlockScheme("q4_0", bits=4, offset=8.0),
    GGUFBlockScheme("q4_1", bits=4, has_min=True),
)}


# ---- the layer ----------------------------------------------------------------------

class QuantLinear(nnx.Module):
    """x [T, in] @ W [in, out] (+ bias) with W stored as `scheme` (SCHEMES) says.
    Parameters are placeholders until loading fills them (model_loader.model_from_hf_tensors)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: jnp.dtype, scheme: str):
        self.scheme = SCHEMES[scheme]
        arrays = self.scheme.arrays(n_in, n_out)
        self.parts = tuple(arrays)
        for part, (shape, dt) in arrays.items():
            setattr(self, part, nnx.Param(jnp.zeros(shape, dt)))
        self.bias = nnx.Param(jnp.zeros((n_out,), dtype)) if bias else None

    def arrays(self) -> dict[str, jax.Array]:
        return {part: getattr(self, part)[...] for part in self.parts}

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.scheme.matmul(x, self.arrays()).astype(x.dtype)
        return y if self.bias is None else y + self.bias[...]


# ---- encoding (host, at load time) ---------------------------------------------------------

@dataclass
class GGUFBlocks:
    """A GGUF Q8_0 / Q4_0 / Q4_1 tensor as stored, unpacked to [out, in] codes (HF's
    layout): q int8 (Q8_0) or uint8 0..15 (Q4), d and m [out, in/32] (float16 values, as float32)."""

    scheme: GGUFBlockScheme
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None = None

    @property
    def kind(self) -> str:
        return self.scheme.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    def map_rows(self, f: Callable[[np.ndarray], np.ndarray]) -> GGUFBlocks:
        """The same tensor with its output rows rearranged by f (q/k unpermuting)."""
        return GGUFBlocks(self.scheme, f(self.q), f(self.d), None if self.m is None else f(self.m))

    def dequantize(self) -> np.ndarray:
        out, n_in = self.q.shape
        q = self.q.reshape(out, n_in // GGUF_BLOCK, GGUF_BLOCK).astype(np.float32)
        if self.scheme.offset:
            q = q - self.scheme.offset
        w = q * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(out, n_in)


def parse_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GGUFBlocks:
    """A GGUF tensor of a natively served type (quant_methods.GGUF_NATIVE) as codes and scales."""
    scheme = SCHEMES[GGUF_NATIVE[type_name]]
    assert isinstance(scheme, GGUFBlockScheme), scheme
    return scheme.parse(raw, shape)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [in, out] -> (int8 [in, out], f32 scale [out]): symmetric per output channel,
    scale = max |w| / 127 (a channel whose scale would be 0 gets 1)."""
    w = np.asarray(w, np.float32)
    scale = (np.abs(w).max(axis=0) / np.float32(127.0)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))  # (a subnormal absmax / 127 underflows to 0 too)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


FP8_E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w (any shape) -> (float8_e4m3fn codes, f32 scale []): one scale for the tensor, as
    vLLM's scaled_fp8_quant: scale = max |w| / 448, codes = w * (1 / scale) clamped to
    +-448, rounded to nearest even. A tensor whose scale would not be a normal float32
    (all zero, or weights below 448 * 2**-126) gets 1, so 1 / scale stays finite and its
    codes round to 0."""
    w = np.asarray(w, np.float32)
    scale = np.float32(np.abs(w).max(initial=0.0) / np.float32(FP8_E4M3_MAX))
    if not scale >= np.finfo(np.float32).tiny:
        scale = np.float32(1.0)
    q = np.clip(w * (np.float32(1.0) / scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.astype(jnp.float8_e4m3fn), np.asarray(scale, np.float32)


def encode(x: np.ndarray | GGUFBlocks, scheme: str) -> dict[str, np.ndarray]:
    """A checkpoint tensor [out, in] (float, or GGUF blocks) -> a QuantLinear's arrays
    ({"kernel", "scale" | "tensor_scale" | "block_scale" [, "block_min"]}, kernels [in, out])."""
    return SCHEMES[scheme].encode(x)


def weight_quant_for(method: str | None, gguf_types: GGUFTypes | None) -> WeightQuant | None:
    """The linears --quantization `method` (a registered name) stores quantized, for a
    checkpoint; gguf_types: a GGUF file's tensor types per linear, None for any other
    checkpoint. A method may name only LAYER_LINEARS and SCHEMES."""
    if method is None:
        return None
    quant = QUANTIZATION_METHODS[method]().weight_quant(gguf_types)
    for path, scheme in quant.schemes:
        if path not in LAYER_LINEARS or scheme not in SCHEMES:
            raise ValueError(f"--quantization {method} quantizes {path!r} as {scheme!r}: a method names a decoder "
                             f"layer linear ({', '.join(LAYER_LINEARS)}) and a scheme ({', '.join(SCHEMES)})")
    return quant
