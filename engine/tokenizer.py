"""A Hugging Face tokenizer directory read without transformers: encode, decode, chat template.

`Tokenizer.from_dir(path)` loads tokenizer.json with the `tokenizers` library and applies what
tokenizer_config.json adds on top, the way transformers' fast tokenizers do:

- named special tokens (bos/eos/unk/pad/...) and `added_tokens_decoder` entries are added to
  the vocabulary when tokenizer.json lacks them;
- BOS/EOS on encode come from tokenizer.json's post-processor alone: transformers 5 drops
  `add_bos_token`/`add_eos_token` from the config whenever tokenizer.json exists, and so do we;
- `clean_up_tokenization_spaces` applies to non-BPE models only (transformers 5 skips it for
  BPE, where it corrupts text);
- the chat template comes from chat_template.jinja, else from the config (a string, or named
  templates of which "default" is used), and renders in a sandboxed Jinja environment with
  trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now` and HF's `tojson`.

Chat templates usually emit the BOS token themselves: encode a rendered chat prompt with
`add_special_tokens=False`, as vLLM does, or the prompt starts with two BOS tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from engine.errors import InvalidRequestError

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


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag) renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it as an instance attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Like HF: no HTML escaping (Jinja's own tojson escapes <, >, &, ').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders them in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
    """Encode/decode text and render chat prompts for one model."""

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
    def from_dir(cls, path: str | Path) -> Tokenizer:
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

    # -- chat ----------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The HF `tokenizers` JSON of the tokenizer (what a grammar compiler reads)."""
        text: str = self._backend.to_str()
        return text

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers renders it (tokenize=False).

        Keys whose value is None are dropped from each message first (an OpenAI client sends
        `content: null` with tool calls), as transformers does. A template that calls
        raise_exception, or fails to render, raises InvalidRequestError.
        """
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template", param="messages")
        cleaned = [{k: v for k, v in message.items() if v is not None} for message in messages]
        context = {
            **self.special_tokens_map,
            **template_kwargs,
            "messages": cleaned,
            "tools": tools,
            "documents": template_kwargs.get("documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_chat_template.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template: {exc}", param="messages") from exc


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
