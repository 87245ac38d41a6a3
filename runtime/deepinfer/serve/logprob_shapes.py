"""The engine's per-token logprobs (RequestOutput.logprobs: (logprob, [(token, logprob), ...]) per
token, alternatives best first) in OpenAI's two shapes: the completions one (parallel lists of
tokens, logprobs, top-alternative maps and text offsets) and the chat one (a list of entries with
each token's text, UTF-8 bytes and top alternatives)."""
from __future__ import annotations


def completion_logprobs(tok, o, offset: int) -> dict:
    """/v1/completions' logprobs of one output; `offset`: characters of the choice before it."""
    toks, lps, tops, offs = [], [], [], []
    for t, (lp, top) in zip(o.token_ids, o.logprobs):
        s = tok.decode([t])
        toks.append(s)
        lps.append(lp)
        tops.append({tok.decode([a]): b for a, b in top})
        offs.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(tok, o) -> list:
    """/v1/chat/completions' logprobs.content entries of one output."""
    return [{**_token(tok, t, lp), "top_logprobs": [_token(tok, a, b) for a, b in top]}
            for t, (lp, top) in zip(o.token_ids, o.logprobs)]


def _token(tok, token_id: int, logprob: float) -> dict:
    # a token that is part of a multi-byte character decodes to U+FFFD on its own; its bytes are
    # then those of U+FFFD, not the raw piece (the Tokenizer does not expose a token's bytes)
    text = tok.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
