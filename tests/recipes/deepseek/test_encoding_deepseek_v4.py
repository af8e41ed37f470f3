"""DeepSeek-V4 chat encoding and DSML output parsing: prompts written out by hand from the publisher's rules,
refusals, parsing of well-formed and malformed output, streaming == whole parse under random splits, round trips,
and the tiny tokenizer reproducing an encoded prompt."""
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from encoding_deepseek_v4 import (Delta, ParsedMessage, StreamingParser, ToolCallDelta, encode_chat, encode_messages,
                                  parse_completion)
from tiny_deepseek_v4 import write_tiny_checkpoint

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
ID = re.compile(r"call_[0-9a-f]{24}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
WEATHER_SCHEMA = ('{"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", '
                  '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}')


def tools_section(*schema_lines):
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        '"<｜DSML｜tool_calls>" block like the following:\n\n'
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="$TOOL_NAME">\n'
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
        "...\n"
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="$TOOL_NAME2">\n'
        "...\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
        'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        + "\n".join(schema_lines) +
        "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
TWO_CALLS = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def user(text):
    return {"role": "user", "content": text}


# ---------------------------------------------------------------- prompts

def test_chat_turns():
    msgs = [{"role": "system", "content": "You are terse."}, user("2+2?"),
            {"role": "assistant", "content": "4", "reasoning_content": "add"}, user("3+3?")]
    assert encode_messages(msgs) == f"{B}You are terse.{U}2+2?{A}</think>4{E}{U}3+3?{A}</think>"
    assert encode_messages(msgs, add_bos=False) == f"You are terse.{U}2+2?{A}</think>4{E}{U}3+3?{A}</think>"


def test_thinking_drops_earlier_reasoning_unless_asked():
    msgs = [user("2+2?"), {"role": "assistant", "content": "4", "reasoning_content": "add"}, user("3+3?")]
    assert encode_messages(msgs, thinking=True) == f"{B}{U}2+2?{A}</think>4{E}{U}3+3?{A}<think>"
    assert encode_messages(msgs, thinking=True, drop_thinking=False) == \
        f"{B}{U}2+2?{A}<think>add</think>4{E}{U}3+3?{A}<think>"
    # the reasoning after the last user turn stays; a developer turn before it is dropped in thinking mode
    msgs = [{"role": "developer", "content": "Rules."}, user("Hi"), {"role": "assistant", "content": "Hello",
                                                                       "reasoning": "greet"}]
    assert encode_messages(msgs, thinking=True) == f"{B}{U}Hi{A}<think>greet</think>Hello{E}"
    assert encode_messages(msgs) == f"{B}{U}Rules.{U}Hi{A}</think>Hello{E}"


def test_reasoning_effort():
    msgs = [user("Hi")]
    assert encode_messages(msgs, thinking=True, reasoning_effort="max") == f"{B}{MAX_EFFORT}{U}Hi{A}<think>"
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == f"{B}{U}Hi{A}<think>"
    assert encode_messages(msgs, reasoning_effort="max") == f"{B}{U}Hi{A}</think>"  # chat mode: no effort text


def test_tools_go_on_the_first_system_message():
    msgs = [{"role": "system", "content": "Be brief."}, user("Weather in Paris?")]
    assert encode_chat(msgs, tools=[WEATHER]) == \
        f"{B}Be brief.\n\n{tools_section(WEATHER_SCHEMA)}{U}Weather in Paris?{A}</think>"
    assert msgs[0] == {"role": "system", "content": "Be brief."}  # the request's messages are left alone


def test_tools_without_system_message_and_response_format():
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    rendered = ("## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                '{"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}')
    assert encode_chat([user("List")], response_format=fmt) == f"{B}\n\n{rendered}{U}List{A}</think>"
    assert encode_chat([user("List")], tools=[WEATHER], response_format=fmt, thinking=True) == \
        f"{B}\n\n{tools_section(WEATHER_SCHEMA)}\n\n{rendered}{U}List{A}<think>"
    assert encode_chat([user("List")], tools=[], response_format={"type": "text"}) == f"{B}{U}List{A}</think>"
    # developer messages carry tools in the publisher's format too
    assert encode_messages([{"role": "developer", "content": "Go.", "tools": [WEATHER]}]) == \
        f"{B}{U}Go.\n\n{tools_section(WEATHER_SCHEMA)}{A}</think>"


def test_tool_results_merge_in_call_order_and_keep_reasoning():
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Rome", "days": 3}}}]
    msgs = [{"role": "system", "content": "S"}, user("Paris and Rome?"),
            {"role": "assistant", "content": None, "reasoning_content": "Two cities.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "b", "content": "rain"},
            {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "sun"},
                                                              {"type": "text", "text": "20C"}]},
            user("Thanks")]
    expected = (f"{B}S\n\n{tools_section(WEATHER_SCHEMA)}{U}Paris and Rome?{A}<think>Two cities.</think>{TWO_CALLS}{E}"
                f"{U}<tool_result>sun\n\n20C</tool_result>\n\n<tool_result>rain</tool_result>\n\nThanks{A}<think>")
    assert encode_chat(msgs, tools=[WEATHER], thinking=True) == expected  # tools: earlier reasoning kept


