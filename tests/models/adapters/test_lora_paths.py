"""LoRA slots on every model path: the native decoder (fused q/k/v and gate/up layers, one slice
per HF module), the generic path (HF's own ``nn.Linear`` modules) and a hybrid model on the
generic path (Gated DeltaNet layers beside attention), each equal to stock PEFT per prompt with
adapters of two ranks and the base model in one ``LLM`` call (CPU fp32, greedy)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged import LLM, LoRARequest, SamplingParams  # noqa: E402
from hf_paged.testing import SMALL_ENGINE, make_prompts, save_checkpoint  # noqa: E402
from hf_paged.testing.models import randomize_lora_, save_random_lora  # noqa: E402

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _hybrid_checkpoint(path):
    from hf_paged.testing.any_model import build_tiny

    _, model = build_tiny("olmo_hybrid", seed=0)
    model.save_pretrained(path)
    return path


def _peft(base_dir, adapter_dir, prompt):
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.tensor([prompt])
    row = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0]  # fmt: skip
    return row[len(prompt) :].tolist()


@pytest.mark.parametrize("path, impl", [("llama", "native"), ("llama", "generic"),
                                        ("olmo_hybrid", "generic")])  # fmt: skip
def test_lora_slots_on_each_model_path(tmp_path, path, impl):
    if path == "llama":
        base = save_checkpoint(str(tmp_path / "base"))
    else:
        base = _hybrid_checkpoint(str(tmp_path / "base"))
    specs = {
        "one": (4, ["q_proj", "v_proj", "down_proj"], 1),
        "two": (8, ["k_proj", "o_proj", "up_proj"], 2),
    }
    dirs = {n: save_random_lora(base, str(tmp_path / n), seed, r=r, lora_alpha=2 * r,
                                target_modules=targets)
            for n, (r, targets, seed) in specs.items()}  # fmt: skip
    names = ["one", None, "two", "one"]
    prompts = make_prompts([3, 5, 9, 6], seed=2, vocab=150)
    reqs = [LoRARequest(n, 1 + (n == "two"), dirs[n]) if n else None for n in names]
    with LLM(base, enable_lora=True, model_impl=impl, **SMALL_ENGINE) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
        model = llm.engine.executor.runner.model
        assert (type(model).__name__ == "LlamaForCausalLM") == (impl == "native")
    got = [o.outputs[0].token_ids for o in outs]
    want = [_peft(base, dirs[n] if n else None, p) for n, p in zip(names, prompts)]
    assert got == want
    assert want[0] != _peft(base, None, prompts[0])  # the adapter matters


@pytest.mark.parametrize("impl", ["native", "generic"])
def test_peft_mixed_batch_on_each_path(impl):
    """An in-memory PEFT model's per-row ``adapter_names`` on either path (the generic path loads
    the PEFT model's base weights under their plain names)."""
    import warnings

    from hf_paged import PagedFallbackWarning
    from hf_paged.testing import PAD, build_hf_model, left_pad

    model = get_peft_model(
        build_hf_model("llama"), LoraConfig(r=4, target_modules=["q_proj", "down_proj"])
    )
    model.add_adapter("two", LoraConfig(r=2, target_modules=["v_proj"]))
    randomize_lora_(model, seed=0)
    ids, mask = left_pad(make_prompts([3, 5, 4]))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
              pad_token_id=PAD, adapter_names=["default", "two", "__base__"])  # fmt: skip
    stock = model.eval().generate(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        paged = model.generate(**kw, backend="paged",
                               paged_config={**SMALL_ENGINE, "model_impl": impl})  # fmt: skip
    assert torch.equal(paged, stock)
