"""A Llama forward pass over the paged :class:`~kvtier.engine.pool.KVPool`.

Tokens of every sequence in a batch are flattened into one ``[N, hidden]``
matrix, so the projections and the MLP run as one matmul each whatever the
mix of prefills and decodes; only attention is per sequence. Each layer
writes its new K/V into the pool first, then attends:

* a prefill with nothing cached (``start == 0``) uses its fresh K/V and SDPA's
  built-in causal mask (the fused path, no gather);
* a prefill on top of cached positions (new token *i* sees positions
  ``<= start + i``) runs the C kernel of :mod:`kvtier.engine.kernels`,
  which reads the sequence's K/V where they lie in its blocks; where it
  does not fit, torch gathers them (one ``index_select``) and runs SDPA
  with a causal mask shifted by ``start`` (``is_causal`` would align the
  triangle top-left, which is wrong once keys outnumber queries);
* decodes (one new token each) are batched, one call per layer into
  :mod:`kvtier.engine.kernels`: on CPU a C kernel that reads each
  sequence's K/V where they lie in its blocks; elsewhere K/V of all
  decoding sequences gathered padded to the longest, with a padding mask.
  Either way the query heads that share a KV head attend together, so
  grouped-query attention needs no repeated K/V. A decode-only step also
  multiplies by the GGUF's own quantized blocks (Q4_0 to Q8_0 and the
  K-quants) instead of the dense matrices when the model was given them
  (:mod:`kvtier.engine.quant`): the step is bound by weight bytes, and
  those are 4-7x fewer.

Between the matrix products, a layer's element-wise steps (each residual
add fused with the RMSNorm after it, RoPE fused with the K/V write into the
pool, SwiGLU's gate) are one C pass each (:mod:`kvtier.engine.rowwise`):
on a short prefill over a cached prefix and on a decode step, torch's
several operator calls per step cost more than their arithmetic.

Choices made by measurement on the shared 2-core development CPU, with the
machine otherwise idle (another busy process there starves 2-thread OpenMP,
so numbers taken under load mean nothing; current figures are in
bench/README.md):

* the torch decode path is a plain ``matmul → softmax → matmul`` with the
  softmax in float32 rather than SDPA with a boolean padding mask: no
  slower than any variant tried, and as precise as SDPA's kernel;
* the C decode kernel beats that gather + matmul path because it reads
  each cached K/V byte once, in place, where torch copies it out and then
  reads the copy twice; with it attention is a minor share of a decode
  step, and most of the rest is the weight matmuls, matrix-vector products
  bound by the bytes of weights they stream (hence the quantized decode
  weights above);
* SDPA on 3-D ``[heads, T, D]`` inputs takes the slow math path on CPU, so
  prefill attention always passes 4-D ones. ``enable_gqa=True`` costs
  nothing there, so prefill never repeats K/V.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.engine import quant
from kvtier.engine.kernels import DecodePlan, NativePrefill, native_fits, plan_decode, plan_prefill
from kvtier.engine.pool import BlockTable, Gather, KVPool, Slots
from kvtier.engine.quant import QuantMatrix, QuantStack, fuse
from kvtier.engine.rowwise import Rope, add_rms_norm, head_rms_norm, rope_table, silu_mul
from kvtier.layout import KVLayout, dtype_name
from kvtier.model import QuantBlocks
from kvtier.model.config import Activation, ModelConfig


@dataclass(frozen=True)
class SeqInput:
    """One sequence's share of a forward: its new tokens, where they start, and its pages.

    ``start`` must equal ``table.num_tokens`` (the positions already in the
    pool) and ``table`` must already hold blocks for ``start + len(token_ids)``
    positions (:meth:`KVPool.grow`): allocation is the scheduler's decision,
    never a side effect of the forward.

    ``verify``: the tokens are a decoding sequence's next token and its
    drafts (:mod:`kvtier.engine.speculate`). Each runs as a decode row that
    attends to the positions up to its own, with the weights and kernel a
    one-token decode uses, and the forward returns logits for every one of
    them, not only the last.
    """

    token_ids: Sequence[int] | torch.Tensor
    start: int
    table: BlockTable
    verify: bool = False


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, Q/K/V and gate/up fused so each is one matmul."""

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    bqkv: torch.Tensor | None = None  # qwen2: Q/K/V biases, fused like the weights
    q_norm: torch.Tensor | None = None  # qwen3, gemma3: RMSNorm weights over each head of Q and of K, before RoPE
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # gemma3: the attention's output normed before the residual add
    post_mlp_norm: torch.Tensor | None = None  # and the MLP's


