"""Anthropic's Messages API: POST /v1/messages (a whole message, or streamed as Anthropic's event
sequence message_start, content_block_start, ping, content_block_delta..., content_block_stop,
message_delta, message_stop) and POST /v1/messages/count_tokens.

A reply's content: a thinking block (a reasoning model's <think> text), a text block, tool_use blocks
(serve.anthropic_blocks, on serve.chat_output's parsers and grammars). stop_reason: "end_turn" (the
model's eos), "tool_use", "max_tokens" or "stop_sequence" (with the one that matched in
stop_sequence). Errors take Anthropic's shape (see serve.api_errors)."""
from __future__ import annotations

import dataclasses
import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from .anthropic_blocks import ReplyBlocks
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .api_errors import APIError, anthropic_error_body
from .chat_output import ChatOutput, plan_chat
from .tool_calls import detect_tool_format
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

    def prompt(req) -> tuple:
        """(prompt ids, the chat plan: reasoning, tool format, the grammar a tool_choice forces)."""
        calls.check_model(req.model)
        tools, choice, parallel, kwargs = req.tool_setup()
        messages, prefill = req.chat()
        if any(m["role"] == "tool" or m.get("tool_calls") for m in messages) and \
                detect_tool_format(tok.chat_markers) is None:
            raise APIError(400, "this model's chat template renders no tool calls, so a conversation with tool_use / "
                                "tool_result blocks cannot be given to it", param="messages")
        text = calls.render_chat(messages, tools=tools, template_kwargs=kwargs) + prefill
        plan = plan_chat(tok, text, tools, choice, parallel)
        if kwargs.get("thinking") and not plan.reasoning:
            raise APIError(400, "thinking: this model's chat template has no reasoning block (<think>)",
                           param="thinking")
        return calls.encode(text, add_bos=False, param="messages"), plan

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return {"input_tokens": len(prompt(req)[0])}

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request):
        ids, plan = prompt(req)
        stops = list(req.stop_sequences or [])
        check_common(1, stops, req.max_tokens, calls.limits, calls.max_tokens_cap, stop_param="stop_sequences")
        params = make_params(dict(max_new_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else
                                  req.temperature, top_p=req.top_p, top_k=req.top_k or 0, seed=random_seed(),
                                  stop=tuple(stops)),
                             NAMES)
        params = dataclasses.replace(params, structured=plan.structured, skip_special_tokens=not plan.keep_special)
        calls.check_prompt(ids, params, "messages", NAMES)
        mid = f"msg_{uuid.uuid4().hex}"
        sub_ids, q = await calls.submit_all(mid, [ids], params, 1, NAMES)
        reply = _Reply(tok, stops)
        parser, blocks = ChatOutput(plan), ReplyBlocks()
        head = {"id": mid, "type": "message", "role": "assistant", "model": calls.model_name}

        def stop_reason():
            reason, seq = reply.stop()
            return ("tool_use", None) if blocks.used_tools and reason == "end_turn" else (reason, seq)

        def feed(o) -> list:
            reply.add(o)
            ev = blocks.add(parser.feed(o.text)) if o.text else []
            if o.finished:
                ev += blocks.add(parser.finish()) + blocks.finish()
            return ev

        if not req.stream:
            for o in await calls.collect(request, sub_ids, q):
                feed(o)
            reason, seq = stop_reason()
            return {**head, "content": blocks.blocks, "stop_reason": reason,
                    "stop_sequence": seq, "usage": {"input_tokens": len(ids), "output_tokens": reply.output_tokens}}

        async def events():
            done, pinged = False, False
            try:
                yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None,
                                                           "stop_sequence": None,
                                                           "usage": {"input_tokens": len(ids), "output_tokens": 0}}})
                while True:
                    o = await q.get()
                    if o is None:
                        break
                    if isinstance(o, Exception):      # the engine failed: the request is gone already
                        done = True
                        yield _event("error", anthropic_error_body(500, str(o)))
                        return
                    for name, data in feed(o):
                        yield _event(name, data)
                        if name == "content_block_start" and not pinged:
                            pinged = True
                            yield _event("ping", {})
                done = True
                reason, seq = stop_reason()
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
