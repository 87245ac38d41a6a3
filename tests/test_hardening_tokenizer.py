"""Hostile tokenizer files, chat templates and messages: each a clear CheckpointError, ConfigError or
InputTypeError naming what is wrong, never a library's exception, a hang or gigabytes of memory; and
the embedded model's prompts byte-identical to what they were before the sandbox was bounded."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from unittest.mock import MagicMock

import pytest

from deepinfer.engine import Tokenizer, default_model_dir
from deepinfer.engine.chat_template import ChatTemplate, RenderLimits
from deepinfer.errors import CheckpointError, ConfigError, InputTypeError

HI = [{"role": "user", "content": "hi"}]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture
def model_dir(tmp_path):
    """The embedded model's tokenizer files (all a Tokenizer reads) in a directory of our own."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, tmp_path / name)
    return tmp_path


def _config(d):
    return json.loads((d / "tokenizer_config.json").read_text())


def _set(**changes):
    """A mutation of tokenizer_config.json setting these keys."""
    def mutate(d):
        (d / "tokenizer_config.json").write_text(json.dumps({**_config(d), **changes}))
    return mutate


def _write(name, data):
    def mutate(d):
        path = d / name
        path.unlink()
        if data is None:
            path.mkdir()
        elif data == "dangling link":
            path.symlink_to(d / "nowhere")
        else:
            path.write_bytes(data)
    return mutate


LOAD_ERRORS = [
    ("tokenizer.json corrupt", _write("tokenizer.json", b'{"version": '), "tokenizer.json: not a valid tokenizer.json"),
    ("tokenizer.json empty", _write("tokenizer.json", b""), "tokenizer.json: not a valid tokenizer.json"),
    ("tokenizer.json a list", _write("tokenizer.json", b"[]"), "invalid type: sequence"),
    ("tokenizer.json a directory", _write("tokenizer.json", None), "tokenizer.json is a directory, not a file"),
    ("tokenizer.json unreadable", _write("tokenizer.json", "dangling link"), "tokenizer.json: cannot read it"),
    ("tokenizer.json not UTF-8", _write("tokenizer.json", b'{"a": "\xff"}'), "tokenizer.json: not UTF-8 text"),
    ("tokenizer.json missing", lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json in the model directory"),
    ("config corrupt", _write("tokenizer_config.json", b'{"bos_token": '), "not valid JSON (Expecting value: line 1"),
    ("config not UTF-8", _write("tokenizer_config.json", b'{"bos_token": "\xc3("}'), "not UTF-8 text"),
    ("config a list", _write("tokenizer_config.json", b"[1, 2]"), "must hold a JSON object, not a list"),
    ("config null", _write("tokenizer_config.json", b"null"), "must hold a JSON object, not null"),
    ("config a directory", _write("tokenizer_config.json", None), "tokenizer_config.json: is a directory"),
    ("config unreadable", _write("tokenizer_config.json", "dangling link"), "tokenizer_config.json: cannot read tokenizer_config.json: it links to"),
    ("bos an int", _set(bos_token=0), "bos_token must be a string or an object with a string 'content', not an integer"),
    ("eos a list", _set(eos_token=[EOS]), "eos_token must be a string or an object with a string 'content', not a list"),
    ("bos without content", _set(bos_token={"__type": "AddedToken"}), "bos_token must be a string or an object"),
    ("eos content an int", _set(eos_token={"content": 1}), "eos_token must be a string or an object"),
    ("bos not in vocab", _set(bos_token="<s>"), "bos_token '<s>' is not in the vocabulary of tokenizer.json"),
    ("eos not in vocab", _set(eos_token={"content": "</s>"}), "eos_token '</s>' is not in the vocabulary"),
    ("add_bos_token a string", _set(add_bos_token="yes"), "add_bos_token must be true or false, not a string"),
    ("add_bos_token an int", _set(add_bos_token=1), "add_bos_token must be true or false, not an integer"),
    ("add_bos_token without bos", _set(bos_token=None), "add_bos_token is true but there is no bos_token"),
    ("chat_template a number", _set(chat_template=3), "chat_template must be a string or a list of"),
    ("chat_template an object", _set(chat_template={"default": "x"}), "chat_template must be a string or a list"),
    ("chat_template list without default", _set(chat_template=[{"name": "tool_use", "template": "x"}]),
     "chat_template holds templates named ['tool_use'] but none named 'default'"),
    ("chat_template list malformed", _set(chat_template=[{"name": "default"}]), "chat_template must be a string or"),
]


@pytest.mark.parametrize("mutate,fragment", [c[1:] for c in LOAD_ERRORS], ids=[c[0] for c in LOAD_ERRORS])
def test_broken_tokenizer_files_are_checkpoint_errors(model_dir, mutate, fragment):
    mutate(model_dir)
    with pytest.raises(CheckpointError) as e:
        Tokenizer(model_dir)
    assert fragment in str(e.value)
    assert str(model_dir) in str(e.value)       # names the file


def test_accepted_config_forms(model_dir):
    _set(bos_token={"__type": "AddedToken", "content": BOS}, eos_token=None, add_bos_token=False,
         chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}])(model_dir)
    tok = Tokenizer(model_dir)
    assert (tok.bos_token, tok.bos_id, tok.eos_token, tok.eos_id, tok.add_bos) == (BOS, 0, None, None, False)
    assert tok.apply_chat_template(HI) == "D"
    (model_dir / "tokenizer_config.json").unlink()
    tok = Tokenizer(model_dir)      # no tokenizer_config.json: no special tokens, no template
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.chat_template) == (None, None, False, None)
    with pytest.raises(ConfigError, match="no chat_template"):
        tok.apply_chat_template(HI)


