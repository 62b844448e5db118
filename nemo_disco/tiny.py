"""Tiny models and tokenizers built in code (CPU demo and tests; nothing is downloaded).

The tokenizer is character-level (every printable ASCII character is a token, spelled in the GPT-2
byte-level alphabet so that transformers' Qwen2 tokenizer class, which it picks from the model type,
reads it the same way) with ChatML special tokens and a chat template, saved as a regular
``PreTrainedTokenizerFast`` folder; the model is a randomly initialised Qwen2, Llama, Qwen3 or Qwen3-MoE
saved as a regular Hugging Face folder (config.json + model.safetensors), so every backend loads it exactly
as it would load a real checkpoint.
"""

from __future__ import annotations

import string
from pathlib import Path

from nemo_disco.config import TinyModelConfig

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 128


def build_tokenizer(out_dir: str | Path):  # noqa: ANN201  (transformers type imported lazily)
    """Build and save the character-level tokenizer; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = _bytes_to_unicode()
    chars = [byte_char[ord(c)] for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    if len(vocab) > VOCAB_SIZE:
        raise AssertionError("tiny vocabulary overflow")
    # Byte-level BPE without merges = one token per character, whitespace included.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (bytes 33-126 map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def hf_config(tiny: TinyModelConfig, vocab_size: int = VOCAB_SIZE, eos_token_id: int = 1, pad_token_id: int = 0):  # noqa: ANN201
    """The transformers config of a tiny model."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    classes = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}
    extra: dict = {}
    if tiny.head_dim is not None:
        extra["head_dim"] = tiny.head_dim
    if tiny.architecture == "qwen3_moe":
        # Every layer sparse, top-k probabilities renormalised: the Qwen3-30B-A3B layout.
        extra.update(
            num_experts=tiny.num_experts,
            num_experts_per_tok=tiny.num_experts_per_tok,
            moe_intermediate_size=tiny.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return classes[tiny.architecture](
        vocab_size=vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
        **extra,
    )


def build_model(tiny: TinyModelConfig, out_dir: str | Path, seed: int = 0, hf_overrides: dict | None = None) -> Path:
    """Build a random tiny model + tokenizer and save both into ``out_dir`` (an HF folder).

    ``hf_overrides`` sets further attributes of the transformers config before the model is built (tests give
    a tiny model a real family's settings, e.g. Llama 3.1's rope scaling).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tok = build_tokenizer(out)
    config = hf_config(tiny, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    for key, value in (hf_overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out


def warm_up(model_dir: str | Path, problems: list, cfg) -> None:  # noqa: ANN001  (cfg: RunConfig)
    r"""Supervised warm-up of a tiny model on gold answers, in place (the CPU demo's starting point).

    A random tiny model never answers correctly, so every question would have p(q) = 0 and DisCO
    (like GRPO) would get no signal. A few supervised updates on ``\\boxed{answer}`` targets bring
    p(q) strictly between 0 and 1 on many questions; RL then has something to discriminate.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_disco.data import encode_prompts

    a = cfg.algorithm
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompts, kept, _ = encode_prompts(
        tok,
        problems,
        template=cfg.data.prompt_template,
        use_chat_template=cfg.data.use_chat_template,
        max_prompt_tokens=cfg.generation.max_prompt_tokens,
    )
    targets = [
        tok.encode(f"\\boxed{{{problems[i].answer}}}", add_special_tokens=False) + [tok.eos_token_id] for i in kept
    ]
    gen = torch.Generator().manual_seed(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.warmup_sft_lr, weight_decay=0.0)
    model.train()
    batch = 64
    for _ in range(a.warmup_sft_steps):
        idx = torch.randint(len(prompts), (batch,), generator=gen).tolist()
        seqs = [prompts[i] + targets[i] for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attn = torch.zeros((batch, width), dtype=torch.long)
        for row, (i, s) in enumerate(zip(idx, seqs, strict=True)):
            ids[row, : len(s)] = torch.tensor(s)
            attn[row, : len(s)] = 1
            labels[row, len(prompts[i]) : len(s)] = torch.tensor(targets[i])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir, safe_serialization=True)
