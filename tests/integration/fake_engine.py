"""A stand-in for ``LLMEngine`` with the same request API, computing logits with the HF model.

Every step runs each schedulable request's whole token list through the HF model (no cache:
slow, but exact and independent of the real engine). ``prefill_steps`` delays a request's first
logits by that many steps (like chunked prefill), so tests see rows' logits arrive at different
steps. Native requests are sampled with HF's own warpers from ``SamplingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from types import SimpleNamespace

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.config import EngineConfig
from hf_paged.engine.core.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.core.request_loop import RequestGroup, run, stream


class _RequestTable(dict):
    """request id -> _Req, with the real table's record of which group added each request."""

    def __init__(self):
        super().__init__()
        self._groups: dict = {}

    def join_group(self, request_id, group) -> None:
        self._groups[request_id] = group

    def leave_group(self, request_id):
        return self._groups.pop(request_id, None)


@dataclass
class FakeStepResult:
    finished: list = field(default_factory=list)
    logits: dict = field(default_factory=dict)


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    params: object
    external: bool
    tokens: list[int]
    wait: int  # steps left before the first logits
    paused: bool = False
    reason: str | None = None
    generator: torch.Generator | None = None
    stop_strings: object = None


class FakeEngine:
    """Same surface as ``LLMEngine`` for the integration: add_request / step / provide_token /
    abort / has_unfinished_requests / close / request_group / stream / run, ``runtime`` and
    ``config``."""

    instances: list[FakeEngine] = []

    def __init__(self, model, config: EngineConfig | None = None, prefill_steps=None):
        self.model = model
        self.config = config or EngineConfig()
        eos = model.generation_config.eos_token_id
        eos = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
        self.runtime = SimpleNamespace(
            config=self.config,
            hf_config=model.config,
            vocab_size=model.config.vocab_size,
            max_model_len=self.config.max_model_len or model.config.max_position_embeddings,
            eos_token_ids=eos,
            num_kv_blocks=self.config.num_kv_blocks or 4096,
        )
        self.tokenizer = None
        self.prefill_steps = prefill_steps or (lambda prompt: 1 + len(prompt) % 3)
        self._ids = count()
        self.requests = _RequestTable()
        self.closed = False
        self.num_added = 0
        self.num_forward_rows = 0
        FakeEngine.instances.append(self)

    def add_request(self, request: EngineRequest):
        if self.closed:
            raise RuntimeError("closed")
        params, request_id = request.params, request.request_id
        external_sampling, stop_strings = request.external_sampling, request.stop_strings
        prompt = list(request.prompt_token_ids)
        if not prompt or any(not 0 <= t < self.runtime.vocab_size for t in prompt):
            raise ValueError(f"prompt_token_ids={prompt!r} is not allowed")
        rid = next(self._ids) if request_id is None else request_id
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        wait = self.prefill_steps(prompt)
        self.requests[rid] = _Req(
            rid, prompt, params, external_sampling, [], wait, generator=gen,
            stop_strings=stop_strings,
        )  # fmt: skip
        self.num_added += 1
        return rid

    def _logits(self, req: _Req) -> torch.Tensor:
        ids = torch.tensor([req.prompt + req.tokens])
        self.num_forward_rows += 1
        with torch.no_grad():
            return self.model(input_ids=ids).logits[0, -1].float()  # [V]

    def _sample(self, req: _Req, logits: torch.Tensor) -> int:
        p = req.params
        ids = torch.tensor([req.prompt + req.tokens])
        scores = logits[None].clone()
        procs = LogitsProcessorList()
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        scores = procs(ids, scores)
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.runtime.eos_token_ids))
        if len(req.tokens) < p.min_tokens:
            scores[0, list(stop)] = float("-inf")
        if p.temperature == 0:
            return int(scores.argmax())
        warp = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
        if p.top_k > 0:
            warp.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1:
            warp.append(TopPLogitsWarper(p.top_p))
        if p.min_p > 0:
            warp.append(MinPLogitsWarper(p.min_p))
        probs = warp(ids, scores).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def step(self) -> FakeStepResult:
        res = FakeStepResult()
        for req in list(self.requests.values()):
            if req.reason is not None or req.paused:
                continue
            if req.wait > 1:
                req.wait -= 1
                continue
            req.wait = 0
            logits = self._logits(req)
            if req.external:
                req.paused = True
                res.logits[(req.rid, 0)] = logits
                continue
            tok = self._sample(req, logits)
            req.tokens.append(tok)
            p = req.params
            stop = set(p.stop_token_ids) | (
                set() if p.ignore_eos else set(self.runtime.eos_token_ids)
            )
            hit = req.stop_strings is not None and req.stop_strings.matches(req.prompt + req.tokens)
            if len(req.tokens) >= p.min_tokens and (tok in stop or hit):
                req.reason = "stop"
            elif len(req.tokens) >= p.max_tokens:
                req.reason = "length"
        # like the real engine: finished (or aborted) requests are reported by a step
        for req in [r for r in self.requests.values() if r.reason is not None]:
            del self.requests[req.rid]
            out = CompletionOutput(0, list(req.tokens), None, req.reason)
            res.finished.append(RequestOutput(req.rid, None, list(req.prompt), [out]))
        return res

    def provide_token(self, rid, token_id: int, *, finish: bool = False) -> None:
        req = self.requests[rid]
        if not req.paused:
            raise ValueError(f"request_id={rid!r} is not waiting for a token")
        req.paused = False
        req.tokens.append(int(token_id))
        if finish:
            req.reason = "stop"
        elif len(req.prompt) + len(req.tokens) >= self.runtime.max_model_len:
            req.reason = "length"

    def abort(self, rid) -> None:
        req = self.requests.get(rid)
        if req is not None and req.reason is None:
            req.reason = "abort"

    def request_kv(self, rids) -> list:
        """``LLMEngine.request_kv``'s answer from an HF forward over each request's tokens."""
        per_req = []
        for rid in rids:
            req = self.requests[rid]
            with torch.no_grad():
                cache = self.model(input_ids=torch.tensor([req.prompt + req.tokens]),
                                   use_cache=True).past_key_values  # fmt: skip
            per_req.append([(lay.keys[0].transpose(0, 1), lay.values[0].transpose(0, 1))
                            for lay in cache.layers])  # fmt: skip
        return [(torch.cat([r[i][0] for r in per_req]), torch.cat([r[i][1] for r in per_req]))
                for i in range(len(per_req[0]))]  # fmt: skip

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # the real engine's request loop, over this surface
    def request_group(self):
        return RequestGroup(self)

    def stream(self, requests, **kwargs):
        return stream(self, requests, **kwargs)

    def run(self, requests, **kwargs):
        return run(self, requests, **kwargs)

    def close(self) -> None:
        self.closed = True
