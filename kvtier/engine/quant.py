"""Decode-step weight products read from the GGUF's own quantized blocks.

A decode step multiplies a handful of activation rows (one per decoding
sequence) by every weight matrix, so it streams every weight's bytes for a
few operations each: bytes and instructions per weight both count. float32 copies of a GGUF's quantized matrices
are 4-7x larger than the blocks they were dequantized from;
:class:`QuantMatrix` keeps the blocks (every supported GGML format, K-quants
included, repacked into one of three forms by :mod:`kvtier.model.blocks`)
and multiplies with the native ``quant_matvec`` (``native/quant_matvec.c``).
A fused matrix whose parts came in different forms (a Q4_K_M file's Q and K
in Q4_K, its V in Q6_K) is a :class:`QuantStack`, one kernel call a form.

The weights are exactly the ones the float32 matmuls use (same values, only
stored smaller), and the products accumulate in float32; what differs is
the order of the sums, by a few ulps, as it already does between a 1-row
and a 64-row float32 matmul. Prefills keep the dense matmuls: they are
compute-bound, and there the blocked GEMM is faster. A bfloat16 engine's
decode steps use these too: its activations are bfloat16 and every quant
is exactly one, so on a CPU with AVX-512 BF16 the products run on bfloat16
pairs (exact products, float32 sums; ``native/quant_matvec.c``), elsewhere
on the float32 build. Its dense weights are the blocks' values rounded to
bfloat16, so decode may round differently from a prefill, but no
decode-computed KV is cached in bfloat16 (``engine.decoded_kv``) and reuse
stays exact. ``q8`` calls (``engine.decode_activations: q8``) round the
activations to int8 a block first and sum in int8, as llama.cpp does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch

from kvtier import extension
from kvtier.model import QuantBlocks, QuantKind

_native = extension.kernels

IMPL: str = _native.QUANT_IMPL  # the build used on this CPU: "avx2" or "base"
Q8: bool = bool(_native.QUANT_Q8)
"""Whether x quantized to 8 bits a block (``engine.decode_activations: q8``) runs here (AVX-512 VNNI)."""
BF16: bool = bool(_native.QUANT_BF16)
"""Whether Q4_1 times bfloat16 rows runs on AVX-512 BF16 here (``avx512bf16``): a bfloat16 engine's decode."""
MAX_ROWS = 64  # activation rows per call (the C kernel's limit): a decode batch


