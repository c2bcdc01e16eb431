"""Segmented LoRA shrink/expand (``kernels/lora_segmented.py``): the Triton kernels equal the torch
reference under Triton's CPU interpreter (ranks 1-64, mixed slots, tokens without an adapter,
empty segments, a column offset into a fused output), and the reference equals PEFT's per-row
``lora_B(lora_A(x)) * scaling``. Runs as a child process like the other interpreter tests; the
GPU case (bf16 on CUDA) is marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels.lora_segmented import LoraSegments, lora_ref
from tests.kernels.interpret_utils import assert_lora_bf16_close, interpret_main, random_lora

RANKS = [1, 2, 7, 16, 33, 64]


def _with_empty_segments(segs: LoraSegments) -> LoraSegments:
    """``segs`` plus an empty segment of a real slot and a segment of slot -1."""
    dev = segs.seg_starts.device
    extra = lambda t, v: torch.cat([t, torch.tensor(v, dtype=t.dtype, device=dev)])  # noqa: E731
    host = segs.host + ((2, 0, 0), (-1, 0, 0))
    return LoraSegments(segs.token_indices, extra(segs.seg_starts, [0, 0]),
                        extra(segs.seg_lens, [0, 3]), extra(segs.seg_slots, [2, -1]),
                        segs.num_tokens, host)  # fmt: skip


def _kernel_error(rank, empty, block_m, view=False):
    from hf_paged.kernels.lora_segmented import lora_triton

    x, a, b, out, scales, slots = random_lora(rank, seed=int(empty))
    if view:  # one slice of a fused layer's stacked A: [S, 3R, K] viewed at rows [R, 2R)
        big = torch.randn(a.shape[0], 3 * rank, a.shape[2])
        big[:, rank : 2 * rank] = a
        a = big[:, rank : 2 * rank]
    segs = LoraSegments.from_slots(slots, "cpu")
    if empty:
        segs = _with_empty_segments(segs)
    want, got = out.clone(), out.clone()
    lora_ref(x, want, a, b, scales, segs, offset=8)
    lora_triton(x, got, a, b, scales, segs, offset=8, block_m=block_m)
    assert not torch.equal(want, out), "the reference added nothing"
    return ((got - want).abs().max() / want.abs().max()).item()


def _cases():
    cases = {f"r{r}": (_kernel_error, (r, False, 16)) for r in RANKS}
    cases["r16_empty_segments"] = (_kernel_error, (16, True, 16))
    cases["r5_empty_segments_m32"] = (_kernel_error, (5, True, 32))
    cases["r16_slice_view"] = (_kernel_error, (16, False, 16, True))
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_triton_matches_reference_interpreted(interpreted, name):
    value = interpreted[name]
    assert value < 1e-5, f"{name}: relative error {value}"


@pytest.mark.parametrize("rank", [1, 8, 64])
def test_reference_is_peft_per_row(rank):
    x, a, b, out, scales, slots = random_lora(rank)
    segs = LoraSegments.from_slots(slots, "cpu")
    got = out.clone()
    lora_ref(x, got, a, b, scales, segs, offset=8)
    want = out.clone()
    for t, s in enumerate(slots):  # PEFT: result += lora_B(lora_A(x)) * scaling, row by row
        if s >= 0:
            want[t, 8:48] += (x[t] @ a[s].T) @ b[s].T * scales[s]
    torch.testing.assert_close(got, want)
    assert not torch.equal(got[:, 8:48], out[:, 8:48])
    # columns outside the slice and rows without an adapter are untouched
    assert torch.equal(got[:, :8], out[:, :8]) and torch.equal(got[:, 48:], out[:, 48:])
    none = [t for t, s in enumerate(slots) if s < 0]
    assert none and torch.equal(got[none], out[none])


def test_segments_group_by_slot():
    segs = LoraSegments.from_slots([3, -1, 0, 3, 0, -1, 3], "cpu")
    assert segs.seg_slots.tolist() == [0, 3]
    assert segs.seg_lens.tolist() == [2, 3]
    assert segs.seg_starts.tolist() == [0, 2]
    assert segs.token_indices.tolist() == [2, 4, 0, 3, 6]
    empty = LoraSegments.from_slots([-1, -1], "cpu")
    assert empty.seg_slots.numel() == 0 and empty.host == ()


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_triton_matches_reference_on_gpu(rank):
    from hf_paged.kernels.lora_segmented import lora_triton

    segments = lambda slots: LoraSegments.from_slots(slots, "cuda")  # noqa: E731
    assert_lora_bf16_close(lora_ref, lora_triton, rank, 300, 512, segments)


if __name__ == "__main__":
    interpret_main(_cases())
