"""gateway.openai.chat_template against transformers' apply_chat_template on the same files
(offline): the variants of tests/engine/text/tokenizer_files.py and the demo checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.checkpoints.demo_model import write_demo_model
from gateway.http.errors import BadRequestError
from gateway.openai.chat_template import ChatTokenizer
from tests.engine.text.tokenizer_files import (
    BASE_CONFIG,
    CHATML_TEMPLATE,
    VARIANTS,
    write_tokenizer_dir,
)

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4", "tool_calls": None},
        {"role": "user", "content": "And <b>\"quotes\"</b> & ünïcödé 🙂?"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text",
                                                                       "text": "joined"}]}],
]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ChatTokenizer, PreTrainedTokenizerBase]:
    config, jinja = VARIANTS[request.param]
    path = write_tokenizer_dir(tmp_path_factory.mktemp(request.param), config, jinja)
    return ChatTokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    pair: tuple[ChatTokenizer, PreTrainedTokenizerBase], add_generation_prompt: bool
) -> None:
    ours, theirs = pair
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_chat_template_tools_tojson_and_raise_exception(tmp_path: Path) -> None:
    path = write_tokenizer_dir(tmp_path, BASE_CONFIG, CHATML_TEMPLATE)
    ours, theirs = ChatTokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    function = {"name": "get_weather", "description": "<é>", "parameters": {"type": "object"}}
    tools: list[Any] = [{"type": "function", "function": function}]
    messages = [{"role": "user", "content": "weather?"}]
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    rendered = ours.apply_chat_template(messages, tools=tools)
    assert rendered == expected
    assert '"description": "<é>"' in rendered  # not HTML-escaped, not ASCII-escaped
    with pytest.raises(BadRequestError, match="unknown role robot") as info:
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert info.value.param == "messages"


def test_chat_template_sandbox_refuses_unsafe_access(tmp_path: Path) -> None:
    path = write_tokenizer_dir(
        tmp_path, BASE_CONFIG, "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(BadRequestError):
        ChatTokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_a_bad_request(tmp_path: Path) -> None:
    config = {k: v for k, v in BASE_CONFIG.items() if k != "chat_template"}
    ours = ChatTokenizer.from_dir(write_tokenizer_dir(tmp_path, config))
    assert ours.chat_template is None
    with pytest.raises(BadRequestError, match="no chat template") as info:
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.param == "messages"


def test_generation_tag_and_strftime_render(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% endfor %}|{{ strftime_now('%Y') | length }}"
    )
    ours = ChatTokenizer.from_dir(write_tokenizer_dir(tmp_path, BASE_CONFIG, template))
    assert ours.apply_chat_template([{"role": "user", "content": "ab"}]) == "ab|4"


def test_the_demo_checkpoint_renders_like_transformers(tmp_path: Path) -> None:
    model_dir = write_demo_model(tmp_path / "demo", seed=0)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ours = ChatTokenizer.from_dir(model_dir)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there!"},
    ]
    rendered = ours.apply_chat_template(messages)
    assert rendered == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
