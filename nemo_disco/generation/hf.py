"""The Generator protocol on a transformers model (CPU demo, tests, debugging), and what both generators share.

Decoding runs the KV-cached loop of :mod:`nemo_disco.generation.kv_decode` over the model's own modules for
Qwen2, Llama, Qwen3 and Qwen3-MoE (1.4x faster than ``generate`` on a CPU), and transformers' ``generate`` with
``decode="generate"`` or where :func:`kv_decode.unsupported` finds a reason (another family, or a transformers
release whose modules the loop does not know; one log line says which); both draw the same tokens from the same
seeded stream.

Conventions shared with the vLLM generator (:mod:`nemo_disco.generation.vllm`), so either backend can
stand in for the other:

- Log-probs: each sampled token's log-prob under the distribution it was sampled from,
  ``log_softmax(logits / temperature)`` after top-k / top-p truncation (renormalised over the kept
  tokens), which is vLLM's ``logprobs_mode="processed_logprobs"``. With ``top_p=1`` and ``top_k=-1``
  (the training defaults) nothing is truncated and this is exactly the policy's
  ``log_softmax(logits / temperature)`` that pi_old uses (alg. 1); with fp32 weights on both sides the
  two agree to rounding. vLLM 0.32 has no mode for "temperature applied, truncation not renormalised":
  its raw modes are before the temperature, its processed modes after top-k / top-p.
  ``temperature=0`` is greedy; its log-probs are those of the temperature-1 distribution.
- Stops: ``stop_token_ids`` is the complete set of stop tokens (the model's own EOS stops a rollout only
  when listed); the stop token is kept as the last token and nothing after it is returned.
  ``ignore_eos`` (benchmarks): stop tokens neither end a rollout nor are masked, every rollout has
  exactly ``max_tokens`` tokens and finish reason "length".
- Refit: ``update_weights`` takes every parameter of the model by its Hugging Face checkpoint name, each once
  (tied aliases such as a tied model's ``lm_head.weight`` may be sent or left out; a MoE layer's experts one
  by one, as checkpoints and vLLM name them, which this generator fuses into transformers' per-layer
  tensors). An unknown or repeated name, a wrong shape or a missing tensor raises a ValueError naming the
  tensor; after a refit that failed part-way, ``generate`` refuses to run until a complete refit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from nemo_disco.generation import kv_decode
from nemo_disco.generation.base import Rollout, SamplingParams
from nemo_disco.weights import DTYPES as _DTYPES
from nemo_disco.weights import to_module_layout

log = logging.getLogger(__name__)


def trim_at_stop(
    tokens: list[int], logprobs: list[float], stop_ids: Sequence[int]
) -> tuple[list[int], list[float], Literal["stop", "length"]]:
    """Cut a generated sequence after its first stop token (kept); finish reason "stop" or "length"."""
    stops = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], logprobs[: i + 1], "stop"
    return tokens, logprobs, "length"


@dataclass(frozen=True)
class WeightSpec:
    """The Hugging Face tensors a refit must deliver: name -> shape.

    Attributes:
        required: every parameter, tied ones once (``named_parameters`` of the transformers model).
        optional: the other entries of its state dict (a tied model's ``lm_head.weight``, persistent buffers).
        where: who checks (the start of every error message).
    """

    required: Mapping[str, tuple[int, ...]]
    optional: Mapping[str, tuple[int, ...]]
    where: str

    @classmethod
    def of_model(cls, model: torch.nn.Module, where: str) -> WeightSpec:
        """The spec of a transformers model (real or on the meta device)."""
        required = {n: tuple(p.shape) for n, p in model.named_parameters()}
        optional = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items() if n not in required}
        return cls(required, optional, where)

    def checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass ``weights`` through, checking each tensor before it goes on.

        Raises:
            ValueError: before an unknown, repeated or mis-shaped tensor, and at the end of a stream that left
                out a required one.
        """
        missing = set(self.required)
        seen: set[str] = set()
        for name, tensor in weights:
            shape = self.required.get(name, self.optional.get(name))
            if shape is None:
                raise ValueError(f"{self.where}: refit tensor {name!r} is not a parameter of the generator's model")
            if name in seen:
                # vLLM would load it into an already processed (repacked) layer.
                raise ValueError(f"{self.where}: refit tensor {name!r} arrived twice")
            seen.add(name)
            if tuple(tensor.shape) != shape:
                got, want = list(tensor.shape), list(shape)
                raise ValueError(f"{self.where}: refit tensor {name!r} has shape {got}, the model expects {want}")
            missing.discard(name)
            yield name, tensor
        if missing:
            first = sorted(missing)[:3]
            raise ValueError(f"{self.where}: the refit left out {len(missing)} tensor(s) of the model, e.g. {first}")


class HFGenerator:
    """Samples with ``model.generate`` and reports each sampled token's log-prob (conventions: module docstring).

    Sampling draws from one ``torch.Generator`` per :meth:`generate` call, seeded with ``sampling.seed``:
    the same call (same prompts, ``n`` and ``batch_size``) gives the same rollouts.

    Args:
        model_dir: Hugging Face folder (config, safetensors, tokenizer).
        dtype: "float32" (CPU), "bfloat16" or "float16".
        device: torch device (default: the current CUDA device, else CPU).
        batch_size: sequences per batch.
        decode: "auto": the KV-cached loop of :mod:`nemo_disco.generation.kv_decode` where it supports the
            model (Qwen2, Llama, Qwen3, Qwen3-MoE; checked on the model here), transformers' ``generate``
            otherwise (one log line gives the reason); "generate": always ``generate``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        device: str | torch.device | None = None,
        batch_size: int = 64,
        decode: Literal["auto", "generate"] = "auto",
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in _DTYPES:
            raise ValueError(f"HFGenerator: dtype={dtype!r}, expected one of {sorted(_DTYPES)}")
        if decode not in ("auto", "generate"):
            raise ValueError(f"HFGenerator: decode={decode!r}, expected 'auto' or 'generate'")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_DTYPES[dtype]).to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = 0
        self.spec = WeightSpec.of_model(self.model, "HFGenerator")
        self._refit_error: str | None = None
        #: "kv" (nemo_disco.generation.kv_decode) or "generate" (transformers' generate).
        self.decode_path = "generate"
        if decode == "auto":
            reason = kv_decode.unsupported(self.model)
            if reason is None:
                self.decode_path = "kv"
            else:
                log.info("transformers generator: decoding with generate(), not the KV-cached loop: %s", reason)

    @classmethod
    def build(cls, model_dir: str | Path, *, dtype: str | None, params: Any, **_: Any) -> HFGenerator:
        """The factory's constructor (:mod:`nemo_disco.generators`): ``params`` are ``generators.HFParams``."""
        options: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
        if params is not None:
            options.update(batch_size=params.hf_batch_size, decode=params.hf_decode)
        return cls(model_dir, **options)

    @staticmethod
    def run_options(cfg: Any) -> dict[str, Any]:
        """A training run's further settings: none (its section's keys are its ``params``)."""
        return {}

    @torch.inference_mode()
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Rollout]]:
        """``n`` rollouts per prompt; rollouts of one prompt are adjacent in the batch (result[i][j])."""
        if self._refit_error is not None:
            raise RuntimeError(f"HFGenerator: the last refit failed ({self._refit_error}); refit all weights first")
        flat = [list(p) for p in prompt_token_ids for _ in range(n)]
        gen = torch.Generator(device=self.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        out: list[Rollout] = []
        for start in range(0, len(flat), self.batch_size):
            out.extend(self._generate_batch(flat[start : start + self.batch_size], sampling, gen))
        return [out[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator) -> list[Rollout]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        stops = [] if sp.ignore_eos else list(sp.stop_token_ids)

        def pick(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """The next token of every row (seeded generator) and its log-prob (conventions: module docstring)."""
            greedy = sp.temperature == 0
            logp = torch.log_softmax(scores.float() / (1.0 if greedy else sp.temperature), dim=-1)  # [B, V]
            if greedy:
                nxt = logp.argmax(-1)
                return nxt, logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
            kept = _top_k_top_p(logp, sp.top_k, sp.top_p).log_softmax(-1)  # renormalised over kept tokens
            nxt = torch.multinomial(kept.exp(), 1, generator=gen).squeeze(-1)
            return nxt, kept.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)

        if self.decode_path == "kv":
            new, lp = kv_decode.sample(
                self.model, ids.to(self.device), attn.to(self.device), sp.max_tokens, pick, stops, self.pad_id
            )
            new, lp = new.cpu(), lp.cpu()
        else:
            new, lp = self._generate_with_transformers(ids, attn, sp.max_tokens, pick, stops)
        rollouts = []
        for i in range(len(prompts)):
            toks, lps, reason = trim_at_stop(new[i].tolist(), lp[i, : new.shape[1]].tolist(), stops)
            rollouts.append(Rollout(token_ids=toks, logprobs=lps, finish_reason=reason))
        return rollouts

    def _generate_with_transformers(
        self, ids: torch.Tensor, attn: torch.Tensor, max_tokens: int, pick: kv_decode.Picker, stops: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.generate`` with ``pick`` choosing every token (a logits processor that forces its choice)."""
        from transformers import LogitsProcessor, LogitsProcessorList

        logps: list[torch.Tensor] = []

        class _Forced(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                nxt, lp = pick(scores)
                logps.append(lp)
                return torch.full_like(scores, float("-inf")).scatter_(-1, nxt.unsqueeze(-1), 0.0)

        seqs = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            do_sample=False,
            max_new_tokens=max_tokens,
            # None (no stop tokens) really means none here: the model's own EOS must not stop a rollout.
            eos_token_id=stops or None,
            pad_token_id=self.pad_id,
            logits_processor=LogitsProcessorList([_Forced()]),
            num_beams=1,
            top_k=None,
            top_p=None,
            temperature=None,
        )
        new = seqs[:, ids.shape[1] :].cpu()  # [B, steps]; rows that stopped early are padded after their stop token
        lp = torch.stack(logps, dim=1).cpu() if logps else torch.zeros((len(ids), 0))
        return new, lp

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place, tensor by tensor (checks and errors: module docstring)."""
        # Looked up per refit: moving the model between devices replaces buffer objects (parameters stay).
        # A tied alias (lm_head.weight) is the embedding's own tensor.
        targets = self.model.state_dict(keep_vars=True)
        self._refit_error = "in progress"
        with torch.no_grad():
            try:
                for name, tensor in self.spec.checked(to_module_layout(weights, self.spec.required)):
                    target = targets[name]
                    target.copy_(tensor.to(target.device, target.dtype))
            except Exception as err:
                self._refit_error = str(err)
                raise
        self._refit_error = None

    def sleep(self) -> None:
        """Move the weights to CPU: frees accelerator memory (there is no KV cache to drop); a no-op on CPU."""
        self.model.to("cpu")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Move the weights back to the generator's device (for any ``tags``: the weights are all there is)."""
        self.model.to(self.device)

    def shutdown(self) -> None:
        """Drop the model; the generator cannot be used afterwards."""
        self.model = None


def _top_k_top_p(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus; [B, V] -> [B, V].

    Top-k first, then the smallest set of most likely remaining tokens whose mass reaches ``top_p``
    (vLLM's order and rule).
    """
    out = logp.clone()
    if top_k is not None and 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_lp.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # the more likely tokens already reach top_p
        sorted_lp[drop] = float("-inf")
        out = torch.full_like(out, float("-inf")).scatter(-1, order, sorted_lp)
    return out
