"""HFLM ``loglikelihood``, ``_loglikelihood_tokens`` and ``loglikelihood_rolling`` on the paged
engine.

``loglikelihood`` builds stock's token requests (``TemplateLM.loglikelihood``) with every
distinct string encoded once (``tokenize.encode_many``), then calls ``_loglikelihood_tokens``:
every request is one engine request scoring its continuation's tokens (``scoring.py``), all in
one engine run, the continuations of a context sharing its KV through the prefix cache.
``loglikelihood_rolling`` builds stock's windows per document and scores them all in one run.
"""

from __future__ import annotations

from hf_paged.engine.core.request import EngineRequest
from hf_paged.integration.lm_eval.scoring import loglikelihood_result, score_params, score_window
from hf_paged.integration.lm_eval.serving import owner_for, run_requests
from hf_paged.integration.lm_eval.tokenize import encode_many
from hf_paged.integration.loras import active_lora_key
from hf_paged.refusal import Refusal


def tokenizes_as_stock(lm) -> bool:
    """``loglikelihood_requests`` reproduces what ``lm.loglikelihood`` would tokenize: a causal
    HFLM whose ``loglikelihood``, ``_encode_pair`` and ``tok_encode`` are lm-eval's (or this
    patch's) own, without ``enable_thinking`` (stock refuses loglikelihood then)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.huggingface import HFLM

    def own(name, cls):
        return getattr(getattr(lm, name, None), "__func__", None) is cls.__dict__.get(name)

    return (lm.backend == "causal" and not getattr(lm, "enable_thinking", False)
            and own("loglikelihood", HFLM) and own("_encode_pair", TemplateLM)
            and own("tok_encode", HFLM))  # fmt: skip


def loglikelihood_requests(lm, pairs) -> list[tuple]:
    """``TemplateLM.loglikelihood``'s ``((context, continuation), context_enc,
    continuation_enc)`` for each pair: an empty context is the prefix token (or the
    continuation's first token when that is it); otherwise ``_encode_pair``'s, the context's
    trailing whitespace moved to the continuation and the whole encoded, then split at the
    context's length. Every encode goes through one ``encode_many`` call (two for empty
    contexts)."""
    pairs = [tuple(p) for p in pairs]
    moved = {}  # non-empty context -> (context, continuation) after the whitespace move
    for ctx, cont in pairs:
        if ctx:
            n = len(ctx) - len(ctx.rstrip())
            moved[ctx, cont] = (ctx[:-n], ctx[-n:] + cont) if n else (ctx, cont)
    strings = list(dict.fromkeys(s for ctx, cont in moved.values() for s in (ctx + cont, ctx)))
    encoded = dict(zip(strings, encode_many(lm, strings)))
    empty = list(dict.fromkeys(cont for ctx, cont in pairs if not ctx))
    bare = dict(zip(empty, encode_many(lm, empty, add_special_tokens=False)))
    out = []
    for ctx, cont in pairs:
        if ctx:
            c, x = moved[ctx, cont]
            context_enc = list(encoded[c])
            continuation_enc = encoded[c + x][len(context_enc) :]
        else:
            cont_enc = list(bare[cont])
            if lm.prefix_token_id != cont_enc[0]:
                context_enc, continuation_enc = [lm.prefix_token_id], cont_enc
            else:
                context_enc, continuation_enc = cont_enc[:1], cont_enc[1:]
        out.append(((ctx, cont), context_enc, continuation_enc))
    return out


def loglikelihood(lm, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
    """``TemplateLM.loglikelihood``: ``lm._loglikelihood_tokens`` on ``loglikelihood_requests``
    of the requests' ``(context, continuation)`` pairs."""
    new_reqs = loglikelihood_requests(lm, [req.args for req in requests])
    return lm._loglikelihood_tokens(new_reqs, disable_tqdm=disable_tqdm)


def loglikelihood_tokens(lm, requests, disable_tqdm: bool) -> list[tuple[float, bool]] | Refusal:
    """``[(logprob, is_greedy)]`` in request order; or, before anything runs, the ``Refusal``
    of a model or call that runs stock."""
    windows = [score_window(ctx, cont, lm.max_length) for _, ctx, cont in requests]
    # the engine's prompt is a window without its last token, plus one discarded new token
    owner = owner_for(lm, max(len(w) for w, _ in windows), scoring=True)
    if isinstance(owner, Refusal):
        return owner
    with owner.hold() as held:
        engine = held.get()
        key = active_lora_key(lm.model, engine)  # a PEFT model's active adapters
        outs = run_requests(
            engine,
            [EngineRequest(w[:-1], score_params(w, start), lora_key=key) for w, start in windows],
            "Running loglikelihood requests (paged)",
            disable_tqdm or lm.rank != 0,
        )
    results = [loglikelihood_result(out, start) for out, (_, start) in zip(outs, windows)]
    for (request_str, _, _), answer in zip(requests, results, strict=True):
        if request_str is not None:  # rolling windows are cached per document, by the caller
            lm.cache_hook.add_partial("loglikelihood", request_str, answer)
    return results


def loglikelihood_rolling(lm, requests, disable_tqdm: bool) -> list[float] | Refusal:
    """One total logprob per document, with stock's windows, all scored in one engine run (or
    the ``Refusal`` of ``loglikelihood_tokens``)."""
    from lm_eval import utils

    windows, counts = [], []
    docs = encode_many(lm, [string for (string,) in (req.args for req in requests)])
    for tokens in docs:
        doc = [
            (None, *utils.make_disjoint_window(w))
            for w in utils.get_rolling_token_windows(
                token_list=tokens,
                prefix_token=lm.prefix_token_id,
                max_seq_len=lm.max_length,
                context_len=1,
            )
        ]
        windows.extend(doc)
        counts.append(len(doc))
    scores = loglikelihood_tokens(lm, windows, disable_tqdm)
    if isinstance(scores, Refusal):
        return scores
    out, pos = [], 0
    for req, n in zip(requests, counts, strict=True):
        total = sum(s[0] for s in scores[pos : pos + n])
        pos += n
        out.append(total)
        lm.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return out
