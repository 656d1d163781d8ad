"""Every block format repacked for the decode kernel stands for exactly the weights ``gguf`` dequantizes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvtier.model.blocks import BLOCK_FORMATS, QuantKind, repack, weights_of
from tests.model.random_blocks import LAYOUT, random_raw

FORMS = {
    GGMLQuantizationType.Q4_0: QuantKind.Q4_1,
    GGMLQuantizationType.Q4_1: QuantKind.Q4_1,
    GGMLQuantizationType.Q4_K: QuantKind.Q4_1,
    GGMLQuantizationType.Q5_0: QuantKind.Q8_0,
    GGMLQuantizationType.Q5_1: QuantKind.Q8_0,
    GGMLQuantizationType.Q5_K: QuantKind.Q8_0,
    GGMLQuantizationType.Q8_0: QuantKind.Q8_0,
    GGMLQuantizationType.Q6_K: QuantKind.Q8_16,
}


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS, key=lambda f: f.name), ids=lambda f: f.name)
def test_repacked_blocks_are_the_dequantized_weights_bit_for_bit(fmt: GGMLQuantizationType) -> None:
    rows, cols = 5, 512
    raw = random_raw(fmt, rows, cols, seed=int(fmt))
    blocks = repack(raw, fmt, rows)
    assert (blocks.kind, blocks.source, blocks.rows, blocks.cols) == (FORMS[fmt], fmt, rows, cols)
    expected = dequantize(raw.reshape(-1), fmt).reshape(rows, cols).astype(np.float32)
    assert np.array_equal(weights_of(blocks.kind, blocks.q, blocks.d, blocks.m, blocks.d_fac, blocks.m_fac), expected)
    plain = blocks.plain()
    assert np.array_equal(weights_of(plain.kind, plain.q, plain.d, plain.m), expected)
    scales_per_row = cols // (16 if blocks.kind is QuantKind.Q8_16 else 32)
    assert plain.d.shape == (rows, scales_per_row) and plain.d.dtype == np.float32
    bytes_per_weight = blocks.q.nbytes / (rows * cols)
    assert bytes_per_weight == (0.5 if blocks.kind is QuantKind.Q4_1 else 1.0)
    if fmt.name.endswith("_K"):  # the K-quants keep their scales factored: an int8 each, a float32 per 256 weights
        assert blocks.d.shape == (rows, cols // 256) and blocks.d_fac.shape == (rows, scales_per_row)
        assert blocks.d_fac.dtype == np.int8 and (blocks.m is None) == (blocks.m_fac is None)
    else:
        assert blocks.d_fac is None and blocks.m_fac is None and plain is blocks


def test_every_format_with_a_layout_is_supported() -> None:
    assert set(FORMS) == set(LAYOUT) == BLOCK_FORMATS
