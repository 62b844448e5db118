"""Tiny models and tokenizers built in code (CPU demo and tests; nothing is downloaded).

The tokenizer is character-level (every printable ASCII character is a token, spelled in the GPT-2
byte-level alphabet so that transformers' Qwen2 tokenizer class, which it picks from the model type,
reads it the same way) with ChatML special tokens and a chat template, saved as a regular
``PreTrainedTokenizerFast`` folder; the model is a randomly initialised model of a registered family
(:mod:`nemo_disco.families`: Qwen2, Llama, Qwen3, Qwen3-MoE) saved as a regular Hugging Face folder
(config.json + model.safetensors), so every backend loads it exactly as it would load a real checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import shutil
import string
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from nemo_disco import families, files
from nemo_disco.config import TinyModelConfig

log = logging.getLogger(__name__)

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
    """The transformers config of a tiny model: its family's config class and fixed keys (``families``)."""
    import transformers

    family = families.get_family(tiny.architecture)
    extra: dict = {}
    if tiny.head_dim is not None:
        extra["head_dim"] = tiny.head_dim
    if family.moe:
        extra.update(
            num_experts=tiny.num_experts,
            num_experts_per_tok=tiny.num_experts_per_tok,
            moe_intermediate_size=tiny.moe_intermediate_size,
        )
    extra.update(copy.deepcopy(dict(family.tiny_config)))
    return getattr(transformers, family.config_class)(
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
    files.honour_umask_tree(out)
    return out


@dataclass(frozen=True)
class WarmupResult:
    """How a supervised warm-up ended (saved as ``warmup.json`` in the model folder).

    Attributes:
        steps: supervised updates made.
        status: "fixed" (no target: exactly the configured updates), "in_band" (accuracy reached the target
            band), "above_band" (it jumped past the band's top between two evaluations) or "cap_reached"
            (still below the band after the most updates allowed).
        accuracy: held-out greedy accuracy at the end (None without a target).
        target: the band [low, high] (None without a target).
        problems: held-out problems of each evaluation (0 without a target).
        history: (updates, accuracy) of every evaluation.
    """

    steps: int
    status: Literal["fixed", "in_band", "above_band", "cap_reached"]
    accuracy: float | None = None
    target: tuple[float, float] | None = None
    problems: int = 0
    history: tuple[tuple[int, float], ...] = ()

    @property
    def message(self) -> str:
        """One line for the log: what was reached, and what to change when the target was missed."""
        if self.status == "fixed":
            return f"warm-up: {self.steps} supervised updates (no accuracy target)"
        low, high = self.target
        head = (
            f"warm-up: held-out greedy accuracy {self.accuracy:.3f} on {self.problems} problems after "
            f"{self.steps} supervised updates"
        )
        if self.status == "in_band":
            return f"{head} (target band {low:g}-{high:g})"
        if self.status == "above_band":
            return (
                f"{head}: ABOVE the target band {low:g}-{high:g} (it jumped past the band between two evaluations); "
                "RL starts from there. Lower algorithm.warmup_eval_every or algorithm.warmup_sft_lr"
            )
        return (
            f"{head}: BELOW the target band {low:g}-{high:g} at the cap (algorithm.warmup_sft_steps="
            f"{self.steps}); RL starts from there. Raise algorithm.warmup_sft_steps or algorithm.warmup_sft_lr"
        )

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON types."""
        return {
            "steps": self.steps,
            "status": self.status,
            "accuracy": self.accuracy,
            "target": list(self.target) if self.target else None,
            "problems": self.problems,
            "history": [list(h) for h in self.history],
            "message": self.message,
        }


def warm_up(
    model_dir: str | Path,
    problems: list,
    cfg,  # noqa: ANN001  (cfg: RunConfig)
    eval_problems: list | None = None,
    cache: str | Path | None = None,
) -> WarmupResult:
    r"""Supervised warm-up of a tiny model on gold answers, in place (the CPU demo's starting point).

    A random tiny model never answers correctly, so every question would have p(q) = 0 and DisCO
    (like GRPO) would get no signal. Supervised updates on ``\boxed{answer}`` targets bring p(q) strictly
    between 0 and 1 on many questions; RL then has something to discriminate.

    How far the warm-up goes decides how much RL can add, and a fixed number of updates lands in different
    places on different CPUs (floating-point rounding differs and compounds over hundreds of updates). So
    with ``algorithm.warmup_target = [low, high]`` the warm-up runs to a measured point instead: every
    ``algorithm.warmup_eval_every`` updates it decodes ``eval_problems`` greedily (batched, the transformers
    generator), grades them with ``reward.grader`` and stops at the first evaluation whose accuracy is at
    least ``low``; ``algorithm.warmup_sft_steps`` caps the updates. Missing the band (below it at the cap, or
    above it after a jump) is logged as a warning naming the keys to change; the run goes on. Progress is logged
    (INFO) at the start and every ``algorithm.warmup_eval_every`` updates: updates done / the cap, elapsed time
    and, with a target, the accuracy measured against the band.

    With ``cache`` (a folder), the warmed-up model is stored there under a key (:func:`warmup_key`) that hashes
    everything that decides it: the initial model and tokenizer files, the supervised and held-out examples,
    every ``algorithm.warmup_*`` key and the seed, the greedy decoding and grading settings, the torch and
    transformers versions, torch's thread count and the CPU. A later warm-up with the same key copies the stored
    files instead of redoing the updates (one log line names the entry). An entry that fails its checksums is
    ignored with a warning and replaced; a cache that cannot be written is a warning, never an error.

    Args:
        model_dir: the tiny model's HF folder (updated in place; ``warmup.json`` is written there).
        problems: training problems (prompt + gold answer).
        cfg: the run config (``algorithm.warmup_*``, ``data.prompt_template``, ``generation``, ``reward``).
        eval_problems: held-out problems for the accuracy target (needed when ``algorithm.warmup_target`` is set).
        cache: the warm-up cache folder (None: no cache).

    Raises:
        ValueError: a target without evaluation problems.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = cfg.algorithm
    if a.warmup_target is not None and not eval_problems:
        raise ValueError("algorithm.warmup_target is set but the warm-up got no held-out problems to measure")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts, targets = _sft_examples(tok, problems, cfg)
    entry = None
    if cache is not None:
        held_out = _eval_examples(tok, eval_problems, cfg) if a.warmup_target is not None else ([], [])
        entry = Path(cache) / warmup_key(model_dir, prompts, targets, *held_out, cfg)
        reused = _load_cached(entry, Path(model_dir))
        if reused is not None:
            log.info("warm-up: reused %s (same model, data, seed and settings)", _shown(entry))
            (log.info if reused.status in ("fixed", "in_band") else log.warning)(reused.message)
            return reused
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.warmup_sft_lr, weight_decay=0.0)
    measure = _GreedyAccuracy(model_dir, tok, eval_problems, cfg) if a.warmup_target is not None else None
    history: list[tuple[int, float]] = []
    result = WarmupResult(steps=a.warmup_sft_steps, status="fixed")
    band = f", measured every {a.warmup_eval_every} on {len(measure.prompts)} held-out problems" if measure else ""
    target = f" (target band {a.warmup_target[0]:g}-{a.warmup_target[1]:g})" if measure else ""
    log.info("warm-up: up to %d supervised updates%s%s", a.warmup_sft_steps, band, target)
    start = time.monotonic()
    try:
        for step in range(1, a.warmup_sft_steps + 1):
            model.train()
            _sft_update(model, opt, tok, prompts, targets, gen)
            if step % a.warmup_eval_every and step < a.warmup_sft_steps:
                continue
            done = f"warm-up: {step}/{a.warmup_sft_steps} updates ({time.monotonic() - start:.0f} s)"
            if measure is None:
                log.info("%s", done)
                continue
            acc = measure(model)
            history.append((step, acc))
            low, high = a.warmup_target
            log.info("%s, held-out greedy accuracy %.3f%s", done, acc, target)
            if acc >= low or step == a.warmup_sft_steps:
                status = "cap_reached" if acc < low else "in_band" if acc <= high else "above_band"
                result = WarmupResult(step, status, acc, a.warmup_target, len(measure.prompts), tuple(history))
                break
    finally:
        if measure is not None:
            measure.close()
    model.save_pretrained(model_dir, safe_serialization=True)
    files.honour_umask_tree(model_dir)
    (Path(model_dir) / "warmup.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    (log.info if result.status in ("fixed", "in_band") else log.warning)(result.message)
    if entry is not None:
        _store_cached(Path(model_dir), entry)
    return result


#: Bump when what a cache entry holds, or what its key covers, changes.
_CACHE_FORMAT = 1
_MANIFEST = "cache-entry.json"


def warmup_key(  # noqa: PLR0913
    model_dir: str | Path,
    prompts: list[list[int]],
    targets: list[list[int]],
    eval_prompts: list[list[int]],
    eval_truths: list[str],
    cfg,  # noqa: ANN001  (cfg: RunConfig)
) -> str:
    """The warm-up cache key: a hash of everything that decides the warmed-up weights.

    The initial model's and tokenizer's files (so the architecture, the seed they were built with and the
    vocabulary), the supervised examples and the held-out ones (token ids and answers: the data, its prompt
    template and length limit), every ``algorithm.warmup_*`` key and ``algorithm.seed``, the greedy decoding and
    grading settings, the Python, torch and transformers versions, torch's thread count and the CPU (rounding
    differs between CPUs and thread counts and compounds over hundreds of updates).
    """
    import torch
    import transformers

    from nemo_disco import generators, parts

    a, g = cfg.algorithm, cfg.generation
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).iterdir()):
        if f.is_file() and f.name != "warmup.json":
            h.update(f.name.encode() + b"\0" + _sha256(f).encode() + b"\0")
    settings = {
        "format": _CACHE_FORMAT,
        "warmup": {k: v for k, v in a.model_dump(mode="json").items() if k.startswith("warmup_")},
        "seed": a.seed,
        "generation": [g.max_response_tokens, *generators.params_of(cfg, "hf").model_dump().values()],
        "reward": [cfg.reward.grader, cfg.reward.timeout_s, *sorted(parts.grader_params(cfg).items())],
        "versions": [sys.version, torch.__version__, transformers.__version__],
        "threads": torch.get_num_threads(),
        "cpu": [platform.machine(), platform.processor(), _cpu_model()],
        "examples": [prompts, targets, eval_prompts, eval_truths],
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:32]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_cached(entry: Path, model_dir: Path) -> WarmupResult | None:
    """Copy a cache entry's files into ``model_dir`` and return its result; None if absent or damaged (logged)."""
    if not entry.exists():
        return None
    try:
        manifest = json.loads((entry / _MANIFEST).read_text())
        if manifest.get("format") != _CACHE_FORMAT or manifest.get("key") != entry.name:
            raise ValueError("its manifest is for another key or format")
        sums = manifest["files"]
        if "warmup.json" not in sums or not any(n.endswith(".safetensors") for n in sums):
            raise ValueError("its manifest lists no weights or no warmup.json")
        for name, digest in sums.items():
            if _sha256(entry / name) != digest:
                raise ValueError(f"{name} does not match its checksum")
        saved = json.loads((entry / "warmup.json").read_text())
        result = WarmupResult(
            steps=int(saved["steps"]),
            status=saved["status"],
            accuracy=saved["accuracy"],
            target=tuple(saved["target"]) if saved["target"] else None,
            problems=int(saved["problems"]),
            history=tuple((int(s), float(x)) for s, x in saved["history"]),
        )
        for name in sums:
            shutil.copyfile(entry / name, model_dir / name)
    except Exception as e:  # noqa: BLE001  (anything wrong with an entry means: redo the warm-up)
        log.warning(
            "warm-up cache entry %s is damaged (%s: %s): ignored, warming up again", _shown(entry), type(e).__name__, e
        )
        return None
    files.honour_umask_tree(model_dir)
    return result


