"""Decode steps with LoRA slots through the per-token kernels (``kernels/lora_per_token.py``):
each token's slot is one device tensor, so a CUDA decode graph captures the LoRA ops once per
batch size and replays them for any adapter mix.

On the CPU the per-token path is switched on by hand (it runs the torch reference there) to show
the runner's side: the decode steps' slots, the slot rewrites when more adapters than slots take
turns, tokens equal to stock PEFT per prompt. On CUDA (``gpu``): decode captured in graphs with
LoRA slots equals the same engine run eagerly and stock PEFT, with padded graph rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hf_paged import LLM, LoRARequest, SamplingParams  # noqa: E402
from hf_paged.testing import SMALL_ENGINE, make_prompts, save_checkpoint  # noqa: E402
from hf_paged.testing.models import save_random_lora  # noqa: E402

NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# three adapters of two ranks and the base model; two slots, so adapters take turns
NAMES = ["one", None, "two", "three", "one", "two"]
ADAPTERS = {
    "one": (4, ["q_proj", "v_proj", "down_proj"]),
    "two": (8, ["k_proj", "o_proj", "up_proj"]),
    "three": (2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def _peft(base_dir, adapter_dir, prompt, device):
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.tensor([prompt], device=device)
    row = model.to(device).eval().generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )[0]  # fmt: skip
    return row[len(prompt) :].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("decode_slots")
    base = save_checkpoint(str(tmp / "base"))
    dirs = {n: save_random_lora(base, str(tmp / n), seed, r=r, lora_alpha=2 * r, target_modules=t)
            for seed, (n, (r, t)) in enumerate(ADAPTERS.items())}  # fmt: skip
    prompts = make_prompts([3, 5, 9, 6, 1, 4], seed=3, vocab=150)
    ids = {n: i + 1 for i, n in enumerate(ADAPTERS)}
    reqs = [LoRARequest(n, ids[n], dirs[n]) if n else None for n in NAMES]
    return base, dirs, prompts, reqs


def _generate(base, prompts, reqs, **cfg):
    with LLM(
        base, enable_lora=True, max_loras=2, max_lora_rank=8, **{**SMALL_ENGINE, **cfg}
    ) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
        runner = llm.engine.executor.runner
        state = {"per_token": runner.lora.per_token, "captured": runner.graph_runner is not None,
                 "reason": runner.cuda_graph_reason}  # fmt: skip
        return [o.outputs[0].token_ids for o in outs], state


def test_per_token_decode_equals_peft(setup, monkeypatch):
    from hf_paged.models.adapters import manager

    seen = []
    prepare = manager.LoraManager.prepare

    def spy(self, chunks):  # every decode step's slots, as the layers read them
        prepare(self, chunks)
        if self.step.decode_slots is not None:
            seen.append(self.step.decode_slots.tolist())

    monkeypatch.setattr(manager, "per_token_available", lambda device: True)
    monkeypatch.setattr(manager.LoraManager, "prepare", spy)
    base, dirs, prompts, reqs = setup
    got, state = _generate(base, prompts, reqs, device="cpu")
    assert state["per_token"]
    want = [_peft(base, dirs[n] if n else None, p, "cpu") for n, p in zip(NAMES, prompts)]
    assert got == want
    assert seen and any(-1 in s for s in seen) and any(len(set(s) - {-1}) == 2 for s in seen)
    assert want[0] != _peft(base, None, prompts[0], "cpu")  # the adapter matters


@pytest.mark.gpu
def test_graph_decode_with_slots_equals_eager_and_peft(setup):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    base, dirs, prompts, reqs = setup
    cuda = dict(dtype="float32", device="cuda", kv_block_size=8)  # the Triton kernels' blocks
    graphs, state = _generate(base, prompts, reqs, **cuda)
    assert state["per_token"] and state["captured"], state["reason"]
    eager, state = _generate(base, prompts, reqs, **cuda, enforce_eager=True)
    assert not state["captured"] and state["reason"] == "enforce_eager=True"
    assert graphs == eager
    want = [_peft(base, dirs[n] if n else None, p, "cuda") for n, p in zip(NAMES, prompts)]
    assert graphs == want