def test_content_parts_and_consecutive_users():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, user("c")]
    assert encode_messages(msgs) == f"{B}{U}a\n\nb\n\nc{A}</think>"


@pytest.mark.parametrize("messages, kwargs, match", [
    ([{"role": "function", "content": "x"}], {}, "unknown role 'function'"),
    ([user("x"), {"role": "tool", "tool_call_id": "zz", "content": "r"}], {}, "tool_call_id 'zz' matches no"),
    ([{"role": "tool", "content": "r"}], {}, "without tool_call_id"),
    ([user("x")], {"reasoning_effort": "low"}, "reasoning_effort"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], {},
     r"content\[0\]: only text parts.*'image_url'"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{oops"}}]}], {},
     "arguments is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}], {},
     "must be a JSON object"),
    ([{"role": "assistant", "tool_calls": [{"id": "a"}]}], {}, r"tool_calls\[0\] must be"),
    ([{"role": "developer", "content": ""}], {}, "developer message with empty content"),
    ([{"role": "system", "content": "s", "tools": [{"type": "function"}]}], {}, r"tools\[0\] must be"),
    ([], {}, "non-empty list"),
])
def test_encode_messages_refuses(messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode_messages(messages, **kwargs)


@pytest.mark.parametrize("messages, kwargs, match", [
    ([user("x"), {"role": "assistant", "content": "y"}], {}, "last message must be from user, developer or tool"),
    ([user("x")], {"response_format": {"type": "xml"}}, "response_format.type"),
    ([user("x")], {"response_format": {"type": "json_schema"}}, "needs a 'json_schema' object"),
    ([user("x")], {"tools": [{"name": "flat"}]}, r"tools\[0\] must be"),
    ([{"role": "bot"}, user("x")], {"tools": [WEATHER]}, r"messages\[0\]: unknown role 'bot'"),
    ([{"role": "system", "content": "s", "tools": [WEATHER]}, user("x")], {"tools": [WEATHER]}, "already carries"),
])
def test_encode_chat_refuses(messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, **kwargs)


# ---------------------------------------------------------------- parsing

CALL_TEXT = (
    "Checking.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="get_time">\n'
    '<｜DSML｜parameter name="zones" string="false">["CET","UTC"]</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    f"</｜DSML｜tool_calls>{E}"
)


def calls(parsed):
    assert all(ID.fullmatch(c.id) for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def test_parse_text_and_reasoning():
    assert parse_completion(f"Hello there.{E}", thinking=False) == ParsedMessage(None, "Hello there.", [])
    assert parse_completion(f"Let me see.</think>Paris.{E}", thinking=True) == ParsedMessage("Let me see.", "Paris.")
    assert parse_completion("still thinking", thinking=True) == ParsedMessage("still thinking", "")
    assert parse_completion(f"A</think>B<think>C{E}ignored", thinking=False) == ParsedMessage(None, "ABC")


def test_parse_parallel_calls():
    p = parse_completion(CALL_TEXT, thinking=False, tools=[WEATHER])
    assert p.content == "Checking."
    assert calls(p) == [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zones": ["CET", "UTC"]}')]
    # thinking: reasoning ends implicitly at the block; the blank line may merge with punctuation or be missing
    p = parse_completion("I need the weather." + CALL_TEXT.removeprefix("Checking."), thinking=True)
    assert (p.reasoning_content, p.content, len(p.tool_calls)) == ("I need the weather.", "", 2)
    assert parse_completion(CALL_TEXT.replace(".\n\n", ".", 1), thinking=False).content == "Checking."


def test_parameter_values_follow_flags_then_schema_types():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "flag": {"type": "boolean"}, "n": {"type": "integer"}, "x": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "s": {"type": "string"}, "m": {"type": "integer"}}}}}

    def param(k, v, string="false"):
        return f'<{D}parameter name="{k}" string="{string}">{v}</{D}parameter>\n'
    text = (f'<{D}tool_calls>\n<{D}invoke name="f">\n' + param("flag", "True") + param("n", "+5") + param("x", "None")
            + param("s", "hello world") + param("m", "7", "true") + param("o", "1e999") + param("j", '{"k": [1]}')
            + f"</{D}invoke>\n</{D}tool_calls>")
    (name, args), = calls(parse_completion(text, thinking=False, tools=[tool]))
    assert args == '{"flag": true, "n": 5, "x": null, "s": "hello world", "m": "7", "o": "1e999", "j": {"k": [1]}}'
    (_, args), = calls(parse_completion(text, thinking=False))  # without schemas: unparsable values stay strings
    assert json.loads(args) == {"flag": "True", "n": "+5", "x": "None", "s": "hello world", "m": "7", "o": "1e999",
                                "j": {"k": [1]}}


