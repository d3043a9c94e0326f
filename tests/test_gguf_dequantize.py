"""GGUF dequantization against the block formats as ggml defines them (ggml-common.h's
block structs, ggml-quants.c's dequantize_row_*), written out here in NumPy: random
blocks -> bytes -> gguf_loader.dequantize, compared with this file's own decoding of the
same bytes. The reference never calls the gguf library, so a layout both got wrong the
same way cannot pass unseen."""

from __future__ import annotations

import numpy as np
import pytest

import gguf_loader

QK = 32  # elements per block of the legacy types
QK_K = 256  # elements per super-block of the k-quants


def f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian IEEE half-precision at byte columns raw[..., 0:2], as float32."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)[..., 0]


def u32(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<u4")[..., 0].astype(np.int64)


def low_high(qs: np.ndarray) -> np.ndarray:
    """Legacy layout: byte j holds element j in its low nibble and element j+16 in its high."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int64)


def ref_q4_0(b: np.ndarray) -> np.ndarray:  # {half d; u8 qs[16]}
    return f16(b[:, 0:2])[:, None] * (low_high(b[:, 2:18]) - 8)


def ref_q4_1(b: np.ndarray) -> np.ndarray:  # {half d; half m; u8 qs[16]}
    return f16(b[:, 0:2])[:, None] * low_high(b[:, 4:20]) + f16(b[:, 2:4])[:, None]


def fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: bit j of the 32-bit qh is element j's fifth bit."""
    return ((u32(qh)[:, None] >> np.arange(QK)) & 1) << 4


def ref_q5_0(b: np.ndarray) -> np.ndarray:  # {half d; u8 qh[4]; u8 qs[16]}
    return f16(b[:, 0:2])[:, None] * ((low_high(b[:, 6:22]) | fifth_bits(b[:, 2:6])) - 16)


def ref_q5_1(b: np.ndarray) -> np.ndarray:  # {half d; half m; u8 qh[4]; u8 qs[16]}
    return f16(b[:, 0:2])[:, None] * (low_high(b[:, 8:24]) | fifth_bits(b[:, 4:8])) + f16(b[:, 2:4])[:, None]


def ref_q8_0(b: np.ndarray) -> np.ndarray:  # {half d; i8 qs[32]}
    return f16(b[:, 0:2])[:, None] * b[:, 2:34].view(np.int8).astype(np.float32)


def ref_q2_k(b: np.ndarray) -> np.ndarray:
    """{u8 scales[16]; u8 qs[64]; half d; half dmin}: 16 groups of 16; group g's scale is
    scales[g] & 15 and its min scales[g] >> 4; each 128-element half takes 32 bytes of qs,
    whose 2-bit fields at shift 0,2,4,6 are four 32-element runs (bytes 0-15 then 16-31)."""
    scales, qs, d, dmin = b[:, :16].astype(np.int64), b[:, 16:80].astype(np.int64), f16(b[:, 80:82]), f16(b[:, 82:84])
    out = np.zeros((len(b), QK_K), np.float32)
    for half in range(2):
        q = qs[:, 32 * half:32 * half + 32]
        for j in range(4):
            for part in range(2):
                g = 8 * half + 2 * j + part
                vals = (q[:, 16 * part:16 * part + 16] >> (2 * j)) & 3
                y0 = 128 * half + 32 * j + 16 * part
                out[:, y0:y0 + 16] = (d * (scales[:, g] & 15))[:, None] * vals - (dmin * (scales[:, g] >> 4))[:, None]
    return out


def ref_q3_k(b: np.ndarray) -> np.ndarray:
    """{u8 hmask[32]; u8 qs[64]; u8 scales[12]; half d}: 16 groups of 16 with 6-bit scales
    (low 4 bits: scales[g] & 15 for g < 8, scales[g-8] >> 4 after; high 2 bits: bits
    2*(g//4) of scales[8 + g%4]), minus 32. A value is its 2 bits (laid out as Q2_K's)
    minus 4 where its hmask bit is clear: bit r of hmask[l] belongs to the r-th of the
    eight 32-element runs, position l."""
    hmask, qs, sc, d = (b[:, :32].astype(np.int64), b[:, 32:96].astype(np.int64), b[:, 96:108].astype(np.int64),
                        f16(b[:, 108:110]))
    scale = np.zeros((len(b), 16), np.int64)
    for g in range(16):
        low = sc[:, g] & 15 if g < 8 else sc[:, g - 8] >> 4
        high = (sc[:, 8 + g % 4] >> (2 * (g // 4))) & 3
        scale[:, g] = (low | (high << 4)) - 32
    out = np.zeros((len(b), QK_K), np.float32)
    for half in range(2):
        q = qs[:, 32 * half:32 * half + 32]
        for j in range(4):
            run = 4 * half + j  # which hmask bit
            for part in range(2):
                g = 8 * half + 2 * j + part
                sl = slice(16 * part, 16 * part + 16)
                vals = ((q[:, sl] >> (2 * j)) & 3) - np.where((hmask[:, sl] >> run) & 1, 0, 4)
                y0 = 128 * half + 32 * j + 16 * part
                out[:, y0:y0 + 16] = (d[:, None] * scale[:, g:g + 1]) * vals
    return out


def scale_min_k4(sc: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 six-bit (scale, min) pairs packed in 12 bytes (get_scale_min_k4)."""
    if j < 4:
        return sc[:, j] & 63, sc[:, j + 4] & 63
    return (sc[:, j + 4] & 15) | ((sc[:, j - 4] >> 6) << 4), (sc[:, j + 4] >> 4) | ((sc[:, j] >> 6) << 4)


def ref_q4_k(b: np.ndarray) -> np.ndarray:
    """{half d; half dmin; u8 scales[12]; u8 qs[128]}: 8 groups of 32; each 64-element
    chunk takes 32 bytes, low nibbles first, then high nibbles."""
    d, dmin, sc, qs = f16(b[:, 0:2]), f16(b[:, 2:4]), b[:, 4:16].astype(np.int64), b[:, 16:144].astype(np.int64)
    out = np.zeros((len(b), QK_K), np.float32)
    for c in range(4):
        q = qs[:, 32 * c:32 * c + 32]
        for k, vals in enumerate((q & 15, q >> 4)):
            s, m = scale_min_k4(sc, 2 * c + k)
            out[:, 64 * c + 32 * k:64 * c + 32 * k + 32] = (d * s)[:, None] * vals - (dmin * m)[:, None]
    return out


def ref_q5_k(b: np.ndarray) -> np.ndarray:
    """{half d; half dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: Q4_K plus a fifth bit,
    bit g of qh[l] for group g's element l."""
    d, dmin, sc = f16(b[:, 0:2]), f16(b[:, 2:4]), b[:, 4:16].astype(np.int64)
    qh, qs = b[:, 16:48].astype(np.int64), b[:, 48:176].astype(np.int64)
    out = np.zeros((len(b), QK_K), np.float32)
    for c in range(4):
        q = qs[:, 32 * c:32 * c + 32]
        for k, vals in enumerate((q & 15, q >> 4)):
            g = 2 * c + k
            s, m = scale_min_k4(sc, g)
            vals = vals + 16 * ((qh >> g) & 1)
            out[:, 32 * g:32 * g + 32] = (d * s)[:, None] * vals - (dmin * m)[:, None]
    return out


def ref_q6_k(b: np.ndarray) -> np.ndarray:
    """{u8 ql[128]; u8 qh[64]; i8 scales[16]; half d}: 6-bit values minus 32, 16 groups of
    16. Per 128-element half (64 bytes of ql, 32 of qh), element 32*k + l takes the low
    or high nibble of ql[l] (k 0, 2) or ql[l+32] (k 1, 3) and bits 2k of qh[l]."""
    ql, qh = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64)
    sc, d = b[:, 192:208].view(np.int8).astype(np.int64), f16(b[:, 208:210])
    out = np.zeros((len(b), QK_K), np.float32)
    for half in range(2):
        lo, hi = ql[:, 64 * half:64 * half + 64], qh[:, 32 * half:32 * half + 32]
        nibbles = (lo[:, :32] & 15, lo[:, 32:] & 15, lo[:, :32] >> 4, lo[:, 32:] >> 4)
        for k in range(4):
            q = (nibbles[k] | (((hi >> (2 * k)) & 3) << 4)) - 32
            for l0 in (0, 16):
                g = 8 * half + 2 * k + l0 // 16
                y0 = 128 * half + 32 * k + l0
                out[:, y0:y0 + 16] = (d * sc[:, g])[:, None] * q[:, l0:l0 + 16]
    return out


# type -> (bytes per block, byte offsets of its half-precision scale fields, reference)
BLOCKS = {
    "Q4_0": (18, (0,), ref_q4_0), "Q4_1": (20, (0, 2), ref_q4_1),
    "Q5_0": (22, (0,), ref_q5_0), "Q5_1": (24, (0, 2), ref_q5_1), "Q8_0": (34, (0,), ref_q8_0),
    "Q2_K": (84, (80, 82), ref_q2_k), "Q3_K": (110, (108,), ref_q3_k), "Q4_K": (144, (0, 2), ref_q4_k),
    "Q5_K": (176, (0, 2), ref_q5_k), "Q6_K": (210, (208,), ref_q6_k),
}


def random_blocks(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n blocks of random bytes (every quant and scale bit pattern is legal) whose
    half-precision fields hold finite values of either sign."""
    size, halves, _ = BLOCKS[kind]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in halves:
        raw[:, off:off + 2] = rng.uniform(-2, 2, (n, 1)).astype("<f2").view(np.uint8)
    return raw


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_each_quantized_type_dequantizes_as_ggml_defines_its_blocks(kind):
    import gguf

    rng = np.random.default_rng(sum(map(ord, kind)))
    rows, per_row = 3, 2  # a [3, 2 blocks] tensor, stored row after row
    blocks = random_blocks(kind, rows * per_row, rng)
    got = gguf_loader.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType[kind], "t")
    want = BLOCKS[kind][2](blocks).reshape(rows, -1)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_half_and_bfloat16_are_the_ieee_and_truncated_float32_bits():
    import gguf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 100
    half = x.astype("<f2")
    got = gguf_loader.dequantize(half.view(np.uint8), gguf.GGMLQuantizationType.F16, "t")
    np.testing.assert_array_equal(got, half.astype(np.float32))
    bf16_bits = (x.view("<u4") >> 16).astype("<u2")  # bf16 is float32's upper 16 bits
    got = gguf_loader.dequantize(bf16_bits.view(np.uint8), gguf.GGMLQuantizationType.BF16, "t")
    np.testing.assert_array_equal(got, (bf16_bits.astype("<u4") << 16).view("<f4"))


def test_every_supported_type_is_checked_here():
    assert set(gguf_loader.SUPPORTED_TYPES) == {"F32", "F16", "BF16", *BLOCKS}
