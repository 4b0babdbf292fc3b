"""SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`: Llama 2, Mistral 7B):
a SentencePiece BPE model trained here the way Llama's was (byte fallback, digits split,
whitespace kept as it is), written into a GGUF file as llama.cpp's converter writes one (pieces,
scores, token types, no merges), then read back by engine.gguf_checkpoint. The reference is
SentencePiece itself, and HF transformers reading the same GGUF file."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from bench.serve.peer_prompts import CORPUS
from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.models.config import ModelConfigError
from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer
from tests.engine.checkpoints.gguf_files import TokenizerFields, write_gguf
from tests.engine.text.tokenizer_strings import tokenizer_strings

# llama.cpp's token types (gguf TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@pytest.fixture(scope="module")
def processor() -> spm.SentencePieceProcessor:
    """A 1,000-piece BPE model with Llama's trainer settings, on English text and the test
    strings' pieces (rare characters stay out of the vocabulary and fall back to bytes)."""
    sentences = [line for line in CORPUS.split(". ") if line.strip()]
    sentences += tokenizer_strings(400, seed=1)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=1000,
        model_type="bpe", byte_fallback=True, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.995,
        user_defined_symbols=["<tool>"], minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _token_type(processor: spm.SentencePieceProcessor, piece_id: int) -> int:
    if processor.is_unknown(piece_id):
        return _UNKNOWN
    if processor.is_control(piece_id):
        return _CONTROL
    if processor.is_byte(piece_id):
        return _BYTE
    if processor.is_unused(piece_id):
        return _UNUSED
    if processor.id_to_piece(piece_id) == "<tool>":
        return _USER_DEFINED
    return _NORMAL


def _write(path: Path, processor: spm.SentencePieceProcessor, **fields: Any) -> Path:
    """A one-layer Llama GGUF carrying the processor's vocabulary as llama.cpp writes it."""
    size = processor.get_piece_size()
    tokenizer = TokenizerFields(
        tokens=[processor.id_to_piece(i) for i in range(size)],
        token_types=[_token_type(processor, i) for i in range(size)],
        merges=[], pre="default", model="llama",
        scores=[processor.get_score(i) for i in range(size)],
        bos_token_id=processor.bos_id(), eos_token_id=processor.eos_id(),
        unk_token_id=processor.unk_id(),
        add_bos_token=None,  # older files say nothing: llama.cpp adds BOS
    )  # fmt: skip
    for key, value in fields.items():
        setattr(tokenizer, key, value)
    config = LlamaConfig(
        vocab_size=size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    ).to_dict()  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_gguf(path, "llama", config, dict(model.state_dict()), tokenizer)
    return path


@pytest.fixture(scope="module")
def gguf_file(processor: spm.SentencePieceProcessor, tmp_path_factory: pytest.TempPathFactory
              ) -> Path:
    return _write(tmp_path_factory.mktemp("spm") / "m.gguf", processor)


def test_ids_and_text_equal_sentencepiece_on_200_strings(
    processor: spm.SentencePieceProcessor, gguf_file: Path, tmp_path: Path
) -> None:
    checkpoint = GGUFCheckpoint.open(gguf_file)
    converted = checkpoint.convert(tmp_path / "converted")
    strings = tokenizer_strings(200, seed=0)
    num_byte_fallbacks = 0
    for tokenizer in (checkpoint.tokenizer(), Tokenizer.from_dir(converted)):
        for text in strings:
            expected = [processor.bos_id(), *processor.encode(text)]
            ids = tokenizer.encode(text)
            assert ids == expected, repr(text)
            assert tokenizer.decode(ids) == processor.decode(expected[1:]), repr(text)
            num_byte_fallbacks += any(processor.is_byte(i) for i in expected)
        assert tokenizer.bos_token_id == processor.bos_id()
        assert tokenizer.eos_token_id == processor.eos_id()
    assert num_byte_fallbacks > 0  # the strings do reach characters outside the vocabulary