HEAD = (f'Ok\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n')


@pytest.mark.parametrize("text, content, expected", [
    # cut at max_tokens inside a parameter: complete parameters stay, the call stays open (no "}" generated)
    (HEAD + f'<{D}parameter name="days" string="false">3', "Ok", [("get_weather", '{"city": "Paris"')]),
    # cut inside the invoke tag: no call
    (f'Ok\n\n<{D}tool_calls>\n<{D}invoke name="get_wea', "Ok", []),
    # cut inside the DSML opener: dropped with its blank line
    ("Ok\n\n<｜DS", "Ok", []),
    ("a <", "a <", []),
    # EOS inside a block ends it
    (HEAD + f"{E}more", "Ok", [("get_weather", '{"city": "Paris"}')]),
    # text after the block is dropped
    (HEAD + f"</{D}invoke>\n</{D}tool_calls>\nDone!{E}", "Ok", [("get_weather", '{"city": "Paris"}')]),
    # a tool not in `tools` is kept as written
    (f'<{D}tool_calls>\n<{D}invoke name="nope">\n</{D}invoke>\n</{D}tool_calls>', "", [("nope", "{}")]),
    # junk and unknown tags skipped, repeated parameter: first wins, new invoke closes the open one
    (f'x<{D}tool_calls>\nhmm <{D}foo bar>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">1</{D}parameter>'
     f'<{D}parameter name="a" string="true">2</{D}parameter><{D}invoke name="g"></{D}invoke>', "x",
     [("f", '{"a": "1"}'), ("g", "{}")]),
    # DSML without the block opener, stray closing tag, a parameter outside any invoke
    (f'Hi <{D}invoke name="f">\n</{D}invoke>', "Hi ", [("f", "{}")]),
    (f"Hi </{D}parameter> there", "Hi ", []),
    (f'<{D}tool_calls><{D}parameter name="a" string="true">v</{D}parameter></{D}tool_calls>', "", []),
    # a broken tag is skipped up to the next one (the text ends inside call g: it stays open)
    (f'<{D}tool_calls><{D}invoke name="f"<{D}invoke name="g">', "", [("g", "{")]),
])
def test_malformed_markup_never_reaches_content(text, content, expected):
    p = parse_completion(text, thinking=False, tools=[WEATHER])
    assert (p.content, calls(p)) == (content, expected)


# ---------------------------------------------------------------- streaming

def test_stream_shape_and_hold_back():
    parser = StreamingParser(thinking=False, tools=[WEATHER])
    deltas = [d for ch in CALL_TEXT for d in parser.feed(ch)] + parser.finish()
    args = [(d.tool_call.index, d.tool_call.name, d.tool_call.arguments) for d in deltas if d.tool_call]
    assert args == [(0, "get_weather", ""), (0, None, "{"), (0, None, '"city": "Paris"'), (0, None, ", \"days\": 3"),
                    (0, None, "}"), (1, "get_time", ""), (1, None, "{"), (1, None, '"zones": ["CET", "UTC"]'),
                    (1, None, "}")]
    assert all(ID.fullmatch(d.tool_call.id) for d in deltas if d.tool_call and d.tool_call.name)
    assert "".join(d.content for d in deltas if d.content) == "Checking."
    assert parser.has_tool_calls

    parser = StreamingParser(thinking=True)
    assert parser.feed("a <") == [Delta(reasoning_content="a ")]
    assert parser.feed("b\n\n") == [Delta(reasoning_content="<b")]
    assert parser.feed("</") == []  # may still be "\n\n</｜DSML｜"
    assert parser.feed("thi") == [Delta(reasoning_content="\n\n")]  # now only "</think>" is possible
    assert parser.feed("nk>c") == [Delta(content="c")]
    assert parser.feed(E) == [] and parser.finish() == [] and not parser.has_tool_calls
    with pytest.raises(ValueError, match="after finish"):
        parser.feed("x")
    with pytest.raises(ValueError, match="exactly one"):
        Delta(content="a", reasoning_content="b")
    assert ToolCallDelta(0).arguments == ""


