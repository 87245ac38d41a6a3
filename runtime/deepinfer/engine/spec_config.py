"""The engine's `speculative` option, parsed and checked: {"method": "mtp", "num_draft": K,
"confidence": "auto" | p, "mtp": true | false} (engine.speculative runs it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import validate as V
from ..errors import ConfigError

MAX_DRAFT = 8


@dataclass
class SpecConfig:
    method: str = "mtp"
    num_draft: int = 2
    confidence: object = "auto"     # "auto" (throughput scheduler) or a survival threshold in [0, 1)

    @classmethod
    def parse(cls, spec: Optional[dict]) -> Optional["SpecConfig"]:
        """None when speculation is off (no method); ConfigError for anything malformed."""
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ConfigError(f"speculative must be an object such as {{\"method\": \"mtp\", \"num_draft\": 2}}, "
                              f"not {spec!r}")
        known = {"method", "num_draft", "confidence", "mtp"}
        unknown = sorted(map(str, set(spec) - known))
        if unknown:
            raise ConfigError(f"unknown speculative option(s) {unknown}; valid: method (\"mtp\"), num_draft "
                              f"(1..{MAX_DRAFT}), confidence (\"auto\" or a threshold in [0, 1)), mtp (load the MTP "
                              f"head: false saves its memory and turns speculation off)")
        if "mtp" in spec:
            V.boolean("speculative.mtp", spec["mtp"])
        if "method" not in spec:
            if set(spec) - {"mtp"}:
                raise ConfigError("speculative: set \"method\": \"mtp\" to speculate (num_draft and confidence "
                                  "need it)")
            return None
        if spec["method"] != "mtp":
            raise ConfigError(f"speculative.method {spec['method']!r} is not supported: only \"mtp\" (DeepSeek's "
                              f"multi-token prediction module)")
        if spec.get("mtp", True) is False:
            raise ConfigError("speculative: method \"mtp\" needs the MTP head; drop \"mtp\": false")
        c = cls()
        c.num_draft = V.integer("speculative.num_draft", spec.get("num_draft", c.num_draft), 1, MAX_DRAFT)
        conf = spec.get("confidence", "auto")
        if conf != "auto":
            if isinstance(conf, str):
                raise ConfigError(f"speculative.confidence must be \"auto\" or a number in [0, 1), not {conf!r}")
            conf = V.number("speculative.confidence", conf, 0, 1)
            if conf >= 1:
                raise ConfigError(f"speculative.confidence must be below 1 (a survival probability threshold; 1 "
                                  f"would admit nothing), not {conf}")
        c.confidence = conf
        return c
