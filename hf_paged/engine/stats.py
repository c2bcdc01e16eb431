"""``LLMEngine.stats``: the engine's counters in one dict (read-only; nothing here changes
state)."""

from __future__ import annotations

from hf_paged.timing.step_profile import profile_stats


def engine_stats(engine) -> dict:
    """Scheduler, block-manager, speculative-decoding and (with ``HF_PAGED_PROFILE=1``)
    per-section timing counters of ``engine``."""
    bm, sched, spec, rt = engine.block_manager, engine.scheduler, engine.spec, engine.runtime
    overlap = engine.overlap
    runner = getattr(engine.executor, "runner", None)  # None: tensor-parallel (other processes)
    return {
        "num_preemptions": sched.num_preemptions,
        "num_parked": engine.external.num_parked,  # paused (external) sequences preempted
        "max_num_running_seqs": sched.max_num_running_seqs,
        "prefix_cache_query_tokens": bm.num_prefix_queries_tokens,
        "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens,
        "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
        "num_kv_blocks": rt.num_kv_blocks,
        "num_free_blocks": bm.num_free_blocks,
        "num_overlapped_steps": overlap.num_launched if overlap else 0,
        "num_held_back": sched.num_held_back,  # waits for a prefix being prefilled
        "num_copied_blocks": bm.num_copied_blocks,  # copy on write of forked blocks
        "spec_num_chunks": spec.num_spec_chunks,  # chunks that verified proposals
        "spec_num_draft_tokens": spec.num_draft_tokens,
        "spec_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_acceptance_rate": spec.acceptance_rate,
        # recurrent layers: one state slot per sequence that can run (max_num_seqs), reserved
        # before the KV cache was sized; bytes of one slot over all layers
        "num_state_slots": rt.num_state_slots,
        "state_slot_bytes": rt.state_slot_bytes,
        "state_pool_bytes": rt.state_slot_bytes
        * (rt.num_state_slots + 1 if rt.num_state_slots else 0),
        **rt.encoder_cache.stats(),  # image features reused (vision-language models)
        **profile_stats(engine.profile, runner.profile if runner is not None else None),
    }
