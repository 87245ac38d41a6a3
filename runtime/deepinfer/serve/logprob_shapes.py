"""The engine's per-token logprobs (RequestOutput.logprobs: (logprob, [(token, logprob), ...]) per
token, alternatives best first) in OpenAI's two shapes: the completions one (parallel lists of
tokens, logprobs, top-alternative maps and text offsets) and the chat one (a list of entries with
each token's text, UTF-8 bytes and top alternatives)."""
from __future__ import annotations

import functools


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
    # a token that is part of a multi-byte character decodes to U+FFFD on its own; `bytes` are its raw
    # bytes (OpenAI's point of the field: the client joins them into the character)
    text = tok.decode([token_id])
    raw = token_bytes(tok, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(raw if raw is not None else text.encode("utf-8"))}


@functools.lru_cache(maxsize=1)
def _byte_level_table() -> dict:
    """GPT-2's byte-level alphabet (which ByteLevel tokenizers, DeepSeek's among them, write pieces in):
    printable bytes stand for themselves, the others for the code points from 256 on, in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tok, token_id: int):
    """The raw bytes of one token of a byte-level tokenizer (None where it cannot tell: then the text's)."""
    hf = getattr(tok, "_tok", None)
    if hf is None or type(hf.decoder).__name__ != "ByteLevel":
        return None
    piece = hf.id_to_token(int(token_id))
    if piece is None:
        return None
    if int(token_id) in hf.get_added_tokens_decoder():
        return piece.encode("utf-8")        # added tokens are plain text, not byte-level pieces
    table = _byte_level_table()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:
        return None
