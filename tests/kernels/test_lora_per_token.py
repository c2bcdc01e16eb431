"""Per-token LoRA (``kernels/lora_per_token.py``, the decode steps' graph-capturable op): the
Triton kernels equal the torch reference under Triton's CPU interpreter (ranks 1-64, mixed slots,
rows without an adapter, every row without one, batch 1 and many, a column offset into a fused
output, a slice view of stacked factors, inputs wide enough to split the shrink), the reference
equals PEFT's per-row ``lora_B(lora_A(x)) * scaling`` and the segmented reference, and the
kernels give the same bits for a row whatever the batch around it (a padded graph batch against
an eager step). Runs as a child process like the other interpreter tests; the GPU cases (bf16,
and a CUDA graph replayed with new slots) are marked ``gpu``."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels.lora_per_token import lora_per_token_ref
from hf_paged.kernels.lora_segmented import LoraSegments, lora_ref
from tests.kernels.interpret_utils import assert_lora_bf16_close, interpret_main, random_lora

RANKS = [1, 2, 7, 16, 33, 64]


def _problem(rank, *args, device="cpu", **kwargs):
    """``random_lora`` with the slots as the int32 device tensor the per-token kernels take."""
    *tensors, slots = random_lora(rank, *args, device=device, **kwargs)
    return (*tensors, torch.tensor(slots, dtype=torch.int32, device=device))


def _kernel_error(rank, num_tokens=37, k=48, view=False, no_adapter=False):
    from hf_paged.kernels.lora_per_token import lora_per_token_triton

    x, a, b, out, scales, slots = _problem(rank, num_tokens, k=k, no_adapter=no_adapter)
    if view:  # one slice of a fused layer's stacked A: [S, 3R, K] viewed at rows [R, 2R)
        big = torch.randn(a.shape[0], 3 * rank, a.shape[2])
        big[:, rank : 2 * rank] = a
        a = big[:, rank : 2 * rank]
    want, got = out.clone(), out.clone()
    lora_per_token_ref(x, want, a, b, scales, slots, offset=8)
    lora_per_token_triton(x, got, a, b, scales, slots, offset=8)
    if no_adapter:  # nothing added, bit for bit
        return float(not torch.equal(got, out) or not torch.equal(want, out))
    assert not torch.equal(want, out), "the reference added nothing"
    none = (slots < 0).nonzero().flatten()
    assert torch.equal(got[none], out[none]), "a row without an adapter changed"
    return ((got - want).abs().max() / want.abs().max()).item()


def _batch_invariance(rank):
    """A row's bits do not depend on the batch around it: row 0 alone, and in a batch of 16
    whose other rows are padding (slot -1) or other adapters' tokens."""
    from hf_paged.kernels.lora_per_token import lora_per_token_triton

    x, a, b, out, scales, slots = _problem(rank, num_tokens=16, k=600)
    slots[0] = 1
    alone = out[:1].clone()
    lora_per_token_triton(x[:1], alone, a, b, scales, slots[:1], offset=8)
    batch = out.clone()
    lora_per_token_triton(x, batch, a, b, scales, slots, offset=8)
    return float(not torch.equal(alone[0], batch[0]))


def _cases():
    cases = {f"r{r}": (_kernel_error, (r,)) for r in RANKS}
    cases["r16_batch1"] = (_kernel_error, (16, 1))
    cases["r8_split_k"] = (_kernel_error, (8, 5, 600))  # 600 wide: several shrink programs
    cases["r16_slice_view"] = (_kernel_error, (16, 37, 48, True))
    cases["r4_no_adapter_rows"] = (_kernel_error, (4, 9, 48, False, True))
    cases["r8_batch_invariance"] = (_batch_invariance, (8,))
    return cases


@pytest.mark.parametrize("name", list(_cases()))
def test_triton_matches_reference_interpreted(interpreted, name):
    value = interpreted[name]
    if name.startswith(("r4_no_adapter", "r8_batch")):
        assert value == 0.0, f"{name}: the kernel's bits differ"
    else:
        assert value < 1e-5, f"{name}: relative error {value}"


@pytest.mark.parametrize("rank", [1, 8, 64])
def test_reference_is_peft_per_row_and_the_segmented_reference(rank):
    x, a, b, out, scales, slots = _problem(rank)
    got = out.clone()
    lora_per_token_ref(x, got, a, b, scales, slots, offset=8)
    want = out.clone()
    for t, s in enumerate(slots.tolist()):  # PEFT: result += lora_B(lora_A(x)) * scaling
        if s >= 0:
            want[t, 8:48] += (x[t] @ a[s].T) @ b[s].T * scales[s]
    torch.testing.assert_close(got, want)
    segmented = out.clone()
    lora_ref(x, segmented, a, b, scales, LoraSegments.from_slots(slots.tolist(), "cpu"), 8)
    torch.testing.assert_close(got, segmented)
    assert not torch.equal(got[:, 8:48], out[:, 8:48])
    assert torch.equal(got[:, :8], out[:, :8]) and torch.equal(got[:, 48:], out[:, 48:])
    none = (slots < 0).nonzero().flatten()
    assert none.numel() and torch.equal(got[none], out[none])


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_triton_matches_reference_on_gpu(rank):
    from hf_paged.kernels.lora_per_token import lora_per_token_triton

    to_tensor = lambda s: torch.tensor(s, dtype=torch.int32, device="cuda")  # noqa: E731
    assert_lora_bf16_close(lora_per_token_ref, lora_per_token_triton, rank, 64, 4096, to_tensor)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_slots():
    """Captured once with every row at -1, replayed after the static slot buffer is rewritten:
    the replay equals an eager call with those slots, bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hf_paged.kernels.lora_per_token import lora_per_token_triton

    x, a, b, out, scales, slots = _problem(16, num_tokens=8, k=1024, n=512, device="cuda")
    static_slots = torch.full_like(slots, -1)
    static_out = out.clone()
    lora_per_token_triton(x, static_out, a, b, scales, static_slots, 8)  # compile, outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_per_token_triton(x, static_out, a, b, scales, static_slots, 8)
    for new in (slots, torch.full_like(slots, 3), slots.flip(0)):
        static_slots.copy_(new)
        static_out.copy_(out)
        graph.replay()
        eager = out.clone()
        lora_per_token_triton(x, eager, a, b, scales, new, 8)
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        assert not torch.equal(static_out, out)


if __name__ == "__main__":
    interpret_main(_cases())