def test_ids_equal_hf_transformers_reading_the_same_file(
    gguf_file: Path, processor: spm.SentencePieceProcessor, tmp_path: Path
) -> None:
    """HF's Metaspace puts no "▁" in front of a text that starts with a space, where
    SentencePiece and llama.cpp do: such strings alone differ, and are what the same file
    without the space prefix gives."""
    hf = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours = GGUFCheckpoint.open(gguf_file).tokenizer()
    unprefixed = GGUFCheckpoint.open(
        _write(tmp_path / "m.gguf", processor, add_space_prefix=False)
    ).tokenizer()
    num_leading_space_differ = 0
    for text in tokenizer_strings(200, seed=0):
        expected = hf(text).input_ids
        if ours.encode(text) != expected:
            assert text[0] == " ", repr(text)
            assert unprefixed.encode(text) == expected, repr(text)
            num_leading_space_differ += 1
    assert num_leading_space_differ > 0


def test_a_user_defined_piece_matches_whole_and_the_space_prefix_follows_the_file(
    processor: spm.SentencePieceProcessor, tmp_path: Path
) -> None:
    """As llama.cpp: the text on each side of a user-defined piece is tokenized as a text of
    its own, each with the space in front."""
    tool = processor.piece_to_id("<tool>")
    plain = GGUFCheckpoint.open(_write(tmp_path / "a" / "m.gguf", processor)).tokenizer()
    ids = plain.encode("call <tool> now", add_special_tokens=False)
    cut = ids.index(tool)
    assert ids[:cut] == processor.encode("call ")
    assert ids[cut + 1 :] == processor.encode(" now")
    no_prefix = GGUFCheckpoint.open(
        _write(tmp_path / "b" / "m.gguf", processor, add_space_prefix=False, add_bos_token=False)
    ).tokenizer()
    ids = no_prefix.encode("hello world")
    assert processor.id_to_piece(ids[0])[0] != "\u2581"  # no space put in front
    assert no_prefix.decode(ids) == "hello world"


def test_a_vocabulary_without_scores_is_a_clear_error(
    processor: spm.SentencePieceProcessor, tmp_path: Path
) -> None:
    checkpoint = GGUFCheckpoint.open(_write(tmp_path / "m.gguf", processor, scores=None))
    with pytest.raises(ModelConfigError, match="needs a score per token"):
        checkpoint.tokenizer()


def test_streamed_text_adds_up_to_the_whole_decode(gguf_file: Path) -> None:
    """Token by token, the deltas give what the output adds to the prompt's text: the "▁" in
    front of a word is its space, never stripped in the middle of a text."""
    tokenizer = GGUFCheckpoint.open(gguf_file).tokenizer()
    for text in tokenizer_strings(60, seed=2):
        ids = tokenizer.encode(text)
        cut = 3  # a prompt of a few tokens, ending on a whole character
        while cut < len(ids) and "\ufffd" in tokenizer.decode(ids[:cut]):
            cut += 1
        prompt, output = ids[:cut], ids[cut:]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        streamed = "".join(detokenizer.add_tokens([token_id]) for token_id in output)
        streamed += detokenizer.flush()
        whole = tokenizer.decode(ids)
        assert whole.startswith(tokenizer.decode(prompt))
        assert streamed == whole[len(tokenizer.decode(prompt)):], repr(text)


@torch.no_grad()
def test_the_served_engine_decodes_hf_greedy_tokens_and_their_text(
    gguf_file: Path, tmp_path: Path
) -> None:
    """The engine `tiergate serve` builds (grammar compiler warmed up on this vocabulary)
    over the converted file: greedy tokens equal HF transformers' on the same GGUF, and the
    streamed text is the decode of those tokens."""
    from gateway.server.model_spec import ModelSpec
    from gateway.server.served_model import build_engine
    from gateway.server.settings import GatewaySettings
    from policies.tiers import TierTable

    converted = GGUFCheckpoint.open(gguf_file).convert(tmp_path / "converted")
    engine = build_engine(GatewaySettings(kv_cache_bytes=16 << 20), TierTable(), ModelSpec(),
                          converted)
    assert engine.tokenizer is not None
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    for index, text in enumerate(["The history of the city", " two  spaces\tand a tab", "😀 ok"]):
        prompt = engine.tokenizer.encode(text)
        engine.add_request(f"r{index}", prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                               ignore_eos=True))
        tokens: list[int] = []
        streamed = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.new_token_ids
                streamed += output.new_text
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                               min_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
        assert len(tokens) == 10 and tokens == expected, repr(text)
        whole = engine.tokenizer.decode(prompt + tokens)
        assert streamed == whole[len(engine.tokenizer.decode(prompt)):], repr(text)
