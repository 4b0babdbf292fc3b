"""engine.tokenizer against transformers' fast tokenizer loaded from the same files (offline)."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.demo_model import CHAT_TEMPLATE, build_tokenizer
from engine.errors import InvalidRequestError
from engine.tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello world",
    "  leading and trailing spaces  ",
    "The scheduler preempts the newest request.\n\nNew paragraph\ttab",
    "Ünïcödé, émojis 🙂🚀 and 你好，世界 — dashes",
    "code: def main():\n    return 42  # comment",
    "inline special <|eot_id|> token and <|begin_of_text|> too",
    "<|im_start|>user\nadded tokens<|im_end|>",
    "numbers 1234567890 3.14159 -42 1e-5",
    "unknown words: zyxwvut qqqq jjjjjj",
]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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


def write_tokenizer_dir(path: Path, config: dict[str, Any], jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return path


BASE_CONFIG: dict[str, Any] = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|eot_id|>",
    "clean_up_tokenization_spaces": False,
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": CHAT_TEMPLATE,
}

VARIANTS: dict[str, tuple[dict[str, Any], str | None]] = {
    # The demo model's files: BOS from tokenizer.json's post-processor.
    "demo": (BASE_CONFIG, None),
    # add_bos/add_eos in the config, which transformers 5 ignores when tokenizer.json exists;
    # a pad token, added tokens that tokenizer.json lacks; chat_template.jinja wins over the
    # config's template.
    "explicit": (
        {
            **BASE_CONFIG,
            "add_bos_token": True,
            "add_eos_token": True,
            "pad_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "special": True,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "single_word": False},
            "added_tokens_decoder": {
                "2048": {"content": "<|im_start|>", "special": True, "lstrip": False,
                         "rstrip": False, "normalized": False, "single_word": False},
                "2049": {"content": "<|im_end|>", "special": True, "lstrip": False,
                         "rstrip": False, "normalized": False, "single_word": False},
            },
        },
        CHATML_TEMPLATE,
    ),
    # No BOS at all, named templates in the config.
    "no_bos": (
        {
            "eos_token": "<|end_of_text|>",
            "add_bos_token": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": [{"name": "default", "template": CHAT_TEMPLATE.replace(
                "{{- bos_token }}", "")}, {"name": "tool_use", "template": "unused"}],
        },
        None,
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tokenizer, PreTrainedTokenizerBase]:
    config, jinja = VARIANTS[request.param]
    path = write_tokenizer_dir(tmp_path_factory.mktemp(request.param), config, jinja)
    return Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(
    pair: tuple[Tokenizer, PreTrainedTokenizerBase], add_special_tokens: bool
) -> None:
    ours, theirs = pair
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(
    pair: tuple[Tokenizer, PreTrainedTokenizerBase], skip_special_tokens: bool
) -> None:
    ours, theirs = pair
    rng = random.Random(0)
    sequences = [theirs.encode(text) for text in TEXTS]
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(20)] for _ in range(20)]
    for ids in sequences:
        expected = theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected


def test_special_ids_and_sizes_match_transformers(
    pair: tuple[Tokenizer, PreTrainedTokenizerBase],
) -> None:
    ours, theirs = pair
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours.vocab_size == len(theirs)
    assert ours.all_special_ids == theirs.all_special_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    pair: tuple[Tokenizer, PreTrainedTokenizerBase], add_generation_prompt: bool
) -> None:
    ours, theirs = pair
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_chat_template_tools_tojson_and_raise_exception(tmp_path: Path) -> None:
    path = write_tokenizer_dir(tmp_path, BASE_CONFIG, CHATML_TEMPLATE)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    function = {"name": "get_weather", "description": "<é>", "parameters": {"type": "object"}}
    tools: list[Any] = [{"type": "function", "function": function}]
    messages = [{"role": "user", "content": "weather?"}]
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=True)
    rendered = ours.apply_chat_template(messages, tools=tools)
    assert rendered == expected
    assert '"description": "<é>"' in rendered  # not HTML-escaped, not ASCII-escaped
    with pytest.raises(InvalidRequestError, match="unknown role robot") as info:
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert info.value.param == "messages"


def test_chat_template_sandbox_refuses_unsafe_access(tmp_path: Path) -> None:
    path = write_tokenizer_dir(
        tmp_path, BASE_CONFIG, "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(InvalidRequestError):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_an_invalid_request(tmp_path: Path) -> None:
    config = {k: v for k, v in BASE_CONFIG.items() if k != "chat_template"}
    ours = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, config))
    assert ours.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_generation_tag_and_strftime_render(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% endfor %}|{{ strftime_now('%Y') | length }}"
    )
    ours = Tokenizer.from_dir(write_tokenizer_dir(tmp_path, BASE_CONFIG, template))
    assert ours.apply_chat_template([{"role": "user", "content": "ab"}]) == "ab|4"


# -- without encoding: a lower bound on the token count; encoding without the GIL -------------

_DEMO = Tokenizer(build_tokenizer(), BASE_CONFIG)
_PIECES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["<|eot_id|>", "<|begin_of_text|>", " " * 40, "\n" * 30, "a" * 70, "7" * 9]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_PIECES, max_size=12), add_special_tokens=st.booleans())
def test_min_num_tokens_never_exceeds_the_encoding(
    pieces: list[str], add_special_tokens: bool
) -> None:
    text = "".join(pieces)
    assert _DEMO.min_num_tokens(text) <= len(_DEMO.encode(text, add_special_tokens))


def test_min_num_tokens_is_tight_for_the_longest_token() -> None:
    longest = max(
        (_DEMO.decode([i], skip_special_tokens=False) for i in range(_DEMO.vocab_size)),
        key=lambda text: len(text.encode()),
    )
    assert _DEMO.max_token_bytes == len(longest.encode())
    assert _DEMO.min_num_tokens(longest) == 1 == len(_DEMO.encode(longest, False))
    assert _DEMO.min_num_tokens(longest * 1000) == 1000


def test_no_bound_where_a_token_may_cover_more_than_its_bytes() -> None:
    lowercased = build_tokenizer()
    lowercased.normalizer = normalizers.Lowercase()
    assert Tokenizer(lowercased, BASE_CONFIG).min_num_tokens("x" * 10_000) == 0
    swallowing = build_tokenizer()  # an added token that takes the spaces before it
    swallowing.add_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    assert Tokenizer(swallowing, BASE_CONFIG).min_num_tokens("x" * 10_000) == 0


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_unlocked_equals_encode(add_special_tokens: bool) -> None:
    for text in TEXTS:
        assert _DEMO.encode_unlocked(text, add_special_tokens) == _DEMO.encode(
            text, add_special_tokens
        )


def test_encode_unlocked_lets_other_threads_run() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(1 << 20))
    done = threading.Event()
    encoder = threading.Thread(target=lambda: (_DEMO.encode_unlocked(text), done.set()))
    ticks = 0
    encoder.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    encoder.join()
    # encode() holds the GIL for the whole encode (2 ticks in 1.2 s on SmolLM2's tokenizer).
    assert ticks >= 50, ticks
