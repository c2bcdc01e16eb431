"""The fused q/k rope kernel and its torch reference on Qwen's multimodal rotary (M-RoPE), against
stock's own rotary, under Triton's CPU interpreter.

Qwen2/2.5-VL lay the T/H/W frequency sections out contiguously, Qwen3-VL interleaves them; in
both, stock's text rotary module turns ``[3, 1, T]`` positions into per-token ``cos``/``sin``
``[T, D]`` and the attention applies Llama's ``apply_rotary_pos_emb``, which the generic path
hands to the fused kernel (``models/generic/rope.py``). The positions here are image-like (the
three rows differ), so a kernel that took one position per token would fail."""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def case_mrope(family: str, use_kernel: bool) -> float:
    import sys

    import torch

    from hf_paged.kernels.fused_rope import qk_norm_rope, qk_norm_rope_ref
    from hf_paged.testing.vlm import build_tiny_vlm

    model = build_tiny_vlm(family)
    text = model.model.language_model
    num_tokens, heads, head_dim = 11, 4, 16
    g = torch.Generator().manual_seed(0)
    t = torch.arange(num_tokens)
    pos = torch.stack([t, 2 + t // 3, 5 + t % 3])[:, None]  # [3, 1, T]: rows differ
    q = torch.randn(1, heads, num_tokens, head_dim, generator=g)
    k = torch.randn(1, 2, num_tokens, head_dim, generator=g)
    cos, sin = text.rotary_emb(q, pos)  # [1, T, D]: sections merged by stock
    apply = sys.modules[type(text).__module__].apply_rotary_pos_emb
    ref_q, ref_k = apply(q, k, cos, sin)  # [1, H, T, D]
    fn = qk_norm_rope if use_kernel else qk_norm_rope_ref
    out_q, out_k = fn(q[0].transpose(0, 1), k[0].transpose(0, 1), cos[0], sin[0])  # [T, H, D]
    err = max((out_q - ref_q[0].transpose(0, 1)).abs().max().item(),
              (out_k - ref_k[0].transpose(0, 1)).abs().max().item())  # fmt: skip
    # and the positions matter: one position per token (row 0) gives another rotation
    cos1, _ = text.rotary_emb(q, pos[:1].expand(3, -1, -1))
    assert (cos1 - cos).abs().max() > 1e-3
    return err


CASES = {
    f"{family}_{'kernel' if kernel else 'reference'}": (case_mrope, (family, kernel))
    for family in FAMILIES
    for kernel in (True, False)
}


INTERPRET_TIMEOUT_S = 300  # the child's bound (conftest.interpreted)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_rope_matches_stock_mrope(interpreted, case):
    result = interpreted[case]
    assert result < 1e-5, f"{case}: max abs error {result}"


if __name__ == "__main__":
    interpret_main(CASES)
