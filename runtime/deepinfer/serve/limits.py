"""What one request may ask of the server (`deepinfer serve --max-body-bytes` and friends)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20          # request bodies larger than this are a 413
    max_prompt_tokens: Optional[int] = None   # None: max_seq_len - 1
    max_tokens: Optional[int] = None       # largest max_tokens a request may ask (None: max_seq_len)
    max_n: int = 8
    max_stop: int = 8
    max_prompts: int = 32                  # prompts in one /v1/completions body
