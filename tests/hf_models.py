"""Tiny random Hugging Face checkpoints for tests: Llama, Qwen2 and Mistral built with
``transformers`` (a dev dependency), written with ``save_pretrained`` next to a real
``tokenizer.json`` (a byte-level BPE trained here on a fixed text) and a chat template.

Nothing is downloaded: weights are seeded random, the tokenizer is trained in-process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KINDS = ("llama", "qwen2", "mistral")

# Llama-3-style and ChatML (Qwen2, with its default system prompt) templates, the two shapes
# most checkpoints use; Mistral's [INST] below.
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mistral-7B-Instruct-v0.1's shape: [INST] markers as plain text, the reply closed by EOS
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "kvcloud stores KV-cache segments in S3 and an index in Redis.",
    "A session moves from one worker to another without recomputing its prefix.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
] * 20


def build_tokenizer(kind: str, out: Path, vocab_size: int = 320) -> Any:
    """Train a byte-level BPE and save it in Hugging Face format; returns the fast tokenizer."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if kind == "qwen2":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        bos, eos, template = None, "<|im_end|>", CHATML_TEMPLATE
    elif kind == "mistral":
        specials = ["<s>", "</s>"]
        bos, eos, template = "<s>", "</s>", MISTRAL_TEMPLATE
    else:
        specials = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        bos, eos, template = "<s>", "</s>", LLAMA_TEMPLATE
    tok = Tokenizer(models.BPE())
    if kind == "qwen2":
        # Qwen2's tokenizer.json splits with this pattern (digits one by one) before the
        # byte-level mapping; transformers' Qwen2Tokenizer re-applies it on load, so the
        # test tokenizer must carry it to be comparable
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    if bos is not None:  # Llama-style: the post-processor prepends BOS
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0]
    )
    fast.chat_template = template
    fast.save_pretrained(out)
    return fast


def build_checkpoint(
    kind: str,
    out: Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    tie: bool = False,
    rope: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    max_shard_size: str | None = None,
    layers: int = 2,
    max_positions: int = 2048,
) -> Path:
    """A tiny random ``kind`` model in ``out`` (config, safetensors, tokenizer, template)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out.mkdir(parents=True, exist_ok=True)
    fast = build_tokenizer(kind, out)
    common: dict[str, Any] = dict(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        eos_token_id=fast.eos_token_id,
        bos_token_id=fast.bos_token_id,
    )
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(rope or {})}
    common["rope_parameters"] = rope_parameters
    if kind == "llama":
        cfg: Any = LlamaConfig(**common)
        cls: Any = LlamaForCausalLM
    elif kind == "qwen2":
        cfg = Qwen2Config(
            **common,
            use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window,
            max_window_layers=1 if sliding_window else layers,
        )
        cls = Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = MistralConfig(**common, sliding_window=sliding_window)
        cls = MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        # transformers' init (std 0.02) makes a random model's output nearly independent of
        # its input; unit-scale weights make every position matter, so a wrong restore
        # shows in the logits.
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5 if "embed" not in name else 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model = model.to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    return out


def to_v4_config(path: Path) -> None:
    """Rewrite ``config.json`` the way transformers 4.x wrote it (``rope_theta`` and
    ``rope_scaling`` instead of ``rope_parameters``): most checkpoints in the wild look so."""
    cfg = json.loads((path / "config.json").read_text())
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.pop("rope_theta", 10000.0)
    rope_type = rp.pop("rope_type", "default")
    cfg["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **rp}
    cfg.pop("layer_types", None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def chat_reference(
    path: Path, user_turns: Sequence[str], n: int
) -> list[tuple[list[int], list[int]]]:
    """transformers alone on a whole conversation, turn by turn: the chat template renders
    every message so far, ``generate()`` answers greedily with ``n`` new tokens, and the reply
    (special tokens skipped) joins the conversation. Returns (input ids, generated ids) per
    turn: what a stateless client resending the conversation is owed, and a session too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    conversation: list[dict[str, str]] = []
    turns = []
    for text in user_turns:
        conversation.append({"role": "user", "content": text})
        rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=tok.pad_token_id or 0,
            )
        gen = out[0, len(ids) :].tolist()
        turns.append((ids, gen))
        reply = tok.decode(gen, skip_special_tokens=True)
        conversation.append({"role": "assistant", "content": reply})
    return turns