@dataclass(frozen=True)
class _QuantLayer:
    """The same layer's matrices as GGUF blocks, for decode steps (:mod:`kvtier.engine.quant`)."""

    wqkv: QuantMatrix | QuantStack
    wo: QuantMatrix
    w_gate_up: QuantMatrix | QuantStack
    w_down: QuantMatrix


@dataclass(frozen=True)
class _Windowed:
    """A sliding-window layer's attention for a sequence longer than the window: torch's, with the window masked."""

    gather: Gather | None  # the cached + new positions (None: nothing cached, attend to the fresh K/V)
    mask: torch.Tensor  # additive [T, start + T]: 0 where a new token may look (causal, within the window)


@dataclass(frozen=True)
class _Prefill:
    rows: slice  # this sequence's rows of the flattened batch
    start: int
    native: NativePrefill | None  # the C kernel over the cached + new positions, where it fits
    gather: Gather | None  # else torch's: None when nothing is cached (attend to the fresh K/V)
    mask: torch.Tensor | None  # additive [T, start + T]: 0 where a new token may look, -inf elsewhere
    windowed: _Windowed | NativePrefill | None  # sliding-window layers, when the window cuts into what tokens see


@dataclass(frozen=True)
class _Decode:
    rows: torch.Tensor  # rows of the flattened batch, one per decoding sequence
    attention: DecodePlan  # the C kernel on CPU, else gather + matmul (kvtier.engine.kernels)
    windowed: DecodePlan | None  # sliding-window layers, when some sequence is longer than the window


@dataclass(frozen=True)
class _Plan:
    """Everything about a batch that is the same for every layer, computed once per forward."""

    ids: torch.Tensor
    ropes: list[Rope]  # per layer: each new token's rotation (the layer's RoPE base), and its pool slot
    last_rows: torch.Tensor
    prefills: list[_Prefill]
    decode: _Decode | None


