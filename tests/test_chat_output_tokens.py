"""Reasoning and tool-call parsing as the server runs it: a recorded output in each family's format is
tokenized by that family's tokenizer (tests/family_chat_models.py: special tokens are single ids),
decoded token by token by the engine's Detokenizer (special tokens kept, as the server keeps them
while tools are in play) and fed to serve.chat_output's ChatOutput delta by delta; what the stream
adds up to equals the one-shot parse of the whole text, and the arguments are the calls' JSON."""
from __future__ import annotations

import json

import pytest

from family_chat_models import family_model

from deepinfer.engine.tokenizer import Detokenizer, Tokenizer
from deepinfer.serve.chat_output import ChatOutput, ChatPlan, merge
from deepinfer.serve.tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, DSML_CLOSE, DSML_OPEN,
                                        TOOL_SEP, parse_tool_calls)

CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris"})]


def _v3(calls):
    return CALLS_BEGIN + "\n".join(f"{CALL_BEGIN}function{TOOL_SEP}{n}\n```json\n{json.dumps(a)}\n```{CALL_END}"
                                   for n, a in calls) + CALLS_END


def _v31(calls):
    return CALLS_BEGIN + "".join(f"{CALL_BEGIN}{n}{TOOL_SEP}{json.dumps(a)}{CALL_END}" for n, a in calls) + CALLS_END


def _dsml(calls):
    invokes = "\n".join(f'{DSML_OPEN}invoke name="{n}">\n' + "".join(
        f'{DSML_OPEN}parameter name="{k}" string="true">{v}{DSML_CLOSE}parameter>\n' for k, v in a.items())
        + f"{DSML_CLOSE}invoke>" for n, a in calls)
    return f"\n\n{DSML_OPEN}function_calls>\n{invokes}\n{DSML_CLOSE}function_calls>"


# (family model, format, the output text: reasoning, an answer, the calls)
OUTPUTS = [("r1", "v3", "Let me look that up.</think>\n\nChecking both." + _v3(CALLS)),
           ("v31", "v31", "I should call the tools.</think>Sure." + _v31(CALLS)),
           ("v31", "dsml", "Two calls are needed.</think>On it." + _dsml(CALLS))]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("fam")
    return {f: Tokenizer(family_model(d, f)) for f in ("r1", "v31")}


@pytest.mark.parametrize("fam, fmt, text", OUTPUTS, ids=[o[1] for o in OUTPUTS])
def test_a_token_stream_parses_as_the_whole_text(tokenizers, fam, fmt, text):
    tok = tokenizers[fam]
    ids = tok.encode(text, add_bos=False)
    assert any(tok._tok.id_to_token(i) == CALLS_BEGIN for i in ids) or fmt == "dsml"   # markers are tokens
    detok = Detokenizer(tok, (), skip_special_tokens=False)
    plan = ChatPlan(reasoning=True, starts_in_reasoning=True, tool_format=fmt, structured=None, keep_special=True)
    out, streamed, pieces = ChatOutput(plan), {}, {"reasoning_content": 0, "tool_calls": 0}
    for t in ids:
        d = out.feed(detok.push(t))
        for k in pieces:
            pieces[k] += bool(d.get(k))
        merge(streamed, d)
    merge(streamed, out.feed(detok.flush()))
    merge(streamed, out.finish())
    reasoning, answer = text.split("</think>", 1)
    content, calls = parse_tool_calls(fmt, answer)
    assert streamed["reasoning_content"] == reasoning
    assert streamed.get("content", "") == content and content.strip()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["tool_calls"]] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(n, a) for n, a in CALLS]
    # it streamed: the reasoning in many deltas, each call's name and then its arguments in more than one
    assert out.called and pieces["reasoning_content"] > 3 and pieces["tool_calls"] > 2 * len(CALLS)
