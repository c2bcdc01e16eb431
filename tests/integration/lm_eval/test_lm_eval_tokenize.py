"""lm-eval's loglikelihood tokenization in batches (``tokenize.encode_many``) equals stock's
per-string ``HFLM.tok_encode``, request by request, and runs stock's own method where it cannot
promise that."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install hf-paged[lm_eval])")

from hf_paged.integration.lm_eval import tokenize  # noqa: E402
from hf_paged.testing.tokenizer import build_bpe_tokenizer, random_words  # noqa: E402

BOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def bpe():
    """The byte-level BPE tokenizer, and the same one adding ``<|endoftext|>`` as BOS."""
    from transformers import PreTrainedTokenizerFast

    plain = build_bpe_tokenizer(merges=1000)
    with_bos = PreTrainedTokenizerFast(tokenizer_object=plain.backend_tokenizer, bos_token=BOS,
                                       eos_token=BOS, pad_token=BOS, add_bos_token=True)  # fmt: skip
    assert with_bos.encode("ba") == [with_bos.bos_token_id, *plain.encode("ba")]
    return plain, with_bos


def bare_hflm(tokenizer, add_bos_token=None, cls=None):
    """An HFLM with only what tokenization reads (no model): stock's own methods run on it."""
    from lm_eval.models.huggingface import HFLM

    lm = (cls or HFLM).__new__(cls or HFLM)
    lm.tokenizer, lm.add_bos_token, lm.custom_prefix_token_id = tokenizer, add_bos_token, None
    lm.backend, lm.enable_thinking = "causal", False
    return lm