STREAM_TEXTS = [
    CALL_TEXT, "I need the weather." + CALL_TEXT.removeprefix("Checking."), f"Let me see.</think>Paris.{E}",
    HEAD + f'<{D}parameter name="days" string="false">3', "Ok\n\n\n<｜DS", "a <", f"x\n\n</think>\n\ny{E}",
    f'Hi <{D}invoke name="f">\n</{D}invoke>', f'<{D}tool_calls><{D}invoke name="f"<{D}invoke name="g">',
    "plain text with < and > and ｜ and DSML", "<think>r</think>c</think>d",
]


def normalized(message):
    return message.reasoning_content, message.content, [(c.name, c.arguments) for c in message.tool_calls]


def stream(text, cuts, thinking, tools=None):
    parser = StreamingParser(thinking, tools)
    pieces, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[last:cut])
        last = cut
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    return ParsedMessage.from_deltas(deltas, thinking)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(STREAM_TEXTS), st.lists(st.integers(0, 400), max_size=12), st.booleans())
def test_stream_equals_whole_parse(text, cuts, thinking):
    cuts = [c % (len(text) + 1) for c in cuts]
    assert normalized(stream(text, cuts, thinking, [WEATHER])) == \
        normalized(parse_completion(text, thinking, [WEATHER]))


