"""Tokenizer directories the tokenizer and chat-template tests load: the demo model's
byte-level BPE with a tokenizer_config.json (and a chat_template.jinja), in variants that
exercise what transformers reads from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.checkpoints.demo_model import CHAT_TEMPLATE, build_tokenizer

__all__ = ["BASE_CONFIG", "CHATML_TEMPLATE", "VARIANTS", "write_tokenizer_dir"]

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
