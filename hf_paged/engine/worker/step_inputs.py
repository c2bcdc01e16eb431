"""A step's model inputs on the device: token ids, positions, KV slots and the attention
metadata of a ``ModelInput``, built on the host in few numpy buffers and copied in one
transfer each (through reused pinned staging buffers on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.attention import AttentionMetadata
from hf_paged.attention.bidirectional import query_key_ends
from hf_paged.engine.core.contracts import ModelInput


@dataclass
class StepEmbeds:
    """A step's prompt-embedding rows on the device, for the model's ``forward(embeds=)``: the
    model embeds the step's ids, then puts ``rows`` at ``index`` (rows of the flattened batch).
    ``deepstack`` rows are added after the first decoder layers at ``deepstack_index``."""

    index: torch.Tensor  # [R] int64
    rows: torch.Tensor  # [R, hidden]
    deepstack_index: torch.Tensor | None = None  # [D] int64
    deepstack: torch.Tensor | None = None  # [num_layers, D, hidden]
    num_tokens: int = 0  # T, the step's tokens

    def scatter(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [T, H] (the ids' embeddings) with the rows put in place (out of place)."""
        return hidden.index_copy(0, self.index, self.rows.to(hidden.dtype))


class StepInputs:
    """Builds the inputs of the runner's steps on ``device`` for KV blocks of ``block_size``."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.block_size = block_size
        self._pinned: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}  # staging buffers
        self.state_pool = None  # a recurrent model's ``StatePool``: its slots go into the steps

    def build(self, inp: ModelInput, kv_cache):
        """``decode`` for a decode step, else ``prefill``."""
        return self.decode(inp, kv_cache) if inp.is_decode else self.prefill(inp, kv_cache)

    def release(self) -> None:
        self._pinned.clear()

    def prefill(self, inp: ModelInput, kv_cache):
        """Ragged batch of chunks (prompt chunks after any prefix-cached tokens, decodes, and
        chunks verifying speculative tokens). Returns (input_ids [T], positions [T], metadata,
        logits_indices [N_rows]: each sampling chunk's last ``num_logits`` positions)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu, ctx, logits_idx = [0], [], []
        for c in inp.chunks:
            n = len(c.token_ids)
            input_ids.extend(c.token_ids)
            pos = range(c.start_pos, c.start_pos + n)
            positions.extend(pos)
            table = c.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            cu.append(cu[-1] + n)
            ctx.append(c.start_pos + n)
            if c.sample:
                logits_idx.extend(range(cu[-1] - c.num_logits, cu[-1]))
        t = len(input_ids)
        # one host buffer, one copy: [input_ids | positions | slots | logits_idx]
        host = np.array(input_ids + positions + slots + logits_idx, dtype=np.int64)
        dev = self.to_device(host, "inputs")
        meta = self._metadata(inp, cu, ctx, dev[2 * t : 3 * t], False, kv_cache)
        if any(c.bidirectional_ranges for c in inp.chunks):
            meta.bidirectional_ranges = [list(c.bidirectional_ranges) for c in inp.chunks]
            ends = query_key_ends(meta.bidirectional_ranges, cu, ctx)
            if ends is not None:
                meta.query_key_ends = self.to_device(np.array(ends, dtype=np.int32), "key_ends")
        positions = dev[t : 2 * t]
        if any(c.mrope_positions is not None or c.position_delta for c in inp.chunks):
            positions = self._mrope_positions(inp, positions)
        return dev[:t], positions, meta, dev[3 * t :]

    def _mrope_positions(self, inp: ModelInput, plain: torch.Tensor) -> torch.Tensor:
        """[3, T] positions of an M-RoPE model's step: each chunk's own, or its plain
        positions plus its delta on every section."""
        parts, at = [], 0
        for c in inp.chunks:
            n = len(c.token_ids)
            if c.mrope_positions is not None:
                parts.append(c.mrope_positions.to(self.device, torch.int64))
            else:
                parts.append((plain[at : at + n] + c.position_delta).expand(3, n))
            at += n
        return torch.cat(parts, dim=1)

    def prompt_embeds(self, inp: ModelInput, dtype: torch.dtype) -> StepEmbeds | None:
        """The step's prompt-embedding rows and where they go in the flattened batch, or None
        when no chunk has any."""
        index, rows, ds_index, ds_rows, at = [], [], [], [], 0
        for c in inp.chunks:
            e = c.embeds
            if e is not None:
                idx = [at + o for o in e.offsets]
                index.extend(idx)
                rows.append(e.rows)
                if e.deepstack is not None:
                    ds_index.extend(idx)
                    ds_rows.append(e.deepstack)
            at += len(c.token_ids)
        if not rows:
            return None
        dev = self.to_device(np.array(index + ds_index, dtype=np.int64), "embeds")
        deep = None
        if ds_rows:
            deep = torch.cat([d.to(self.device, dtype) for d in ds_rows], dim=1)
        return StepEmbeds(
            index=dev[: len(index)],
            rows=torch.cat([r.to(self.device, dtype) for r in rows]),
            deepstack_index=dev[len(index) :] if ds_rows else None,
            deepstack=deep,
            num_tokens=at,
        )

    def decode(self, inp: ModelInput, kv_cache):
        """One token per sequence (its last sampled one). Same returns as ``prefill``."""
        bs = self.block_size
        chunks = inp.chunks
        n = len(chunks)
        host = np.empty((3, n), dtype=np.int64)  # input_ids, positions, slots
        host[0] = [c.token_ids[0] for c in chunks]
        pos = np.array([c.start_pos for c in chunks], dtype=np.int64)
        host[1] = pos + np.array([c.position_delta for c in chunks], dtype=np.int64)  # M-RoPE
        host[2] = [c.block_table[p // bs] for c, p in zip(chunks, pos.tolist())]
        host[2] = host[2] * bs + pos % bs
        dev = self.to_device(host, "inputs")
        ctx = (pos + 1).tolist()
        meta = self._metadata(inp, list(range(n + 1)), ctx, dev[2], True, kv_cache)
        logits_idx = torch.arange(n, dtype=torch.int64, device=self.device)
        return dev[0], dev[1], meta, logits_idx

    def to_device(self, host: np.ndarray, slot: str) -> torch.Tensor:
        """``host`` on the device. On CUDA it is staged through a pinned buffer reused per
        ``slot``, so the copy is an asynchronous DMA; the buffer's last copy is waited for
        before it is overwritten (a worker rank's host can run ahead of its stream)."""
        t = torch.from_numpy(host)
        if self.device.type != "cuda":
            return t
        buf, done = self._pinned.get(slot, (None, None))
        if buf is None or buf.numel() < t.numel() * t.element_size():
            buf = torch.empty(max(4096, 2 * t.numel() * t.element_size()), dtype=torch.uint8)
            buf, done = buf.pin_memory(), torch.cuda.Event()
        else:
            done.synchronize()
        staged = buf[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        done.record()
        self._pinned[slot] = (buf, done)
        return out

    def _metadata(self, inp, cu, ctx, slot_mapping, is_decode: bool, kv_cache) -> AttentionMetadata:
        """Block tables, context lengths and cu_seqlens in one int32 host buffer and one copy.

        The layout keeps what Triton specializes a kernel on constant from step to step, so the
        variant compiled at warm-up serves every later step (a new one costs a compile of ~1 s,
        mid-run): table rows are 16 entries apart (``stride(0) % 16 == 0``) and every segment
        starts 16-byte aligned. [tables (n x row, row = mb rounded up to 16) | ctx (n, padded to
        4) | cu (n + 1)]."""
        chunks = inp.chunks
        n = len(chunks)
        mb = max(1, max(len(c.block_table) for c in chunks))
        row = -(-mb // 16) * 16
        ctx_at, cu_at = n * row, n * row + -(-n // 4) * 4
        host = np.zeros(cu_at + n + 1, dtype=np.int32)
        tables = host[:ctx_at].reshape(n, row)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_table)] = c.block_table
        host[ctx_at : ctx_at + n] = ctx
        host[cu_at:] = cu
        dev = self.to_device(host, "meta")
        return AttentionMetadata(
            is_decode=is_decode,
            num_seqs=n,
            slot_mapping=slot_mapping,
            cu_seqlens_q=dev[cu_at:],
            context_lens=dev[ctx_at : ctx_at + n],
            block_tables=dev[:ctx_at].view(n, row)[:, :mb],
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            max_context_len=max(ctx),
            cu_seqlens_q_cpu=cu,
            context_lens_cpu=ctx,
            kv_cache=kv_cache,
            **self._state_fields(chunks),
        )

    def _state_fields(self, chunks) -> dict:
        """A recurrent model's per-sequence slots and whether each holds a state already (the
        sequence computed tokens before this chunk), in one int64 copy."""
        if self.state_pool is None:
            return {}
        n = len(chunks)
        host = np.empty(2 * n, dtype=np.int64)
        host[:n] = [c.state_slot for c in chunks]
        host[n:] = [c.start_pos > 0 for c in chunks]
        dev = self.to_device(host, "state")
        return dict(state_indices=dev[:n], has_initial_state=dev[n:] != 0,
                    recurrent_states=self.state_pool.layers)  # fmt: skip
