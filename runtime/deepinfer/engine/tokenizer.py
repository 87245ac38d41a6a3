"""The tokenizer (tokenizer.json through `tokenizers`, the chat template from tokenizer_config.json,
rendered in jinja2's sandbox, or DeepSeek's own encoder for the releases that ship no template) and the
incremental detokenizer that turns sampled ids into text deltas."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from .. import validate as V
from ..errors import CheckpointError, ConfigError, InputTypeError
from . import dsml_encoding
from .chat_template import ChatTemplate, RenderLimits

# Releases that ship a Python encoder instead of a chat template (by config.json's model_type or
# architectures), and the dsml_encoding version that renders their chats
_ENCODER_OF = {"deepseek_v32": "v32", "DeepseekV32ForCausalLM": "v32",
               "deepseek_v4": "v4", "DeepseekV4ForCausalLM": "v4"}


class Tokenizer:
    """tokenizer.json through `tokenizers`, the chat template from tokenizer_config.json.

    A missing, unreadable or malformed file, or a value of tokenizer_config.json of the wrong kind,
    is a CheckpointError naming the file and the key."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        self._tok = _load_tokenizer(model_dir / "tokenizer.json")
        self.config_path = model_dir / "tokenizer_config.json"
        self.config = _load_config(self.config_path)
        self.bos_token, self.bos_id = self._special_token("bos_token")
        self.eos_token, self.eos_id = self._special_token("eos_token")
        self.add_bos = self._add_bos()
        self.chat_template = _chat_template_source(self.config, self.config_path)
        # a template wins: V3.2-Exp is a deepseek_v32 model with V3.1's template
        self.chat_encoder = None if self.chat_template else _builtin_encoder(model_dir)
        self._compiled_template = None

    def _special_token(self, key: str) -> tuple[Optional[str], Optional[int]]:
        value = self.config.get(key)
        if value is None:
            return None, None
        token = value.get("content") if isinstance(value, dict) else value     # an AddedToken's content
        if not isinstance(token, str):
            raise CheckpointError(f"{self.config_path}: {key} must be a string or an object with a string "
                                  f"'content', not {_json_kind(value)}; fix {key} there")
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{self.config_path}: {key} {token!r} is not in the vocabulary of tokenizer.json; "
                                  f"set {key} to one of its tokens, or to null")
        return token, token_id

    def _add_bos(self) -> bool:
        add = self.config.get("add_bos_token", False)
        if not isinstance(add, bool):
            raise CheckpointError(f"{self.config_path}: add_bos_token must be true or false, not {_json_kind(add)}")
        if add and self.bos_id is None:
            raise CheckpointError(f"{self.config_path}: add_bos_token is true but there is no bos_token; "
                                  "set bos_token or make add_bos_token false")
        return add

    @property
    def chat_format(self) -> Optional[str]:
        """"dsml" where DeepSeek's encoder renders the chats (its tool calls are DSML); None where the
        chat template decides, and its text says (serve.tool_calls.detect_tool_format)."""
        return "dsml" if self.chat_encoder else None

    @property
    def chat_markers(self) -> Optional[str]:
        """Text holding the markers this model's chat prompts use (<think>, the tool-call tokens), for
        code that learns the format from them: the chat template, or the encoder's marker list."""
        return self.chat_template or (dsml_encoding.MARKERS if self.chat_encoder else None)

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

    def decode_stream(self, skip_special_tokens: bool = True):
        """A fresh incremental decoder (tokenizers' DecodeStream): each token's text costs O(1).
        skip_special_tokens=False keeps markers a parser needs (tool-call tokens that a tokenizer
        marks special)."""
        from tokenizers.decoders import DecodeStream

        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, stream, token: int) -> Optional[str]:
        """The text `token` adds to `stream`'s output (None while a multi-byte character is incomplete)."""
        return stream.step(self._tok, int(token))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, limits=None,
                            tools: Optional[list] = None, template_kwargs: Optional[dict] = None) -> str:
        """The prompt for `messages` (a list of {"role": str, "content": str, ...} dicts). `limits`
        (a chat_template.RenderLimits, default RenderLimits()) bounds what rendering may cost. `tools`
        (OpenAI's tool list) and `template_kwargs` (a request's chat_template_kwargs, e.g. V3.1's
        {"thinking": true}) are the template's variables as in transformers' apply_chat_template; they
        cannot replace the ones set here. A model with DeepSeek's encoder instead of a template
        (chat_encoder) reads `thinking` (or `enable_thinking`) and V4's `reasoning_effort` from them.
        InputTypeError / ConfigError for bad messages or a template that fails on them;
        CheckpointError for a template that does not compile."""
        if not self.chat_template and not self.chat_encoder:
            raise ConfigError("this model's tokenizer_config.json has no chat_template")
        _check_messages(messages)
        if not isinstance(add_generation_prompt, bool):
            raise InputTypeError(f"add_generation_prompt must be a bool, not {type(add_generation_prompt).__name__}")
        if self._compiled_template is None and not self.chat_encoder:
            # compiled at first use: a model with a broken template still generates
            self._compiled_template = ChatTemplate(self.chat_template, str(self.config_path))
        own = {"messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & (set(own) | {"tools"}))
        if clash:
            raise ConfigError(f"chat_template_kwargs may not set {', '.join(clash)} (the request's own fields do)")
        limits = limits or RenderLimits()
        if self.chat_encoder:
            return self._encode_chat(messages, add_generation_prompt, limits, tools, extra)
        if tools is not None:
            extra["tools"] = tools
        return self._compiled_template.render(limits, **own, **extra)

    def _encode_chat(self, messages, add_generation_prompt, limits, tools, kwargs) -> str:
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking", False))
        if not isinstance(thinking, bool):
            raise InputTypeError(f"chat_template_kwargs' thinking must be true or false, not {type(thinking).__name__}")
        effort = kwargs.get("reasoning_effort")
        text = dsml_encoding.encode_messages(messages, tools=tools, thinking=thinking,
                                             add_generation_prompt=add_generation_prompt,
                                             bos_token=self.bos_token or "", version=self.chat_encoder,
                                             reasoning_effort=effort if isinstance(effort, str) else None)
        if len(text) > limits.max_chars:
            raise ConfigError(f"the chat prompt is {len(text)} characters long, over the limit of {limits.max_chars}")
        return text


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)):
        hint = "; wrap a prompt as [{'role': 'user', 'content': prompt}]" if isinstance(messages, str) else ""
        raise InputTypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                             f"not {type(messages).__name__}{hint}")
    if not messages:
        raise ConfigError("messages is empty: give at least one {'role': ..., 'content': ...} message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputTypeError(f"messages[{i}] must be a dict with 'role' and 'content', not {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ConfigError(f"messages[{i}] has no '{key}': every message needs a string 'role' and 'content'")
            if not isinstance(m[key], str):
                raise InputTypeError(f"messages[{i}]['{key}'] must be a string, not {type(m[key]).__name__}")


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()   # a dangling link is a broken file, not an absent one


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a file; put the model's {path.name} there")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                              f"re-download the model's {path.name}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror}); check that it exists and is readable") from None


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer as HFTokenizer

    if not _exists(path):
        raise CheckpointError(f"{path}: no tokenizer.json in the model directory; copy the model's tokenizer.json there")
    text = _read_text(path)
    try:
        return HFTokenizer.from_str(text)
    except Exception as e:      # tokenizers raises a bare Exception for any malformed file
        raise CheckpointError(f"{path}: not a valid tokenizer.json ({e}); re-download it or save it again "
                              "with tokenizers or transformers") from None


