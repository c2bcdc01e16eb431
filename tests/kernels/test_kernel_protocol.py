"""The toy PagedModel (hf_paged/testing/toy_model.py) on the Triton backend under Triton's CPU
interpreter: the Triton kernels (store, paged prefill, paged decode) run on each layer's slice of
the runner-style ``KVCache``, layer 1 with a softcap and V head dim != K head dim; with
``FALLBACK_LAYERS`` layer 1 (head dim 320) is reported by ``TritonBackend.problem`` and gets the
torch reference. Logits match the dense oracle.

Run as a script by the test (``TRITON_INTERPRET=1`` must be set before triton is imported).
"""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main


def case_toy_backends(layers: str) -> float:
    import tempfile

    import torch
    from transformers import AutoConfig

    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.layers.context import ModelContext
    from hf_paged.testing import make_kv_cache, run_step, toy_model
    from hf_paged.testing.toy_model import ToyPagedForCausalLM, save_toy_model

    table = {"modifiers": toy_model.LAYERS, "fallback": toy_model.FALLBACK_LAYERS}[layers]
    with tempfile.TemporaryDirectory() as path:
        ref = save_toy_model(path, layers=table)
        ctx = ModelContext(TritonBackend(), kv_block_size=8)
        model = ToyPagedForCausalLM(AutoConfig.from_pretrained(path), ctx).eval()
        model.load_weights(path)
    names = [layer.attn.backend.name for layer in model.layers]
    fell_back = layers == "fallback"
    assert names == ["triton", "torch" if fell_back else "triton"], names
    assert list(ctx.fallbacks) == ([1] if fell_back else []), ctx.fallbacks
    seqs = [[5, 9, 33, 7, 60, 2, 8, 11, 40, 3], [40, 41, 3, 17, 22, 9]]
    kv = make_kv_cache(model, 8, 8)
    first = run_step(model, kv, [s[:-4] for s in seqs], [len(s) - 4 for s in seqs], 8, 4)
    second = run_step(model, kv, [s[:-1] for s in seqs], [3, 3], 8, 4)  # over a cached prefix
    decode = run_step(model, kv, seqs, [1, 1], 8, 4)
    err = 0.0
    for i, s in enumerate(seqs):
        got = torch.cat([first[i], second[i], decode[i]])
        want = ref.dense_logits(s)
        err = max(err, float((got - want).abs().max() / want.abs().max()))
    return err


CASES = {f"toy_{name}": (case_toy_backends, (name,)) for name in ("modifiers", "fallback")}


INTERPRET_TIMEOUT_S = 300  # the child's bound (conftest.interpreted)


@pytest.mark.parametrize("case", sorted(CASES))
def test_protocol_case(interpreted, case):
    result = interpreted[case]
    assert result < 1e-4


if __name__ == "__main__":
    interpret_main(CASES)
