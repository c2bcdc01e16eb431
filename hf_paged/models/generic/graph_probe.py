"""Can a generic model's decode step be captured in a CUDA graph? Probe it once after loading.

HF modules may sync with the host (``.item()``, ``nonzero`` in an MoE's expert loop, dynamic
rope's ``max(position_ids)``): capture then fails, or a replay would silently reuse values the
capture saw. The probe runs a two-sequence decode step eagerly on a small temporary KV cache,
captures the same step, replays it, and compares; any error or difference turns decode graphs
off for the model, with the reason in ``cuda_graph_reason``. A model with recurrent layers gets
a small state pool too, restored before the replay (the eager step updated it in place).
"""

from __future__ import annotations

import torch

from hf_paged.attention.base import AttentionMetadata
from hf_paged.attention.kv_cache import KVCache
from hf_paged.refusal import Refusal

_BLOCKS_PER_SEQ = 2


def _decode_step(model, block_size: int):
    """(input_ids [2], positions [2], meta) of a decode step over a fresh small KV cache."""
    dev = model.device
    kv = KVCache(model.kv_cache_specs, 2 * _BLOCKS_PER_SEQ, block_size, model.dtype, dev)
    pos = [block_size - 1, block_size + 1]  # one at a block's end, one inside the next block
    tables = [[2 * i + b for b in range(_BLOCKS_PER_SEQ)] for i in range(2)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in enumerate(pos)]
    meta = AttentionMetadata(
        is_decode=True,
        num_seqs=2,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.arange(3, dtype=torch.int32, device=dev),
        context_lens=torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        max_seqlen_q=1,
        max_context_len=max(pos) + 1,
        kv_cache=kv,
    )
    if model.state_specs:
        from hf_paged.models.recurrent.state_pool import StatePool

        pool = StatePool(model.state_specs, num_slots=2, device=dev)
        meta.state_indices = torch.tensor([pool.alloc(), pool.alloc()], device=dev)
        meta.has_initial_state = torch.ones(2, dtype=torch.bool, device=dev)
        meta.recurrent_states = pool.layers
    ids = torch.tensor([5, 7], dtype=torch.int64, device=dev)
    return ids, torch.tensor(pos, dtype=torch.int64, device=dev), meta


@torch.inference_mode()
def cuda_graph_refusal(model, block_size: int = 16) -> Refusal | None:
    """Why ``model`` (a loaded ``GenericForCausalLM`` on CUDA) must decode eagerly, or None."""
    ids, pos, meta = _decode_step(model, block_size)
    states = meta.recurrent_states or []
    before = [{k: t.clone() for k, t in layer.items()} for layer in states]
    eager = model.forward(ids, pos, meta).clone()
    for layer, saved in zip(states, before):  # the replay starts from the same states
        for k, t in layer.items():
            t.copy_(saved[k])
    torch.cuda.synchronize(model.device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = model.forward(ids, pos, meta)
        graph.replay()
        torch.cuda.synchronize(model.device)
    except Exception as e:  # noqa: BLE001  host syncs and unsupported ops end up here
        torch.cuda.synchronize(model.device)
        return Refusal(
            "cuda_graph", f"capturing a decode step failed ({type(e).__name__}: {str(e)[:200]})"
        )
    finally:
        meta.kv_cache.release()
    if not torch.allclose(out.float(), eager.float(), rtol=1e-3, atol=1e-3):
        return Refusal(
            "cuda_graph",
            "a replayed decode step differs from the eager one (state captured at record time)",
        )
    return None
