"""A step's model inputs on the device: token ids, positions, KV slots and the attention
metadata of a ``ModelInput``, built on the host in few numpy buffers and copied in one
transfer each (through reused pinned staging buffers on CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.attention import AttentionMetadata
from hf_paged.engine.core.contracts import ModelInput


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
        return dev[:t], dev[t : 2 * t], meta, dev[3 * t :]

    def decode(self, inp: ModelInput, kv_cache):
        """One token per sequence (its last sampled one). Same returns as ``prefill``."""
        bs = self.block_size
        chunks = inp.chunks
        n = len(chunks)
        host = np.empty((3, n), dtype=np.int64)  # input_ids, positions, slots
        host[0] = [c.token_ids[0] for c in chunks]
        pos = [c.start_pos for c in chunks]
        host[1] = pos
        host[2] = [c.block_table[p // bs] for c, p in zip(chunks, pos)]
        host[2] = host[2] * bs + host[1] % bs
        dev = self.to_device(host, "inputs")
        ctx = (host[1] + 1).tolist()
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
