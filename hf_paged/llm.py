"""``LLM``: the offline batch API (vLLM's shape) over one LLMEngine."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from hf_paged.config import SamplingParams
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import RequestOutput


class LLM:
    """Generate for many prompts at once with continuous batching.

    Args:
        model: checkpoint directory or a loaded HF causal-LM.
        tokenizer: optional; defaults to the one saved beside the checkpoint.
        **engine_kwargs: EngineConfig keys (``max_num_seqs``, ``num_kv_blocks``, ...).

    Example:
        >>> with LLM("path/to/ckpt", max_num_seqs=64) as llm:
        ...     outs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        ...     print(outs[0].text)
    """

    def __init__(self, model, tokenizer=None, **engine_kwargs):
        self.engine = LLMEngine(model, engine_kwargs, tokenizer=tokenizer)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompts=<str> is not allowed without a tokenizer: save one beside the "
                    "checkpoint, pass tokenizer=..., or give token-id lists"
                )
            return prompt, self.engine.validate_prompt(self.tokenizer.encode(prompt))
        return None, self.engine.validate_prompt(prompt)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one SamplingParams for all prompts or one per prompt.
            use_tqdm: show a progress bar.

        Raises:
            ValueError: a bad prompt or a params list of the wrong length. Nothing is queued
                then, and the engine stays usable.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {len(prompts)} "
                    "prompts: give one SamplingParams or one per prompt"
                )
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(
                    f"sampling_params[{i}]={sp!r} is not allowed: must be a SamplingParams"
                )
        encoded = [self._encode(p) for p in prompts]  # validate everything before queueing
        ids_in_order = []
        try:
            for (text, ids), sp in zip(encoded, params):
                ids_in_order.append(self.engine.add_request(ids, sp, prompt=text))
        except BaseException:
            for rid in ids_in_order:
                self.engine.abort(rid)
            raise
        return self._run(ids_in_order, use_tqdm)

    def _run(self, request_ids: list, use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(request_ids)
        done: dict = {}
        bar = tqdm(total=len(request_ids), desc="hf_paged", disable=not use_tqdm)
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step().finished:
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in wanted - set(done):
                self.engine.abort(rid)
            self.engine.step()  # drop the aborted requests' blocks
            raise
        finally:
            bar.close()
        return [done[r] for r in request_ids]

    @property
    def stats(self) -> dict:
        return self.engine.stats

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
