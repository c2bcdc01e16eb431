"""Fused RMSNorm / q-k norm + rope / silu_and_mul kernels vs their torch references under Triton's
CPU interpreter (tiny fp32 and fp16 shapes), plus a tiny Llama and Qwen3 forward with every
fused kernel switched in.

As in tests/kernels/test_kernels_interpret.py, ``TRITON_INTERPRET=1`` must be set before triton is
imported, so every check runs in one child process (this file run as a script) that prints
``{case: relative_error}`` as JSON. The interpreter rounds fp32 -> bf16 by truncation (the GPU
rounds to nearest even), so bf16 is only checked on the GPU (tests/kernels/test_fused_kernels.py);
fp16 casts round to nearest here, which checks that the kernels round where torch does.
"""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main, run_interpreter_cases

# max |out - ref| / max |ref|: fp32 differs only in summation order / exp; fp16 by <= 1 ulp, and
# in fp16 nearly every element must be bit-equal (see _rel_err)
TOL = {"fp32": 1e-5, "fp16": 1e-3}


def _rel_err(out, ref) -> float:
    import torch

    if out.shape != ref.shape or out.dtype != ref.dtype:
        return float("inf")
    if not torch.isfinite(out).all():
        return float("inf")
    if out.dtype == torch.float16:
        # rounding where torch rounds makes nearly all elements bit-equal (a missed rounding
        # leaves ~13% off by an ulp); the fp32 sum order may flip a rare one
        mismatches = int((out != ref).sum())
        if mismatches > 1 + out.numel() // 100:
            raise AssertionError(f"{mismatches} of {out.numel()} fp16 elements differ")
    return (
        (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)
    ).item()


def _dtype(name):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16}[name]


def _randn(*shape, dtype, seed=0, scale=1.0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _cos_sin(num_tokens, head_dim, dtype):
    """Real rotary tables: positions 0..T-1 (and a far one), base 10000, as RotaryEmbedding."""
    import torch

    from hf_paged.layers.rotary import default_inv_freq

    pos = torch.arange(num_tokens, dtype=torch.float32)
    pos[-1] = 5000.0
    freqs = pos[:, None] * default_inv_freq(10000.0, head_dim)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def case_rms_norm(dt, rows, hidden, residual, strided=False):
    from hf_paged.kernels import fused_norm

    dtype = _dtype(dt)
    width = hidden + 5 if strided else hidden  # strided: rows of a wider buffer
    x = _randn(rows, width, dtype=dtype, seed=1, scale=3.0)[:, :hidden]
    w = _randn(hidden, dtype=dtype, seed=2)
    if not residual:
        return _rel_err(fused_norm.rms_norm(x, w, 1e-6), fused_norm.rms_norm_ref(x, w, 1e-6))
    r = _randn(rows, hidden, dtype=dtype, seed=3, scale=10.0)
    out, new_r = fused_norm.fused_add_rms_norm(x, r, w, 1e-6)
    ref, ref_r = fused_norm.fused_add_rms_norm_ref(x, r, w, 1e-6)
    return max(_rel_err(out, ref), _rel_err(new_r, ref_r))


def case_rms_norm_3d():
    """A [T, H, D] input (per-head norm through the generic path), fp32 weight on fp16 x."""
    import torch

    from hf_paged.kernels import fused_norm

    x = _randn(3, 4, 32, dtype=torch.float16, seed=4)
    w = _randn(32, dtype=torch.float32, seed=5)
    return _rel_err(fused_norm.rms_norm(x, w, 1e-5), fused_norm.rms_norm_ref(x, w, 1e-5))


def _rope_inputs(dt, num_tokens, num_heads, num_kv_heads, head_dim, norm, seed):
    """q, k, v as strided views of one fused qkv projection (as the model hands them over), the
    rotary tables and the optional q/k norm weights: ``(qkv, q, k, v, cos, sin, weights)``."""
    dtype = _dtype(dt)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    cos, sin = _cos_sin(num_tokens, head_dim, dtype)
    weights = (None, None)
    if norm:
        weights = (_randn(head_dim, dtype=dtype, seed=7), _randn(head_dim, dtype=dtype, seed=8))
    return qkv, q, k, v, cos, sin, weights


def case_rope(dt, num_tokens, num_heads, num_kv_heads, head_dim, norm):
    from hf_paged.kernels import fused_rope

    qkv, q, k, _, cos, sin, weights = _rope_inputs(
        dt, num_tokens, num_heads, num_kv_heads, head_dim, norm, seed=6
    )
    before = qkv.clone()
    out = fused_rope.qk_norm_rope(q, k, cos, sin, *weights, eps=1e-6)
    ref = fused_rope.qk_norm_rope_ref(q, k, cos, sin, *weights, eps=1e-6)
    if not qkv.equal(before):  # inputs are left as they are
        return float("inf")
    return max(_rel_err(out[0], ref[0]), _rel_err(out[1], ref[1]))


def case_rope_store(dt, num_tokens, num_heads, num_kv_heads, head_dim, norm):
    """The rotary kernel also writing k and v into a paged cache: the cache equals rotary then
    ``store_kvcache_ref``; slot -1 tokens are skipped; q/k outputs are unchanged by the store."""
    import torch

    from hf_paged.kernels import fused_rope
    from hf_paged.kernels.attention.kv_store import store_kvcache_ref

    dtype = _dtype(dt)
    _, q, k, v, cos, sin, weights = _rope_inputs(
        dt, num_tokens, num_heads, num_kv_heads, head_dim, norm, seed=16
    )
    block_size, num_blocks = 4, 6
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, 7.0, dtype=dtype) for _ in range(4)]  # ours k/v, ref k/v
    gen = torch.Generator().manual_seed(num_tokens)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # skipped tokens (graph padding, cached prefix)
    out = fused_rope.qk_norm_rope(q, k, cos, sin, *weights, eps=1e-6,
                                  kv_cache=(v, caches[0], caches[1], slots))  # fmt: skip
    ref = fused_rope.qk_norm_rope_ref(q, k, cos, sin, *weights, eps=1e-6)
    store_kvcache_ref(ref[1], v, caches[2], caches[3], slots)
    err = max(_rel_err(out[0], ref[0]), _rel_err(out[1], ref[1]))
    err = max(err, _rel_err(caches[0], caches[2]), _rel_err(caches[1], caches[3]))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    if not (caches[0].view(-1, num_kv_heads, head_dim)[untouched] == 7.0).all():
        return float("inf")  # a write outside the given slots
    return err


