"""The OpenAI-compatible HTTP API (FastAPI on uvicorn): /v1/completions, /v1/chat/completions
(streaming as server-sent events or not), /v1/models, /health, /metrics.

Handlers tokenize, validate and hand requests to the engine thread (serve.async_engine); they
never touch the model. Errors use OpenAI's JSON shape {"error": {"message", "type", "param",
"code"}}: 400 bad parameter, 404 unknown model or route, 413 body too large, 503 queue full or
shutting down. A client that disconnects aborts its request, which frees its KV blocks at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import QueueFullError, SamplingParams
from ..errors import CheckpointError, InputError
from .async_engine import AsyncEngine, EngineStopped
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("deepinfer")


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20          # request bodies larger than this are a 413
    max_prompt_tokens: Optional[int] = None   # None: max_seq_len - 1
    max_tokens: Optional[int] = None       # largest max_tokens a request may ask (None: max_seq_len)
    max_n: int = 8
    max_stop: int = 8
    max_prompts: int = 32                  # prompts in one /v1/completions body


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
                   headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is refused with 413 before it is read whole
    (by Content-Length, or while a chunked body streams in)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await _send_413(send, self.limit)
        # read the body here (it is bounded), then replay it to the app
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return      # the client left before sending its body
            chunks.append(msg.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await _send_413(send, self.limit)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_413(send, limit):
    body = json.dumps({"error": {"message": f"request body larger than {limit} bytes", "type": "invalid_request_error",
                                 "param": None, "code": "request_too_large"}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def create_app(aengine: AsyncEngine, model_name: str, limits: Optional[ServerLimits] = None,
               drain_timeout: float = 30.0) -> FastAPI:
    """The app; when the server stops (after uvicorn drained open responses) the engine thread
    finishes what still runs, up to drain_timeout seconds, and stops."""
    limits = limits or ServerLimits()
    eng = aengine.engine
    tok = eng.tokenizer
    max_seq = eng.runner.max_seq_len
    max_prompt = limits.max_prompt_tokens or max_seq - 1
    max_tokens_cap = limits.max_tokens or max_seq
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
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in errs[:5])
        aengine.metrics.requests_rejected.labels(status="400").inc()
        return error_response(400, msg or "invalid request", param=".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else
                              "server_error", code="not_found" if e.status_code == 404 else None)

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
                                            "owned_by": "deepinfer", "max_model_len": max_seq}]}

    # ------------------------------------------------------------------ shared request handling
    def check_model(name):
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def sampling(req, max_new: int, logprobs: Optional[int] = None) -> SamplingParams:
        bad = req.unsupported()
        if bad:
            raise APIError(400, bad[1], param=bad[0])
        if req.n > limits.max_n:
            raise APIError(400, f"n must be <= {limits.max_n}", param="n")
        stops = req.stops()
        if len(stops) > limits.max_stop:
            raise APIError(400, f"at most {limits.max_stop} stop strings", param="stop")
        if max_new > max_tokens_cap:
            raise APIError(400, f"max_tokens {max_new} > the server's limit {max_tokens_cap}", param="max_tokens")
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        try:
            return SamplingParams.from_options(
                max_new_tokens=max_new, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=req.top_p, top_k=max(req.top_k or 0, 0), seed=seed, stop=tuple(stops), logprobs=logprobs,
                ignore_eos=req.ignore_eos)
        except InputError as e:
            raise APIError(400, str(e)) from None

    def check_prompt(ids: list, params: SamplingParams, param: str):
        if len(ids) > max_prompt:
            raise APIError(400, f"prompt of {len(ids)} tokens > the server's limit {max_prompt}", param=param)
        try:
            eng.check_request(ids, params)
        except InputError as e:
            raise APIError(400, f"{e}; lower max_tokens or shorten the prompt", param=param) from None

    async def submit_all(rid: str, prompts: list, params: SamplingParams, n: int) -> tuple[list, asyncio.Queue]:
        """Submit one engine request per prompt, all feeding one queue; undo on failure."""
        q: Optional[asyncio.Queue] = None
        ids = []
        try:
            for i, p in enumerate(prompts):
                sub_id = f"{rid}-{i}"
                got = await aengine.submit(sub_id, p, params, n)
                ids.append(sub_id)
                if q is None:
                    q = got
                else:   # fan in: forward this prompt's outputs into the first queue
                    asyncio.ensure_future(_forward(got, q))
        except QueueFullError as e:
            for s in ids:
                aengine.abort(s)
            raise APIError(503, str(e), "server_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineStopped as e:
            for s in ids:
                aengine.abort(s)
            raise APIError(503, str(e), "server_error", code="shutting_down") from None
        except InputError as e:
            for s in ids:
                aengine.abort(s)
            raise APIError(400, str(e)) from None
        return ids, q

    async def collect(request: Request, sub_ids: list, q: asyncio.Queue):
        """Every output of the requests (non-streaming); aborts them if the client goes away."""
        outs, left = [], len(sub_ids)
        try:
            while left:
                try:
                    o = await asyncio.wait_for(q.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError()
                    continue
                if o is None:
                    left -= 1
                elif isinstance(o, Exception):
                    raise APIError(503, str(o), "server_error")
                else:
                    outs.append(o)
            return outs
        finally:
            if left:
                for s in sub_ids:
                    aengine.abort(s)

    def logprob_block(o, offset: int) -> dict:
        toks, lps, tops, offs = [], [], [], []
        for t, (lp, top) in zip(o.token_ids, o.logprobs):
            s = tok.decode([t])
            toks.append(s)
            lps.append(lp)
            tops.append({tok.decode([a]): b for a, b in top})
            offs.append(offset)
            offset += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

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
                for s in sub_ids:
                    aengine.abort(s)

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts or len(prompts) > limits.max_prompts:
            raise APIError(400, f"prompt must hold 1 to {limits.max_prompts} prompts", param="prompt")
        params = sampling(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        try:
            ids = [eng.encode_prompt(x) for x in prompts]
        except InputError as e:
            raise APIError(400, str(e), param="prompt") from None
        for x in ids:
            check_prompt(x, params, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub_ids, q = await submit_all(rid, ids, params, req.n)
        index = {s: i for i, s in enumerate(sub_ids)}
        n_prompt = sum(len(x) for x in ids) * req.n
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        want_lp = req.logprobs is not None

        if not req.stream:
            outs = await collect(request, sub_ids, q)
            text, reason, lp, n_out = {}, {}, {}, 0
            for o in outs:
                k = index[o.request_id] * req.n + o.index
                if want_lp and o.token_ids:
                    blk = logprob_block(o, len(text.get(k, "")))
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
            lp = logprob_block(o, sent.get(k, 0)) if want_lp and o.token_ids else None
            sent[k] = sent.get(k, 0) + len(o.text)
            return {"index": k, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason if o.finished else None}

        return StreamingResponse(stream_events(req, sub_ids, q, base, n_prompt, choice), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True)
            ids = eng.encode_prompt(text, add_bos=False)
        except CheckpointError as e:
            # the model's own template is broken: the server's fault, and its path is not the client's business
            log.error("chat template: %s", e)
            raise APIError(500, "this model's chat template cannot be used (see the server's log)",
                           "server_error") from None
        except InputError as e:     # these messages fail the template (its limits, raise_exception, ...)
            raise APIError(400, str(e), param="messages") from None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_new = asked if asked is not None else max(min(max_seq - len(ids), max_tokens_cap), 0)
        params = sampling(req, max_new)
        check_prompt(ids, params, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub_ids, q = await submit_all(rid, [ids], params, req.n)
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}
        n_prompt = len(ids) * req.n

        if not req.stream:
            outs = await collect(request, sub_ids, q)
            text, reason, n_out = {}, {}, 0
            for o in outs:
                text[o.index] = text.get(o.index, "") + o.text
                if o.finished:
                    reason[o.index] = o.finish_reason
                    n_out += o.num_output_tokens
            choices = [{"index": k, "message": {"role": "assistant", "content": text.get(k, "")}, "logprobs": None,
                        "finish_reason": reason.get(k)} for k in range(req.n)]
            return {**base, "choices": choices,
                    "usage": usage(n_prompt, n_out)}

        base = {**base, "object": "chat.completion.chunk"}

        def choice(o):
            if not (o.text or o.finished):
                return None
            return {"index": o.index, "delta": {"content": o.text} if o.text else {}, "logprobs": None,
                    "finish_reason": o.finish_reason if o.finished else None}

        roles = [{**base, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                       "finish_reason": None}]} for k in range(req.n)]
        return StreamingResponse(stream_events(req, sub_ids, q, base, n_prompt, choice, roles),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


async def _forward(src: asyncio.Queue, dst: asyncio.Queue):
    while True:
        o = await src.get()
        await dst.put(o)
        if o is None or isinstance(o, Exception):
            return
