"""The HTTP API (FastAPI on uvicorn): OpenAI's /v1/completions and /v1/chat/completions (streaming
as server-sent events or not), /v1/models, /health, /metrics; vLLM's /tokenize and /detokenize
(serve.tokenize_api); Anthropic's /v1/messages (serve.anthropic).

Handlers tokenize, validate and hand requests to the engine thread (serve.async_engine); they
never touch the model. Errors use OpenAI's JSON shape {"error": {"message", "type", "param",
"code"}} (Anthropic's under /v1/messages): 400 bad parameter, 404 unknown model or route, 413 body
too large, 503 queue full or shutting down. A client that disconnects aborts its request, which
frees its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .anthropic import add_messages_routes
from .api_errors import APIError, error_response
from .async_engine import AsyncEngine
from .body_limit import BodyLimit
from .chat_output import ChatOutput, merge, plan_chat
from .engine_calls import EngineCalls
from .limits import ServerLimits
from .logprob_shapes import chat_logprobs, completion_logprobs
from .protocol import ChatCompletionRequest, CompletionRequest
from .request_params import openai_params
from .tokenize_api import add_tokenize_routes

__all__ = ["APIError", "ServerLimits", "create_app"]

log = logging.getLogger("deepinfer")


def create_app(aengine: AsyncEngine, model_name: str, limits: Optional[ServerLimits] = None,
               drain_timeout: float = 30.0) -> FastAPI:
    """The app; when the server stops (after uvicorn drained open responses) the engine thread
    finishes what still runs, up to drain_timeout seconds, and stops."""
    limits = limits or ServerLimits()
    calls = EngineCalls(aengine, model_name, limits)
    tok = calls.tokenizer
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, aengine.shutdown, drain_timeout)

    app = FastAPI(title="deepinfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        aengine.metrics.requests_rejected.labels(status=str(e.status)).inc()
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        errs = e.errors()
        locs = [[str(x) for x in er.get("loc", ()) if x != "body"] for er in errs]
        msg = "; ".join(f"{'.'.join(loc) or 'the body'}: {er.get('msg')}" for loc, er in zip(locs[:5], errs))
        aengine.metrics.requests_rejected.labels(status="400").inc()
        return error_response(400, msg or "invalid request", param=_param(locs), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else
                              "server_error", code="not_found" if e.status_code == 404 else None,
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request, e: Exception):
        # a bug, not the client's doing: still an answer in the route's error shape, the traceback in the log
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return error_response(500, f"internal error ({type(e).__name__}; see the server's log)", "server_error",
                              path=request.url.path)

    # ------------------------------------------------------------------ info
    @app.get("/health")
    async def health():
        s = aengine.snapshot()
        if not s["alive"]:
            return error_response(503, "the engine thread is not running", "server_error")
        return {"status": "ok", "running": s["running"], "waiting": s["waiting"]}

    @app.get("/metrics")
    async def metrics():
        return Response(aengine.metrics.render(aengine.snapshot()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "deepinfer", "max_model_len": calls.max_seq}]}

    # ------------------------------------------------------------------ shared by both OpenAI routes
    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    async def stream_events(req, sub_ids: list, q: asyncio.Queue, base: dict, n_prompt: int, choice, prelude=()):
        """Server-sent events for the requests' outputs: `choice(o)` is the chunk's choice entry (None:
        nothing to send), then the usage chunk when asked for and [DONE]. A client that goes away
        (the generator is closed early) or an engine failure aborts the requests."""
        left, n_out = len(sub_ids), 0
        try:
            for chunk in prelude:
                yield sse(chunk)
            while left:
                o = await q.get()
                if o is None:
                    left -= 1
                    continue
                if isinstance(o, Exception):
                    yield sse({"error": {"message": str(o), "type": "server_error", "param": None, "code": None}})
                    break
                if o.finished:
                    n_out += o.num_output_tokens
                c = choice(o)
                if c is not None:
                    yield sse({**base, "choices": [c]})
            if req.stream_options and req.stream_options.include_usage and not left:
                yield sse({**base, "choices": [], "usage": usage(n_prompt, n_out)})
            yield "data: [DONE]\n\n"
        finally:
            if left:        # the client went away (or the engine failed): free the blocks now
                calls.abort(sub_ids)

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        calls.check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts or len(prompts) > limits.max_prompts:
            raise APIError(400, f"prompt must hold 1 to {limits.max_prompts} prompts", param="prompt")
        params, names = openai_params(req, 16 if req.max_tokens is None else req.max_tokens, limits,
                                      calls.max_tokens_cap, req.logprobs)
        ids = [calls.encode(x) for x in prompts]
        for x in ids:
            calls.check_prompt(x, params, "prompt", names)
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub_ids, q = await calls.submit_all(rid, ids, params, req.n, names, req.priority)
        index = {s: i for i, s in enumerate(sub_ids)}
        n_prompt = sum(len(x) for x in ids) * req.n
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        want_lp = req.logprobs is not None

        if not req.stream:
            outs = await calls.collect(request, sub_ids, q)
            text, reason, lp, n_out = {}, {}, {}, 0
            for o in outs:
                k = index[o.request_id] * req.n + o.index
                if want_lp and o.token_ids:
                    blk = completion_logprobs(tok, o, len(text.get(k, "")))
                    acc = lp.setdefault(k, {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []})
                    for key in acc:
                        acc[key] += blk[key]
                text[k] = text.get(k, "") + o.text
                if o.finished:
                    reason[k] = o.finish_reason
                    n_out += o.num_output_tokens
            choices = [{"index": k, "text": text.get(k, ""), "logprobs": lp.get(k) if want_lp else None,
                        "finish_reason": reason.get(k)} for k in range(len(sub_ids) * req.n)]
            return {**base, "choices": choices,
                    "usage": usage(n_prompt, n_out)}

        sent = {}       # characters streamed per choice (logprobs' text_offset)

        def choice(o):
            k = index[o.request_id] * req.n + o.index
            if not (o.text or o.finished or (want_lp and o.token_ids)):
                return None
            lp = completion_logprobs(tok, o, sent.get(k, 0)) if want_lp and o.token_ids else None
            sent[k] = sent.get(k, 0) + len(o.text)
            return {"index": k, "text": o.text, "logprobs": lp,
                    "finish_reason": o.finish_reason if o.finished else None}

        return StreamingResponse(stream_events(req, sub_ids, q, base, n_prompt, choice), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        calls.check_model(req.model)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        tool_choice = req.tool_choice_json()
        tools = req.tools_json() if tool_choice != "none" else None
        prompt = calls.render_chat(messages, tools=tools, template_kwargs=req.template_kwargs())
        plan = plan_chat(tok, prompt, tools, tool_choice, req.parallel_tool_calls)
        ids = calls.encode(prompt, add_bos=False, param="messages")
        asked_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_new = asked if asked is not None else calls.default_max_tokens(len(ids))
        want_lp = req.logprobs
        params, names = openai_params(req, max_new, limits, calls.max_tokens_cap,
                                      (req.top_logprobs or 0) if want_lp else None, asked_param, "top_logprobs")
        params = chat_params(params, plan, names)
        calls.check_prompt(ids, params, "messages", names)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub_ids, q = await calls.submit_all(rid, [ids], params, req.n, names, req.priority)
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        n_prompt = len(ids) * req.n

        parsers = [ChatOutput(plan) for _ in range(req.n)]

        def reason_of(o) -> str:
            return "tool_calls" if parsers[o.index].called and o.finish_reason == "stop" else o.finish_reason

        if not req.stream:
            outs = await calls.collect(request, sub_ids, q)
            msgs = [{"role": "assistant", "content": ""} for _ in range(req.n)]
            reason, lp, n_out = {}, {}, 0
            for o in outs:
                merge(msgs[o.index], parsers[o.index].feed(o.text))
                if want_lp:
                    lp.setdefault(o.index, []).extend(chat_logprobs(tok, o))
                if o.finished:
                    merge(msgs[o.index], parsers[o.index].finish())
                    reason[o.index] = reason_of(o)
                    n_out += o.num_output_tokens
            for m in msgs:
                if m.get("tool_calls") and not m["content"].strip():
                    m["content"] = None         # OpenAI's shape of a message that only calls tools
            choices = [{"index": k, "message": msgs[k],
                        "logprobs": {"content": lp.get(k, []), "refusal": None} if want_lp else None,
                        "finish_reason": reason.get(k)} for k in range(req.n)]
            return {**base, "choices": choices,
                    "usage": usage(n_prompt, n_out)}

        base = {**base, "object": "chat.completion.chunk"}

        def choice(o):
            delta = parsers[o.index].feed(o.text) if o.text else {}
            if o.finished:
                for k, v in parsers[o.index].finish().items():
                    delta[k] = delta.get(k, v[:0]) + v      # text or tool-call items, after what came first
            if not (delta or o.finished or (want_lp and o.token_ids)):
                return None
            return {"index": o.index, "delta": delta,
                    "logprobs": {"content": chat_logprobs(tok, o), "refusal": None} if want_lp else None,
                    "finish_reason": reason_of(o) if o.finished else None}

        roles = [{**base, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}]} for k in range(req.n)]
        return StreamingResponse(stream_events(req, sub_ids, q, base, n_prompt, choice, roles),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    add_tokenize_routes(app, calls)
    add_messages_routes(app, calls)
    return app


def chat_params(params, plan, names: dict):
    """A chat request's SamplingParams with what its plan adds: the grammar a tool_choice of "required"
    or a named function forces (one constraint per request: with response_format too, a 400), a
    response_format that starts after the reasoning a prompt opened, and the special tokens kept in the
    text while tools are in play (the tool-call markers may be special tokens)."""
    structured = params.structured
    if plan.structured is not None:
        if structured is not None:
            raise APIError(400, f"tool_choice forces tool calls and {names['structured']} constrains the output too; "
                                "use one of them", param="tool_choice")
        structured = plan.structured
    elif structured is not None and plan.starts_in_reasoning:
        structured = {**structured, "after": "</think>"}    # the answer after the reasoning is constrained
    return dataclasses.replace(params, structured=structured, skip_special_tokens=not plan.keep_special)


def _param(locs: list) -> Optional[str]:
    """The field a validation failure is about. A value that fits no member of a union fails once per
    member, each error's location ending in the member's type ("stop.str", "stop.list[str]"): their
    common prefix is the field itself."""
    if not locs:
        return None
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    return ".".join(common or locs[0]) or None
