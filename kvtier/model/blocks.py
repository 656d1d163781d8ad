"""GGUF weight blocks repacked into the three forms the decode kernel reads (``native/quant_matvec.c``).

GGML has a dozen block formats, but each weight of the ones people run is
``scale * q + minimum`` with a small integer ``q`` and a scale (and maybe a
minimum) shared by 16 or 32 consecutive weights. The K-quants only store
those scales compactly (6-bit factors of a float16 per 256 weights); once
multiplied out they are ordinary float32 scales. So every supported format
repacks, at load, into one of:

* :attr:`QuantKind.Q4_1`: 4-bit ``q`` (two a byte, GGML's order: byte ``k``
  of a 32-weight block holds ``q[k]`` low and ``q[k + 16]`` high), a scale and
  a minimum per 32. From Q4_0 (minimum ``-8 d``), Q4_1 and Q4_K.
* :attr:`QuantKind.Q8_0`: ``q`` an int8, a scale per 32, a minimum per 32 or
  none. From Q8_0, Q5_0 (``q - 16``), Q5_1 and Q5_K.
* :attr:`QuantKind.Q8_16`: ``q`` an int8 and a scale per 16. From Q6_K
  (``q - 32``, scale ``d * scales[i]``).

The K-quants' scales stay factored (``d_fac``, ``m_fac``: the small
integers, an int8 each, beside one float32 per 256 weights): multiplied out
they cost a third of Q4_K's bytes again, and decode streams every byte. The
kernel multiplies them out a row at a time, as it starts the row.

The products that make the float32 scales (a float16 times a 6- or 8-bit
integer) and the weights ``scale * q + minimum`` are exact or rounded once,
exactly as ``gguf.quants.dequantize`` rounds them, so the repacked blocks
stand for the very weights :func:`~kvtier.model.load_gguf` dequantizes, bit
for bit. The 5- and 6-bit formats widen to a byte a weight (the kernel reads
whole bytes); still a quarter of float32's bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K


class QuantKind(enum.IntEnum):
    """The block forms the decode kernel reads (the value is the C kernel's ``kind``)."""

    Q4_1 = 0  # 4-bit q, float32 scale and minimum per 32
    Q8_0 = 1  # int8 q, float32 scale per 32, float32 minimum per 32 or none
    Q8_16 = 2  # int8 q, float32 scale per 16


class QuantBlocks(NamedTuple):
    """One weight matrix in a kernel form: arrays a C kernel can stream, row by row.

    ``q`` holds each row's quants back to back (Q4_1: ``cols / 2`` bytes of
    nibbles; the int8 forms: ``cols`` int8 as uint8); ``d`` the scales,
    float32 ``[rows, cols / 32]`` (``[rows, cols / 16]`` for Q8_16); ``m`` the
    minimums, float32 ``[rows, cols / 32]`` or None. ``source`` is the GGML
    format they came from.

    Factored (the K-quants): ``d_fac`` holds an int8 per scale and ``d`` one
    float32 per 256 weights, ``[rows, cols / 256]``; scale ``k`` of a row is
    ``d[k // per] * d_fac[k]``. Likewise ``m`` and ``m_fac`` (an int8 per 32).
    """

    kind: QuantKind
    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    source: GGMLQuantizationType
    d_fac: np.ndarray | None = None
    m_fac: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def cols(self) -> int:
        return int(self.q.shape[1]) * (2 if self.kind is QuantKind.Q4_1 else 1)

    def plain(self) -> QuantBlocks:
        """The same blocks with their scales multiplied out, one float32 each (for parts stacked with plain ones)."""
        if self.d_fac is None:
            return self
        m = None if self.m is None else multiplied_out(self.m, self.m_fac)
        return self._replace(d=multiplied_out(self.d, self.d_fac), m=m, d_fac=None, m_fac=None)


def multiplied_out(per_super: np.ndarray, factors: np.ndarray | None) -> np.ndarray:
    """Factored scales ``[rows, supers]`` x ``[rows, scales]`` as one float32 per scale, rounded as gguf rounds them."""
    if factors is None:
        return per_super
    rows, supers = per_super.shape
    grouped = factors.reshape(rows, supers, -1).astype(np.float32)
    return np.ascontiguousarray((per_super[:, :, None] * grouped).reshape(rows, -1), dtype=np.float32)


class _Form(NamedTuple):
    """One format's blocks in the kernel's form, a row of arrays per GGML block: ``w = d[s] * q + m[s]``."""

    q: np.ndarray  # [n, quant bytes per block] uint8: packed nibbles (Q4_1) or int8 as uint8
    d: np.ndarray  # [n, scales per block] float32, or [n, 1] where factored
    m: np.ndarray | None  # [n, scales per block] float32, or [n, 1] where factored
    d_fac: np.ndarray | None = None  # [n, scales per block] int8: the factored K-quants
    m_fac: np.ndarray | None = None


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ``[n, 2]`` (bytes) as float32 ``[n, 1]``."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes of GGML's 32-weight nibble order to ``[..., 32]`` values 0..15."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _packed(values: np.ndarray) -> np.ndarray:
    """``[n, k, 32]`` values 0..15 into GGML's nibble order, ``[n, k * 16]`` bytes (inverse of :func:`_nibbles`)."""
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8).reshape(len(values), -1)


def _int8(values: np.ndarray) -> np.ndarray:
    """Signed quants of any shape ``[n, ...]`` as the kernel's int8 bytes ``[n, weights]``."""
    return values.astype(np.int8).view(np.uint8).reshape(len(values), -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block) as ``[n, 32]`` values 0 or 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8) << 4


