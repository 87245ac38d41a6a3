"""The tokenizer (tokenizer.json through `tokenizers`, the chat template from tokenizer_config.json,
rendered in jinja2's sandbox) and the incremental detokenizer that turns sampled ids into text deltas."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from ..errors import CheckpointError, ConfigError


class Tokenizer:
    """tokenizer.json through `tokenizers`, the chat template from tokenizer_config.json."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json in the model directory")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_id is not None
        self.chat_template = self.config.get("chat_template")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_stream(self):
        """A fresh incremental decoder (tokenizers' DecodeStream): each token's text costs O(1)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=True)

    def step(self, stream, token: int) -> Optional[str]:
        """The text `token` adds to `stream`'s output (None while a multi-byte character is incomplete)."""
        return stream.step(self._tok, int(token))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ConfigError("this model's tokenizer_config.json has no chat_template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ConfigError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_str(t) -> Optional[str]:
    if isinstance(t, dict):
        return t.get("content")
    return t


class Detokenizer:
    """Turns a growing list of ids into text deltas, holding back an incomplete UTF-8 character and
    any tail that could still become a stop string.

    Each token costs O(1) tokenizer work (an incremental DecodeStream, not a decode of every id so
    far) and O(longest stop string) string work: only the new tail is searched."""

    def __init__(self, tok: Tokenizer, stops: Sequence[str]):
        self.tok, self.stops = tok, [s for s in stops if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self._stream = tok.decode_stream()
        self.text = ""         # every character decoded so far (cut at a stop string)
        self.emitted = 0       # characters already handed out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        piece = self.tok.step(self._stream, token)
        if not piece:
            return ""   # an incomplete multi-byte character: wait for the next token
        old = len(self.text)
        self.text += piece
        if self.stops:
            lo = max(0, old - self.max_stop + 1)    # a stop string ending in the new piece starts here or later
            hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                self.text = self.text[:min(hits)]
                return self._take(len(self.text))
        hold = 0
        for s in self.stops:  # keep back a suffix that is a prefix of a stop string
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._take(len(self.text) - hold)

    def flush(self) -> str:
        """The held-back tail at the end of a request (nothing after a stop string)."""
        return "" if self.stopped else self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted:upto]
        self.emitted = upto
        return out
