"""The engine's sampling controls on the embedded model (ABI 1.7's sample fields, engine.sample_controls):
frequency / presence penalties pick, at every greedy step, the token the penalized logits rank first;
logit_bias forces and bans tokens; min_tokens holds eos back; rows with and without controls share a
batch without changing each other; seeded sampling with penalties is reproducible."""
from __future__ import annotations

import math

import pytest

from test_engine import engine  # noqa: F401  (the embedded model on the reference and the CPU backend)

from deepinfer.errors import ConfigError

PROMPT = "def add(a, b):\n    return a + b\n\ndef"


def _outputs(engine, **opts):
    """(token ids, logprobs per token) of one greedy request."""
    rid = engine.add_request(PROMPT, **opts)
    toks, lps = [], []
    while engine.is_running(rid):
        for o in engine.step():
            if o.request_id == rid:
                toks += o.token_ids
                lps += o.logprobs
    return toks, lps


@pytest.mark.parametrize("freq, pres", [(1.5, 0.0), (0.0, 2.0), (0.7, 0.6)])
def test_greedy_penalties_pick_the_top_penalized_token(engine, freq, pres):
    """Logprobs are the model's own (before the controls); the token chosen at each step must rank first
    among the top 20 after subtracting count * freq + presence (a shift-invariant adjustment)."""
    plain, _ = _outputs(engine, max_new_tokens=24, ignore_eos=True)
    toks, lps = _outputs(engine, max_new_tokens=24, ignore_eos=True, logprobs=20, frequency_penalty=freq,
                         presence_penalty=pres)
    assert len(toks) == 24
    counts: dict = {}
    for tok, (lp, top) in zip(toks, lps):
        def adjusted(t, v):
            c = counts.get(t, 0)
            return v - c * freq - (pres if c else 0.0)
        mine = adjusted(tok, lp)
        best = max(adjusted(t, v) for t, v in top)
        assert mine >= best - 1e-4, (tok, mine, best)
        counts[tok] = counts.get(tok, 0) + 1
    # the penalties did something: the plain continuation repeats more
    assert toks != plain
    assert max(counts.values()) <= max(plain.count(t) for t in set(plain))


def test_logit_bias_forces_and_bans(engine):
    plain, _ = _outputs(engine, max_new_tokens=6, ignore_eos=True)
    forced, _ = _outputs(engine, max_new_tokens=6, ignore_eos=True, logit_bias={"42": 100})
    assert forced == [42] * 6
    banned, _ = _outputs(engine, max_new_tokens=6, ignore_eos=True, logit_bias={plain[0]: -100})
    assert banned[0] != plain[0]


def test_min_tokens_holds_eos_back(engine):
    eos = sorted(engine.eos_ids)[0]
    quick, _ = _outputs(engine, max_new_tokens=12, logit_bias={eos: 100})
    assert quick == []                     # eos at once (it is not an output token)
    held, _ = _outputs(engine, max_new_tokens=12, logit_bias={eos: 100}, min_tokens=5)
    assert len(held) == 5 and eos not in held


def test_rows_with_and_without_controls_share_a_batch(engine):
    alone, _ = _outputs(engine, max_new_tokens=10, ignore_eos=True)
    pen_alone, _ = _outputs(engine, max_new_tokens=10, ignore_eos=True, repetition_penalty=4.0)
    a = engine.add_request(PROMPT, max_new_tokens=10, ignore_eos=True)
    b = engine.add_request(PROMPT, max_new_tokens=10, ignore_eos=True, repetition_penalty=4.0)
    got = {a: [], b: []}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.token_ids
    assert got[a] == alone and got[b] == pen_alone
    assert pen_alone != alone


def test_seeded_sampling_with_penalties_is_reproducible(engine):
    opts = dict(max_new_tokens=12, ignore_eos=True, temperature=0.9, seed=7, frequency_penalty=0.5,
                logit_bias={"13": 2.0})
    assert _outputs(engine, **opts)[0] == _outputs(engine, **opts)[0]


def test_bad_controls_are_config_errors(engine):
    vocab = engine.runner.cfg.vocab_size
    for opts, msg in ((dict(logit_bias={str(vocab): 1}), "outside the vocabulary"),
                      (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=-1), "repetition"),
                      (dict(logit_bias={"x": 1}), "token ids"), (dict(frequency_penalty=math.nan), "finite")):
        with pytest.raises(ConfigError, match=msg):
            engine.add_request(PROMPT, **opts)