def case_silu(dt, rows, inter, strided=False):
    from hf_paged.kernels import fused_act

    dtype = _dtype(dt)
    width = 2 * inter + 3 if strided else 2 * inter
    x = _randn(rows, width, dtype=dtype, seed=9, scale=3.0)[:, : 2 * inter]
    return _rel_err(fused_act.silu_and_mul(x), fused_act.silu_and_mul_ref(x))


def case_empty():
    """Zero tokens: empty outputs of the right shapes, no launch."""
    import torch

    from hf_paged.kernels import fused_act, fused_norm, fused_rope

    x, w = torch.empty(0, 64), torch.ones(64)
    q, k, cs = torch.empty(0, 4, 32), torch.empty(0, 2, 32), torch.empty(0, 32)
    shapes = [
        fused_norm.rms_norm(x, w, 1e-6).shape,
        fused_norm.fused_add_rms_norm(x, x, w, 1e-6)[1].shape,
        fused_act.silu_and_mul(x).shape,
        *(t.shape for t in fused_rope.qk_norm_rope(q, k, cs, cs)),
    ]
    expected = [(0, 64), (0, 64), (0, 32), (0, 4, 32), (0, 2, 32)]
    return 0.0 if [tuple(s) for s in shapes] == expected else float("inf")


def case_bad_inputs_raise():
    import torch

    from hf_paged.kernels import fused_act, fused_norm, fused_rope

    x, w = torch.randn(2, 64), torch.ones(64)
    q, k, cs = torch.randn(2, 4, 32), torch.randn(2, 2, 32), torch.randn(2, 32)
    calls = [
        lambda: fused_norm.rms_norm(x, torch.ones(32), 1e-6),  # weight not [H]
        lambda: fused_norm.fused_add_rms_norm(x, x.double(), w, 1e-6),  # residual dtype
        lambda: fused_rope.qk_norm_rope(q, k, cs.half(), cs),  # mixed dtypes
        lambda: fused_rope.qk_norm_rope(q, k, cs, cs, torch.ones(32), None),  # one weight
        lambda: fused_act.silu_and_mul(torch.randn(2, 7)),  # odd width
    ]
    for call in calls:
        try:
            call()
        except ValueError:
            continue
        return float("inf")
    return 0.0


