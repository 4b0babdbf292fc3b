"""Tool-call formats: reading calls out of a model's text (whole and streamed), the grammars
that force a call, and how tools and past calls reach a chat template."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import llguidance
import pytest

from gateway.openai.chat_template import compile_chat_template
from gateway.openai.tool_calls import (
    FORMATS,
    MAX_PARALLEL_CALLS,
    FunctionTool,
    StreamedToolCalls,
    ToolChoice,
    format_for_template,
    render_messages,
    required_call_grammar,
)

WEATHER = FunctionTool("get_weather", "The weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = FunctionTool("get_time", None, None)
NAMES = frozenset({"get_weather", "get_time"})

CALLS = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lyon"}}; '
                   '{"name": "get_time", "parameters": {}}',
    "mistral": 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}},'
               ' {"name": "get_time", "arguments": {}}]',
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_calls_are_read_out_of_the_text(name: str) -> None:
    content, calls = FORMATS[name].parse(CALLS[name], NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Lyon"}), ("get_time", {})]
    assert content == ("" if name == "llama3_json" else "Let me look.")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_text_without_calls_is_content(name: str) -> None:
    text = "It is sunny in Lyon."
    assert FORMATS[name].parse(text, NAMES) == (text, [])
    # A malformed call is left as text rather than half-read.
    broken = CALLS[name].replace('"city"', "city")
    assert FORMATS[name].parse(broken, NAMES) == (broken, [])


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_whole(name: str, piece: int) -> None:
    text = CALLS[name]
    stream = StreamedToolCalls(FORMATS[name], NAMES)
    sent = "".join(stream.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    rest, calls = stream.finish()
    content, expected = FORMATS[name].parse(text, NAMES)
    assert calls == expected
    assert (sent + rest).strip() == content
    assert "<tool_call" not in sent and "[TOOL" not in sent  # no marker leaks as content


def test_streamed_text_without_calls_goes_out_as_it_comes() -> None:
    stream = StreamedToolCalls(FORMATS["hermes"], NAMES)
    assert stream.feed("It is ") == "It is "
    assert stream.feed("sunny <tool") == "sunny "  # may start a call: held
    assert stream.feed("kit>") == "<toolkit>"  # it did not
    assert stream.finish() == ("", [])


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),
        ("llama3_json", '{"name": "Alice", "age": 30}'),  # a JSON reply, not a call
        ("llama3_json", '{"name": "get_time"}'),  # no arguments, no marker: not a call
        ("mistral", '[{"name": "Alice", "age": 30}]'),
        ("mistral", '[{"name": "get_time"}]'),
    ],
)
def test_only_calls_of_offered_functions_are_calls(name: str, text: str) -> None:
    assert FORMATS[name].parse(text, NAMES) == (text, [])


def test_text_around_streamed_calls_is_kept() -> None:
    text = ' Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.'
    stream = StreamedToolCalls(FORMATS["hermes"], NAMES)
    sent = "".join(stream.feed(text[i:i + 4]) for i in range(0, len(text), 4))
    rest, calls = stream.finish()
    assert [c.name for c in calls] == ["get_time"]
    assert sent + rest == " Sure.\n\nDone."
    assert FORMATS["hermes"].parse(text, NAMES)[0] == "Sure.\n\nDone."


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_call_grammars_accept_calls_and_refuse_the_rest(name: str, parallel: bool) -> None:
    grammar = llguidance.LLMatcher.grammar_from_lark(
        required_call_grammar(FORMATS[name], [WEATHER, TIME], ToolChoice("required"), parallel))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    one = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}'
                  "\n</tool_call>",
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Lyon"}}',
        "mistral": '[{"name": "get_weather", "arguments": {"city": "Lyon"}}]',
    }[name]
    assert _accepts(grammar, one)
    assert not _accepts(grammar, one.replace("get_weather", "get_wether"))
    assert not _accepts(grammar, one.replace('"city": "Lyon"', '"town": "Lyon"'))
    assert not _accepts(grammar, "The weather is fine.")


def test_a_named_function_allows_only_it_once() -> None:
    grammar = llguidance.LLMatcher.grammar_from_lark(required_call_grammar(
        FORMATS["hermes"], [WEATHER, TIME], ToolChoice("function", "get_time"), True))
    assert _accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not _accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Lyon"}}\n</tool_call>')


def test_parallel_calls_are_capped() -> None:
    grammar = llguidance.LLMatcher.grammar_from_lark(
        required_call_grammar(FORMATS["hermes"], [TIME], ToolChoice("required"), True))
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _accepts(grammar, "\n".join([call] * MAX_PARALLEL_CALLS))
    assert not _accepts(grammar, "\n".join([call] * (MAX_PARALLEL_CALLS + 1)))


def _accepts(grammar: str, text: str) -> bool:
    """The grammar matches text exactly (bytes, no tokenizer)."""
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


_TOKENIZER: list[llguidance.LLTokenizer] = []


def _byte_tokenizer() -> llguidance.LLTokenizer:
    """A tokenizer with one token a byte (ids 0-255) and an EOS (256)."""
    if not _TOKENIZER:
        vocab = {f"<0x{b:02X}>": b for b in range(256)}
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": {"type": "ByteFallback"},
            "added_tokens": [{"id": 256, "content": "</s>", "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True}],
            "model": {"type": "BPE", "vocab": {**vocab, "</s>": 256}, "merges": [],
                      "byte_fallback": True, "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False},
        }
        _TOKENIZER.append(llguidance.LLTokenizer(json.dumps(tokenizer), eos_token=256))
    return _TOKENIZER[0]


def test_the_format_follows_the_template() -> None:
    assert format_for_template(None).name == "hermes"
    assert format_for_template("{{ messages }}").name == "hermes"  # no tools: our prompt
    assert format_for_template("{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert format_for_template("{% if tools %}<|python_tag|>{% endif %}").name == "llama3_json"
    assert format_for_template("{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert format_for_template(None, "mistral").name == "mistral"


HISTORY = [
    {"role": "user", "content": "Weather in Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
]


def test_a_template_without_tools_gets_them_in_a_system_message() -> None:
    messages, tools = render_messages(HISTORY, [WEATHER], "{{ messages }}")
    assert tools is None
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": '
                           '"get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}


def test_a_template_with_tools_renders_them_itself() -> None:
    source = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{% for c in m.tool_calls or [] %}"
              "{{ c.function.arguments.city }}{% endfor %}{% endfor %}")
    messages, tools = render_messages(HISTORY, [WEATHER], source)
    rendered = compile_chat_template(source).render(messages=messages, tools=tools)
    assert rendered == "[get_weather]Lyon"


def _best_of_three_s(parse: Callable[[], object]) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        parse()
        times.append(time.perf_counter() - start)
    return min(times)


# Replies a model can be made to write (a guided_regex, say) that cost a backtracking
# parser time polynomial in their length. 100,000 characters each.
_LONG = 100_000
ADVERSARIAL = {
    "hermes": [
        "<tool_call>" + " " * _LONG,  # the reported one: cubic with `\s*(.*?)\s*`
        "<tool_call>" * (_LONG // 11),  # openings without a close
        ("<tool_call> </tool_call>" * (_LONG // 24)),  # empty calls: not calls
        "<tool_call>" + "[" * _LONG + "</tool_call>",  # nested past the parser's recursion
        '<tool_call>{"name": "get_time", "arguments": ' + "[" * _LONG + "</tool_call>",
    ],
    "llama3_json": [
        "{" + " " * _LONG,
        "<|python_tag|>" + "{" * _LONG,
        '{"name": "get_time", "parameters": {"a": ' + "[" * _LONG + "]" * _LONG + "}}",
        '{"name": "get_time", "parameters": {}}; ' * (_LONG // 40),
    ],
    "mistral": [
        "[" + " " * _LONG,
        "[TOOL_CALLS]" + "[" * _LONG,
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"a": ' + "[" * 5_000 + "]" * 5_000
        + "}}]",
    ],
}


@pytest.mark.parametrize(
    ("name", "text"), [(name, text) for name, texts in ADVERSARIAL.items() for text in texts]
)
def test_adversarial_replies_parse_in_linear_time(name: str, text: str) -> None:
    """Each shape at 100,000 characters parses in under 50 ms (a linear parse takes about a
    millisecond; the old hermes pattern took 2.9 s at 2,000 spaces), whole and streamed."""
    tool_format = FORMATS[name]
    assert _best_of_three_s(lambda: tool_format.parse(text, NAMES)) < 0.05

    def streamed() -> None:
        stream = StreamedToolCalls(tool_format, NAMES)
        for i in range(0, len(text), 4):  # a token's worth of characters at a time
            stream.feed(text[i:i + 4])
        stream.finish()

    # 25,000 deltas: a fixed cost each, never a search of the whole text so far.
    assert _best_of_three_s(streamed) < 0.5


def test_deeply_nested_arguments_are_not_calls() -> None:
    """Arguments nested deeper than the JSON encoder recurses read as text, not a 500."""
    nested = '{"a": ' * 5_000 + "1" + "}" * 5_000
    for name, text in [
        ("hermes", f'<tool_call>{{"name": "get_time", "arguments": {nested}}}</tool_call>'),
        ("llama3_json", f'<|python_tag|>{{"name": "get_time", "parameters": {nested}}}'),
        ("mistral", f'[TOOL_CALLS][{{"name": "get_time", "arguments": {nested}}}]'),
    ]:
        assert FORMATS[name].parse(text, NAMES) == (text, [])


def test_streamed_marker_split_over_many_deltas() -> None:
    stream = StreamedToolCalls(FORMATS["hermes"], NAMES)
    text = 'ok <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    sent = "".join(stream.feed(ch) for ch in text)
    assert sent == "ok "
    assert stream.finish() == ("", [FORMATS["hermes"].parse(text, NAMES)[1][0]])
