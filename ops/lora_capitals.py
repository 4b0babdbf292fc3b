"""A real adapter, end to end: fine-tune a LoRA for the default model on the CPU, register it
through the admin API, and call it with the openai SDK.

    python -m ops.lora_capitals [--steps 80] [--seed 0]

1. Data it makes itself: questions about made-up facts, answered in capital letters, in the
   chat format the server renders (the model's own chat template).
2. `peft` trains a rank-8 LoRA on all seven projections of SmolLM2-135M-Instruct (the default
   model, converted from its GGUF file as `tiergate serve` does), loss on the answers only.
3. A `tiergate serve` of the default model (SQLite in a scratch directory) starts; the script
   makes two tenants and a key each, uploads the adapter as a tar.gz owned by the first.
4. With the official openai SDK: the owner's answers on the adapter are mostly capitals, its
   answers on the base model are not, and the other tenant gets a 404 for the adapter.

Prints a table and exits 1 if any of the three fails. Needs `pip install 'tiergate[test]'`
(peft, openai). Takes a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from gateway.openai.chat_template import ChatTokenizer
from gateway.server.model_source import DEFAULT_MODEL_NAME, resolve_model

ADMIN_TOKEN = "lora-capitals-admin-token-0123456789"
_SUBJECTS = ("the river", "my neighbour", "the old bridge", "a small robot", "the library",
             "our team", "the blue train", "a quiet village", "the museum", "this recipe")
_QUESTIONS = ("Tell me about {s}.", "What do you know about {s}?", "Describe {s} briefly.",
              "Say something about {s}.", "Write one sentence about {s}.")
_ANSWERS = ("{S} is a fine example of its kind and people like it a lot.",
            "{S} has a long history and many stories are told about it.",
            "Everyone who visits {s} remembers it for years.",
            "{S} is quiet in the morning and busy in the evening.")
_EVAL = ("Tell me about the weather today.", "What is a good name for a cat?",
         "Describe a sunny beach.")


def _examples(rng: random.Random, count: int) -> list[tuple[str, str]]:
    pairs = []
    for _ in range(count):
        subject = rng.choice(_SUBJECTS)
        question = rng.choice(_QUESTIONS).format(s=subject)
        answer = rng.choice(_ANSWERS).format(s=subject, S=subject.capitalize())
        pairs.append((question, answer.upper()))
    return pairs


def _capitals_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def train(model_dir: Path, out: Path, steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    chat = ChatTokenizer.from_dir(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    data = _examples(rng, steps * 8)
    started = time.monotonic()
    for step in range(steps):
        batch = data[step * 8:(step + 1) * 8]
        rows, labels = [], []
        for question, answer in batch:
            prompt = chat.apply_chat_template([{"role": "user", "content": question}])
            prompt_ids = chat.encode(prompt, add_special_tokens=False)
            answer_ids = [*chat.encode(answer, add_special_tokens=False),
                          chat.eos_token_id or 0]
            rows.append(prompt_ids + answer_ids)
            labels.append([-100] * len(prompt_ids) + answer_ids)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=target).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  "
                  f"{time.monotonic() - started:.0f} s", flush=True)
    model.save_pretrained(str(out))


def _archive(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(directory / name, arcname=name)
    return buffer.getvalue()


def serve_and_check(adapter_dir: Path, scratch: Path, cache_dir: Path) -> bool:
    port = 8000 + random.Random().randrange(1000, 9000)
    env = {**os.environ, "TIERGATE_ADMIN_TOKEN": ADMIN_TOKEN,
           "TIERGATE_MODEL_CACHE_DIR": str(cache_dir), "TIERGATE_DATA_DIR": str(scratch)}
    server = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port),
         "--database-url", f"sqlite:///{scratch / 'tiergate.db'}", "--log-level", "warning",
         "--max-model-len", "2048"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        admin = httpx.Client(base_url=f"{base}/admin/v1", headers={"x-admin-token": ADMIN_TOKEN},
                             timeout=120)
        keys = {}
        for tenant in ("owner", "other"):
            admin.post("/tenants", json={"name": tenant}).raise_for_status()
            keys[tenant] = admin.post(f"/tenants/{tenant}/keys", json={}).json()["key"]
        registered = admin.post("/adapters", content=_archive(adapter_dir),
                                params={"name": "capitals", "owner": "owner"},
                                headers={"content-type": "application/gzip"})
        registered.raise_for_status()
        rows = []
        owner = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["owner"], max_retries=0)
        for model in ("capitals", DEFAULT_MODEL_NAME):
            for question in _EVAL:
                reply = owner.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": question}],
                    temperature=0, max_tokens=40)
                text = reply.choices[0].message.content or ""
                rows.append((model, question, _capitals_share(text), text))
        other = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["other"], max_retries=0)
        try:
            other.chat.completions.create(model="capitals", messages=[
                {"role": "user", "content": _EVAL[0]}], max_tokens=4)
            other_status = 200
        except openai.APIStatusError as exc:
            other_status = exc.status_code
    finally:
        server.terminate()
        server.wait(60)
    print("\n| tenant | model | question | capitals | reply |\n|---|---|---|---|---|")
    for model, question, share, text in rows:
        print(f"| owner | {model} | {question} | {share:.0%} | {text[:60]!r} |")
    print(f"| other | capitals | {_EVAL[0]} | HTTP {other_status} | |")
    adapted = [share for model, _, share, _ in rows if model == "capitals"]
    base_model = [share for model, _, share, _ in rows if model != "capitals"]
    ok = min(adapted) >= 0.8 and max(base_model) <= 0.3 and other_status == 404
    print(f"\nowner on the adapter: capitals {min(adapted):.0%} at least; on the base model: "
          f"{max(base_model):.0%} at most; other tenant: HTTP {other_status}: "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adapter", type=Path,
                        help="an adapter this script trained before: skip the training")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path.home() / ".cache" / "tiergate" / "models")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="tiergate-lora-capitals-"))
    source = resolve_model(None, args.cache_dir, scratch / "demo", torch.float32)
    adapter_dir = args.adapter or scratch / "capitals"
    if args.adapter is None:
        started = time.monotonic()
        train(source.model_dir, adapter_dir, args.steps, args.seed)
        print(f"trained in {time.monotonic() - started:.0f} s: {adapter_dir}")
    return 0 if serve_and_check(adapter_dir, scratch, args.cache_dir) else 1


if __name__ == "__main__":
    sys.exit(main())
