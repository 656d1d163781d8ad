"""Decode-step weight products read from the GGUF's own quantized blocks.

A decode step multiplies a handful of activation rows (one per decoding
sequence) by every weight matrix, so it is bound by the bytes of weights it
streams, not by arithmetic. float32 copies of the embedded model's Q4_1 and
Q8_0 matrices are 5-6x larger than the blocks they were dequantized from;
:class:`QuantMatrix` keeps the blocks (repacked by
:func:`~kvtier.model.load_gguf_blocks`) and multiplies with the native
``quant_matvec`` (``native/quant_matvec.c``).

The weights are exactly the ones the float32 matmuls use (same values, only
stored smaller), and the products accumulate in float32; what differs is
the order of the sums, by a few ulps, as it already does between a 1-row
and a 64-row float32 matmul. Prefills keep the dense matmuls: they are
compute-bound, and there the blocked GEMM is faster. A bfloat16 engine's
decode steps use these too: its activations are bfloat16 and a Q4_1 quant
is exactly one, so on a CPU with AVX-512 BF16 the Q4_1 products run on
bfloat16 pairs (exact products, float32 sums; ``native/quant_matvec.c``),
elsewhere on the float32 build. Its dense weights are the blocks' values
rounded to bfloat16, so decode may round differently from a prefill, but
no decode-computed KV is cached in bfloat16 (``engine.decoded_kv``) and
reuse stays exact.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.model import QuantBlocks, QuantKind

try:
    _native = importlib.import_module("kvtier._native_kernels")
except ImportError:  # not built: the engine keeps the dense matmuls
    _native = None

NATIVE: bool = hasattr(_native, "quant_matvec")
IMPL: str | None = getattr(_native, "QUANT_IMPL", None)  # the build used on this CPU: "avx2" or "base"
BF16: bool = bool(getattr(_native, "QUANT_BF16", 0))
"""Whether Q4_1 times bfloat16 rows runs on AVX-512 BF16 here (``avx512bf16``): a bfloat16 engine's decode."""
MAX_ROWS = 64  # activation rows per call (the C kernel's limit): a decode batch


@dataclass(frozen=True)
class QuantMatrix:
    """A ``[rows, cols]`` weight matrix as quantized blocks; ``x @ W.T`` for up to :data:`MAX_ROWS` rows of ``x``."""

    kind: QuantKind
    q: torch.Tensor  # uint8 [rows, cols / 2] (Q4_1) or [rows, cols] (Q8_0)
    d: torch.Tensor  # float32 [rows, cols / 32]
    m: torch.Tensor | None  # float32 [rows, cols / 32], Q4_1 only
    rows: int
    cols: int

    @classmethod
    def of(cls, blocks: QuantBlocks) -> QuantMatrix:
        return cls.cat([blocks])

    @classmethod
    def cat(cls, parts: Sequence[QuantBlocks]) -> QuantMatrix:
        """Rows of ``parts`` stacked, like ``torch.cat`` of the dense matrices (fused Q/K/V, gate/up)."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.cols for p in parts}) != 1:
            raise ValueError("only matrices of one format and width stack")
        (kind,) = kinds

        def stack(arrays: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(np.concatenate(arrays, axis=0)))

        m = stack([p.m for p in parts if p.m is not None]) if kind is QuantKind.Q4_1 else None
        return cls(
            kind, stack([p.q for p in parts]), stack([p.d for p in parts]), m, sum(p.rows for p in parts), parts[0].cols
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def __call__(self, x: torch.Tensor, *, threads: int | None = None, impl: str | None = None) -> torch.Tensor:
        """``x [n, cols]`` (float32 or bfloat16) times the matrix's transpose: ``[n, rows]`` float32.

        bfloat16 rows go to the C side as they are: for Q4_1 on a CPU with
        AVX-512 BF16 (:data:`BF16`) the products run on bfloat16 pairs (a
        quant is exactly a bfloat16, so each product is exact); otherwise
        the C side widens them to float32, exactly.
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
        assert _native is not None, "quant_matvec needs the native extension"
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
        )
        return out


__all__ = ["BF16", "IMPL", "MAX_ROWS", "NATIVE", "QuantMatrix"]
