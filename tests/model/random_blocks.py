"""Raw GGUF blocks of every supported format, for tests that need K-quants without a quantizer.

Random bytes are valid blocks of every format once their float16 fields are
finite, so the quants and the packed K-quant scales are random over their
whole range (every bit pattern a real file can hold), and only the float16
scales are drawn small: weights stay in the range a model's do.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from kvtier.model.blocks import BLOCK_FORMATS

# format -> (bytes per block, weights per block, offsets of its float16 fields)
LAYOUT: dict[GGMLQuantizationType, tuple[int, int, tuple[int, ...]]] = {
    GGMLQuantizationType.Q4_0: (18, 32, (0,)),
    GGMLQuantizationType.Q4_1: (20, 32, (0, 2)),
    GGMLQuantizationType.Q5_0: (22, 32, (0,)),
    GGMLQuantizationType.Q5_1: (24, 32, (0, 2)),
    GGMLQuantizationType.Q8_0: (34, 32, (0,)),
    GGMLQuantizationType.Q4_K: (144, 256, (0, 2)),
    GGMLQuantizationType.Q5_K: (176, 256, (0, 2)),
    GGMLQuantizationType.Q6_K: (210, 256, (208,)),
}
assert set(LAYOUT) == BLOCK_FORMATS


def random_raw(fmt: GGMLQuantizationType, rows: int, cols: int, seed: int, scale: float = 0.002) -> np.ndarray:
    """``rows x cols`` weights as raw blocks ``[blocks, bytes]`` of ``fmt``, rows back to back."""
    block_bytes, per_block, halves = LAYOUT[fmt]
    assert cols % per_block == 0, f"{fmt.name} needs columns in multiples of {per_block}"
    rng = np.random.default_rng(seed)
    n = rows * cols // per_block
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for at in halves:
        raw[:, at : at + 2] = (rng.standard_normal(n) * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw
