"""Batched torch attention for the CPU: one attention call per layer per step over every sequence.

The reference backend (``torch_ref.py``) gathers each sequence's pages and runs SDPA once per
sequence, a host loop of ~10 small ops per sequence per layer; at 32 decoding sequences that loop
was most of a decode step. This backend pads the step instead, as stock ``generate`` does: the
queries to ``[N, max_q]``, the keys to ``[N, max_context]`` gathered from the paged cache in one
index, and one boolean mask (causal, context length, sliding window) covers the padding.

GQA costs no copy of K/V: the ``g = H // Hkv`` query heads of a kv head are folded into the
query-length axis (``[N, Hkv, g * max_q, D]``), so SDPA sees as many heads as the cache holds.
Score modifiers (softcap, ALiBi, attention sinks) and dtypes below fp32 take an explicit
matmul-softmax path over the same layout, in the reference's order (scores in the input dtype,
softmax in fp32). The step's layout (indices and masks) is built once and
shared by every layer of the step.

Under a reduced-precision autocast (the model's mixed precision, ``models/autocast.py``) SDPA
computes in bf16, where its CPU kernel's result for a query row depends on how many keys the
call holds, masked or not (its blocking of the probability x value product over the keys):
padding a sequence's keys to a longer one's moves its output by a bf16 rounding step now and
then. Stock's oracle, each request alone, attends over exactly its own keys; so there a step's
sequences are grouped by equal query and context lengths (``exact``), and a decode group passes
no mask and, in a sliding-window layer, only the window's keys, as stock's decode does (its
sliding cache holds the last ``window`` keys). One call per group: GRPO's copies of one prompt
decode as one.

A float8 KV cache goes to the reference (it attends to a whole prompt's own unquantized K/V, which
a gather from the cache cannot give), and so does a step with bidirectional ranges (images of
Gemma 3 and its kin).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.kernels.attention.kv_store import store_kvcache_ref


@dataclass
class StepLayout:
    """Where every query and key of a group of a step's sequences sits in the padded
    ``[N, max_q]`` / ``[N, max_ctx]`` batch; built once per step (``AttentionMetadata``) and read
    by every layer."""

    num_seqs: int
    max_q: int
    max_ctx: int
    q_pos: torch.Tensor  # [N, max_q] int64: position of each query (padding: its row's last)
    k_pos: torch.Tensor  # [max_ctx] int64
    # [N, max_q] int64: row of q for each padded query (None: decode, q is already [N, 1])
    q_index: torch.Tensor | None
    # [T] int64: the padded query of each token, in token order (None: decode)
    token_index: torch.Tensor | None
    kv_slots: torch.Tensor  # [N, max_ctx] int64: flat cache slot (or row of k, uncached)
    base_mask: torch.Tensor  # [N, max_q, max_ctx] bool: causal and inside the context
    # [T_group] int64: the step's token rows this layout computes (None: all, in order)
    out_rows: torch.Tensor | None = None
    # every query sees every key of its sequence (decode over equal contexts, no key padding)
    sees_all: bool = False
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by sliding window
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # by kv head count

    def kv_rows(self, num_kv_heads: int) -> torch.Tensor:  # [N * Hkv * max_ctx] int64
        """Rows of the cache viewed as ``[slots * Hkv, D]`` in ``[N, Hkv, max_ctx]`` order: one
        ``index_select`` then gives the keys already laid out for the matmuls, contiguous."""
        if num_kv_heads not in self.rows:
            heads = torch.arange(num_kv_heads, device=self.kv_slots.device)
            rows = self.kv_slots[:, None, :] * num_kv_heads + heads[None, :, None]
            self.rows[num_kv_heads] = rows.reshape(-1)
        return self.rows[num_kv_heads]

    def mask(self, window: int | None) -> torch.Tensor:  # [N, max_q, max_ctx] bool
        if window is None:
            return self.base_mask
        if window not in self.masks:
            rel = self.q_pos[:, :, None] - self.k_pos[None, None, :]
            self.masks[window] = self.base_mask & (rel < window)
        return self.masks[window]


# a prefill step's sequences are grouped so that a group's padded query x key pairs stay within
# this factor of its real ones (or within _SMALL_PAIRS, where another call would cost more)
_MAX_PADDING = 2.0
_SMALL_PAIRS = 1 << 16


def build_layouts(meta: AttentionMetadata, block_size: int | None, device,
                  exact: bool = False) -> list[StepLayout]:  # fmt: skip
    """The padded layouts of ``meta``'s step: one for a decode step; for a step with prefill
    chunks, one per group of sequences of similar lengths (see ``group_sequences``); with
    ``exact``, one per distinct (query length, context length) (module docstring).
    ``block_size`` None: no cache, keys are rows of the step's own k (whole prompts)."""
    cu = torch.tensor(meta.cu_seqlens_q_cpu or meta.cu_seqlens_q.tolist(), dtype=torch.int64)
    ctx = torch.tensor(meta.context_lens_cpu or meta.context_lens.tolist(), dtype=torch.int64)
    q_lens = cu[1:] - cu[:-1]  # [N]
    tables = None if block_size is None else meta.block_tables.to("cpu", torch.int64)
    group = group_exact if exact else group_sequences
    groups = group(q_lens.tolist(), ctx.tolist())
    if len(groups) == 1:
        return [_layout(cu, q_lens, ctx, tables, block_size, device, torch.arange(len(q_lens)))]
    return [_layout(cu, q_lens, ctx, tables, block_size, device, torch.tensor(g)) for g in groups]


def group_sequences(q_lens: list[int], ctx: list[int]) -> list[list[int]]:
    """Sequence indices in groups: all of them when every query length is 1 (decode); else by
    query length, longest first, a group closed when padding it to its longest query and context
    would cost more than ``_MAX_PADDING`` times its real query x key pairs."""
    n = len(q_lens)
    if all(q == 1 for q in q_lens):
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: (-q_lens[i], -ctx[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    max_q = max_ctx = real = 0
    for i in order:
        mq, mc = max(max_q, q_lens[i], 1), max(max_ctx, ctx[i], 1)
        padded = (len(cur) + 1) * mq * mc
        if cur and padded > max(_MAX_PADDING * (real + q_lens[i] * ctx[i]), _SMALL_PAIRS):
            groups.append(sorted(cur))
            cur, max_q, max_ctx, real = [], 0, 0, 0
            mq, mc = max(q_lens[i], 1), max(ctx[i], 1)
        cur.append(i)
        max_q, max_ctx, real = mq, mc, real + q_lens[i] * ctx[i]
    groups.append(sorted(cur))
    return groups


def group_exact(q_lens: list[int], ctx: list[int]) -> list[list[int]]:
    """Sequence indices grouped by equal (query length, context length), so that no key is
    padding (module docstring); groups in order of their first sequence."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(q_lens, ctx)):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _layout(cu, q_lens, ctx, tables, block_size, device, seqs: torch.Tensor) -> StepLayout:
    """The layout of sequences ``seqs`` (indices into the step, ascending)."""
    n = len(seqs)
    start, q_lens, ctx = cu[:-1][seqs], q_lens[seqs], ctx[seqs]
    max_q = max(1, int(q_lens.max()))
    max_ctx = max(1, int(ctx.max()))
    j = torch.arange(max_q)
    valid = j[None, :] < q_lens[:, None]  # [n, max_q]
    # query j of a sequence sits at ctx - q_len + j; padding repeats the last query's position,
    # so its mask row is a real one (never all masked)
    last = (q_lens - 1).clamp(min=0)
    q_pos = ctx[:, None] - q_lens[:, None] + torch.minimum(j[None, :], last[:, None])
    k_pos = torch.arange(max_ctx)
    base_mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < ctx[:, None, None]
    )
    total = int(cu[-1])
    q_index = token_index = out_rows = None
    if not (max_q == 1 and bool(valid.all()) and n == total):  # not a whole decode step
        q_index = torch.where(valid, start[:, None] + j[None, :], 0)
        token_index = valid.reshape(-1).nonzero().squeeze(1)
        rows = q_index[valid]  # the step's token rows of this group, in its order
        if len(rows) != total or not torch.equal(rows, torch.arange(total)):
            out_rows = rows
    if block_size is None:  # keys are the step's own rows: a sequence's key t is row start + t
        kv_slots = (start[:, None] + k_pos[None, :]).clamp(max=max(total - 1, 0))
    else:
        blocks = (k_pos // block_size).clamp(max=tables.shape[1] - 1)
        kv_slots = tables[seqs][:, blocks] * block_size + k_pos % block_size
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    sees_all = bool(base_mask.all())
    return StepLayout(n, max_q, max_ctx, to(q_pos), to(k_pos), to(q_index), to(token_index),
                      to(kv_slots), to(base_mask), to(out_rows), sees_all)  # fmt: skip


class TorchBatchedBackend(AttentionBackend):
    """Every layer spec the reference computes, in one call per layer per step (any device;
    chosen on the CPU). Output equals the reference's up to floating-point rounding."""

    name = "torch_batched"
    supports_cuda_graph = False
    accepts_sinks = True
    accepts_bidirectional = True  # a step with bidirectional ranges goes to the reference

    def __init__(self):
        self._reference = TorchRefBackend()
        # the last step's layouts, the metadata they were built from (kept alive, so that the
        # identity check cannot match a new object at a reused address) and their ``exact``
        self._layouts: tuple[AttentionMetadata, bool, list[StepLayout]] | None = None

    def release(self) -> None:
        self._layouts = None

    def layouts(self, meta: AttentionMetadata, block_size: int | None, device,
                exact: bool = False) -> list[StepLayout]:  # fmt: skip
        if self._layouts is None or self._layouts[0] is not meta or self._layouts[1] != exact:
            self._layouts = (meta, exact, build_layouts(meta, block_size, device, exact))
        return self._layouts[2]

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata,
                spec: AttentionLayerSpec, kv_stored: bool = False, sinks=None) -> torch.Tensor:  # fmt: skip
        """``AttentionBackend.forward`` (its shapes); ``sinks`` [H] as the reference takes
        them. Returns [T, H, Dv]."""
        has_cache = k_cache is not None and v_cache is not None
        bidirectional = meta.bidirectional_ranges is not None and spec.bidirectional
        if bidirectional or (has_cache and k_cache.dtype != q.dtype):
            return self._reference.forward(q, k, v, k_cache, v_cache, meta, spec, kv_stored, sinks)
        if has_cache and not kv_stored:
            store_kvcache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        if not has_cache:
            _check_uncached(meta)
        exact = torch.is_autocast_enabled(q.device.type)  # SDPA in bf16: module docstring
        lays = self.layouts(meta, k_cache.shape[1] if has_cache else None, q.device, exact)
        k_src = k_cache if has_cache else k  # [.., Hkv, D]: cache slots, or the step's rows
        v_src = v_cache if has_cache else v
        if len(lays) == 1 and lays[0].out_rows is None:
            return self._attend(lays[0], q, k_src, v_src, spec, sinks)
        out = None  # [T, H, Dv], in the groups' output dtype (bf16 under autocast)
        for lay in lays:
            o = self._attend(lay, q, k_src, v_src, spec, sinks)
            if out is None:
                out = o.new_empty(q.shape[0], q.shape[1], v.shape[-1])
            out[lay.out_rows] = o
        return out

    @staticmethod
    def _attend(lay: StepLayout, q, k_src, v_src, spec: AttentionLayerSpec, sinks):
        """The outputs of ``lay``'s tokens, in its order: [T_group, H, Dv]."""
        n, mq, h, hkv = lay.num_seqs, lay.max_q, spec.num_heads, spec.num_kv_heads
        g, d, dv, lk = h // hkv, q.shape[-1], v_src.shape[-1], lay.max_ctx
        # one index_select of rows: several times faster on the CPU than advanced indexing,
        # and the result is contiguous in the layout the matmuls read
        rows = lay.kv_rows(hkv)
        keys = k_src.reshape(-1, d).index_select(0, rows).view(n, hkv, lk, d)  # [N,Hkv,Lk,D]
        vals = v_src.reshape(-1, dv).index_select(0, rows).view(n, hkv, lk, dv)
        if lay.q_index is None:  # decode: one query per sequence, in order
            qp = q.reshape(n, 1, h, d)
        else:
            qp = q.index_select(0, lay.q_index.view(-1)).view(n, mq, h, d)  # [N, mq, H, D]
        # fold the g query heads of each kv head into the query axis: [N, Hkv, g * mq, D]
        qg = qp.reshape(n, mq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * mq, d)
        mask = lay.mask(spec.sliding_window)  # [N, mq, Lk]
        plain = spec.softcap is None and spec.alibi_slopes is None and sinks is None
        # fp32: SDPA (what stock's "sdpa" attention computes); lower precisions take the explicit
        # path, which is several times faster than the CPU's SDPA kernels there
        if plain and q.dtype == torch.float32:
            # [N, 1, g*mq, Lk] (a decode's one row broadcasts over the g heads)
            m = mask[:, None] if g == 1 or mq == 1 else mask.repeat(1, g, 1)[:, None]
            if lay.sees_all:  # decode over equal contexts (``exact``): stock's decode keys
                m, w = None, spec.sliding_window
                if w is not None and lk > w:  # stock's sliding cache holds the last w keys
                    keys, vals = keys[:, :, -w:], vals[:, :, -w:]
            o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=m, scale=spec.scale)
        else:
            o = _attend_modified(qg, keys, vals, mask, lay, spec, sinks)
        # [N, Hkv, g*mq, Dv] -> [N, mq, H, Dv] -> the tokens' rows [T_group, H, Dv]
        o = o.view(n, hkv, g, mq, dv).permute(0, 3, 1, 2, 4).reshape(n * mq, h, dv)
        return o if lay.token_index is None else o.index_select(0, lay.token_index)


