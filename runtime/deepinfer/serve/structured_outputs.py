"""The request fields that constrain the output (OpenAI's response_format, vLLM's structured_outputs
and its legacy guided_* names) as the one SamplingParams.structured dict the engine takes.

A request names at most one constraint: two (say response_format json_schema and guided_regex) is a
400 naming both, not one silently winning."""
from __future__ import annotations

import json
from typing import Optional

from .api_errors import APIError


def constraint(req) -> Optional[tuple[str, dict]]:
    """(the request parameter that set it, SamplingParams.structured) or None for free text."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"type": "json_object"}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs a json_schema member "
                                "({'name': ..., 'schema': {...}})", param="response_format.json_schema")
        js = rf.json_schema
        found.append(("response_format", {"type": "json_schema", "schema": {} if js.schema_ is None else js.schema_,
                                          "strict": bool(js.strict)}))
    so = req.structured_outputs
    if so is not None:
        found += _members("structured_outputs.", so.json_, so.regex, so.grammar, so.choice)
        if so.json_object:
            found.append(("structured_outputs.json_object", {"type": "json_object"}))
    found += _members("guided_", req.guided_json, req.guided_regex, req.guided_grammar, req.guided_choice)
    if len(found) > 1:
        raise APIError(400, f"at most one structured-output constraint per request: {found[0][0]} and {found[1][0]} "
                            f"both constrain the output", param=found[1][0])
    return found[0] if found else None


def _members(prefix: str, schema, regex, grammar, choice) -> list:
    out = []
    if schema is not None:
        # vLLM's json always enforces the schema: strict
        out.append((prefix + "json", {"type": "json_schema", "schema": _schema(prefix + "json", schema),
                                      "strict": True}))
    if regex is not None:
        out.append((prefix + "regex", {"type": "regex", "pattern": regex}))
    if grammar is not None:
        out.append((prefix + "grammar", {"type": "grammar", "grammar": grammar}))
    if choice is not None:
        if not choice:
            raise APIError(400, f"{prefix}choice must hold at least one string", param=prefix + "choice")
        out.append((prefix + "choice", {"type": "choice", "choices": list(choice)}))
    return out


def _schema(param: str, schema) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{param} is a string but not JSON: {e}", param=param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object, not {type(schema).__name__}", param=param)
    return schema
