"""A decoder layer's element-wise steps: the residual add and RMSNorm, RoPE with the K/V write, SwiGLU's gate.

Around its matrix products a layer does small per-row work, and in torch
each step is five to ten operator calls (RMSNorm: a cast, a square, a mean,
an add, a reciprocal square root, two products, a cast back). On an agent's
next turn (a few dozen new tokens over a cached transcript) and on every
decode step, those calls cost more than their arithmetic. The C kernels of
``native/rowwise.c`` do each step in one pass:

* :func:`add_rms_norm`: ``x + delta`` (in place) and its RMSNorm;
* :class:`Rope`, planned once per forward: rotate-half RoPE of the queries
  (into a contiguous buffer, as the attention kernels take them) and keys,
  then the keys and values into their pool slots, no ``index_put``;
* :func:`silu_mul`: ``silu(gate) * up``.

They round step by step as torch's float32 / bfloat16 operators do and
differ from the torch formulas kept here (:func:`rms_norm`,
:func:`apply_rope`, the fallbacks for CUDA, float16 or a build without the
kernels) only in RMSNorm's summation order and ``exp``'s last bits. Each
row is computed alone in a fixed order: a token's K/V do not depend on
which other tokens shared its forward, so chunked, cached and fresh
prefills write the same bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier import extension
from kvtier.engine.kernels import element_args
from kvtier.engine.pool import KVPool, Slots

_native = extension.kernels

IMPLS: tuple[str, ...] = _native.rowwise_impls()
"""Their builds this CPU runs, best first (``avx512``, ``avx2``, ``base``): the first is the one used."""

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
MAX_COLS = 16384
PARALLEL_ROWS = 256  # below this a second thread's hand-off costs more than the rows it takes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back before the weight, as the HF Llama reference does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_table(head_dim: int, theta: float, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[context_length, head_dim]`` in float32, in rotate-half (HF) order."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(context_length).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, head_dim]`` by per-token ``cos``/``sin [N, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _native_fits(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        first.device.type == "cpu"
        and first.dtype in NATIVE_DTYPES
        and all(t.dtype == first.dtype and t.device == first.device and t.is_contiguous() for t in tensors)
    )


def _threads(rows: int) -> int:
    return torch.get_num_threads() if rows >= PARALLEL_ROWS else 1


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *, impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + delta`` (``x`` itself when ``delta`` is None) and its RMSNorm times ``weight``; ``x`` is ``[N, hidden]``.

    On the C path the sum is written into ``x``: the forward owns its
    residual stream, so nothing else sees the old rows.
    """
    cols = x.shape[-1]
    parts = (x, weight) if delta is None else (x, weight, delta)
    if not (_native_fits(*parts) and x.dim() == 2 and cols <= MAX_COLS and weight.shape == (cols,)):
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    rows = x.shape[0]
    _native.rms_norm(
        x.data_ptr(),
        0 if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        cols,
        eps,
        x.dtype == torch.bfloat16,
        _threads(rows),
        impl,
    )
    return x, out


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, impl: str | None = None) -> torch.Tensor:
    """``F.rms_norm(x, (d,), weight, eps)`` of ``x [N, heads, d]``, each head a row: per-head Q/K norms.

    torch's own operator rounds once, after the weight (where :func:`rms_norm`
    rounds before it); the C kernel follows it (``round_once``) and differs
    only in the summation order of the mean, as its other rows do.
    """
    d = x.shape[-1]
    rows = x.reshape(-1, d).contiguous()  # Q or K of a fused product: a column slice, copied once
    if not (_native_fits(rows, weight) and d <= MAX_COLS and weight.shape == (d,)):
        return F.rms_norm(x, (d,), weight, eps)
    out = torch.empty_like(rows)
    n = rows.shape[0]
    _native.rms_norm(
        rows.data_ptr(),
        0,
        weight.data_ptr(),
        out.data_ptr(),
        n,
        d,
        eps,
        x.dtype == torch.bfloat16,
        _threads(n),
        impl,
        round_once=True,
    )
    return out.view(x.shape)