@dataclass(frozen=True)
class QuantMatrix:
    """A ``[rows, cols]`` weight matrix as quantized blocks; ``x @ W.T`` for up to :data:`MAX_ROWS` rows of ``x``.

    Scales are one float32 each, or factored as the K-quants store them
    (``d_fac``/``m_fac``, see :class:`~kvtier.model.QuantBlocks`): the kernel
    multiplies a row's out as it starts it, and streams a quarter of the bytes.
    """

    kind: QuantKind
    q: torch.Tensor  # uint8 [rows, cols / 2] (Q4_1) or [rows, cols] (int8 as uint8: Q8_0, Q8_16)
    d: torch.Tensor  # float32 [rows, cols / 32] ([rows, cols / 16] for Q8_16); [rows, cols / 256] where factored
    m: torch.Tensor | None  # float32 [rows, cols / 32]: always for Q4_1, for Q8_0 where the source had minimums
    rows: int
    cols: int
    d_fac: torch.Tensor | None = None  # int8 [rows, scales]: factored scales
    m_fac: torch.Tensor | None = None  # int8 [rows, cols / 32]: factored minimums

    @classmethod
    def of(cls, blocks: QuantBlocks) -> QuantMatrix:
        return cls.cat([blocks])

    @classmethod
    def cat(cls, parts: Sequence[QuantBlocks]) -> QuantMatrix:
        """Rows of ``parts`` stacked, like ``torch.cat`` of the dense matrices (fused Q/K/V, gate/up).

        Parts must share a form; where only some carry minimums, the others get
        zeros (the same weights, and one kernel call instead of two). Factored
        scales stay factored where every part has them and the kernel can take
        a row of them; otherwise they are multiplied out.
        """
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.cols for p in parts}) != 1:
            raise ValueError("only matrices of one form and width stack")
        (kind,) = kinds
        scales = parts[0].cols // (16 if kind is QuantKind.Q8_16 else 32)
        factored = scales <= _native.QUANT_MAX_ROW_SCALES and all(
            p.d_fac is not None and (p.m is None) == (p.m_fac is None) for p in parts
        )
        if not factored:
            parts = [p.plain() for p in parts]

        def stack(arrays: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(np.concatenate(arrays, axis=0)))

        with_min = any(p.m is not None for p in parts)
        m = stack([np.zeros_like(p.d) if p.m is None else p.m for p in parts]) if with_min else None
        d_fac = m_fac = None
        if factored:
            d_fac = stack([p.d_fac for p in parts])
            blocks = parts[0].cols // 32
            zeros = [np.zeros((p.rows, blocks), np.int8) if p.m_fac is None else p.m_fac for p in parts]
            m_fac = stack(zeros) if with_min else None
        return cls(
            kind,
            stack([p.q for p in parts]),
            stack([p.d for p in parts]),
            m,
            sum(p.rows for p in parts),
            parts[0].cols,
            d_fac,
            m_fac,
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.q, self.d, self.m, self.d_fac, self.m_fac)
        return sum(t.numel() * t.element_size() for t in arrays if t is not None)

    def __call__(
        self, x: torch.Tensor, *, threads: int | None = None, impl: str | None = None, q8: bool = False
    ) -> torch.Tensor:
        """``x [n, cols]`` (float32 or bfloat16) times the matrix's transpose: ``[n, rows]`` float32.

        bfloat16 rows go to the C side as they are: on a CPU with AVX-512
        BF16 (:data:`BF16`) the products run on bfloat16 pairs (a quant is
        exactly a bfloat16, so each product is exact); otherwise the C side
        widens them to float32, exactly. ``q8``: x is quantized to int8 per
        32 values first and the products run in int8 (:data:`Q8`, llama.cpp's
        arithmetic): no longer exact, and far fewer instructions.
        """
        if (
            x.dtype not in (torch.float32, torch.bfloat16)
            or x.dim() != 2
            or x.shape[1] != self.cols
            or x.device.type != "cpu"
        ):
            raise ValueError(
                f"need float32 or bfloat16 [n, {self.cols}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        n = x.shape[0]
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"{n} rows; the kernel takes 1..{MAX_ROWS}")
        x = x.contiguous()
        out = torch.empty(n, self.rows, dtype=torch.float32)
        _native.quant_matvec(
            int(self.kind),
            self.q.data_ptr(),
            self.d.data_ptr(),
            0 if self.m is None else self.m.data_ptr(),
            self.rows,
            self.cols,
            x.data_ptr(),
            n,
            out.data_ptr(),
            threads or torch.get_num_threads(),  # the team's workers watch between calls: even a small matrix gains
            impl,
            x.dtype == torch.bfloat16,
            0 if self.d_fac is None else self.d_fac.data_ptr(),
            0 if self.m_fac is None else self.m_fac.data_ptr(),
            q8,
        )
        return out


@dataclass(frozen=True)
class QuantStack:
    """Rows of matrices in different forms, stacked: each run of one form is one :class:`QuantMatrix`."""

    parts: tuple[QuantMatrix, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(
        self, x: torch.Tensor, *, threads: int | None = None, impl: str | None = None, q8: bool = False
    ) -> torch.Tensor:
        return torch.cat([p(x, threads=threads, impl=impl, q8=q8) for p in self.parts], dim=1)


def fuse(parts: Sequence[QuantBlocks]) -> QuantMatrix | QuantStack:
    """Rows of ``parts`` stacked: one :class:`QuantMatrix` where they share a form, else a :class:`QuantStack`."""
    runs = [QuantMatrix.cat(list(run)) for _, run in groupby(parts, key=lambda p: p.kind)]
    return runs[0] if len(runs) == 1 else QuantStack(tuple(runs))


__all__ = ["BF16", "IMPL", "MAX_ROWS", "Q8", "QuantMatrix", "QuantStack", "fuse"]
