"""IncrementalDetokenizer: deltas add up to the full decode and never carry broken UTF-8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.checkpoints.demo_model import build_tokenizer
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world, the model reads 12345 tokens.",
    "Ünïcödé, émojis 🙂🚀 and 你好，世界 — dashes",
    "🧑‍🚀 ZWJ sequence and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
    "  spaces\n\nand\ttabs  ",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_dir(path)


def stream_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add_tokens([token_id]) for token_id in ids]


def test_deltas_concatenate_to_the_full_decode(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer)
        deltas = stream_one_by_one(detok, ids)
        assert "".join(deltas) == detok.text == tokenizer.decode(ids) == text
        assert all("\ufffd" not in delta for delta in deltas)
        assert detok.output_token_ids == ids


def test_split_characters_are_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several byte-level tokens for this test"
    assert tokenizer.decode(ids[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("go "))
    deltas = stream_one_by_one(detok, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🚀"
    assert detok.num_pending_tokens == 0


def test_prompt_context_does_not_leak_into_the_output(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("The prompt ends here:")
    output = tokenizer.encode(" and the answer starts 🙂 here", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(stream_one_by_one(detok, output)) == tokenizer.decode(output)


def test_several_tokens_at_once(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_tokens(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(deltas) == TEXTS[1]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    eot = tokenizer.token_to_id("<|eot_id|>")
    assert eot is not None
    ids = [*tokenizer.encode("Done.", add_special_tokens=False), eot]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = stream_one_by_one(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert deltas[-1] == ("" if skip_special_tokens else "<|eot_id|>")


def test_flush_emits_an_incomplete_tail_as_the_full_decode_would(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer)
    streamed = "".join(stream_one_by_one(detok, ids))
    assert streamed == "ok"  # " 🚀" starts with a token holding the space and a first byte
    assert detok.num_pending_tokens > 0
    tail = detok.flush()
    assert streamed + tail == tokenizer.decode(ids) and tail.endswith("\ufffd")
    assert detok.flush() == ""


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=30), chunk=st.integers(min_value=1, max_value=4))
def test_any_text_streams_back_exactly(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=tokenizer.encode("ctx"))
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert "".join(deltas) == tokenizer.decode(ids)