def case_model(family, fused_store=False):
    """A tiny fp32 model's prefill + decode logits: torch path vs every fused kernel on CPU.
    ``fused_store``: the backend lets the rotary kernel write the KV cache (as Triton does)."""
    import torch

    from hf_paged.attention.torch_ref import TorchRefBackend
    from hf_paged.kernels import fused_act, fused_norm, fused_rope
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.loader import load_weights
    from hf_paged.models.registry import build_model
    from hf_paged.testing import build_hf_model, make_kv_cache, run_step

    class StoredKVRef(TorchRefBackend):
        accepts_stored_kv = True

    hf = build_hf_model(family)
    backend = StoredKVRef() if fused_store else TorchRefBackend()
    model = build_model(hf.config, ModelContext(backend), dtype=torch.float32)
    load_weights(model, hf)
    seqs = [[5, 9, 33, 7, 100, 2, 8], [40, 41, 3]]

    def logits():
        kv = make_kv_cache(model, 8, 4)
        prefill = run_step(model, kv, seqs, [len(s) for s in seqs], 4, 4)
        decode = run_step(model, kv, [s + [1] for s in seqs], [1, 1], 4, 4)
        return torch.cat(prefill + decode)

    ref = logits()
    calls = {"norm": 0, "rope": 0, "act": 0}
    stores = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            if name == "rope":
                stores.append(args[7] is not None)  # launch_checked(..., eps, kv_cache)
            return fn(*args, **kwargs)

        return wrapper

    # dispatch as on CUDA: whatever the kernels take goes to them (restored afterwards)
    patches = {
        (fused_norm, "supports"): lambda x, w, r=None: fused_norm._problem(x, w, r) is None,
        (fused_rope, "supports"): lambda *a: fused_rope._problem(*a) is None,
        (fused_act, "supports"): lambda x: fused_act._problem(x) is None,
        (fused_norm, "rms_norm"): counted("norm", fused_norm.rms_norm),
        (fused_norm, "fused_add_rms_norm"): counted("norm", fused_norm.fused_add_rms_norm),
        (fused_rope, "launch_checked"): counted("rope", fused_rope.launch_checked),
        (fused_act, "silu_and_mul"): counted("act", fused_act.silu_and_mul),
    }
    saved = {key: getattr(*key) for key in patches}
    try:
        for (module, name), fn in patches.items():
            setattr(module, name, fn)
        out = logits()
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
    layers = hf.config.num_hidden_layers
    if calls != {"norm": 2 * (2 * layers + 1), "rope": 2 * layers, "act": 2 * layers}:
        raise AssertionError(f"fused kernels not all used: {calls}")
    if stores != [fused_store] * len(stores):
        raise AssertionError(f"the rotary kernel stored K/V in {stores}, expected {fused_store}")
    return _rel_err(out, ref)


CASES = {
    "fp32_empty": (case_empty, ()),
    "fp32_bad_inputs_raise": (case_bad_inputs_raise, ()),
    "fp16_rms_norm_3d": (case_rms_norm_3d, ()),
    "fp32_model_llama": (case_model, ("llama",)),
    "fp32_model_qwen3": (case_model, ("qwen3",)),
    "fp32_model_llama_fused_store": (case_model, ("llama", True)),
    "fp32_model_qwen3_fused_store": (case_model, ("qwen3", True)),
}
for _dt in ("fp32", "fp16"):
    for _rows, _hidden in ((1, 64), (7, 100), (3, 1024)):
        for _res in (False, True):
            CASES[f"{_dt}_rms_norm_r{_rows}_h{_hidden}_res{int(_res)}"] = (
                case_rms_norm,
                (_dt, _rows, _hidden, _res),
            )
    CASES[f"{_dt}_rms_norm_strided"] = (case_rms_norm, (_dt, 5, 96, True, True))
    # (tokens, q heads, kv heads, head_dim): GQA, MQA, heads past one head block, D = 80
    for _shape in ((1, 4, 2, 64), (7, 16, 8, 128), (3, 6, 1, 32), (5, 40, 8, 64), (2, 3, 3, 80)):
        for _norm in (False, True):
            _name = (
                f"{_dt}_rope_t{_shape[0]}_q{_shape[1]}_kv{_shape[2]}_d{_shape[3]}_norm{int(_norm)}"
            )
            CASES[_name] = (case_rope, (_dt, *_shape, _norm))
            CASES[_name.replace("_rope_", "_rope_store_")] = (
                case_rope_store,
                (_dt, *_shape, _norm),
            )
    for _rows, _inter in ((1, 64), (3, 1000), (2, 2500)):
        CASES[f"{_dt}_silu_r{_rows}_i{_inter}"] = (case_silu, (_dt, _rows, _inter))
    CASES[f"{_dt}_silu_strided"] = (case_silu, (_dt, 3, 96, True))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_interpreter_cases(__file__, timeout=300)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_kernel_matches_reference(interpreter_results, case):
    result = interpreter_results[case]
    assert isinstance(result, float), result  # a string is the child's traceback
    assert result < TOL[case.split("_")[0]], f"{case}: relative error {result}"


if __name__ == "__main__":
    interpret_main(CASES)