def silu_mul(gate_up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [N, 2 * inter]`` (gate first, as the fused weight is): ``[N, inter]``."""
    if not (_native_fits(gate_up) and gate_up.dim() == 2):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, inter)
    _native.silu_mul(
        gate_up.data_ptr(), out.data_ptr(), rows, inter, gate_up.dtype == torch.bfloat16, _threads(rows), impl
    )
    return out


class Rope:
    """One forward's RoPE and K/V write, planned once: the positions and slots are the same for every layer.

    :meth:`apply` takes a layer's fused ``qkv [N, (heads + 2 kv_heads) *
    head_dim]`` and returns ``q [N, heads, D]`` (contiguous), ``k`` and ``v``
    ``[N, kv_heads, D]``, with K/V already in the pool. The C kernel where
    the tensors fit, else :func:`apply_rope` and :meth:`KVPool.write`.
    """

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slots: Slots,
        pool: KVPool,
        num_heads: int,
        *,
        impl: str | None = None,
    ) -> None:
        """``cos``/``sin``: the model's tables ``[context, head_dim]`` in its dtype; ``positions``: int64 ``[N]``."""
        layout = pool.layout
        self._pool, self._slots, self._impl = pool, slots, impl
        self._heads, self._kv_heads, self._dim = num_heads, layout.num_kv_heads, layout.head_dim
        layer = pool.layers[0]
        # An 8-bit pool's quants and scales are written by the same kernel, rounded as quantize_rows rounds them.
        self._elements = element_args(layer)
        pool_fits = layer.device.type == "cpu" and (
            layout.quantized or (layer.dtype in (cos.dtype, torch.float16) and layer.is_contiguous())
        )
        self.native = (
            _native_fits(cos, sin)
            and pool_fits
            and layer.stride(-1) == 1
            and layer.stride(-2) == layout.head_dim
            and layout.head_dim % 2 == 0
            and layout.head_dim <= 512
        )
        if self.native:
            self._positions = positions.to(torch.int64).contiguous()
            self._blocks = slots.blocks.to(torch.int64).contiguous()
            self._offsets = slots.offsets.to(torch.int64).contiguous()
            self._tables = (cos, sin)
            self._strides = tuple(layer.stride()[:4])
        else:
            self._cos, self._sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def apply(self, layer: int, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = qkv.shape[0]
        heads, kv_heads, dim = self._heads, self._kv_heads, self._dim
        q_dim, kv_dim = heads * dim, kv_heads * dim
        if self.native:
            qkv = qkv.contiguous()
            q = qkv.new_empty(rows, heads, dim)
            _native.rope_kv(
                qkv.data_ptr(),
                rows,
                qkv.shape[1],
                heads,
                kv_heads,
                dim,
                self._tables[0].data_ptr(),
                self._tables[1].data_ptr(),
                self._positions.data_ptr(),
                q.data_ptr(),
                self._pool.layers[layer].data_ptr(),
                self._strides,
                self._blocks.data_ptr(),
                self._offsets.data_ptr(),
                qkv.dtype == torch.bfloat16,
                _threads(rows),
                self._impl,
                **self._elements,
            )
            k = qkv[:, q_dim : q_dim + kv_dim].unflatten(-1, (kv_heads, dim))
            v = qkv[:, q_dim + kv_dim :].unflatten(-1, (kv_heads, dim))
            return q, k, v
        q, k, v = qkv.split((q_dim, kv_dim, kv_dim), dim=-1)
        q = apply_rope(q.reshape(rows, heads, dim), self._cos, self._sin)
        k = apply_rope(k.reshape(rows, kv_heads, dim), self._cos, self._sin)
        v = v.reshape(rows, kv_heads, dim)
        self._pool.write(layer, self._slots, k, v)
        return q, k, v