def many_strings(rng, n: int) -> list[str]:
    """ASCII words, random unicode, leading / trailing whitespace, the BOS text first, empty
    strings, repeats."""
    pools = [
        lambda: random_words(rng, rng.randint(1, 30)),
        lambda: "".join(
            chr(
                rng.choice(
                    [
                        rng.randint(32, 126),
                        rng.randint(0xA0, 0x2FFF),
                        rng.randint(0x4E00, 0x4FFF),
                        rng.randint(0x1F300, 0x1F64F),
                    ]
                )
            )
            for _ in range(rng.randint(1, 40))
        ),  # fmt: skip
        lambda: (
            rng.choice([" ", "  ", "\n", "\t "]) + random_words(rng, 5) + rng.choice([" ", "\n"])
        ),
        lambda: BOS + random_words(rng, rng.randint(0, 8)),
        lambda: "",
    ]
    out = [rng.choice(pools)() for _ in range(n)]
    return out + rng.sample(out, n // 4)


@pytest.fixture
def counted(monkeypatch):
    """Counts the tokenizer's batch calls (the fast path) and their strings."""
    calls = []
    real = tokenize._batch_call

    def spy(tokenizer, strings, kwargs):
        calls.append(len(strings))
        return real(tokenizer, strings, kwargs)

    monkeypatch.setattr(tokenize, "_batch_call", spy)
    monkeypatch.setattr(tokenize, "num_threads", lambda: 3)  # the pool, whatever this machine
    return calls


@pytest.mark.parametrize("add_bos_token", [True, False, None])
@pytest.mark.parametrize("add_special_tokens", [None, False, True])
def test_encode_many_equals_tok_encode(bpe, counted, add_bos_token, add_special_tokens):
    lm = bare_hflm(bpe[1], add_bos_token)
    strings = many_strings(random.Random(0), 400)
    want = [lm.tok_encode(s, add_special_tokens=add_special_tokens) for s in strings]
    got = tokenize.encode_many(lm, strings, add_special_tokens=add_special_tokens)
    assert got == want
    assert len({id(ids) for ids in got}) == len(got)  # no two results share a list
    # the batch path, each distinct string once, over several chunks
    assert sum(counted) == len(set(strings)) and len(counted) > 3
    if add_bos_token and add_special_tokens is None:  # a string that starts with it: no 2nd BOS
        bos = lm.prefix_token_id
        assert all(w[:1] == [bos] and w[:2] != [bos, bos] for w in want)


def test_guard_falls_back_to_tok_encode(bpe, counted, monkeypatch):
    """A batch call that disagrees with ``tok_encode`` on the checked strings: every string is
    ``tok_encode``'s."""
    lm = bare_hflm(bpe[0])
    strings = many_strings(random.Random(1), 200)
    want = [lm.tok_encode(s) for s in strings]
    monkeypatch.setattr(
        tokenize, "_batch_call", lambda tok, ss, kw: [[7, *tok.encode(s)] for s in ss]
    )
    assert tokenize.encode_many(lm, strings) == want


def test_overridden_tok_encode_is_used(bpe, counted):
    from lm_eval.models.huggingface import HFLM

    class Reversed(HFLM):
        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return super().tok_encode(string, add_special_tokens)[::-1]

    lm = bare_hflm(bpe[0], cls=Reversed)
    strings = many_strings(random.Random(2), 200)
    assert tokenize.encode_many(lm, strings) == [lm.tok_encode(s) for s in strings]
    assert not counted  # no batch call at all


# ---- loglikelihood: the triples _loglikelihood_tokens receives ---------------------------


def mc_requests(rng, n_docs: int) -> list[SimpleNamespace]:
    """Multiple-choice requests: contexts (some ending in spaces or a newline, some empty)
    with 4 continuations each, a continuation that starts with the BOS text, a repeated doc."""
    reqs = []
    for i in range(n_docs):
        end = rng.choice(["", " ", "  ", "\n"])
        ctx = "" if i % 7 == 0 else f"Q: {random_words(rng, rng.randint(5, 60))}{end}"
        conts = [rng.choice([" ", ""]) + random_words(rng, rng.randint(1, 4)) for _ in range(3)]
        conts.append(BOS + " x" if i % 7 == 0 else " " + random_words(rng, 1))
        reqs.extend(SimpleNamespace(args=(ctx, cont)) for cont in conts)
    return reqs + reqs[:4]


@pytest.fixture
def installed():
    from hf_paged.integration.lm_eval import install as adapter

    adapter.uninstall_lm_eval()
    from lm_eval.models.huggingface import HFLM

    stock = HFLM.__dict__["loglikelihood"]
    adapter.install_lm_eval()
    yield stock
    adapter.uninstall_lm_eval()


def _capture(lm):
    """Make ``lm._loglikelihood_tokens`` record its requests; returns the record."""
    seen = []

    def record(requests, disable_tqdm=False):
        seen.append(requests)
        return [(0.0, False)] * len(requests)

    lm._loglikelihood_tokens = record
    return seen


@pytest.mark.parametrize("add_bos_token", [True, None])
def test_loglikelihood_sends_stocks_requests(bpe, counted, installed, add_bos_token):
    lm = bare_hflm(bpe[1], add_bos_token)
    seen = _capture(lm)
    reqs = mc_requests(random.Random(3), 60)
    installed(lm, reqs)  # stock's HFLM.loglikelihood
    lm.always_paged = False  # not paged: the patched method is stock's
    lm.loglikelihood(reqs)
    assert not counted and seen[1] == seen[0]
    lm.always_paged = True
    lm.loglikelihood(reqs)
    stock, ours = seen[0], seen[2]
    assert ours == stock and counted  # and through the batch path
    # the cases the requests were built to hold
    assert any(ctx == "" and ctx_enc == [lm.prefix_token_id] for (ctx, _), ctx_enc, _ in stock)
    assert any(ctx.endswith(" ") for (ctx, _), _, _ in stock)


class _PairsReversed:
    def _encode_pair(self, context, continuation):
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        return context_enc[::-1], continuation_enc


class _TokensShifted:
    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return [i + 1 for i in super().tok_encode(string, add_special_tokens)]


class _Filtered:
    def loglikelihood(self, requests, disable_tqdm=False):
        return super().loglikelihood([r for r in requests if r.args[0]], disable_tqdm)


@pytest.mark.parametrize("mixin", [_PairsReversed, _TokensShifted, _Filtered, "seq2seq"])
def test_loglikelihood_runs_stock_when_tokenizing_differs(bpe, installed, monkeypatch, mixin):
    """A subclass that tokenizes its own way, or a seq2seq HFLM, gets stock's method."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.huggingface import HFLM

    from hf_paged.integration.lm_eval import loglikelihood as adapter

    def refuse(*args):
        raise AssertionError("the batched tokenization ran")

    monkeypatch.setattr(adapter, "loglikelihood_requests", refuse)

    cls = HFLM if mixin == "seq2seq" else type("Sub", (mixin, HFLM), {})
    lm = bare_hflm(bpe[0], cls=cls)
    if mixin == "seq2seq":
        lm.backend = "seq2seq"
    seen = _capture(lm)
    reqs = mc_requests(random.Random(4), 20)
    lm.always_paged = True
    lm.loglikelihood(reqs)
    # stock: TemplateLM.loglikelihood on the subclass's own methods
    wanted = [r for r in reqs if r.args[0]] if mixin is _Filtered else reqs
    TemplateLM.loglikelihood(lm, wanted)
    assert seen[0] == seen[1]


# ---- end to end: a tiny model with the BPE tokenizer, stock and paged -------------------------


@pytest.fixture(scope="module")
def bpe_hflm(tmp_path_factory, bpe):
    from lm_eval.models.huggingface import HFLM

    from hf_paged.integration import dispatch
    from hf_paged.integration.lm_eval import install as adapter
    from hf_paged.testing.models import save_tiny_model

    path = str(tmp_path_factory.mktemp("bpe_model"))
    tok = bpe[0]
    save_tiny_model("qwen3", path, seed=0, vocab_size=len(tok))
    tok.save_pretrained(path)
    adapter.install_lm_eval()
    lm = HFLM(pretrained=path, device="cpu", dtype="float32", batch_size=4)
    yield lm, dispatch
    dispatch.set_default_backend(None)
    dispatch.release(lm.model)
    adapter.uninstall_lm_eval()


def test_paged_loglikelihood_equals_stock(bpe_hflm):
    lm, dispatch = bpe_hflm
    reqs = mc_requests(random.Random(5), 12)
    docs = [SimpleNamespace(args=(random_words(random.Random(i), 150),)) for i in range(3)]
    dispatch.set_default_backend("hf")
    stock, stock_rolling = lm.loglikelihood(reqs), lm.loglikelihood_rolling(docs)
    assert dispatch.owner(lm.model).engine is None
    dispatch.set_default_backend("paged")
    ours, ours_rolling = lm.loglikelihood(reqs), lm.loglikelihood_rolling(docs)
    assert dispatch.owner(lm.model).engine is not None  # the engine served them
    for (a, ga), (b, gb) in zip(stock, ours, strict=True):
        assert math.isclose(a, b, abs_tol=1e-4) and ga == gb, (a, b)
    for a, b in zip(stock_rolling, ours_rolling, strict=True):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-4), (a, b)


# ---- install / uninstall ---------------------------------------------------------------------


def test_install_and_uninstall_restore_hflm_exactly(monkeypatch):
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.huggingface import HFLM

    from hf_paged.integration.lm_eval import install as adapter

    adapter.uninstall_lm_eval()
    before = dict(HFLM.__dict__)
    adapter.install_lm_eval()
    assert HFLM.loglikelihood is adapter._loglikelihood
    assert adapter._originals["loglikelihood"] is before["loglikelihood"]
    adapter.uninstall_lm_eval()
    assert dict(HFLM.__dict__) == before
    # a version where HFLM inherits loglikelihood: uninstall leaves it inheriting again
    monkeypatch.delattr(HFLM, "loglikelihood")
    adapter.install_lm_eval()
    assert HFLM.__dict__["loglikelihood"] is adapter._loglikelihood
    assert adapter._originals["loglikelihood"] is TemplateLM.loglikelihood
    adapter.uninstall_lm_eval()
    assert "loglikelihood" not in HFLM.__dict__ and HFLM.loglikelihood is TemplateLM.loglikelihood
