"""Fused RMSNorm / q-k norm + rope / silu_and_mul kernels vs their torch references under Triton's
CPU interpreter (tiny fp32 and fp16 shapes), plus a tiny Llama and Qwen3 forward with every
fused kernel switched in.

As in tests/kernels/test_paged_attention.py, ``TRITON_INTERPRET=1`` must be set before triton is
imported, so every check runs in one child process (this file run as a script) that prints
``{case: relative_error}`` as JSON. The interpreter rounds fp32 -> bf16 by truncation (the GPU
rounds to nearest even), so bf16 is only checked on the GPU (below, marker ``gpu``);
fp16 casts round to nearest here, which checks that the kernels round where torch does.

Fused RMSNorm / q-k norm + rope / silu_and_mul kernels vs their torch references on CUDA.

The references run on the same device (torch's CUDA ops), so in bf16/fp16 the kernels should give
the same bits for nearly every element (they round where torch rounds); the rare flip comes from
fp32 summation order, rsqrt/exp/div approximations. fp32 gets a tight tolerance instead (FMA
contraction). Also: the layers dispatch to the kernels on CUDA, and the kernels replay in a CUDA
graph on new data.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.testing.markers import marked
from tests.kernels.interpret_utils import interpret_main

# ---- under Triton's CPU interpreter (the cases run in one child process) --------------------------


# max |out - ref| / max |ref|: fp32 differs only in summation order / exp; fp16 by <= 1 ulp, and
# in fp16 nearly every element must be bit-equal (see _rel_err)
TOL_FP32 = {"fp32": 1e-5, "fp16": 1e-3}


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


def _randn_fp32(*shape, dtype, seed=0, scale=1.0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _cos_sin_fp32(num_tokens, head_dim, dtype):
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
    x = _randn_fp32(rows, width, dtype=dtype, seed=1, scale=3.0)[:, :hidden]
    w = _randn_fp32(hidden, dtype=dtype, seed=2)
    if not residual:
        return _rel_err(fused_norm.rms_norm(x, w, 1e-6), fused_norm.rms_norm_ref(x, w, 1e-6))
    r = _randn_fp32(rows, hidden, dtype=dtype, seed=3, scale=10.0)
    out, new_r = fused_norm.fused_add_rms_norm(x, r, w, 1e-6)
    ref, ref_r = fused_norm.fused_add_rms_norm_ref(x, r, w, 1e-6)
    return max(_rel_err(out, ref), _rel_err(new_r, ref_r))


def case_rms_norm_3d():
    """A [T, H, D] input (per-head norm through the generic path), fp32 weight on fp16 x."""
    import torch

    from hf_paged.kernels import fused_norm

    x = _randn_fp32(3, 4, 32, dtype=torch.float16, seed=4)
    w = _randn_fp32(32, dtype=torch.float32, seed=5)
    return _rel_err(fused_norm.rms_norm(x, w, 1e-5), fused_norm.rms_norm_ref(x, w, 1e-5))


def _rope_inputs(dt, num_tokens, num_heads, num_kv_heads, head_dim, norm, seed):
    """q, k, v as strided views of one fused qkv projection (as the model hands them over), the
    rotary tables and the optional q/k norm weights: ``(qkv, q, k, v, cos, sin, weights)``."""
    dtype = _dtype(dt)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn_fp32(num_tokens, width, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    cos, sin = _cos_sin_fp32(num_tokens, head_dim, dtype)
    weights = (None, None)
    if norm:
        weights = (
            _randn_fp32(head_dim, dtype=dtype, seed=7),
            _randn_fp32(head_dim, dtype=dtype, seed=8),
        )
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
    x = _randn_fp32(rows, width, dtype=dtype, seed=9, scale=3.0)[:, : 2 * inter]
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


INTERPRET_TIMEOUT_S = 300  # the child's bound (conftest.interpreted)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_kernel_matches_reference(interpreted, case):
    result = interpreted[case]
    assert result < TOL_FP32[case.split("_")[0]], f"{case}: relative error {result}"


# ---- on CUDA --------------------------------------------------------------------------------------


_MARKS_FUSED_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


TOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}  # ~1 ulp relative


NUM_TOKENS = [1, 7, 256, 1000]


MIN_BIT_EQUAL = 0.99  # bf16/fp16: fraction of elements that must match the reference exactly


def _randn(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)


def _cos_sin(num_tokens, head_dim, dtype):
    """Rotary tables as RotaryEmbedding builds them, for spread-out positions."""
    from hf_paged.layers.rotary import default_inv_freq

    pos = torch.arange(num_tokens, device="cuda", dtype=torch.float32) * 37.0
    freqs = pos[:, None] * default_inv_freq(1e6, head_dim).cuda()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite output"
    tol = TOL[ref.dtype]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)
    if ref.dtype != torch.float32:
        equal = (out == ref).float().mean().item()
        assert equal >= MIN_BIT_EQUAL, f"only {equal:.4f} of the elements are bit-equal"


# the norm tests' cases: every dtype, hidden sizes tiny, odd and the real models' up to 8192
NORM_CASES = [
    pytest.mark.parametrize("dtype", DTYPES),
    pytest.mark.parametrize("hidden", [64, 100, 1024, 2048, 4096, 8192]),
    pytest.mark.parametrize("num_tokens", NUM_TOKENS),
]


@marked([*_MARKS_FUSED_KERNELS, *NORM_CASES])
def test_rms_norm(dtype, hidden, num_tokens):
    from hf_paged.kernels.fused_norm import rms_norm, rms_norm_ref

    x = _randn(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=2)
    _assert_matches(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@marked([*_MARKS_FUSED_KERNELS, *NORM_CASES])
def test_fused_add_rms_norm(dtype, hidden, num_tokens):
    from hf_paged.kernels.fused_norm import fused_add_rms_norm, fused_add_rms_norm_ref

    x = _randn(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    r = _randn(num_tokens, hidden, dtype=dtype, seed=3, scale=10.0)
    w = _randn(hidden, dtype=dtype, seed=2)
    x0, r0 = x.clone(), r.clone()
    out, new_r = fused_add_rms_norm(x, r, w, 1e-6)
    ref, ref_r = fused_add_rms_norm_ref(x, r, w, 1e-6)
    _assert_matches(out, ref)
    _assert_matches(new_r, ref_r)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs were modified"


@marked(_MARKS_FUSED_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (8, 1), (40, 40)])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope(dtype, head_dim, num_tokens, heads, norm):
    from hf_paged.kernels.fused_rope import qk_norm_rope, qk_norm_rope_ref

    num_heads, num_kv_heads = heads
    # q, k as strided views of a fused qkv projection, like the model hands them over
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cos, sin = _cos_sin(num_tokens, head_dim, dtype)
    weights = (None, None)
    if norm:
        weights = (_randn(head_dim, dtype=dtype, seed=7), _randn(head_dim, dtype=dtype, seed=8))
    before = qkv.clone()
    out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, eps=1e-6)
    ref_q, ref_k = qk_norm_rope_ref(q, k, cos, sin, *weights, eps=1e-6)
    _assert_matches(out_q, ref_q)
    _assert_matches(out_k, ref_k)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert torch.equal(qkv, before), "inputs were modified"


@marked(_MARKS_FUSED_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1000, 3072, 14336])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul(dtype, inter, num_tokens):
    from hf_paged.kernels.fused_act import silu_and_mul, silu_and_mul_ref

    x = _randn(num_tokens, 2 * inter, dtype=dtype, seed=9, scale=3.0)
    _assert_matches(silu_and_mul(x), silu_and_mul_ref(x))


@marked(_MARKS_FUSED_KERNELS)
def test_layers_dispatch_to_kernels():
    """On CUDA the layers give the kernels' outputs (and those match the torch path)."""
    from hf_paged.kernels import fused_act, fused_norm, fused_rope
    from hf_paged.layers.activation import SiluAndMul
    from hf_paged.layers.layernorm import RMSNorm
    from hf_paged.layers.rotary import apply_rotary_emb_qk

    dtype, hidden, head_dim = torch.bfloat16, 1024, 128
    norm = RMSNorm(hidden, eps=1e-6).to("cuda", dtype)
    norm.weight.data.copy_(_randn(hidden, dtype=dtype, seed=2))
    x = _randn(7, hidden, dtype=dtype, seed=1)
    r = _randn(7, hidden, dtype=dtype, seed=3)
    assert torch.equal(norm(x), fused_norm.rms_norm(x, norm.weight, 1e-6))
    for got, want in zip(norm(x, r), fused_norm.fused_add_rms_norm(x, r, norm.weight, 1e-6)):
        assert torch.equal(got, want)
    gate_up = _randn(7, 2 * 3072, dtype=dtype, seed=4)
    assert torch.equal(SiluAndMul()(gate_up), fused_act.silu_and_mul(gate_up))

    q_norm, k_norm = (RMSNorm(head_dim, eps=1e-6).to("cuda", dtype) for _ in range(2))
    q_norm.weight.data.copy_(_randn(head_dim, dtype=dtype, seed=5))
    k_norm.weight.data.copy_(_randn(head_dim, dtype=dtype, seed=6))
    q, k = _randn(7, 16, head_dim, dtype=dtype, seed=7), _randn(7, 8, head_dim, dtype=dtype)
    cos, sin = _cos_sin(7, head_dim, dtype)
    *got, stored = apply_rotary_emb_qk(q, k, cos, sin, q_norm, k_norm)
    want = fused_rope.qk_norm_rope(q, k, cos, sin, q_norm.weight, k_norm.weight, 1e-6)
    assert not stored and all(torch.equal(a, b) for a, b in zip(got, want))
    *got, stored = apply_rotary_emb_qk(q, k, cos, sin)
    want = fused_rope.qk_norm_rope(q, k, cos, sin)
    assert not stored and all(torch.equal(a, b) for a, b in zip(got, want))
    # with a cache to write: the rotated k and v land in it, as store_kvcache would put them
    from hf_paged.kernels.attention.kv_store import store_kvcache

    v = _randn(7, 8, head_dim, dtype=dtype, seed=9)
    caches = [torch.zeros(4, 16, 8, head_dim, dtype=dtype, device="cuda") for _ in range(4)]
    slots = torch.tensor([3, -1, 17, 40, 63, -1, 0], device="cuda")
    *got, stored = apply_rotary_emb_qk(q, k, cos, sin, kv_cache=(v, caches[0], caches[1], slots))
    assert stored and all(torch.equal(a, b) for a, b in zip(got, want))
    store_kvcache(want[1], v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@marked(_MARKS_FUSED_KERNELS)
@torch.inference_mode()
def test_kernels_replay_in_cuda_graph():
    """A decode-shaped chain of all four kernels, captured once, replayed on new inputs."""
    from hf_paged.kernels import fused_act, fused_norm, fused_rope

    dtype, num_tokens, hidden, heads, head_dim = torch.bfloat16, 8, 1024, (16, 8), 128
    w = _randn(hidden, dtype=dtype, seed=1)
    qw, kw = _randn(head_dim, dtype=dtype, seed=2), _randn(head_dim, dtype=dtype, seed=3)
    static = {
        "x": torch.zeros(num_tokens, hidden, dtype=dtype, device="cuda"),
        "r": torch.zeros(num_tokens, hidden, dtype=dtype, device="cuda"),
        "qk": torch.zeros(num_tokens, sum(heads), head_dim, dtype=dtype, device="cuda"),
        "cos": torch.zeros(num_tokens, head_dim, dtype=dtype, device="cuda"),
        "sin": torch.zeros(num_tokens, head_dim, dtype=dtype, device="cuda"),
    }

    def step(fused: bool, t: dict):
        norm, add_norm, rope, act = (
            (fused_norm.rms_norm, fused_norm.fused_add_rms_norm, fused_rope.qk_norm_rope,
             fused_act.silu_and_mul) if fused else
            (fused_norm.rms_norm_ref, fused_norm.fused_add_rms_norm_ref,
             fused_rope.qk_norm_rope_ref, fused_act.silu_and_mul_ref)
        )  # fmt: skip
        h = norm(t["x"], w, 1e-6)
        h, res = add_norm(h, t["r"], w, 1e-6)
        q, k = rope(t["qk"][:, : heads[0]], t["qk"][:, heads[0] :], t["cos"], t["sin"], qw, kw,
                    1e-6)  # fmt: skip
        return act(torch.cat((h, res), dim=-1)), res, q, k

    step(True, static)  # warm up: compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(True, static)
    for seed in range(3):
        new = {
            "x": _randn(num_tokens, hidden, dtype=dtype, seed=10 + seed),
            "r": _randn(num_tokens, hidden, dtype=dtype, seed=20 + seed),
            "qk": _randn(num_tokens, sum(heads), head_dim, dtype=dtype, seed=30 + seed),
        }
        new["cos"], new["sin"] = _cos_sin(num_tokens, head_dim, dtype)
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        for got, want in zip(outs, step(False, new)):
            _assert_matches(got, want)


@marked(_MARKS_FUSED_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128256), (4, 151936), (256, 151936), (3, 4097), (2, 1)])
def test_argmax_matches_torch(dtype, shape):
    from hf_paged.kernels.argmax import argmax

    b, v = shape
    x = _randn(b, v, dtype=dtype, seed=v)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    # bf16 logits tie often: the maximum repeated, the first index wins
    x[:, v // 2] = 30.0
    x[:, v - 1] = 30.0
    x[:, min(5, v - 1)] = 30.0
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    x[b - 1, v - 1] = float("nan")  # NaN beats everything
    x[0, :] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    rows = x[:, : max(v - 1, 1)]  # a strided view
    assert torch.equal(argmax(rows), rows.argmax(dim=-1))


@marked(_MARKS_FUSED_KERNELS)
def test_argmax_replays_in_a_graph():
    from hf_paged.kernels.argmax import argmax

    x = _randn(8, 128256, dtype=torch.bfloat16)
    argmax(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(x)
    x.copy_(_randn(8, 128256, dtype=torch.bfloat16, seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(dim=-1))


if __name__ == "__main__":
    interpret_main(CASES)
