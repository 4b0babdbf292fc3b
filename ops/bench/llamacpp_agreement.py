"""Greedy tokens of tiergate and llama.cpp on the default model's Q4_1 file, as stored.

    python -m ops.bench.llamacpp_agreement [--max-tokens 32]

`tiergate serve --dtype auto` (the file's blocks as stored) and llama-server (built as
`tiergate bench peer --compare-llamacpp` builds it) on the same file, one after the other,
each asked for the default-model test's 16 chat prompts at temperature 0 twice: as token ids
(the chat template applied by HF transformers' tokenizer of the file: the two servers see
the same prompt) through /v1/completions, and as messages through /v1/chat/completions (each
server renders the template itself). Printed per route: answers equal, and each answer's
tokens in common from the start.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import openai
from transformers import AutoTokenizer

from bench.serve.llamacpp_build import ensure_built
from bench.serve.peer_servers import LlamaServer, TiergateServer
from gateway.server.model_source import DEFAULT_MODEL_NAME, default_model_file
from tests.gateway.server.test_default_model import CHAT_PROMPTS

CACHE = Path.home() / ".cache/tiergate/models"


def answers(base_url: str, key: str | None, model: str, prompts: list[list[int]],
            max_tokens: int) -> tuple[list[str], list[str]]:
    """(completions of the token-id prompts, chat answers to the messages)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=key or "none", max_retries=0)
    completions = [client.completions.create(model=model, prompt=ids, max_tokens=max_tokens,
                                             temperature=0).choices[0].text for ids in prompts]
    chats = [client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        temperature=0).choices[0].message.content or "" for text in CHAT_PROMPTS]
    return completions, chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model_file = default_model_file(CACHE)
    tokenizer = AutoTokenizer.from_pretrained(model_file.parent, gguf_file=model_file.name)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True))
               for text in CHAT_PROMPTS]
    work = Path(tempfile.mkdtemp(prefix="tiergate-agreement-"))
    build = ensure_built()
    with TiergateServer(work / "tiergate", 2, dtype="auto", max_num_seqs=8,
                        kv_cache_bytes=128 << 20, model_cache_dir=CACHE) as server:
        ours = answers(server.base_url, server.api_key, server.model or DEFAULT_MODEL_NAME,
                       prompts, args.max_tokens)
    with LlamaServer(work / "llama", 2, binary=build.server, model_file=model_file, parallel=4,
                     ctx_size=8192, alias=DEFAULT_MODEL_NAME, extra_args=()) as server:
        theirs = answers(server.base_url, None, DEFAULT_MODEL_NAME, prompts, args.max_tokens)
    print(f"{model_file.name}, {build.version.label}, greedy, "
          f"{args.max_tokens} tokens at most")
    for route, mine, other in (("token ids, /v1/completions", ours[0], theirs[0]),
                               ("messages, /v1/chat/completions", ours[1], theirs[1])):
        common = []
        for a, b in zip(mine, other, strict=True):
            left = tokenizer.encode(a, add_special_tokens=False)
            right = tokenizer.encode(b, add_special_tokens=False)
            n = 0
            while n < min(len(left), len(right)) and left[n] == right[n]:
                n += 1
            common.append(n)
        equal = sum(a == b for a, b in zip(mine, other, strict=True))
        print(f"{route}: {equal} of {len(mine)} answers equal; tokens in common from the "
              f"start: {common}")


if __name__ == "__main__":
    main()