def _store_cached(model_dir: Path, entry: Path) -> None:
    """Store a warmed-up model folder as a cache entry: written to a temporary folder, then renamed into place."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        sums = {}
        for f in sorted(model_dir.iterdir()):
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
                sums[f.name] = _sha256(tmp / f.name)
        manifest = {"format": _CACHE_FORMAT, "key": entry.name, "files": sums}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        files.replace_folder(tmp, entry)  # a damaged entry of the same key is replaced once this one is complete
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        log.warning("warm-up cache: could not store %s (%s); the run goes on without it", _shown(entry), e)
        return
    log.info("warm-up: stored for reuse in %s", _shown(entry))


def _shown(path: Path) -> str:
    """A path as logged: relative to the current folder when inside it (runs/.warmup-cache/...)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _sft_examples(tok, problems: list, cfg) -> tuple[list[list[int]], list[list[int]]]:  # noqa: ANN001
    r"""Prompt ids and target ids (``\boxed{answer}`` + EOS) of every problem whose prompt fits."""
    from nemo_disco.data import encode_run_prompts

    prompts, kept, _ = encode_run_prompts(tok, problems, cfg)
    targets = [
        tok.encode(f"\\boxed{{{problems[i].answer}}}", add_special_tokens=False) + [tok.eos_token_id] for i in kept
    ]
    return prompts, targets


