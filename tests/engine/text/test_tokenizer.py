"""engine.text.tokenizer against transformers' fast tokenizer loaded from the same files
(offline). Chat templates render in the gateway: tests/gateway/openai/test_chat_template.py."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.checkpoints.demo_model import CHAT_TEMPLATE, build_tokenizer
from engine.text.tokenizer import Tokenizer
from tests.engine.text.tokenizer_files import (
    BASE_CONFIG,
    CHATML_TEMPLATE,
    VARIANTS,
    write_tokenizer_dir,
)

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


def test_the_chat_template_source_is_read(tmp_path: Path) -> None:
    """chat_template.jinja wins over the config; of named templates, "default"; the engine
    only carries the source (gateway.openai.chat_template renders it)."""
    read = {
        name: Tokenizer.from_dir(write_tokenizer_dir(tmp_path / name, config, jinja))
        for name, (config, jinja) in VARIANTS.items()
    }
    assert read["demo"].chat_template == CHAT_TEMPLATE
    assert read["explicit"].chat_template == CHATML_TEMPLATE
    assert read["no_bos"].chat_template == CHAT_TEMPLATE.replace("{{- bos_token }}", "")
    assert read["demo"].special_tokens_map == {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
    }
    config = {k: v for k, v in BASE_CONFIG.items() if k != "chat_template"}
    assert Tokenizer.from_dir(write_tokenizer_dir(tmp_path / "none", config)).chat_template is None


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