def _load_config(path: Path) -> dict:
    if not _exists(path):
        return {}
    config = V.read_json(path, path.name, err=CheckpointError, fix="fix it or re-download it")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not {_json_kind(config)}; fix it or re-download it")
    return config


def _builtin_encoder(model_dir: Path) -> Optional[str]:
    """The dsml_encoding version for a model whose release ships DeepSeek's encoder instead of a
    chat template, from its config.json; None for any other model, or with no config.json."""
    path = model_dir / "config.json"
    if not _exists(path):
        return None
    config = V.read_json(path, "config.json", err=CheckpointError, fix="fix config.json or download it again")
    if not isinstance(config, dict):
        return None         # the model config's own reader says what is wrong with it
    model_type = config.get("model_type")
    names = [model_type] if model_type is not None else config.get("architectures")   # as model.config reads them
    if not isinstance(names, list):
        return None
    return next((_ENCODER_OF[n] for n in names if isinstance(n, str) and n in _ENCODER_OF), None)


def _chat_template_source(config: dict, path: Path) -> Optional[str]:
    """The chat_template string; from HF's list of named templates, the one named "default"."""
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                          and isinstance(t.get("template"), str) for t in template):
        named = {t["name"]: t["template"] for t in template}
        if "default" in named:
            return named["default"]
        raise CheckpointError(f"{path}: chat_template holds templates named {sorted(named)} but none named "
                              "'default'; name the one to use 'default'")
    raise CheckpointError(f"{path}: chat_template must be a string or a list of {{\"name\": ..., \"template\": ...}} "
                          f"objects, not {_json_kind(template)}; fix chat_template there")


def _json_kind(value) -> str:
    """The kind of a bad value and the start of it, for a message."""
    return f"{V.json_kind(value)} ({json.dumps(value)[:60]})"


class Detokenizer:
    """Turns a growing list of ids into text deltas, holding back an incomplete UTF-8 character and
    any tail that could still become a stop string.

    Each token costs O(1) tokenizer work (an incremental DecodeStream, not a decode of every id so
    far) and O(longest stop string) string work: only the new tail is searched."""

    def __init__(self, tok: Tokenizer, stops: Sequence[str], skip_special_tokens: bool = True):
        self.tok, self.stops = tok, [s for s in stops if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self._stream = tok.decode_stream(skip_special_tokens)
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
