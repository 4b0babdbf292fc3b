"""A Hugging Face tokenizer directory read without transformers: encode, decode, and the chat
template's source.

`Tokenizer.from_dir(path)` loads tokenizer.json with the `tokenizers` library and applies what
tokenizer_config.json adds on top, the way transformers' fast tokenizers do:

- named special tokens (bos/eos/unk/pad/...) and `added_tokens_decoder` entries are added to
  the vocabulary when tokenizer.json lacks them;
- BOS/EOS on encode come from tokenizer.json's post-processor alone: transformers 5 drops
  `add_bos_token`/`add_eos_token` from the config whenever tokenizer.json exists, and so do we;
- `clean_up_tokenization_spaces` applies to non-BPE models only (transformers 5 skips it for
  BPE, where it corrupts text);
- the chat template's source comes from chat_template.jinja, else from the config (a string,
  or named templates of which "default" is used). The engine only carries it: the gateway
  renders chat prompts (gateway.openai.chat_template).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Self

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["Tokenizer"]

# The named special tokens transformers passes to chat templates (its special_tokens_map).
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _read_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class Tokenizer:
    """Encode/decode text for one model; carries its chat template's source."""

    def __init__(
        self,
        backend: BackendTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        config = config or {}
        self._backend = backend
        self._config = config  # tokenizer_config.json's fields, as given
        self.chat_template = chat_template  # Jinja source, None if the model has none
        # Named special tokens as strings, as templates see them (bos_token, eos_token, ...).
        self.special_tokens_map: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens", []))
        extra_tokens = extra.values() if isinstance(extra, dict) else extra
        self._extra_special_tokens = [
            c for c in (_token_content(t) for t in extra_tokens) if c is not None
        ]
        self._add_missing_tokens(config)
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Self:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from `path`."""
        path = Path(path)
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        return cls(backend, config, _read_chat_template(path, config))

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja to `path`, so
        that from_dir(path) reads back the same tokenizer."""
        path = Path(path)
        self._backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(self._config, indent=2))
        if self.chat_template is not None:
            (path / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")

    def _add_missing_tokens(self, config: dict[str, Any]) -> None:
        vocab = self._backend.get_vocab(with_added_tokens=True)
        missing: list[AddedToken] = []
        added = config.get("added_tokens_decoder", {})
        for _, spec in sorted(added.items(), key=lambda item: int(item[0])):
            if isinstance(spec, dict) and spec.get("content") not in vocab:
                missing.append(
                    AddedToken(
                        spec["content"],
                        single_word=spec.get("single_word", False),
                        lstrip=spec.get("lstrip", False),
                        rstrip=spec.get("rstrip", False),
                        normalized=spec.get("normalized", not spec.get("special", False)),
                        special=spec.get("special", False),
                    )
                )
        for content in [*self.special_tokens_map.values(), *self._extra_special_tokens]:
            if content not in vocab and all(t.content != content for t in missing):
                missing.append(AddedToken(content, special=True, normalized=False))
        if missing:
            self._backend.add_tokens(missing)

    # -- ids -----------------------------------------------------------------------------------

    def _named_id(self, name: str) -> int | None:
        content = self.special_tokens_map.get(name)
        return None if content is None else self._backend.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' len(tokenizer))."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of the named and extra special tokens, in transformers' order, no duplicates."""
        ids: list[int] = []
        for content in [*self.special_tokens_map.values(), *self._extra_special_tokens]:
            token_id = self._backend.token_to_id(content)
            if token_id is not None and token_id not in ids:
                ids.append(token_id)
        return ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- text ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, what the post-processor adds (BOS)."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(), releasing the GIL while the backend works (its batch entry point does;
        its single one does not): for a worker thread, so other threads run meanwhile."""
        encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding[0].ids
        return ids

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) found without encoding (0 when none is known):
        the text's UTF-8 bytes over the longest token's, for byte-level BPE models whose every
        token stands for its own bytes."""
        if self.max_token_bytes is None:
            return 0
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)

    @cached_property
    def max_token_bytes(self) -> int | None:
        """Most bytes of text one token covers, or None when a token may cover more than its
        own bytes (a normalizer that can shrink text, a pre-tokenizer that drops characters,
        an added token that swallows the spaces beside it) or the model is not byte-level BPE."""
        spec = json.loads(self._backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        keeps_bytes = all(
            part.get("type") in ("ByteLevel", "Digits")
            or (part.get("type") == "Split" and part.get("behavior") != "Removed")
            for part in parts
        )
        if (
            spec.get("normalizer") is not None
            or spec.get("model", {}).get("type") != "BPE"
            or not any(part.get("type") == "ByteLevel" for part in parts)
            or not keeps_bytes
        ):
            return None
        added = self._backend.get_added_tokens_decoder()
        if any(token.lstrip or token.rstrip for token in added.values()):
            return None
        # A byte-level token's string holds one character per byte; an added token is its text.
        longest = max(
            (len(token) for token in self._backend.get_vocab(with_added_tokens=False)), default=1
        )
        for token in added.values():
            longest = max(longest, len(token.content.encode("utf-8")))
        return longest

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def to_json(self) -> str:
        """The HF `tokenizers` JSON of the tokenizer (what a grammar compiler reads)."""
        text: str = self._backend.to_str()
        return text


# transformers' clean_up_tokenization, for WordPiece-style tokenizers.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