CONVERSATIONS = [
    (HI, True, f"{BOS}<｜User｜>hi<｜Assistant｜>"),
    (HI, False, f"{BOS}<｜User｜>hi"),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}], True,
     f"{BOS}You are terse.\n<｜User｜>What is 2+2?<｜Assistant｜>4{EOS}<｜User｜>And 3+3?<｜Assistant｜>"),
    ([{"role": "user", "content": "héllo ü 中文 {{ x }} {% raw %}"}], False, f"{BOS}<｜User｜>héllo ü 中文 {{{{ x }}}} {{% raw %}}"),
]


@pytest.mark.parametrize("messages,gen,expected", CONVERSATIONS)
def test_embedded_template_output_unchanged(messages, gen, expected):
    """Expected strings computed before the sandbox was bounded (and equal to transformers' apply_chat_template)."""
    assert Tokenizer(default_model_dir()).apply_chat_template(messages, add_generation_prompt=gen) == expected


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": {"type": "string"}}}}]
RICH_TEMPLATES = [
    # namespaces, loop variables, tojson with an indent, macros, set blocks, ~, %, str.format, filters
    "{% set ns = namespace(sys='', n=0) %}{% for m in messages %}{% if m.role == 'system' %}"
    "{% set ns.sys = ns.sys + m.content + '\n' %}{% endif %}{% endfor %}{{ bos_token }}{{ ns.sys }}"
    "{% if tools %}{{ tools|tojson(indent=2) }}\n{% endif %}"
    "{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }} {{ m.role|upper }}: "
    "{{ m.content|trim }}{{ eos_token if loop.last }}\n{% endfor %}",
    "{% macro show(m) %}[{{ m.role }}] {{ m.content|replace('\n', ' ')|truncate(20) }}{% endmacro %}"
    "{% set body %}{% for m in messages %}{{ show(m) }}{{ ', ' if not loop.last }}{% endfor %}{% endset %}"
    "{{ body|length }}:{{ body }}|{{ '%s-%03d' % ('x', messages|length) }}|{{ '{}:{:>6}'.format('y', 42) }}"
    "|{{ messages|map(attribute='role')|join(',') }}|{{ 'a' ~ 1 ~ none }}|{{ 'ab'.center(6, '*') }}"
    "|{{ range(3)|list }}|{{ [1, 2] * 2 }}|{{ 2 ** 10 }}|{{ messages[0].content|indent(2, true) }}|{{ 'q'|format }}",
    # recursive loops, loop.cycle/previtem/revindex, for-else, filter and call blocks, dict iteration
    "{% for item in [{'n': 'a', 'kids': [{'n': 'b', 'kids': []}]}, {'n': 'c', 'kids': []}] recursive %}"
    "{{ loop.depth }}{{ item.n }}{% if item.kids %}({{ loop(item.kids) }}){% endif %}{% endfor %}"
    "|{% for m in messages %}{{ loop.cycle('x', 'y') }}{{ loop.revindex }}{{ loop.previtem.role if loop.previtem }}"
    "{% endfor %}|{% for x in [] %}no{% else %}empty{% endfor %}|{% filter upper %}{{ messages[2].content }}"
    "{% endfilter %}|{% macro box() %}[{{ caller() }}]{% endmacro %}{% call box() %}in{% endcall %}"
    "|{% for k, v in {'b': 1, 'a': 2}|dictsort %}{{ k }}={{ v }};{% endfor %}|{{ (messages|first).role }}"
    "|{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|map('length')|sum }}",
]
RICH_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hello there,\nfriend  "},
                 {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("template", RICH_TEMPLATES)
def test_bounded_sandbox_renders_as_jinja2_does(template):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    variables = dict(messages=RICH_MESSAGES, add_generation_prompt=True, bos_token=BOS, eos_token=EOS, tools=TOOLS)
    expected = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(variables)
    assert ChatTemplate(template, "t").render(RenderLimits(), **variables) == expected


SMALL = RenderLimits(max_chars=10_000, max_steps=5_000, max_seconds=60)
TEMPLATE_ERRORS = [
    # (id, template, limits, error class, message fragment)
    ("syntax error", "{{ bos_token }}\n{% for m in messages %}{{ m.content }", None, CheckpointError,
     "chat_template line 2: unexpected '}'"),
    ("unknown filter", "{{ messages|nosuchfilter }}", None, CheckpointError, "No filter named 'nosuchfilter'"),
    ("undefined attribute", "{{ bos_token }}\n{{ messages[0].content.nope.deeper }}", None, ConfigError,
     "chat template line 2: 'str object' has no attribute 'nope'"),
    ("undefined name", "{{ tools.first }}", None, ConfigError, "'tools' is undefined"),
    ("recursive macro", "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", None, ConfigError, "recursion too deep"),
    ("sandbox attribute", "{{ ''.__class__ }}", None, ConfigError,
     "the sandbox refused an unsafe operation (access to attribute '__class__' of a str is unsafe)"),
    ("sandbox mutation", "{{ messages.append(1) }}", None, ConfigError, "attribute 'append' of a list is unsafe"),
    ("raise_exception", "{% if messages[0].role != 'system' %}{{ raise_exception('first must be system') }}{% endif %}",
     None, ConfigError, "the template refused these messages: first must be system"),
    ("runtime error", "{{ 1 / 0 }}", None, ConfigError, "ZeroDivisionError: division by zero"),
    ("str * huge", "{{ 'a' * 10**9 }}", None, ConfigError, "the result of '*' would be 1000000000 characters long"),
    ("str * 10**8", "{{ 'a' * 10**8 }}", None, ConfigError, "the result of '*' would be 100000000 characters long"),
    ("list * huge", "{{ [[0] * 1000] * 1000 }}", SMALL, ConfigError, "the result of '*' would be"),
    ("int ** huge", "{{ 7 ** (10**6) }}", None, ConfigError, "'**' would make an int of 3000000 bits"),
    ("int * doubling", "{% set ns = namespace(x=2) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     None, ConfigError, "'*' would make an int of"),
    ("+ doubling", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     None, ConfigError, "the result of '+' would be 2097152 characters long"),
    ("~ doubling", "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     None, ConfigError, "the result of '~' would be 2097152 characters long"),
    ("% width", "{{ '%1000000000d' % 1 }}", None, ConfigError, "the result of '%' would be"),
    ("% star width", "{{ '%*s' % (10**9, 'x') }}", None, ConfigError, "the result of '%' would be"),
    ("str.center", "{{ 'x'.center(10**9) }}", None, ConfigError, "the result of str.center would be 1000000000"),
    ("str.ljust", "{{ 'x'.ljust(10**9) }}", None, ConfigError, "the result of str.ljust"),
    ("str.rjust", "{{ 'x'.rjust(10**9) }}", None, ConfigError, "the result of str.rjust"),
    ("str.zfill", "{{ '1'.zfill(10**9) }}", None, ConfigError, "the result of str.zfill"),
    ("str.expandtabs", "{{ ('\t' * 1000).expandtabs(10**6) }}", None, ConfigError, "the result of str.expandtabs"),
    ("str.replace", "{{ ('x' * 1000).replace('', 'y' * 10**5) }}", None, ConfigError, "the result of str.replace"),
    ("str.join", "{{ ('y' * 10**6).join(range(1000)|map('string')) }}", None, ConfigError, "the result of str.join"),
    ("Markup.center", "{{ ('x'|safe).center(10**9) }}", None, ConfigError, "the result of str.center"),
    ("str.format", "{{ '{:>1000000000}'.format(1) }}", None, ConfigError, "the result of str.format would be"),
    ("str.format nested width", "{{ '{:{}}'.format('x', 10**9) }}", None, ConfigError, "the result of str.format"),
    ("str.format_map", "{{ '{a:>1000000000}'.format_map({'a': 1}) }}", None, ConfigError, "str.format_map"),
    ("format filter", "{{ '%1000000000s'|format('x') }}", None, ConfigError, "the format filter's result would be"),
    ("center filter", "{{ 'x'|center(10**9) }}", None, ConfigError, "the center filter's result"),
    ("indent filter", "{{ ('a\n' * 10000)|indent(10**5) }}", None, ConfigError, "the indent filter's result"),
    ("join filter", "{{ range(1000)|join('y' * 10**6) }}", None, ConfigError, "the join filter's result"),
    ("replace filter", "{{ ('x' * 1000)|replace('x', 'y' * 10**5) }}", None, ConfigError, "the replace filter's"),
    ("tojson indent", "{{ [[[1] * 50] * 50]|tojson(indent=10**4) }}", None, ConfigError, "the tojson filter's result"),
    ("batch filter", "{{ [1]|batch(10**9, 0)|list }}", None, ConfigError, "one batch of the batch filter"),
    ("shared lists printed", "{% set a = [1,1,1,1,1,1,1,1,1,1] %}{% set b = [a,a,a,a,a,a,a,a,a,a] %}"
     "{% set c = [b,b,b,b,b,b,b,b,b,b] %}{% set d = [c,c,c,c,c,c,c,c,c,c] %}{% set e = [d,d,d,d,d,d,d,d,d,d] %}"
     "{% set f = [e,e,e,e,e,e,e,e,e,e] %}{{ f }}", None, ConfigError, "an output would be"),
    ("shared lists to a filter", "{% set a = [1,1,1,1,1,1,1,1,1,1] %}{% set b = [a,a,a,a,a,a,a,a,a,a] %}"
     "{% set c = [b,b,b,b,b,b,b,b,b,b] %}{% set d = [c,c,c,c,c,c,c,c,c,c] %}{{ d|string }}", SMALL, ConfigError,
     "an argument of the string filter would be"),
    ("lipsum is gone", "{{ lipsum(10**6) }}", None, ConfigError, "'lipsum' is undefined"),
    ("range too long", "{% for i in range(10**5) %}{% for j in range(10**5) %}{% for k in range(10**5) %}"
     "{% endfor %}{% endfor %}{% endfor %}", None, ConfigError, "range() of 100000 items, over the limit of 10000"),
    ("nested loops", "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
     "{% endfor %}{% endfor %}{% endfor %}", SMALL, ConfigError, "more than 5000 steps"),
    ("loops over a string", "{% set s = 'x' * 9000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
     SMALL, ConfigError, "more than 5000 steps"),
    ("macro fan-out", "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
     SMALL, ConfigError, "more than 5000 steps"),
    ("deadline", "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}",
     RenderLimits(max_seconds=0), ConfigError, "still rendering after 0 s"),
    ("long prompt", "{% for i in range(100) %}{{ 'x' * 1000 }}{% endfor %}", SMALL, ConfigError,
     "the prompt passed 10000 characters"),
    ("long set block", "{% set x %}{% for i in range(100) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}", SMALL,
     ConfigError, "a block's output would be"),
    ("built in all", "{% for i in range(1000) %}{% set x = ('x' * 9000) ~ i %}{% endfor %}", SMALL, ConfigError,
     "the template built more than 320000 characters in all"),
]


@pytest.mark.parametrize("template,limits,error,fragment", [c[1:] for c in TEMPLATE_ERRORS],
                         ids=[c[0] for c in TEMPLATE_ERRORS])
def test_hostile_chat_templates_are_clear_errors(model_dir, template, limits, error, fragment):
    _set(chat_template=template)(model_dir)
    tok = Tokenizer(model_dir)      # a template is compiled at first use: the tokenizer still loads
    with pytest.raises(error) as e:
        tok.apply_chat_template(HI, limits=limits)
    assert fragment in str(e.value)


MESSAGE_ERRORS = [
    ("a str", "hello", InputTypeError, "messages must be a list of {'role': ..., 'content': ...} dicts, not str; wrap"),
    ("a dict", HI[0], InputTypeError, "messages must be a list of"),
    ("empty", [], ConfigError, "messages is empty"),
    ("a str message", ["hi"], InputTypeError, "messages[0] must be a dict with 'role' and 'content', not str"),
    ("no content", [HI[0], {"role": "user"}], ConfigError, "messages[1] has no 'content'"),
    ("no role", [{"content": "hi"}], ConfigError, "messages[0] has no 'role'"),
    ("content None", [{"role": "assistant", "content": None}], InputTypeError,
     "messages[0]['content'] must be a string, not NoneType"),
    ("role an int", [{"role": 1, "content": "hi"}], InputTypeError, "messages[0]['role'] must be a string, not int"),
]


@pytest.mark.parametrize("messages,error,fragment", [c[1:] for c in MESSAGE_ERRORS], ids=[c[0] for c in MESSAGE_ERRORS])
def test_bad_messages(messages, error, fragment):
    with pytest.raises(error) as e:
        Tokenizer(default_model_dir()).apply_chat_template(messages)
    assert fragment in str(e.value)


def test_add_generation_prompt_must_be_a_bool():
    with pytest.raises(InputTypeError, match="add_generation_prompt must be a bool, not str"):
        Tokenizer(default_model_dir()).apply_chat_template(HI, add_generation_prompt="no")


MEMORY_PROBE = r"""
import json, resource, sys
from pathlib import Path
from deepinfer.engine.chat_template import ChatTemplate, RenderLimits
out = []
for template in json.loads(sys.argv[1]):
    try:
        ChatTemplate(template, "t").render(RenderLimits(), messages=[])
        out.append("rendered")
    except Exception as e:
        out.append(type(e).__name__)
# VmHWM is this process image's own peak; ru_maxrss keeps the peak of the parent forked before exec
# (a pytest holding torch is over 1 GB)
try:
    peak_kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"errors": out, "maxrss_mb": peak_kb / 1024}))
"""


def test_memory_attacks_end_without_allocating_gigabytes():
    """With the default limits: each attack is refused, and the process never held half a gigabyte."""
    attacks = ["{{ 'a' * 10**9 }}", "{{ 'a' * 10**8 }}", "{{ ('a' * 10**6) * 1000 }}",
               "{% set ns = namespace(s='a' * 10**6) %}{% for i in range(1000) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
               "{% macro m() %}{% for i in range(10000) %}{{ 'x' * 10**6 }}{% endfor %}{% endmacro %}{{ m() }}",
               "{% for i in range(10000) %}{{ 'x' * 10**6 }}{% endfor %}",
               "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
               "{% set ns.l = ns.l + [namespace(a=('x' * 10**6) ~ i)] %}{% endfor %}",
               "{{ [[[0] * 1000] * 1000] * 1000 }}", "{{ 'x'.center(10**9) }}"]
    run = subprocess.run([sys.executable, "-c", MEMORY_PROBE, json.dumps(attacks)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["errors"] == ["ConfigError"] * len(attacks)
    assert report["maxrss_mb"] < 512, report


def test_server_turns_template_errors_into_400s(model_dir):
    """The chat endpoint answers 400 with the message (a stub engine: rendering fails before it is used)."""
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from deepinfer.serve.app import create_app

    for template, status, fragment in [
            ("{{ 'a' * 10**9 }}", 400, "the result of '*' would be"),
            ("{{ ''.__class__ }}", 400, "the sandbox refused an unsafe operation"),
            ("{{ raise_exception('no') }}", 400, "the template refused these messages: no"),
            # the model's template itself is broken: the server's fault, and no file path goes to the client
            ("{% for %}", 500, "chat template cannot be used")]:
        _set(chat_template=template)(model_dir)
        aengine = MagicMock()
        aengine.engine.tokenizer = Tokenizer(model_dir)
        aengine.engine.runner.max_seq_len = 256
        r = TestClient(create_app(aengine, "m")).post("/v1/chat/completions", json={"model": "m", "messages": HI})
        assert r.status_code == status, r.text
        assert fragment in r.json()["error"]["message"]
        assert str(model_dir) not in r.json()["error"]["message"]