FRAGMENTS = ["a", " ", "\n", "\n\n", "<", ">", "｜", "/", '"', "3", "</think>", "<think>", E, f"<{D}",
             f"</{D}", f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="get_weather">', f"</{D}invoke>",
             f'<{D}parameter name="city" string="true">', f'<{D}parameter name="days" string="false">',
             f'<{D}parameter name="x">', f"</{D}parameter>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.lists(st.integers(0, 2000), max_size=10), st.booleans())
def test_fuzzed_markup(fragments, cuts, thinking):
    text = "".join(fragments)
    whole = parse_completion(text, thinking, [WEATHER])
    assert normalized(stream(text, [c % (len(text) + 1) for c in cuts], thinking, [WEATHER])) == normalized(whole)
    for part in (whole.content, whole.reasoning_content or ""):
        assert D not in part and E not in part and "<think>" not in part
    assert "</think>" not in whole.content
    assert all(isinstance(json.loads(c.arguments), dict) for c in whole.tool_calls[:-1])
    if whole.tool_calls:  # the last call may be one the text ended inside: its complete parameters, unclosed
        last = whole.tool_calls[-1].arguments
        assert isinstance(json.loads(last if is_json(last) else last + "}"), dict)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("thinking", [False, True])
def test_a_reply_cut_at_every_character_keeps_only_what_was_generated(thinking):
    """max_tokens at every character of a two-call reply: the text is what was generated, each call a prefix of the
    whole reply's; calls the model closed are whole, the one it was writing has "{" and its complete parameters,
    unclosed (never a value or a "}" that was not generated); the stream, fed a character at a time, adds up to the
    same."""
    whole = parse_completion(CALL_TEXT, thinking, [WEATHER])
    assert len(whole.tool_calls) == 2
    for k in range(len(CALL_TEXT)):
        text = CALL_TEXT[:k]
        cut = parse_completion(text, thinking, [WEATHER])
        assert text.startswith((cut.reasoning_content or "") + cut.content)  # the text as generated (no DSML)
        assert len(cut.tool_calls) <= 2
        closed = text.count(f"</{D}invoke>")  # calls the model ended
        for i, (c, w) in enumerate(zip(cut.tool_calls, whole.tool_calls)):
            assert c.name == w.name and w.arguments.startswith(c.arguments), (k, c)
            if i < closed:
                assert c.arguments == w.arguments
            else:
                assert not is_json(c.arguments) and isinstance(json.loads(c.arguments + "}"), dict), (k, c)
        assert normalized(stream(text, range(k), thinking, [WEATHER])) == normalized(cut), k


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("thinking, completion", [
    (False, f"Hello.{E}"),
    (True, f"Short thought.</think>Paris is the capital.{E}"),
    (True, f"Two cities.</think>{TWO_CALLS}{E}"),
    (False, "Checking." + TWO_CALLS.replace(
        'name="get_weather">\n<',
        'name="get_weather">\n<｜DSML｜parameter name="opts" string="false">{"a": [1, null], "b": true}</｜DSML｜parameter>\n<',
        1) + E),
])
def test_parse_then_encode_round_trip(thinking, completion):
    prompt = encode_messages([user("q")], thinking=thinking)
    parsed = parse_completion(completion, thinking, tools=[WEATHER])
    assert encode_messages([user("q"), parsed.to_message()], thinking=thinking) == prompt + completion


def test_multi_turn_tool_round_trip():
    completion = f"Two cities.</think>{TWO_CALLS}{E}"
    msgs = [{"role": "system", "content": "S"}, user("Paris and Rome?")]
    prompt = encode_chat(msgs, tools=[WEATHER], thinking=True)
    parsed = parse_completion(completion, thinking=True, tools=[WEATHER])
    assert calls(parsed) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome", "days": 3}')]
    first, second = (c.id for c in parsed.tool_calls)
    follow_up = msgs + [parsed.to_message(), {"role": "tool", "tool_call_id": second, "content": "rain"},
                        {"role": "tool", "tool_call_id": first, "content": "sun"}]
    assert encode_chat(follow_up, tools=[WEATHER], thinking=True) == \
        prompt + completion + f"{U}<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>{A}<think>"


def test_tiny_tokenizer_reproduces_the_prompt(tmp_path):
    tok = AutoTokenizer.from_pretrained(write_tiny_checkpoint(tmp_path / "ckpt", quantized=False))
    calls_ = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]
    prompt = encode_chat([{"role": "system", "content": "Sé breve."}, user("天气?"),
                          {"role": "assistant", "content": "", "reasoning_content": "Look up.", "tool_calls": calls_},
                          {"role": "tool", "tool_call_id": "a", "content": "sun"}], tools=[WEATHER], thinking=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    for special in (B, E, U, A, "<think>", "</think>"):
        assert ids.count(tok.convert_tokens_to_ids(special)) == prompt.count(special) > 0


IMG = "<｜deepseek_image｜>"


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_worked_examples():
    """DeepSeek-V4-Flash-Vision-Exp's rule: an image part is a text part holding one placeholder, joined with the
    message's other parts by a blank line; the image parts come back in prompt order."""
    images = []
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image("u1")]}]
    assert encode_messages(msgs, images=images) == f"{B}{U}What is this?\n\n{IMG}{A}</think>"
    assert images == [image("u1")]
    images = []
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    call2 = {**call, "id": "c2"}
    msgs = [{"role": "user", "content": [image("a"), image("b"), {"type": "text", "text": "same?"}]},
            {"role": "assistant", "content": "", "tool_calls": [call, call2]},
            {"role": "tool", "tool_call_id": "c2", "content": [image("d")]},  # results go in call order: c1 first
            {"role": "tool", "tool_call_id": "c1", "content": [image("c")]}]
    text = encode_messages(msgs, images=images)
    assert text.startswith(f"{B}{U}{IMG}\n\n{IMG}\n\nsame?{A}</think>")
    assert text.endswith(f"{U}<tool_result>{IMG}</tool_result>\n\n<tool_result>{IMG}</tool_result>{A}</think>")
    assert [p["image_url"]["url"] for p in images] == ["a", "b", "c", "d"]


def test_image_parts_refusals():
    with pytest.raises(ValueError, match="holds the image placeholder"):
        encode_messages([{"role": "user", "content": f"look {IMG}"}], images=[])
    with pytest.raises(ValueError, match=r"content\[0\] holds the image placeholder"):
        encode_chat([{"role": "user", "content": [{"type": "text", "text": IMG}]}], images=[])
    with pytest.raises(ValueError, match=r"messages\[1\].content\[0\]: only text parts"):  # not in assistant turns
        encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "content": [image("a")]},
                         {"role": "user", "content": "y"}], images=[])
