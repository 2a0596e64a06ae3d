"""The reasoning and tool-call parsers on text alone: whole-text results, and streaming
split at every character boundary (and one character at a time, and at random cuts)
giving exactly the whole-text result."""

from __future__ import annotations

import json
import random
import re

import pytest

from flintc.serve.reasoning import ReasoningParser, initial_state_for_prompt, split_reasoning
from flintc.serve.tool_calls import ToolCallParser, parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]


def splits(text: str):
    """Every way to cut text in two, one char at a time, and 20 random multi-cuts."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream_reasoning(chunks, initial="start"):
    p = ReasoningParser(initial)
    r, c = [], []
    for ch in chunks:
        a, b = p.feed(ch)
        r.append(a)
        c.append(b)
    a, b = p.finish()
    return ("".join(r + [a]) if p.saw_reasoning else None), "".join(c + [b])


REASONING_CASES = [
    ("<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("\n <think>a</think>\nb", "a", "\nb"),
    ("<think>cut off mid-thou", "cut off mid-thou", ""),
    ("<think>ends at a partial tag </thi", "ends at a partial tag </thi", ""),
    ("no tags at all, <thin", None, "no tags at all, <thin"),
    ("  leading spaces kept", None, "  leading spaces kept"),
    ("", None, ""),
    ("<thin", None, "<thin"),  # a cut-off opening tag is text
    ("<think></think>", "", ""),
    ("text first <think>x</think> y", None, "text first <think>x</think> y"),
    ("<think>a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    ("<think>数据 🚀</think>模型", "数据 🚀", "模型"),
]


@pytest.mark.parametrize("text,reasoning,content", REASONING_CASES)
def test_reasoning_whole_and_every_split(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    for chunks in splits(text):
        assert stream_reasoning(chunks) == (reasoning, content), chunks


def test_reasoning_initial_states():
    assert split_reasoning("still thinking</think>answer", "reasoning") == ("still thinking", "answer")
    assert split_reasoning("cut", "reasoning") == ("cut", "")
    assert split_reasoning("<think>x</think>y", "content") == (None, "<think>x</think>y")
    assert initial_state_for_prompt("<|assistant|>\n") == "start"
    assert initial_state_for_prompt("<|assistant|>\n<think>") == "reasoning"
    assert initial_state_for_prompt("<|assistant|>\n<think></think>") == "content"
    with pytest.raises(ValueError, match="initial"):
        ReasoningParser("thinking")


def test_reasoning_loses_no_text_on_random_input():
    """Only whitespace before <think> and the two tags themselves may disappear."""
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<th", "</", "a", " ", "\n", "é", "x>"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        p = ReasoningParser()
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        r, c = r1 + r2, c1 + c2
        if p.saw_reasoning:
            closed = "</think>" if p.state == "content" else ""
            assert "<think>" + r + closed + c == text.lstrip(), text
        else:
            assert (r, c) == ("", text)
        for chunks in [list(text), [text[: len(text) // 2], text[len(text) // 2:]]]:
            assert stream_reasoning(chunks) == split_reasoning(text)


def stream_tools(chunks, tools=TOOLS):
    p = ToolCallParser(tools)
    content, calls = [], []
    for ch in chunks:
        c, new = p.feed(ch)
        content.append(c)
        calls += new
    c, new = p.finish()
    return "".join(content + [c]), [(t.name, json.loads(t.arguments)) for t in calls + new]


def whole_tools(text, tools=TOOLS):
    content, calls = parse_tool_calls(text, tools)
    return content, [(t.name, json.loads(t.arguments)) for t in calls]


TOOL_CASES = [
    # one call, typed and string values
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
     "", [("get_weather", {"city": "Paris", "days": 3})]),
    # content before, two calls, GLM-4.5 newlines, a string-typed param that looks like a number
    ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
     "<arg_key>zip</arg_key><arg_value>8001</arg_value>\n</tool_call>\n"
     "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>\n",
     "Let me check.\n", [("get_weather", {"city": "Zürich", "zip": "8001"}), ("get_time", {"tz": "UTC"})]),
    # unknown tool: JSON values keep their type, other values stay strings
    ("<tool_call>other<arg_key>a</arg_key><arg_value>[1, 2]</arg_value><arg_key>b</arg_key>"
     "<arg_value>{\"x\": null}</arg_value><arg_key>c</arg_key><arg_value>true</arg_value>"
     "<arg_key>d</arg_key><arg_value>not json</arg_value><arg_key>e</arg_key><arg_value>\"q\"</arg_value>"
     "</tool_call>",
     "", [("other", {"a": [1, 2], "b": {"x": None}, "c": True, "d": "not json", "e": "q"})]),
    # no arguments
    ("<tool_call>get_time</tool_call>", "", [("get_time", {})]),
    # plain text
    ("no calls here < tool_call >", "no calls here < tool_call >", []),
    # text after a call keeps its trailing whitespace, however it is cut (regression: a
    # chunk of only whitespace after such text was held as if right after the call, and
    # dropped at the end); whitespace right after the last call is still dropped
    ("<tool_call>get_time</tool_call>Done. \n", "Done. \n", [("get_time", {})]),
    ("<tool_call>get_time</tool_call>\nok \n<tool_call>get_time</tool_call> \n", "\nok \n",
     [("get_time", {}), ("get_time", {})]),
]

MALFORMED = [
    "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",  # key without value
    "<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
    "<tool_call>get_weather<arg_key>a</arg_key><arg_value>1</arg_value>junk</tool_call>",  # stray text
    "<tool_call>get_weather<arg_key>a</arg_key><arg_value>1</arg_value>"
    "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",  # repeated key
    "<tool_call>bad<name<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # < in name
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",  # never closed
    "<tool_call>a<tool_call>b</tool_call>",  # nested start
]


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_calls_whole_and_every_split(text, content, calls):
    assert whole_tools(text) == (content, calls)
    for chunks in splits(text):
        assert stream_tools(chunks) == (content, calls), chunks


@pytest.mark.parametrize("bad", MALFORMED)
def test_malformed_tool_call_becomes_content(bad):
    good = "<tool_call>get_time<arg_key>tz</arg_key><arg_value>CET</arg_value></tool_call>"
    for text, content, calls in [(bad, bad, []), ("hi " + bad, "hi " + bad, []),
                                 (good + bad, bad, [("get_time", {"tz": "CET"})])]:
        assert whole_tools(text) == (content, calls)
        for chunks in splits(text):
            assert stream_tools(chunks) == (content, calls), chunks


def test_tool_call_argument_nested_past_the_recursion_limit_is_a_string():
    """An <arg_value> nested deeper than Python's JSON decoder goes stays its text (a
    RecursionError, a 500, before), as a value that is no JSON."""
    deep = "[" * 5000 + "]" * 5000
    text = f"<tool_call>get_weather<arg_key>days</arg_key><arg_value>{deep}</arg_value></tool_call>"
    assert whole_tools(text) == ("", [("get_weather", {"days": deep})])  # (an integer parameter)


def test_tool_call_ids_and_openai_shape():
    _, calls = parse_tool_calls("<tool_call>get_time</tool_call><tool_call>get_time</tool_call>", TOOLS)
    # ids as vLLM's make_tool_call_id, one function for parsed and forced calls
    assert len(calls) == 2 and calls[0].id != calls[1].id
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id) for c in calls), calls
    d = calls[1].to_openai(1)
    assert d == {"index": 1, "id": calls[1].id, "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}}


def test_reasoning_then_tools_pipeline_every_split():
    """The server's chat pipeline: reasoning parser first, its content into the tool parser."""
    text = ("<think>I should call get_weather.</think>Sure.<tool_call>get_weather<arg_key>city</arg_key>"
            "<arg_value>Oslo</arg_value></tool_call>")
    for chunks in splits(text):
        rp, tp = ReasoningParser(), ToolCallParser(TOOLS)
        reasoning, content, calls = [], [], []
        for ch in chunks + [None]:
            r, c = rp.feed(ch) if ch is not None else rp.finish()
            cc, new = tp.feed(c)
            if ch is None:
                c2, _ = tp.finish()
                cc += c2
            reasoning.append(r)
            content.append(cc)
            calls += new
        assert "".join(reasoning) == "I should call get_weather."
        assert "".join(content) == "Sure."
        assert [(t.name, json.loads(t.arguments)) for t in calls] == [("get_weather", {"city": "Oslo"})]
