"""Anthropic's Messages API: POST /v1/messages (a whole message, or streamed as Anthropic's event
sequence message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop) and POST /v1/messages/count_tokens.

One text content block per reply. stop_reason: "end_turn" (the model's eos), "max_tokens" or
"stop_sequence" (with the one that matched in stop_sequence). Errors take Anthropic's shape (see
serve.api_errors)."""
from __future__ import annotations

import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .api_errors import anthropic_error_body
from .engine_calls import EngineCalls
from .request_params import check_common, make_params, random_seed

# SamplingParams fields -> Anthropic's parameters, where they differ
NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}


class _Reply:
    """One reply as its outputs arrive: its text, token ids, and why it ended."""

    def __init__(self, tok, stops: list):
        self.tok, self.stops = tok, stops
        self.text, self.ids, self.finish_reason, self.output_tokens = "", [], None, 0

    def add(self, o) -> None:
        self.text += o.text
        self.ids += o.token_ids
        if o.finished:
            self.finish_reason, self.output_tokens = o.finish_reason, o.num_output_tokens

    def stop(self) -> tuple:
        """(stop_reason, stop_sequence)."""
        if self.finish_reason == "length":
            return "max_tokens", None
        # the engine cuts the text where a stop string starts and says only "stop": the decoded ids
        # (which include the stop string's tokens) tell which one it was, if any (else: eos)
        if self.stops:
            full = self.tok.decode(self.ids)
            at = {s: full.find(s, max(0, len(self.text) - len(s))) for s in self.stops}
            hits = [(i, s) for s, i in at.items() if i >= 0]
            if hits:
                return "stop_sequence", min(hits)[1]
        return "end_turn", None


def add_messages_routes(app: FastAPI, calls: EngineCalls) -> None:
    tok = calls.tokenizer

    def prompt_ids(req) -> list:
        calls.check_model(req.model)
        req.check_supported()
        messages, prefill = req.chat()
        return calls.encode(calls.render_chat(messages) + prefill, add_bos=False, param="messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return {"input_tokens": len(prompt_ids(req))}

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        ids = prompt_ids(req)
        stops = list(req.stop_sequences or [])
        check_common(1, stops, req.max_tokens, calls.limits, calls.max_tokens_cap, stop_param="stop_sequences")
        params = make_params(dict(max_new_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else
                                  req.temperature, top_p=req.top_p, top_k=req.top_k or 0, seed=random_seed(),
                                  stop=tuple(stops)),
                             NAMES)
        calls.check_prompt(ids, params, "messages", NAMES)
        mid = f"msg_{uuid.uuid4().hex}"
        sub_ids, q = await calls.submit_all(mid, [ids], params, 1, NAMES)
        reply = _Reply(tok, stops)
        head = {"id": mid, "type": "message", "role": "assistant", "model": calls.model_name}

        if not req.stream:
            for o in await calls.collect(request, sub_ids, q):
                reply.add(o)
            reason, seq = reply.stop()
            return {**head, "content": [{"type": "text", "text": reply.text}], "stop_reason": reason,
                    "stop_sequence": seq, "usage": {"input_tokens": len(ids), "output_tokens": reply.output_tokens}}

        async def events():
            done = False
            try:
                yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None,
                                                           "stop_sequence": None,
                                                           "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
                yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                yield _event("ping", {})
                while True:
                    o = await q.get()
                    if o is None:
                        break
                    if isinstance(o, Exception):      # the engine failed: the request is gone already
                        done = True
                        yield _event("error", anthropic_error_body(500, str(o)))
                        return
                    reply.add(o)
                    if o.text:
                        yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                    "text": o.text}})
                done = True
                reason, seq = reply.stop()
                yield _event("content_block_stop", {"index": 0})
                yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                               "usage": {"output_tokens": reply.output_tokens}})
                yield _event("message_stop", {})
            finally:
                if not done:        # the client went away: free the blocks now
                    calls.abort(sub_ids)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _event(name: str, data: dict) -> str:
    body = data if name == "error" else {"type": name, **data}
    return f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
