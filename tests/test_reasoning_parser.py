"""The streaming reasoning parser (serve/reasoning.py) on outputs in the shape DeepSeek's published
templates produce (tests/data/chat_templates): fed in random small chunks, split at every position,
it must give exactly what the one-shot split gives, and never show part of a tag."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from deepinfer.engine.chat_template import ChatTemplate, RenderLimits
from deepinfer.serve.reasoning import ReasoningParser, partial_marker_len, prompt_opens_reasoning, split_reasoning

DATA = Path(__file__).resolve().parent / "data" / "chat_templates"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# (output, starts_in_reasoning, reasoning, content)
CASES = [
    # R1 after its template's "<｜Assistant｜><think>\n": the output starts inside the reasoning
    ("Okay, 2+2. Basic arithmetic.\n</think>\n\nThe answer is **4**.", True,
     "Okay, 2+2. Basic arithmetic.\n", "\n\nThe answer is **4**."),
    # older R1 template (no <think> in the prompt): the model writes it
    ("<think>\nFirst, note 7 is prime.\n</think>\n\nYes, 7 is prime.", False,
     "\nFirst, note 7 is prime.\n", "\n\nYes, 7 is prime."),
    # the prompt has <think> and the model writes it again anyway
    ("<think>double open</think>answer", True, "double open", "answer"),
    # cut off by max_tokens inside the reasoning: all of it is reasoning
    ("still thinking about </thi", True, "still thinking about </thi", ""),
    # V3.1 / V3.2 chat mode: the prompt ends "</think>", the output is all answer
    ("Hello! How can I help?", False, None, "Hello! How can I help?"),
    # an answer that mentions the tags is not reasoning
    ("Use <think> tags like <think>this</think>.", False, None, "Use <think> tags like <think>this</think>."),
    ("<thinking> is not the tag", False, None, "<thinking> is not the tag"),
    ("</think>straight to the answer", True, None, "straight to the answer"),
    ("  \n<think>lead</think>x", False, "lead", "x"),
    ("", True, None, ""),
    ("", False, None, ""),
    # unicode on both sides of the tag
    ("推理：先算 3×3＝9。</think>答案是 9。", True, "推理：先算 3×3＝9。", "答案是 9。"),
]


def _chunks(text: str, rng: random.Random, most: int = 5) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        out.append(text[i:i + n])
        i += n
    return out


def _stream(pieces, starts_in_reasoning, start="<think>", end="</think>"):
    parser = ReasoningParser(start, end, starts_in_reasoning)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return deltas


@pytest.mark.parametrize("text,starts,reasoning,content", CASES)
def test_one_shot_split(text, starts, reasoning, content):
    assert split_reasoning(text, starts) == (reasoning, content)


@pytest.mark.parametrize("text,starts,reasoning,content", CASES)
@pytest.mark.parametrize("seed", range(8))
def test_random_chunks_match_one_shot(text, starts, reasoning, content, seed):
    deltas = _stream(_chunks(text, random.Random(seed)), starts)
    assert ("".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas)) == (reasoning, content)


@pytest.mark.parametrize("text,starts,reasoning,content", CASES)
def test_every_split_point_including_inside_the_tags(text, starts, reasoning, content):
    for cut in range(len(text) + 1):
        deltas = _stream([text[:cut], text[cut:]], starts)
        assert ("".join(r for r, _ in deltas) or None, "".join(c for _, c in deltas)) == (reasoning, content), cut


def test_no_delta_shows_part_of_a_tag():
    text = "abc</think>def"
    deltas = _stream(list(text), True)
    for r, c in deltas:
        assert "<" not in r and "<" not in c
    assert "".join(r for r, _ in deltas) == "abc" and "".join(c for _, c in deltas) == "def"


def test_reasoning_streams_before_the_end_tag_arrives():
    parser = ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("Let me ") == ("Let me ", "")
    assert parser.feed("think</") == ("think", "")         # "</" may start </think>: held back
    assert parser.in_reasoning
    assert parser.feed("think>Done") == ("", "Done")
    assert not parser.in_reasoning
    assert parser.finish() == ("", "")


def test_content_is_not_held_back_once_reasoning_is_over():
    parser = ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("<thi") == ("", "")                  # could still be <think>
    assert parser.feed("s is text <") == ("", "<this is text <")


def test_custom_tags():
    assert split_reasoning("<reason>r</reason>c", False, "<reason>", "</reason>") == ("r", "c")
    with pytest.raises(ValueError):
        ReasoningParser(start="", end="</think>")


def test_partial_marker_len():
    assert partial_marker_len("abc</th", ["</think>"]) == 4
    assert partial_marker_len("abc", ["</think>"]) == 0
    assert partial_marker_len("a</think>", ["</think>"]) == 0      # a whole marker is not partial
    assert partial_marker_len("x<", ["<a>", "<bb>"]) == 1


def _render(name: str, messages, **kwargs) -> str:
    return ChatTemplate((DATA / name).read_text(encoding="utf-8"), name).render(
        RenderLimits(), messages=messages, bos_token=BOS, eos_token=EOS, **kwargs)


def test_prompt_opens_reasoning_on_the_published_templates():
    chat = [{"role": "user", "content": "What is 2+2?"}]
    r1 = _render("deepseek-r1.jinja", chat, add_generation_prompt=True)
    assert r1.endswith("<｜Assistant｜><think>\n") and prompt_opens_reasoning(r1)
    v31_think = _render("deepseek-v3.1.jinja", chat, add_generation_prompt=True, thinking=True)
    v31_chat = _render("deepseek-v3.1.jinja", chat, add_generation_prompt=True)
    assert v31_think.endswith("<｜Assistant｜><think>") and prompt_opens_reasoning(v31_think)
    assert v31_chat.endswith("<｜Assistant｜></think>") and not prompt_opens_reasoning(v31_chat)
    assert not prompt_opens_reasoning("no tags at all")
    assert not prompt_opens_reasoning("<think>closed</think>")
    assert prompt_opens_reasoning("<think>a</think> ... <think>\n")


def test_v32_encoder_turns_split_into_the_published_reasoning():
    """The official V3.2 encoder's rendering: each thinking-mode assistant turn after its prompt's
    `<think>` is reasoning up to `</think>`, and that reasoning is the test input's reasoning_content."""
    text = (DATA / "deepseek-v3.2-encoding-test_output.txt").read_text(encoding="utf-8")
    messages = json.loads((DATA / "deepseek-v3.2-encoding-test_input.json").read_text(encoding="utf-8"))["messages"]
    prompt, _, output = text.rpartition("<｜Assistant｜><think>")
    assert prompt_opens_reasoning(prompt + "<｜Assistant｜><think>")
    output = output.split(EOS)[0]
    for seed in range(4):
        deltas = _stream(_chunks(output, random.Random(seed), most=9), True)
        reasoning = "".join(r for r, _ in deltas)
        assert reasoning == messages[9]["reasoning_content"]
        assert "".join(c for _, c in deltas).startswith("\n\n<｜DSML｜function_calls>")
    # the turn after the last tool results ends the thinking the encoder opened after them
    last = text.rsplit("</function_results>\n\n<think>", 1)[1].split(EOS)[0]
    assert split_reasoning(last, True) == (messages[12]["reasoning_content"], messages[12]["content"])
