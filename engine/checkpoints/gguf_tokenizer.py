"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library (no transformers).

llama.cpp keeps two kinds of vocabulary this module reads:
- byte-level BPE (`tokenizer.ggml.model = "gpt2"`: Llama 3, Qwen2/3, SmolLM, Mistral's
  Tekken): tokens, merges and token types, and the way text is split before BPE
  (`tokenizer.ggml.pre`). A split it does not know is an error, never a guess: a wrong split
  gives wrong ids without any other symptom.
- SentencePiece BPE (`"llama"`: Llama 2, Mistral 7B v0.1-v0.3, TinyLlama): tokens with a score
  each and no merges. SentencePiece merges the adjacent pair whose joined piece scores
  highest, so the merges are the vocabulary's pieces cut in two, best score first; spaces
  become "▁" with one in front of the text (`tokenizer.ggml.add_space_prefix`), and a
  character outside the vocabulary falls back to its UTF-8 bytes (the <0xNN> tokens).
Either becomes a `tokenizers.Tokenizer` and the special-token settings transformers keeps in
tokenizer_config.json, so `engine.text.tokenizer.Tokenizer` serves a GGUF model exactly as it
serves a HF checkpoint directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from engine.models.config import ModelConfigError

__all__ = ["GGUFTokenizerFields", "build_backend_tokenizer", "tokenizer_config"]

# llama.cpp's token types (gguf TokenType).
_NORMAL = 1
_CONTROL = 3
_USER_DEFINED = 4
_SPACE = "\u2581"  # how SentencePiece spells a space

# Pre-tokenizer splits by `tokenizer.ggml.pre`: the patterns each model's tokenizer.json uses.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, str] = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# GPT-2's own split (ByteLevel's regex), alone or after single digits (SmolLM, StarCoder).
_GPT2_SPLIT_PRES = ("default", "gpt-2", "gpt2")
_DIGITS_THEN_GPT2_PRES = ("smollm", "starcoder")


