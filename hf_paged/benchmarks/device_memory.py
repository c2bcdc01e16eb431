"""The device between timed runs: wait for it, hand its cached memory back, say its memory."""

from __future__ import annotations

import torch


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    """Return cached allocator blocks, so the next system sizes its cache from real free memory."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def mem_str(device) -> str:
    """GPU memory in use / held by the caching allocator / free, for progress lines."""
    if torch.device(device).type != "cuda":
        return "cpu"
    free, total = torch.cuda.mem_get_info(device)
    alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return (
        f"alloc {alloc / 2**30:.1f} GiB, reserved {reserved / 2**30:.1f}, free {free / 2**30:.1f}"
    )
