"""Strings a tokenizer is checked on: ASCII prose, Unicode, emoji, code, numbers, whitespace
runs and special-token text, alone and mixed."""

from __future__ import annotations

import random

__all__ = ["tokenizer_strings"]


def tokenizer_strings(count: int, seed: int) -> list[str]:
    """count strings: the pieces below, then random joins of 2-6 of them."""
    pieces = [
        "The quick brown fox jumps over the lazy dog.", "Hello, world!", "it's", "they'll",
        "don't", "I'm", "café", "naïve", "Ünïcödé", "straße", "ĳ", "日本語のテキスト", "你好，世界",
        "Привет, мир", "مرحبا بالعالم", "שלום", "नमस्ते", "😀", "🚀🚀", "👩‍💻", "🇫🇷", "❤️",
        "def f(x):\n    return x ** 2", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "SELECT * FROM t WHERE id = 42;", "<div class=\"a\">x</div>", "$ ls -la | grep py",
        "3.14159", "1,000,000", "2024-11-27", "0x1F", "-42", "1e-5", "12345678901234567890",
        " ", "  ", "\t", "\n", "\n\n", "\r\n", "   \t  \n", "        ",
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
        "ALL CAPS TEXT", "MiXeD cAsE", "snake_case_name", "camelCaseName", "kebab-case",
        "a.b.c", "...", "?!", "—", "–", "«quotes»", "“curly”", "'single'", "\\n", "~`^",
    ]
    rng = random.Random(seed)
    strings = list(pieces)
    while len(strings) < count:
        parts = rng.sample(pieces, rng.randint(2, 6))
        glue = rng.choice(["", " ", "  ", "\n", "\t", " \n "])
        strings.append(glue.join(parts))
    return strings[:count]
