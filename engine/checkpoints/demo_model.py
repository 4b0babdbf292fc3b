"""A tiny random-weight Llama checkpoint with a real tokenizer, written offline in a second.

`write_demo_model(dir)` produces what a Hugging Face Llama repository holds: config.json,
model.safetensors, generation_config.json, tokenizer.json and tokenizer_config.json. Weights are
random (the model talks nonsense) but the shapes, names, tokenizer and chat template are real,
so the whole serving path runs on any CPU at interactive speed. The byte-level BPE tokenizer is
trained on a small built-in text; the chat template follows Llama 3's header/eot format.
Everything is a pure function of the seed: the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["DemoModelConfig", "write_demo_model"]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
EOT_TOKEN = "<|eot_id|>"  # ends an assistant turn: the chat eos
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, HEADER_START, HEADER_END, EOT_TOKEN]

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

_PARAGRAPHS = [
    "The gateway accepts requests from many tenants. Each tenant has a key, a tier and a budget.",
    "Premium requests are scheduled first; batch requests fill whatever capacity is left over.",
    "A paged cache stores keys and values in blocks of sixteen tokens, shared between prompts.",
    "When memory runs short, the scheduler preempts the newest request and recomputes it later.",
    "Hello! How can I help you today? I can answer questions, write code or summarise a text.",
    "The weather today is sunny with a light breeze, and tomorrow it may rain in the afternoon.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough, let it rise, then bake it.",
    "Python is a programming language; def main(): print('hello, world') returns None.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 3.14 2.718 -1 +7 50% $20.",
    "Questions and answers, lists and tables, emails and stories: a model writes all of them.",
    "Tokens are counted, latency is measured, and every second of the accelerator is billed.",
    "Ünïcödé text, émojis 🙂🚀 and other scripts — 你好，世界 — are encoded as bytes first.",
]
# Common English words; generated sentences draw from them so BPE has enough to merge.
_LEXICON = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy everything process
music market sense nation plan college interest death experience effect class control care
field development role effort rate heart drug show leader light voice wife police mind price
report decision son view relationship town road arm difference value building action model
season society tax director position player record paper space ground form event official
matter center couple site project activity star table need court oil situation cost industry
figure street image phone data picture practice piece land product doctor wall patient worker
news test movie north love support technology step baby computer type attention film tree
source organization hair window evidence population site truth character speech message
be have do say get make go know take see come think look want give use find tell ask seem
feel try leave call keep let begin help talk turn start show hear play run move like live
believe hold bring happen write provide sit stand lose pay meet include continue set learn
lead understand watch follow stop create speak read allow add spend grow open walk win offer
remember consider appear buy wait serve die send expect build stay fall cut reach kill remain
suggest raise pass sell require decide return explain hope develop carry break receive agree
support hit produce eat cover catch draw choose cause point listen realize place close
other new good high old great big small large national young different long little important
political bad white real best right social only public sure low early able human local late
hard major better economic strong possible whole free military true federal international
full special easy clear recent certain personal open red difficult available likely short
single medical current wrong private past foreign fine common poor natural significant
similar hot dead central happy serious ready simple left physical general environmental
financial blue democratic dark various entire close legal religious cold final main green nice
huge popular traditional cultural quickly slowly carefully really always never often usually
already still again almost together perhaps maybe quite rather enough today tomorrow
yesterday tonight soon later above below under over between through during before after
without within along across behind beyond toward against among around because although
while unless until whether however therefore instead meanwhile otherwise
"""
_TAILS = ["quickly.", "on time.", "in the morning.", "without errors.", "for every tier.",
          "again and again.", "before the deadline.", "with great care.", "in small steps.",
          "today?", "right now!", "as expected;", "if possible:", "(probably)."]


@dataclass
class DemoModelConfig:
    """Shapes of the demo Llama (written to config.json)."""

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # GQA, so the engine's grouped-query path runs
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    target_vocab_size: int = 2048  # BPE training target; the real size is what training reaches


def training_corpus() -> list[str]:
    """The built-in text: fixed paragraphs, generated sentences and numbers (fixed seed)."""
    rng = random.Random(1234)
    words = _LEXICON.split()
    sentences = []
    for _ in range(1500):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        sentences.append(f"{sentence.capitalize()} {rng.choice(_TAILS)}")
    numbers = " ".join(str(rng.randint(0, 99999)) for _ in range(2000))
    return _PARAGRAPHS * 4 + sentences + [numbers]


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None, f"{token} missing from the vocabulary"
    return token_id


def build_tokenizer(target_vocab_size: int = 2048) -> Tokenizer:
    """A byte-level BPE tokenizer with Llama-3-style special tokens; BOS added on encode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target_vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _tokenizer_config() -> dict[str, object]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": DemoModelConfig.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def _random_weights(config: DemoModelConfig, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """HF Llama parameter names; N(0, 0.02) matrices, unit norm weights."""
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
    kv_dim = config.num_key_value_heads * head_dim

    def normal(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.02

    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        weights[prefix + "self_attn.q_proj.weight"] = normal(hidden, hidden)
        weights[prefix + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        weights[prefix + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        weights[prefix + "self_attn.o_proj.weight"] = normal(hidden, hidden)
        weights[prefix + "mlp.gate_proj.weight"] = normal(config.intermediate_size, hidden)
        weights[prefix + "mlp.up_proj.weight"] = normal(config.intermediate_size, hidden)
        weights[prefix + "mlp.down_proj.weight"] = normal(hidden, config.intermediate_size)
        weights[prefix + "input_layernorm.weight"] = torch.ones(hidden)
        weights[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab_size, hidden)
    return weights


def _model_config(config: DemoModelConfig, vocab_size: int, bos_id: int,
                  eos_ids: list[int]) -> dict[str, object]:
    fields = asdict(config)
    fields.pop("target_vocab_size")
    rope_theta = fields.pop("rope_theta")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        **fields,
        "head_dim": config.hidden_size // config.num_attention_heads,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_model(
    dir: Path, seed: int = 0, config: DemoModelConfig | None = None
) -> Path:
    """Write the demo checkpoint into `dir` (created if missing) and return `dir`."""
    config = config or DemoModelConfig()
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(config.target_vocab_size)
    vocab_size = tokenizer.get_vocab_size()
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    eos_ids = [_token_id(tokenizer, EOT_TOKEN), _token_id(tokenizer, EOS_TOKEN)]

    tokenizer.save(str(dir / "tokenizer.json"))
    _write_json(dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(dir / "config.json", _model_config(config, vocab_size, bos_id, eos_ids))
    _write_json(
        dir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_ids, "do_sample": True,
         "temperature": 0.7, "top_p": 0.9},
    )
    save_file(_random_weights(config, vocab_size, seed), str(dir / "model.safetensors"),
              metadata={"format": "pt"})
    return dir
