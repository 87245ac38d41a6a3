"""vLLM's /tokenize and /detokenize: the token ids the engine would run for a prompt or for chat
messages (their count against max_model_len), and the text of token ids."""
from __future__ import annotations

from typing import Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError

from .api_errors import APIError
from .engine_calls import EngineCalls
from .protocol import STRICT, ChatMessage


class TokenizePrompt(BaseModel):
    model_config = STRICT
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True       # the tokenizer's bos, as /v1/completions adds it
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = STRICT
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False      # the template writes the bos itself
    return_token_strs: bool = False


class Detokenize(BaseModel):
    model_config = STRICT
    model: Optional[str] = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, calls: EngineCalls) -> None:
    tok = calls.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: dict):
        # the two shapes told apart by their key, so that an error names the field, not a union branch
        try:
            req = (TokenizeChat if "messages" in body else TokenizePrompt).model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        calls.check_model(req.model)
        add_bos = None if req.add_special_tokens else False
        if isinstance(req, TokenizeChat):
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
            ids = calls.encode(calls.render_chat(messages, req.add_generation_prompt), add_bos, param="messages")
        else:
            ids = calls.encode(req.prompt, add_bos) if req.prompt else []
        out = {"count": len(ids), "max_model_len": calls.max_seq, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [tok.decode([t]) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(req: Detokenize):
        calls.check_model(req.model)
        vocab = tok.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}
