"""Speculative decoding on the engine: proposals before a step, their verification after it.

A request may carry a proposer (``proposers.py``). Before a synchronous step, every running
sequence of such a request that is in decode state (one token to compute) gets up to ``k``
proposed tokens in ``Sequence.spec_token_ids``, ``k`` capped so that the step cannot overshoot
``max_tokens`` or ``max_model_len``. The scheduler gives the sequence one chunk of ``1 + k``
tokens (its last token and the proposal) through the paged prefill path; the runner returns a
logits row at each of those positions. Verification keeps the longest prefix the model agrees
with plus the model's own next token (``layers/rejection_sampler.py``): by matching the model's
own draws (greedy, or proposals without probabilities), or by the speculative-sampling rule when
the proposal came with the distribution it was drawn from. ``Scheduler.accept`` then rolls the
rejected tokens back (KV blocks past the kept tokens released, ``num_computed_tokens`` rewound)
before any block reaches the prefix cache. Each row is sampled with the request's penalties and
``min_tokens`` applied to its own history (the tokens before its position), as stock applies
its processors per position. Each sequence keeps its own number of tokens; the stop rule runs on
each kept token in order.

The engine owns the sequences; this module sets only ``spec_token_ids`` and reports the tokens
to keep, which the engine applies through the scheduler.
"""

from __future__ import annotations

import torch

from hf_paged.engine.core.sequence import Sequence
from hf_paged.engine.spec.proposers import ProposalRequest
from hf_paged.engine.worker.runner_output import RunnerOutput
from hf_paged.engine.worker.sampling_inputs import sampling_metadata
from hf_paged.layers.rejection_sampler import accept_matching, rejection_sample
from hf_paged.layers.sampler import apply_penalties, sampling_probs, token_logprobs


class SpecDecoder:
    """The engine's speculative part: which sequences propose, and what a step keeps.

    Args:
        requests: the engine's ``RequestTable`` (requests carry their proposer).
        max_model_len: the engine's sequence limit.
        vocab_size: proposed ids must be below it.
        generator: for sampled requests without a seed (rejection sampling's draws).

    Attributes:
        num_spec_chunks: chunks that verified at least one proposed token.
        num_draft_tokens: proposed tokens verified.
        num_accepted_tokens: of those, kept.
    """

    def __init__(
        self,
        requests,
        max_model_len: int,
        vocab_size: int,
        generator: torch.Generator | None = None,
    ):
        self.requests = requests
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.generator = generator
        self._probs: dict[int, torch.Tensor] = {}  # seq_id -> this step's proposal's q rows
        self.num_spec_chunks = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- before the step ----------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        """Set ``spec_token_ids`` of the running sequences whose request has a proposer and
        that are in decode state; one ``propose`` call per proposer."""
        self._probs.clear()
        groups: dict[int, tuple[object, list[ProposalRequest]]] = {}
        for seq in running:
            req = self.requests.of(seq.seq_id)
            if req is None or req.proposer is None:
                continue
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens != 1:  # still prefilling
                continue
            params = req.params
            # the kept run (k tokens and one more) must fit max_tokens and max_model_len
            k = min(params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq)) - 1
            if k < 1:
                continue
            item = ProposalRequest(seq, k, params, req.stop_ids, self.requests.generator(seq))
            groups.setdefault(id(req.proposer), (req.proposer, []))[1].append(item)
        for proposer, items in groups.values():
            for it, prop in zip(items, proposer.propose(items), strict=True):
                tokens = list(prop.token_ids)[: it.max_tokens]
                if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens):
                    raise ValueError(
                        f"{type(proposer).__name__} proposed {tokens}: token ids must be ints in "
                        f"[0, {self.vocab_size})"
                    )
                it.seq.spec_token_ids = tokens
                if tokens and prop.probs is not None:
                    self._probs[it.seq.seq_id] = prop.probs[: len(tokens)]

    def wants_logits(self, seq: Sequence, num_rows: int) -> bool:
        """Whether a chunk's rows are verified here from raw logits (speculative sampling)
        rather than sampled by the runner (greedy / matching)."""
        return num_rows > 1 and seq.seq_id in self._probs

    # ---- after the step -----------------------------------------------------------------

    def verify(
        self, seqs: list[Sequence], starts: list[int], counts: list[int], ro: RunnerOutput
    ) -> dict[int, tuple[list[int], list | None]]:
        """The tokens each chunk with proposed tokens keeps, and their logprobs when asked.

        Args:
            seqs: the step's sampled sequences (row order); ``starts[i]`` / ``counts[i]``: the
                first logits row of ``seqs[i]`` and how many it has.
            ro: the runner's output (sampled rows; raw logits of the ``wants_logits`` rows).
        Returns:
            seq_id -> (tokens to keep, per-token logprobs or None), for chunks with > 1 row.
        """
        out: dict[int, tuple[list[int], list | None]] = {}
        by_logits = []
        for seq, r0, n in zip(seqs, starts, counts, strict=True):
            if n == 1:
                continue
            if self.wants_logits(seq, n):
                by_logits.append((seq, r0, n))
                continue
            drawn = ro.sampled_token_ids[r0 : r0 + n]
            tokens = accept_matching(seq.spec_token_ids, drawn)
            lps = ro.logprobs[r0 : r0 + len(tokens)] if self._wants_logprobs(seq) else None
            out[seq.seq_id] = (tokens, lps)
        if by_logits:
            out.update(self._rejection(by_logits, ro))
        for seq, _, n in zip(seqs, starts, counts, strict=True):
            if seq.seq_id in out:
                self.num_spec_chunks += 1
                self.num_draft_tokens += n - 1
                self.num_accepted_tokens += len(out[seq.seq_id][0]) - 1
        return out

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        req = self.requests.of(seq.seq_id)
        if req is not None and req.proposer is not None:
            req.proposer.observe(seq, num_proposed, num_accepted)

    def release(self, seq: Sequence) -> None:
        """``seq`` finished: its proposer forgets it (a draft engine frees its request)."""
        self._probs.pop(seq.seq_id, None)
        req = self.requests.of(seq.seq_id)
        if req is not None and req.proposer is not None:
            req.proposer.release(seq)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    # ---- internals ----------------------------------------------------------------------

    def _wants_logprobs(self, seq: Sequence) -> bool:
        return self.requests.of(seq.seq_id).params.logprobs is not None

    def _rejection(self, chunks, ro: RunnerOutput) -> dict:
        """Speculative sampling for the chunks whose proposal has draft probabilities."""
        seqs = [s for s, _, _ in chunks]
        rows = [r for _, r0, n in chunks for r in range(r0, r0 + n)]
        logits = torch.stack([ro.logits[r] for r in rows])  # [sum(k + 1), V]
        meta = sampling_metadata(self.requests, seqs, [n for _, _, n in chunks])
        kept = rejection_sample(
            sampling_probs(logits, meta),
            torch.cat([self._probs[s.seq_id] for s in seqs]).to(logits.device),
            [s.spec_token_ids for s in seqs],
            [self.requests.generator(s) for s in seqs],
            self.generator,
        )
        out, first = {}, 0
        for (seq, _, n), tokens in zip(chunks, kept, strict=True):
            lps = None
            if self._wants_logprobs(seq):  # the kept tokens' logprobs at their positions
                row_meta = sampling_metadata(self.requests, [seq], [n])
                pen = apply_penalties(logits[first : first + n].float(), row_meta)
                ids = torch.tensor(tokens, device=logits.device)
                lps = token_logprobs(pen[: len(tokens)], ids, row_meta.params[: len(tokens)])
            out[seq.seq_id] = (tokens, lps)
            first += n
        return out