# Q4_0, Q4_1 and Q8_0 already hold their quants as the kernel reads them: only the scales change form.
def _q4_0(b: np.ndarray) -> _Form:
    d = _f16(b[:, 0:2])
    return _Form(b[:, 2:18], d, -8.0 * d)


def _q4_1(b: np.ndarray) -> _Form:
    return _Form(b[:, 4:20], _f16(b[:, 0:2]), _f16(b[:, 2:4]))


def _q8_0(b: np.ndarray) -> _Form:
    return _Form(b[:, 2:34], _f16(b[:, 0:2]), None)


def _q5_0(b: np.ndarray) -> _Form:
    q = _nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6])
    return _Form(_int8(q.astype(np.int8) - 16), _f16(b[:, 0:2]), None)


def _q5_1(b: np.ndarray) -> _Form:
    q = _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8])
    return _Form(_int8(q), _f16(b[:, 0:2]), _f16(b[:, 2:4]))


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: ``d``, the eight sub-blocks' scale factors, ``-dmin`` and their minimum factors (0..63 each)."""
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, 0:2]), sc.astype(np.int8), -_f16(b[:, 2:4]), mn.astype(np.int8)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quant 4-bit fields: 32 bytes per 64 weights, low nibbles the first 32, high the next: ``[n, 8, 32]``."""
    pairs = qs.reshape(len(qs), 4, 1, 32)
    return np.concatenate([pairs & 0x0F, pairs >> 4], axis=2).reshape(len(qs), 8, 32)


def _q4_k(b: np.ndarray) -> _Form:
    d, sc, m, mn = _k_scales(b)
    return _Form(_packed(_k_nibbles(b[:, 16:144])), d, m, sc, mn)


def _q5_k(b: np.ndarray) -> _Form:
    d, sc, m, mn = _k_scales(b)
    high = np.unpackbits(np.ascontiguousarray(b[:, 16:48])[:, :, None], axis=-1, bitorder="little")  # [n, 32, 8]
    return _Form(_int8(_k_nibbles(b[:, 48:176]) | (high.transpose(0, 2, 1) << 4)), d, m, sc, mn)


def _q6_k(b: np.ndarray) -> _Form:
    n = len(b)
    ql, qh = b[:, 0:128].reshape(n, 2, 1, 64), b[:, 128:192].reshape(n, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # 128 weights: l, l+32, l+64, l+96
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8)
    return _Form(_int8((low | (high << 4)).astype(np.int8) - 32), _f16(b[:, 208:210]), None, scales)


# GGML format -> (bytes per block, its blocks in the kernel's form, the form)
_FORMATS: dict[GGMLQuantizationType, tuple[int, Callable[[np.ndarray], _Form], QuantKind]] = {
    GGMLQuantizationType.Q4_0: (18, _q4_0, QuantKind.Q4_1),
    GGMLQuantizationType.Q4_1: (20, _q4_1, QuantKind.Q4_1),
    GGMLQuantizationType.Q5_0: (22, _q5_0, QuantKind.Q8_0),
    GGMLQuantizationType.Q5_1: (24, _q5_1, QuantKind.Q8_0),
    GGMLQuantizationType.Q8_0: (34, _q8_0, QuantKind.Q8_0),
    GGMLQuantizationType.Q4_K: (144, _q4_k, QuantKind.Q4_1),
    GGMLQuantizationType.Q5_K: (176, _q5_k, QuantKind.Q8_0),
    GGMLQuantizationType.Q6_K: (210, _q6_k, QuantKind.Q8_16),
}
BLOCK_FORMATS = frozenset(_FORMATS)
"""The GGML formats decode reads as blocks; a matrix in any other (F32, F16, BF16...) decodes dense."""


def repack(raw: np.ndarray, fmt: GGMLQuantizationType, rows: int) -> QuantBlocks:
    """A matrix's raw GGUF bytes (``rows`` rows) in its kernel form."""
    block_bytes, form, kind = _FORMATS[fmt]
    f = form(np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes))

    def per_row(a: np.ndarray, dtype: type) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(rows, -1), dtype=dtype)

    m = None if f.m is None else per_row(f.m, np.float32)
    d_fac = None if f.d_fac is None else per_row(f.d_fac, np.int8)
    m_fac = None if f.m_fac is None else per_row(f.m_fac, np.int8)
    return QuantBlocks(kind, per_row(f.q, np.uint8), per_row(f.d, np.float32), m, fmt, d_fac, m_fac)


def weights_of(
    kind: QuantKind,
    q: np.ndarray,
    d: np.ndarray,
    m: np.ndarray | None,
    d_fac: np.ndarray | None = None,
    m_fac: np.ndarray | None = None,
) -> np.ndarray:
    """The float32 matrix arrays in a kernel form stand for, ``d * q + m`` weight by weight (what tests compare)."""
    rows = len(q)
    d = multiplied_out(d, d_fac)
    m = None if m is None else multiplied_out(m, m_fac)
    if kind is QuantKind.Q4_1:
        values = _nibbles(q.reshape(rows, -1, 16)).astype(np.float32)
    else:
        values = q.view(np.int8).reshape(rows, d.shape[1], -1).astype(np.float32)
    w = values * d[..., None]
    if m is not None:
        w = w + m[..., None]
    return w.reshape(rows, -1)