class LlamaModel:
    """Llama-family decoder (RMSNorm, rotate-half RoPE, GQA, SwiGLU) over a paged KV pool.

    An architecture's additions (:class:`~kvtier.model.config.ArchitectureTraits`:
    Q/K/V biases, per-head Q/K norms) are tensors of the layer, applied to
    the fused Q/K/V product before RoPE: every path after that (the fused
    RoPE and K/V write, the attention kernels) is the same for all of them.
    Gemma 3's further ones are as local: its embeddings scaled, a norm on
    each block's output, GeGLU for SwiGLU, and sliding-window layers with
    their own RoPE base. A sliding-window layer attends as any other until a
    sequence outgrows its window; past that its attention starts at the
    window: the C kernels take the window and read nothing before it, and
    torch's paths, where those do not fit, mask it.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        blocks: Mapping[str, QuantBlocks] | None = None,
        q8_decode: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``blocks`` (from :func:`~kvtier.model.load_gguf_blocks`): the quantized form of the same weights.

        Given, and where it applies (float32 or bfloat16 on the CPU, the native
        kernel built, every projection and the lm_head in a supported format),
        decode steps read those instead of the dense matrices. ``q8_decode``:
        their products take the activations rounded to 8 bits a block
        (``engine.decode_activations: q8``; needs :data:`quant.Q8`).
        ``kv_dtype``: the KV pool's, ``dtype`` (the default), ``torch.float16``,
        ``torch.int8`` or ``torch.float8_e4m3fn`` (``engine.kv_dtype``; 8-bit
        quants with row scales); all but ``dtype`` need the CPU's C attention kernels.
        """
        if q8_decode and not quant.Q8:
            raise ValueError("8-bit decode products need AVX-512 VNNI, which this CPU lacks")
        self.q8_decode = q8_decode
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"{config.num_heads} heads do not group evenly over {config.num_kv_heads} KV heads")
        self.config = config
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        if self.kv_dtype not in (dtype, torch.float16, torch.int8, torch.float8_e4m3fn):
            raise ValueError(
                f"a {dtype} model's KV pool holds {dtype}, float16, int8 or float8_e4m3fn, not {self.kv_dtype}"
            )
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weights lack {name!r}")
            return weights[name].detach().to(device=self.device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        traits = config.traits
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype) if traits.scaled_embedding else None
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.norm = w("model.norm.weight")
        self.layers = [self._layer(w, f"model.layers.{i}.") for i in range(config.num_layers)]
        self._q_dim, self._kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.decode_layers: list[_QuantLayer] | None = None
        self.lm_head_blocks: QuantMatrix | None = None
        dense_ok = dtype in (torch.float32, torch.bfloat16)
        if blocks is not None and dense_ok and self.device.type == "cpu":
            self._load_decode_blocks(blocks)
        cos, sin = rope_table(config.head_dim, config.rope_theta, config.context_length)
        self.cos = cos.to(device=self.device, dtype=dtype)
        self.sin = sin.to(device=self.device, dtype=dtype)
        self.local_rope: tuple[torch.Tensor, torch.Tensor] | None = None
        if config.sliding_layers and config.local_rope_theta not in (None, config.rope_theta):
            cos, sin = rope_table(config.head_dim, config.local_rope_theta, config.context_length)
            self.local_rope = (cos.to(device=self.device, dtype=dtype), sin.to(device=self.device, dtype=dtype))

    def _layer(self, get: Callable[[str], torch.Tensor], p: str) -> _Layer:
        attn = [get(f"{p}self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        mlp = [get(f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
        traits = self.config.traits
        bias = torch.cat([get(f"{p}self_attn.{n}_proj.bias") for n in ("q", "k", "v")]) if traits.qkv_bias else None
        norms = [get(f"{p}self_attn.{n}_norm.weight") for n in ("q", "k")] if traits.qk_norm else [None, None]
        post = traits.post_norms
        return _Layer(
            attn_norm=get(f"{p}input_layernorm.weight"),
            wqkv=torch.cat(attn, dim=0),
            wo=get(f"{p}self_attn.o_proj.weight"),
            mlp_norm=get(f"{p}pre_feedforward_layernorm.weight" if post else f"{p}post_attention_layernorm.weight"),
            w_gate_up=torch.cat(mlp, dim=0),
            w_down=get(f"{p}mlp.down_proj.weight"),
            bqkv=bias,
            q_norm=norms[0],
            k_norm=norms[1],
            post_attn_norm=get(f"{p}post_attention_layernorm.weight") if post else None,
            post_mlp_norm=get(f"{p}post_feedforward_layernorm.weight") if post else None,
        )

    def _load_decode_blocks(self, blocks: Mapping[str, QuantBlocks]) -> None:
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        names = [head]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            names += [f"{p}self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
            names += [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if not all(n in blocks for n in names):
            return  # some matrix dense in the file (F16, BF16...): decode keeps the dense matmuls throughout

        def fused(p: str, *parts: str) -> QuantMatrix | QuantStack:
            return fuse([blocks[f"{p}{part}.weight"] for part in parts])

        layers = []
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            layers.append(
                _QuantLayer(
                    wqkv=fused(p, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    wo=QuantMatrix.of(blocks[f"{p}self_attn.o_proj.weight"]),
                    w_gate_up=fused(p, "mlp.gate_proj", "mlp.up_proj"),
                    w_down=QuantMatrix.of(blocks[f"{p}mlp.down_proj.weight"]),
                )
            )
        self.decode_layers = layers
        self.lm_head_blocks = QuantMatrix.of(blocks[head])

    # -- pool ------------------------------------------------------------------
    def kv_layout(self, block_size: int) -> KVLayout:
        c = self.config
        eight_bit = self.kv_dtype.itemsize == 1  # kvtier's 8-bit pools always carry their rows' scales
        return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, self.kv_dtype, row_scales=eight_bit)

    def make_pool(self, block_size: int, num_blocks: int) -> KVPool:
        pool = KVPool(self.kv_layout(block_size), num_blocks, self.device)
        if pool.layout.dtype != self.dtype and not native_fits(pool.layers[0], self.config.num_heads):
            raise ValueError(
                f"{dtype_name(pool.layout.dtype)} KV under a {dtype_name(self.dtype)} model is read by the CPU's C "
                f"attention kernels only, which do not take this pool "
                f"({pool.device}, head_dim {self.config.head_dim}, {self.config.num_heads} heads over "
                f"{self.config.num_kv_heads}): set engine.kv_dtype auto"
            )
        return pool

    # -- forward ---------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, seqs: Sequence[SeqInput], pool: KVPool, *, layer_ready: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Run the new tokens of ``seqs``; float32 logits of each sequence's last new token, ``[S, vocab]``
        (of each of its tokens for a ``verify`` sequence, in order).

        The lm_head runs on the last rows only: on a long prefill it would
        otherwise cost as much as several layers. Those few rows are a
        matrix-vector product bound by the head's bytes, so they read its
        GGUF blocks when the model has them (Q8_0 here: 34 bytes per 32
        weights instead of float32's 128), prefill or decode alike.
        ``layer_ready(l)``, when given, is called right before layer *l*
        first reads the pool: cached K/V still being copied in
        (:class:`~kvtier.engine.onboard.LayerwiseLoad`) only has to be there
        by then.
        """
        hidden, plan = self._hidden(seqs, pool, layer_ready)
        last = hidden[plan.last_rows]
        if self.lm_head_blocks is not None and len(last) <= quant.MAX_ROWS:
            return self.lm_head_blocks(last, q8=self.q8_decode)
        return self._logits(last)

    @torch.inference_mode()
    def forward_all(self, seqs: Sequence[SeqInput], pool: KVPool) -> list[torch.Tensor]:
        """Like :meth:`forward` but logits at every new position, ``[len(token_ids), vocab]`` per sequence."""
        if any(s.verify for s in seqs):
            raise ValueError("forward_all returns every position already: pass the sequences without verify")
        hidden, plan = self._hidden(seqs, pool, None)
        bounds = [0, *(plan.last_rows + 1).tolist()]
        return [self._logits(hidden[a:b]) for a, b in itertools.pairwise(bounds)]

    __call__ = forward

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head.T).float()

    def _hidden(
        self, seqs: Sequence[SeqInput], pool: KVPool, layer_ready: Callable[[int], None] | None
    ) -> tuple[torch.Tensor, _Plan]:
        self._check(seqs, pool)
        plan = self._plan(seqs, pool)
        eps = self.config.rms_norm_eps
        decode = self._decode_blocks(plan)
        # each residual add is fused with the RMSNorm that follows it: the norm's input is the sum
        embedded = F.embedding(plan.ids, self.embed)
        if self.embed_scale is not None:
            embedded = embedded * self.embed_scale
        x, h = add_rms_norm(embedded, None, self.layers[0].attn_norm, eps)
        norms = [layer.mlp_norm for layer in self.layers]
        after = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        for i, layer in enumerate(self.layers):
            q = None if decode is None else decode[i]
            attended = self._attention(i, layer, q, h, plan, pool, layer_ready)
            if layer.post_attn_norm is not None:  # Gemma 3's norms on a block's output: the C kernel, no residual
                attended = add_rms_norm(attended, None, layer.post_attn_norm, eps)[1]
            x, h = add_rms_norm(x, attended, norms[i], eps)
            mlp = self._mlp(layer, q, h)
            if layer.post_mlp_norm is not None:
                mlp = add_rms_norm(mlp, None, layer.post_mlp_norm, eps)[1]
            x, h = add_rms_norm(x, mlp, after[i], eps)
        for s in seqs:
            s.table.num_tokens = s.start + len(s.token_ids)
        return h, plan

    def _decode_blocks(self, plan: _Plan) -> list[_QuantLayer] | None:
        """The quantized matrices when this forward is a decode step they can serve, else None (dense)."""
        if plan.prefills or plan.decode is None or len(plan.ids) > quant.MAX_ROWS:
            return None
        return self.decode_layers

    def _check(self, seqs: Sequence[SeqInput], pool: KVPool) -> None:
        want = self.kv_layout(pool.block_size)
        if pool.layout != want or pool.device != self.device:
            raise ValueError(f"pool {pool.layout.descriptor} on {pool.device} does not fit {want.descriptor}")
        if not seqs:
            raise ValueError("a forward needs at least one sequence")
        for s in seqs:
            if s.start != s.table.num_tokens or not len(s.token_ids):
                raise ValueError(f"{len(s.token_ids)} new tokens at {s.start}; the table holds {s.table.num_tokens}")
            if s.start + len(s.token_ids) > self.config.context_length:
                raise ValueError(f"sequence runs past the context length {self.config.context_length}")

    def _plan(self, seqs: Sequence[SeqInput], pool: KVPool) -> _Plan:
        ids, positions, slots, last_rows = [], [], [], []
        prefills: list[_Prefill] = []
        decoding: list[tuple[int, BlockTable, int]] = []  # row, pages, positions it attends to
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            ids.append(torch.as_tensor(s.token_ids, dtype=torch.long).reshape(-1))
            positions.append(torch.arange(s.start, s.start + n))
            slots.append(pool.slots(s.table, s.start, n))
            if n == 1 or s.verify:
                decoding += [(row + i, s.table, s.start + i + 1) for i in range(n)]
            else:
                native = plan_prefill(pool, s.table, s.start, n, self.config.num_heads)
                torch_path = s.start > 0 and native is None
                gather = pool.plan_gather([s.table], [s.start + n]) if torch_path else None
                mask = self._shifted_causal_mask(s.start, n) if torch_path else None
                windowed = self._windowed_prefill(pool, s.table, s.start, n)
                prefills.append(_Prefill(slice(row, row + n), s.start, native, gather, mask, windowed))
            last_rows += range(row, row + n) if s.verify else [row + n - 1]
            row += n
        pos = torch.cat(positions).to(self.device)
        slot = Slots(torch.cat([x.blocks for x in slots]), torch.cat([x.offsets for x in slots]))
        rope = Rope(self.cos, self.sin, pos, slot, pool, self.config.num_heads)
        ropes = [rope] * self.config.num_layers
        if self.local_rope is not None:
            local = Rope(*self.local_rope, pos, slot, pool, self.config.num_heads)
            ropes = [local if self.config.window(i) else rope for i in range(self.config.num_layers)]
        return _Plan(
            ids=torch.cat(ids).to(self.device),
            ropes=ropes,
            last_rows=torch.tensor(last_rows, device=self.device),
            prefills=prefills,
            decode=self._plan_decode(decoding, pool) if decoding else None,
        )

    def _shifted_causal_mask(self, start: int, count: int) -> torch.Tensor:
        """New token *i* sees positions ``<= start + i``, built once per forward for every layer.

        Additive (0 / -inf) in the model dtype rather than boolean: SDPA
        takes the same kernel either way, bit for bit, but converts a
        boolean mask to this form on every call: a fresh ``[count, total]``
        tensor per layer, a sizable share of a short tail's attention over a
        long prefix.
        """
        total = start + count
        query_pos = torch.arange(start, total, device=self.device)
        allowed = torch.arange(total, device=self.device)[None, :] <= query_pos[:, None]
        mask = torch.zeros(count, total, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, float("-inf"))

    def _windowed_prefill(
        self, pool: KVPool, table: BlockTable, start: int, count: int
    ) -> _Windowed | NativePrefill | None:
        """Sliding-window layers' attention, when the window cuts into what these tokens see.

        The C kernel with the window where it takes the pool (where the forward
        uses it for the other layers too, so a token's K/V are the same bits
        however the prompt was cut: bfloat16's exact reuse), else torch's path
        with the window in the mask.
        """
        window = self.config.sliding_window
        if not self.config.sliding_layers or window is None or start + count <= window:
            return None
        native = plan_prefill(pool, table, start, count, self.config.num_heads, window=window)
        if native is not None:
            return native
        total = start + count
        query_pos = torch.arange(start, total, device=self.device)[:, None]
        key_pos = torch.arange(total, device=self.device)[None, :]
        allowed = (key_pos <= query_pos) & (key_pos > query_pos - window)
        mask = torch.zeros(count, total, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))
        gather = pool.plan_gather([table], [total]) if start > 0 else None
        return _Windowed(gather, mask)

    def _plan_decode(self, decoding: list[tuple[int, BlockTable, int]], pool: KVPool) -> _Decode:
        tables, lengths = [t for _, t, _ in decoding], [n for _, _, n in decoding]
        rows = torch.tensor([r for r, _, _ in decoding], device=self.device)
        window = self.config.sliding_window
        windowed = None
        if self.config.sliding_layers and window is not None and max(lengths) > window:
            windowed = plan_decode(pool, tables, lengths, self.config.num_heads, window=window)
        return _Decode(rows, plan_decode(pool, tables, lengths, self.config.num_heads), windowed)

    def _mlp(self, layer: _Layer, q: _QuantLayer | None, h: torch.Tensor) -> torch.Tensor:
        if q is not None:  # the activation in the model's dtype, as the dense path computes it
            gate_up = q.w_gate_up(h, q8=self.q8_decode).to(h.dtype)
            return q.w_down(self._gate(gate_up), q8=self.q8_decode).to(h.dtype)
        return self._gate(h @ layer.w_gate_up.T) @ layer.w_down.T

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the fused ``[N, 2 * inter]`` product: SwiGLU in one C pass, or GeGLU."""
        if self.config.traits.activation is Activation.SILU:
            return silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def _attention(
        self,
        index: int,
        layer: _Layer,
        quantized: _QuantLayer | None,
        h: torch.Tensor,
        plan: _Plan,
        pool: KVPool,
        layer_ready: Callable[[int], None] | None,
    ) -> torch.Tensor:
        c = self.config
        q_dim = c.num_heads * c.head_dim
        qkv = h @ layer.wqkv.T if quantized is None else quantized.wqkv(h, q8=self.q8_decode).to(h.dtype)
        qkv = self._before_rope(layer, qkv)
        if layer_ready is not None:
            layer_ready(index)  # cached K/V of this layer are in the pool from here on
        q, k, v = plan.ropes[index].apply(index, qkv)  # and this forward's new ones from here
        sliding = self.config.window(index) is not None
        if plan.decode is not None and not plan.prefills:  # a decode step: its rows are the whole batch, in order
            out = self._decode_attention(index, plan.decode, q, sliding)
        elif plan.decode is None and len(plan.prefills) == 1:  # one prompt: likewise
            out = self._prefill_attention(index, plan.prefills[0], q, k, v, pool, sliding)
        else:  # a mix: each part into its rows
            out = torch.empty_like(q)
            for p in plan.prefills:
                out[p.rows] = self._prefill_attention(index, p, q[p.rows], k[p.rows], v[p.rows], pool, sliding)
            if plan.decode is not None:
                out[plan.decode.rows] = self._decode_attention(index, plan.decode, q[plan.decode.rows], sliding)
        out = out.reshape(-1, q_dim)
        return out @ layer.wo.T if quantized is None else quantized.wo(out, q8=self.q8_decode).to(h.dtype)

    def _before_rope(self, layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """The architecture's hooks on the fused ``qkv [N, q_dim + 2 kv_dim]``: biases, then per-head Q/K norms."""
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv
        if layer.q_norm is not None and layer.k_norm is not None:
            c, q_dim, kv_dim = self.config, self._q_dim, self._kv_dim
            d, eps = c.head_dim, c.rms_norm_eps
            q = head_rms_norm(qkv[:, :q_dim].reshape(-1, c.num_heads, d), layer.q_norm, eps)
            k = head_rms_norm(qkv[:, q_dim : q_dim + kv_dim].reshape(-1, c.num_kv_heads, d), layer.k_norm, eps)
            qkv = torch.cat([q.flatten(1), k.flatten(1), qkv[:, q_dim + kv_dim :]], dim=1)
        return qkv

    def _prefill_attention(
        self, index: int, p: _Prefill, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, sliding: bool
    ) -> torch.Tensor:
        """One sequence's new tokens ``q [T, heads, D]`` against its cached plus new positions.

        On top of cached positions, the C kernel where it fits
        (:class:`~kvtier.engine.kernels.NativePrefill`: no gather, no mask
        to build or read). Else SDPA, with 4-D inputs (``[1, heads, T, D]``):
        on CPU it takes its flash kernel only for 4-D inputs and falls back
        to the math path, which materializes every score, for 3-D ones.
        """
        if sliding and isinstance(p.windowed, NativePrefill):
            return p.windowed.attend(index, q)
        if sliding and p.windowed is not None:
            return self._windowed_attention(index, p.windowed, q, k, v, pool)
        if p.native is not None:
            return p.native.attend(index, q)
        q = q.transpose(0, 1).unsqueeze(0)
        if p.gather is None:
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        total = p.start + q.shape[2]
        keys, values = pool.gather(index, p.gather)
        keys, values = keys[:, :, :total], values[:, :, :total]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=p.mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _windowed_attention(
        self, index: int, w: _Windowed, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """A sliding-window layer's new tokens against the positions inside their windows (SDPA, masked)."""
        q = q.transpose(0, 1).unsqueeze(0)
        if w.gather is None:
            keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        else:
            total = w.mask.shape[1]
            keys, values = pool.gather(index, w.gather)
            keys, values = keys[:, :, :total], values[:, :, :total]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=w.mask, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _decode_attention(self, index: int, d: _Decode, q: torch.Tensor, sliding: bool) -> torch.Tensor:
        """Decoding tokens ``q [S, heads, D]``, each against its own sequence's cached positions.

        The kernel was picked once for the forward (:func:`~kvtier.engine.kernels.plan_decode`;
        the plan holds the pool). A decode step runs the same one whether its
        prefix was reused or recomputed, so reuse stays exact.
        """
        if sliding and d.windowed is not None:
            return d.windowed.attend(index, q)
        return d.attention.attend(index, q)
