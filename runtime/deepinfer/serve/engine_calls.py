"""What every route (OpenAI's, Anthropic's, /tokenize) does with the engine: check the model name,
render chat messages, check a prompt against the limits, submit requests, collect their outputs,
and abort them when the client goes away. Failures are APIErrors; each route answers them in its
own error shape."""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from fastapi import Request

from ..engine import QueueFullError, SamplingParams
from ..errors import CheckpointError, InputError
from .api_errors import APIError
from .async_engine import AsyncEngine, EngineStopped
from .limits import ServerLimits
from .request_params import refusal

log = logging.getLogger("deepinfer")


class EngineCalls:
    def __init__(self, aengine: AsyncEngine, model_name: str, limits: ServerLimits):
        self.aengine, self.model_name, self.limits = aengine, model_name, limits
        self.engine = aengine.engine
        self.tokenizer = self.engine.tokenizer
        self.max_seq = self.engine.runner.max_seq_len
        self.max_prompt = limits.max_prompt_tokens or self.max_seq - 1
        self.max_tokens_cap = limits.max_tokens or self.max_seq

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def render_chat(self, messages: list, add_generation_prompt: bool = True, param: str = "messages",
                    tools: Optional[list] = None, template_kwargs: Optional[dict] = None) -> str:
        """The prompt text of chat messages ({"role", "content": str, ...} dicts) by the model's template,
        with the request's tools and chat_template_kwargs as template variables."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tools=tools, template_kwargs=template_kwargs)
        except CheckpointError as e:
            # the model's own template is broken: the server's fault, and its path is not the client's business
            log.error("chat template: %s", e)
            raise APIError(500, "this model's chat template cannot be used (see the server's log)",
                           "server_error") from None
        except InputError as e:     # these messages fail the template (its limits, raise_exception, ...)
            raise APIError(400, str(e), param=param) from None

    def encode(self, text_or_ids, add_bos: Optional[bool] = None, param: str = "prompt") -> list:
        try:
            return self.engine.encode_prompt(text_or_ids, add_bos=add_bos)
        except InputError as e:
            raise APIError(400, str(e), param=param) from None

    def check_prompt(self, ids: list, params: SamplingParams, param: str, names: Optional[dict] = None) -> None:
        """Whether the engine can run this prompt with these params: a 400 about the prompt (`param`) or,
        when the engine's message starts with a sampling field, about that (`names`: see refusal)."""
        if len(ids) > self.max_prompt:
            raise APIError(400, f"prompt of {len(ids)} tokens > the server's limit {self.max_prompt}", param=param)
        try:
            self.engine.check_request(ids, params)
        except InputError as e:
            msg = str(e)
            if "max_new_tokens" in msg:     # the prompt and max_tokens do not fit together
                raise APIError(400, f"{msg}; lower max_tokens or shorten the prompt", param=param) from None
            raise refusal(msg, names or {}, param if msg.startswith("token id") else None) from None

    def default_max_tokens(self, n_prompt: int) -> int:
        """max_tokens for a chat request that gives none: what is left of the context, within the cap."""
        return max(min(self.max_seq - n_prompt, self.max_tokens_cap), 0)

    async def submit_all(self, rid: str, prompts: list, params: SamplingParams, n: int,
                         names: Optional[dict] = None, priority: int = 0) -> tuple[list, asyncio.Queue]:
        """Submit one engine request per prompt, all feeding one queue; undo on failure. `names`: see
        refusal; a refusal naming no field is taken to be about the output constraint, if any (what
        the engine checks only when it adds a request)."""
        if priority and self.engine.config.scheduling_policy != "priority":
            raise APIError(400, f"priority {priority} needs a server started with scheduling_policy 'priority'; this "
                                f"one serves requests in arrival order", param="priority")
        q: Optional[asyncio.Queue] = None
        ids = []
        try:
            for i, p in enumerate(prompts):
                sub_id = f"{rid}-{i}"
                got = await self.aengine.submit(sub_id, p, params, n, priority)
                ids.append(sub_id)
                if q is None:
                    q = got
                else:   # fan in: forward this prompt's outputs into the first queue
                    asyncio.ensure_future(_forward(got, q))
        except QueueFullError as e:
            self.abort(ids)
            raise APIError(503, str(e), "server_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineStopped as e:
            self.abort(ids)
            raise APIError(503, str(e), "server_error", code="shutting_down") from None
        except InputError as e:
            self.abort(ids)
            fallback = (names or {}).get("structured") if params.structured is not None else None
            raise refusal(str(e), names or {}, fallback) from None
        return ids, q

    def abort(self, sub_ids: list) -> None:
        for s in sub_ids:
            self.aengine.abort(s)

    async def collect(self, request: Request, sub_ids: list, q: asyncio.Queue) -> list:
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
                self.abort(sub_ids)


async def _forward(src: asyncio.Queue, dst: asyncio.Queue):
    while True:
        o = await src.get()
        await dst.put(o)
        if o is None or isinstance(o, Exception):
            return
