"""Chat templates: a model's Jinja template (its source read by the engine's Tokenizer from
chat_template.jinja or tokenizer_config.json) compiled and rendered the way transformers does
it, into the prompt text of a chat request.

Templates render in a sandboxed Jinja environment with trim_blocks/lstrip_blocks,
`raise_exception`, `strftime_now`, HF's `tojson` and its `{% generation %}` tag, and see the
tokenizer's named special tokens (bos_token, eos_token, ...). They usually emit the BOS token
themselves: encode a rendered prompt with `add_special_tokens=False`, as vLLM does, or the
prompt starts with two BOS tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine import Tokenizer
from gateway.http.errors import BadRequestError

__all__ = ["ChatTokenizer", "compile_chat_template"]


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


class ChatTokenizer(Tokenizer):
    """The engine's Tokenizer, plus chat prompts rendered from its template (compiled on first
    use): the tokenizer the gateway holds. Load it with `ChatTokenizer.from_dir(path)`."""

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
        `content: null` with tool calls), as transformers does. A model without a template,
        or a template that calls raise_exception or fails to compile or render, is a 400 on
        `messages`.
        """
        if self.chat_template is None:
            raise BadRequestError("this model has no chat template", param="messages")
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
            raise BadRequestError(f"chat template: {exc}", param="messages") from exc
