"""HFLM ``_loglikelihood_tokens`` and ``loglikelihood_rolling`` on the paged engine.

``loglikelihood`` tokenizes as stock, then calls ``_loglikelihood_tokens``: every request is one
engine request scoring its continuation's tokens (``scoring.py``), all in one engine run, the
continuations of a context sharing its KV through the prefix cache. ``loglikelihood_rolling``
builds stock's windows per document and scores them all in one run.
"""

from __future__ import annotations

from hf_paged.engine.core.request import EngineRequest
from hf_paged.integration.lm_eval.scoring import loglikelihood_result, score_params, score_window
from hf_paged.integration.lm_eval.serving import owner_for, run_requests


def loglikelihood_tokens(lm, requests, disable_tqdm: bool) -> list[tuple[float, bool]]:
    """``[(logprob, is_greedy)]`` in request order.

    Raises:
        PagedFallback: before anything runs, when the model or the call runs stock.
    """
    windows = [score_window(ctx, cont, lm.max_length) for _, ctx, cont in requests]
    # the engine's prompt is a window without its last token, plus one discarded new token
    need = max(len(w) for w, _ in windows)
    with owner_for(lm, need, scoring=True).hold() as held:
        outs = run_requests(
            held.get(),
            [EngineRequest(w[:-1], score_params(w, start)) for w, start in windows],
            "Running loglikelihood requests (paged)",
            disable_tqdm or lm.rank != 0,
        )
    results = [loglikelihood_result(out, start) for out, (_, start) in zip(outs, windows)]
    for (request_str, _, _), answer in zip(requests, results, strict=True):
        if request_str is not None:  # rolling windows are cached per document, by the caller
            lm.cache_hook.add_partial("loglikelihood", request_str, answer)
    return results


def loglikelihood_rolling(lm, requests, disable_tqdm: bool) -> list[float]:
    """One total logprob per document, with stock's windows, all scored in one engine run."""
    from lm_eval import utils

    windows, counts = [], []
    for (string,) in (req.args for req in requests):
        doc = [
            (None, *utils.make_disjoint_window(w))
            for w in utils.get_rolling_token_windows(
                token_list=lm.tok_encode(string),
                prefix_token=lm.prefix_token_id,
                max_seq_len=lm.max_length,
                context_len=1,
            )
        ]
        windows.extend(doc)
        counts.append(len(doc))
    scores = loglikelihood_tokens(lm, windows, disable_tqdm)
    out, pos = [], 0
    for req, n in zip(requests, counts, strict=True):
        total = sum(s[0] for s in scores[pos : pos + n])
        pos += n
        out.append(total)
        lm.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return out