@dataclass(frozen=True)
class GGUFTokenizerFields:
    """The tokenizer.ggml.* fields of one GGUF file."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: str | None  # tokenizer.ggml.pre: how text is split before BPE
    tokens: Sequence[str]  # the vocabulary, by id
    token_types: Sequence[int]  # llama.cpp token type per id (1 normal, 3 control, 4 user-defined)
    merges: Sequence[str]  # "left right", best first (byte-level BPE)
    scores: Sequence[float]  # a score per token (SentencePiece: higher merges first)
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool  # the model expects BOS in front of a plain encode
    add_eos_token: bool
    add_space_prefix: bool  # SentencePiece: "▁" in front of the text
    chat_template: str | None


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE tokens spell)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _byte_level_spelling(token: str) -> str:
    """A token as byte-level BPE spells it: unchanged when it already is (every normal token),
    else its UTF-8 bytes mapped to the alphabet (a control token written in plain text)."""
    alphabet = _byte_alphabet()
    if set(token) <= set(alphabet.values()):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    name = pre or "default"
    if name in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_SPLIT_PRES:
        return byte_level
    if name in _DIGITS_THEN_GPT2_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    known = sorted([*_SPLITS, *_GPT2_SPLIT_PRES, *_DIGITS_THEN_GPT2_PRES])
    raise ModelConfigError(
        f"unsupported GGUF pre-tokenizer {name!r} (tokenizer.ggml.pre); supported: "
        + ", ".join(known)
    )


def _post_processor(fields: GGUFTokenizerFields) -> processors.PostProcessor | None:
    """BOS/EOS around a plain encode when the file asks for them (Llama 3 adds BOS)."""
    specials: list[tuple[str, int]] = []
    single = "$A"
    if fields.add_bos_token and fields.bos_token_id is not None:
        bos = fields.tokens[fields.bos_token_id]
        specials.append((bos, fields.bos_token_id))
        single = f"{bos} {single}"
    if fields.add_eos_token and fields.eos_token_id is not None:
        eos = fields.tokens[fields.eos_token_id]
        if eos not in dict(specials):
            specials.append((eos, fields.eos_token_id))
        single = f"{single} {eos}"
    if not specials:
        return processors.ByteLevel(trim_offsets=False) if fields.model == "gpt2" else None
    return processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=specials
    )


def build_backend_tokenizer(fields: GGUFTokenizerFields) -> BackendTokenizer:
    """The `tokenizers` tokenizer for a byte-level BPE or SentencePiece GGUF vocabulary."""
    if fields.model == "gpt2":
        backend = _byte_level_bpe(fields)
    elif fields.model == "llama":
        backend = _sentencepiece_bpe(fields)
    else:
        raise ModelConfigError(
            f"unsupported GGUF tokenizer model {fields.model!r} (tokenizer.ggml.model): "
            "byte-level BPE ('gpt2': Llama 3, Qwen2/3, SmolLM, Tekken) and SentencePiece BPE "
            "('llama': Llama 2, Mistral 7B) are read"
        )
    post_processor = _post_processor(fields)
    if post_processor is not None:
        backend.post_processor = post_processor
    types = list(fields.token_types)
    # Control tokens (<|im_start|>, <|eot_id|>) match whole and are skipped by decode's
    # skip_special_tokens; user-defined ones (<think>) match whole and are kept in text.
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(fields.tokens, types, strict=False)
        if kind == _CONTROL
    ]
    user_defined = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(fields.tokens, types, strict=False)
        if kind == _USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user_defined:
        backend.add_tokens(user_defined)
    if backend.get_vocab_size(with_added_tokens=True) != len(fields.tokens):
        raise ModelConfigError(
            "the GGUF vocabulary holds duplicate tokens: "
            f"{len(fields.tokens)} ids, {backend.get_vocab_size(with_added_tokens=True)} distinct"
        )
    return backend


def _byte_level_bpe(fields: GGUFTokenizerFields) -> BackendTokenizer:
    spelled = [_byte_level_spelling(token) for token in fields.tokens]
    vocab = {token: token_id for token_id, token in enumerate(spelled)}
    merges: list[tuple[str, str]] = []
    for merge in fields.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelConfigError(f"malformed GGUF merge {merge!r}")
        merges.append((left, right))
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(fields.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(fields: GGUFTokenizerFields) -> BackendTokenizer:
    tokens = list(fields.tokens)
    if len(fields.scores) != len(tokens):
        raise ModelConfigError(
            f"a SentencePiece GGUF vocabulary needs a score per token (tokenizer.ggml.scores): "
            f"{len(fields.scores)} scores for {len(tokens)} tokens"
        )
    unk = fields.unk_token_id
    backend = BackendTokenizer(
        models.BPE(
            vocab={token: token_id for token_id, token in enumerate(tokens)},
            merges=_merges_by_score(tokens, fields.scores, fields.token_types),
            unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # Spaces spelled "▁", and one in front of the text: always, as SentencePiece and llama.cpp
    # do (Metaspace's prepend leaves it out of a text that starts with a space), and after a
    # special token, as llama.cpp does (the normalizer sees the text between added tokens).
    prefix = fields.add_space_prefix
    to_spaces = normalizers.Replace(" ", _SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), to_spaces]) if prefix else to_spaces
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space put in front of the text
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]
) -> list[tuple[str, str]]:
    """Every cut of a normal piece into two normal pieces, the joined piece's score first
    (ties: the lower id, then the shorter left part)."""
    types = list(token_types) or [_NORMAL] * len(tokens)
    normal = {token for token, kind in zip(tokens, types, strict=False) if kind == _NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, token in enumerate(tokens):
        if token not in normal:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[token_id]), token_id, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def tokenizer_config(fields: GGUFTokenizerFields) -> dict[str, Any]:
    """What transformers keeps in tokenizer_config.json: the named special tokens."""
    config: dict[str, Any] = {"clean_up_tokenization_spaces": False}
    for name, token_id in (
        ("bos_token", fields.bos_token_id),
        ("eos_token", fields.eos_token_id),
        ("unk_token", fields.unk_token_id),
        ("pad_token", fields.pad_token_id),
    ):
        if token_id is not None and 0 <= token_id < len(fields.tokens):
            config[name] = fields.tokens[token_id]
    return config