def _eval_examples(tok, problems: list, cfg) -> tuple[list[list[int]], list[str]]:  # noqa: ANN001
    """Prompt ids and answers of the held-out problems the warm-up measures (those whose prompt fits)."""
    from nemo_disco.data import encode_run_prompts

    prompts, kept, _ = encode_run_prompts(tok, problems, cfg)
    return prompts, [str(problems[i].answer) for i in kept]


def _sft_update(model, opt, tok, prompts: list[list[int]], targets: list[list[int]], gen) -> None:  # noqa: ANN001
    """One supervised update on 64 random examples (loss on the target tokens only)."""
    import torch

    batch = 64
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


class _GreedyAccuracy:
    """Greedy accuracy of a model on fixed problems: the transformers generator (batched) + the run's grader."""

    def __init__(self, model_dir: str | Path, tok, problems: list, cfg) -> None:  # noqa: ANN001
        from nemo_disco import generators, parts
        from nemo_disco.data import encode_run_prompts
        from nemo_disco.generation.base import SamplingParams
        from nemo_disco.generation.hf import HFGenerator
        from nemo_disco.rewards import GraderPool

        self.prompts, kept, _ = encode_run_prompts(tok, problems, cfg)
        self.truths = [problems[i].answer for i in kept]
        self.tok = tok
        stops = {tok.eos_token_id}
        if "<|im_end|>" in tok.get_vocab():
            stops.add(tok.convert_tokens_to_ids("<|im_end|>"))
        self.sampling = SamplingParams(
            temperature=0.0, max_tokens=cfg.generation.max_response_tokens, stop_token_ids=tuple(sorted(stops))
        )
        own = generators.params_of(cfg, "hf")
        self.generator = HFGenerator(model_dir, batch_size=own.hf_batch_size, decode=own.hf_decode)
        r = cfg.reward
        params = parts.grader_params(cfg)
        self.grader = GraderPool(r.grader, timeout_s=r.timeout_s, workers=r.workers, params=params)

    def __call__(self, model) -> float:  # noqa: ANN001
        import torch

        model.eval()
        with torch.no_grad():
            self.generator.update_weights(model.named_parameters())
        rollouts = self.generator.generate(self.prompts, 1, self.sampling)
        texts = [self.tok.decode(rs[0].token_ids, skip_special_tokens=True) for rs in rollouts]
        scores, _ = self.grader.score(texts, self.truths)
        return sum(scores) / len(scores)

    def close(self) -> None:
        self.grader.close()
        self.generator.shutdown()
