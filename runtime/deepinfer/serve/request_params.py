"""A request's sampling fields as SamplingParams, with the server's limits checked and every
refusal a 400 that names the request's own parameter (max_tokens, not the engine's max_new_tokens)."""
from __future__ import annotations

import re
import secrets
from typing import Optional

from ..engine import SamplingParams
from ..errors import InputError
from .api_errors import APIError
from .limits import ServerLimits
from .structured_outputs import constraint

# a message about one sampling field starts with its name ("top_k must be...", "a stop string holds...")
_FIELD_NAMES = sorted(SamplingParams.__dataclass_fields__, key=len, reverse=True)     # "stop_token_ids" before "stop"
_LEADING_FIELD = re.compile(r"^(?:an? )?(" + "|".join(_FIELD_NAMES) + r")\b")


def refusal(message: str, names: dict, param: Optional[str] = None) -> APIError:
    """The 400 for an engine refusal (SamplingParams.from_options, Engine.check_request): about the
    field its message starts with, under the request's name for it (`names`: SamplingParams field ->
    request parameter, in the message too); `param` when it names no field."""
    m = _LEADING_FIELD.match(message)
    if m is None:
        return APIError(400, message, param=param)
    name = names.get(m.group(1), m.group(1))
    return APIError(400, message[:m.start(1)] + name + message[m.end(1):], param=name)


def make_params(options: dict, names: dict) -> SamplingParams:
    """SamplingParams.from_options(**options); a ConfigError becomes a 400 naming the request's parameter."""
    try:
        return SamplingParams.from_options(**options)
    except InputError as e:
        raise refusal(str(e), names) from None


def check_common(n: int, stops: list, max_new: int, limits: ServerLimits, max_tokens_cap: int,
                 max_tokens_param: str = "max_tokens", stop_param: str = "stop") -> None:
    """The server's own limits on a request, before the engine's."""
    if n > limits.max_n:
        raise APIError(400, f"n must be <= {limits.max_n}", param="n")
    if len(stops) > limits.max_stop:
        raise APIError(400, f"{stop_param}: at most {limits.max_stop} stop strings", param=stop_param)
    if max_new > max_tokens_cap:
        raise APIError(400, f"{max_tokens_param} {max_new} > the server's limit {max_tokens_cap}",
                       param=max_tokens_param)


def openai_params(req, max_new: int, limits: ServerLimits, max_tokens_cap: int, logprobs: Optional[int] = None,
                  max_tokens_param: str = "max_tokens",
                  logprobs_param: str = "logprobs") -> tuple[SamplingParams, dict]:
    """(SamplingParams, their names: see refusal) for a /v1/completions or /v1/chat/completions body."""
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0])
    stops = req.stops()
    check_common(req.n, stops, max_new, limits, max_tokens_cap, max_tokens_param)
    if req.min_tokens > max_new:
        raise APIError(400, f"min_tokens {req.min_tokens} > {max_tokens_param} {max_new}", param="min_tokens")
    structured = constraint(req)
    names = {"max_new_tokens": max_tokens_param, "logprobs": logprobs_param,
             "structured": structured[0] if structured else "response_format"}
    params = make_params(dict(
        max_new_tokens=max_new, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p, top_k=max(req.top_k or 0, 0), seed=random_seed() if req.seed is None else req.seed,
        stop=tuple(stops), logprobs=logprobs, ignore_eos=req.ignore_eos, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias, min_tokens=req.min_tokens, structured=structured[1] if structured else None),
        names)
    return params, names


def random_seed() -> int:
    """An unseeded request's seed: fresh each time, so two of them sample differently."""
    return secrets.randbits(63)