def _attend_modified(qg, keys, vals, mask, lay: StepLayout, spec: AttentionLayerSpec, sinks):
    """Softcap, then ALiBi, then the mask, then softmax (with a sink logit per head), as
    ``torch_ref.attend`` orders them; ``qg`` [N, Hkv, g*mq, D] -> [N, Hkv, g*mq, Dv]."""
    n, hkv, gq, _ = qg.shape
    mq = lay.max_q
    g = gq // mq
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * spec.scale  # [N, Hkv, g*mq, Lk]
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    scores = scores.view(n, hkv, g, mq, -1)
    if spec.alibi_slopes is not None:
        slopes = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=qg.device)
        rel = (lay.k_pos[None, None, :] - lay.q_pos[:, :, None]).float()  # [N, mq, Lk]
        scores = scores + slopes.view(1, hkv, g, 1, 1) * rel[:, None, None]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(n, hkv, g, mq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    probs = probs.view(n, hkv, gq, -1).to(vals.dtype)
    return torch.matmul(probs, vals)


def _check_uncached(meta: AttentionMetadata) -> None:
    cu = meta.cu_seqlens_q_cpu or meta.cu_seqlens_q.tolist()
    ctx = meta.context_lens_cpu or meta.context_lens.tolist()
    for i in range(meta.num_seqs):
        if ctx[i] != cu[i + 1] - cu[i] and cu[i + 1] > cu[i]:
            raise ValueError(
                f"sequence {i} has {ctx[i] - (cu[i + 1] - cu[i])} cached tokens but "
                "meta.kv_cache is None: without a cache only whole prompts can be attended"
            )
