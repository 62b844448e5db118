"""The Generator protocol on transformers ``generate`` (CPU demo, tests, debugging).

Log-prob convention (shared with the vLLM generator): the log-prob of each sampled token under the
distribution it was sampled from, ``log_softmax(logits / temperature)`` after top-k / top-p
truncation. With top_p = 1 and top_k = -1 (training) that is what the policy computes for pi_old; with
fp32 weights on both sides the two agree to rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from nemo_disco.generation.base import Rollout, SamplingParams

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trim_at_stop(tokens: list[int], logprobs: list[float], stop_ids: Sequence[int]) -> tuple[list, list, str]:
    """Cut a generated sequence after its first stop token (kept); finish reason "stop" or "length"."""
    stops = set(stop_ids)
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1], logprobs[: i + 1], "stop"
    return tokens, logprobs, "length"


def check_weight_names(incoming: str, shape: torch.Size, params: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    """The parameter ``incoming`` refers to; a clear error naming the tensor when it is unknown or mis-shaped."""
    if incoming not in params:
        raise ValueError(f"{where}: refit tensor {incoming!r} is not a parameter of the generator's model")
    target = params[incoming]
    if tuple(target.shape) != tuple(shape):
        raise ValueError(
            f"{where}: refit tensor {incoming!r} has shape {list(shape)}, the model expects {list(target.shape)}"
        )
    return target


class HFGenerator:
    """Samples with ``model.generate`` and reports each sampled token's log-prob.

    Args:
        model_dir: Hugging Face folder (config, safetensors, tokenizer).
        dtype: "float32" (CPU), "bfloat16" or "float16".
        device: torch device (default: the current CUDA device, else CPU).
        batch_size: sequences per ``generate`` call.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        device: str | torch.device | None = None,
        batch_size: int = 64,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_DTYPES[dtype]).to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = 0
        self._params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams
    ) -> list[list[Rollout]]:
        """``n`` rollouts per prompt; rollouts of one prompt are adjacent in the batch (result[i][j])."""
        flat = [list(p) for p in prompt_token_ids for _ in range(n)]
        gen = torch.Generator(device=self.device)
        if sampling.seed is not None:
            gen.manual_seed(sampling.seed)
        out: list[Rollout] = []
        for start in range(0, len(flat), self.batch_size):
            out.extend(self._generate_batch(flat[start : start + self.batch_size], sampling, gen))
        return [out[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    def _generate_batch(self, prompts: list[list[int]], sp: SamplingParams, gen: torch.Generator) -> list[Rollout]:
        from transformers import LogitsProcessor, LogitsProcessorList

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        stops = list(sp.stop_token_ids)
        logps: list[torch.Tensor] = []

        class _Sampler(LogitsProcessor):
            """Samples the next token itself (seeded generator), records its log-prob, forces it."""

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                greedy = sp.temperature == 0
                logp = torch.log_softmax(scores.float() / (1.0 if greedy else sp.temperature), dim=-1)  # [B, V]
                filtered = logp if greedy else _top_k_top_p(logp, sp.top_k, sp.top_p)
                if sp.ignore_eos and stops:
                    filtered[:, stops] = float("-inf")
                if greedy:
                    nxt = filtered.argmax(-1, keepdim=True)  # [B, 1]
                else:
                    nxt = torch.multinomial(filtered.softmax(-1), 1, generator=gen)  # [B, 1]
                logps.append(filtered.log_softmax(-1).gather(-1, nxt).squeeze(-1))
                forced = torch.full_like(scores, float("-inf"))
                return forced.scatter_(-1, nxt, 0.0)

        seqs = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            do_sample=False,
            max_new_tokens=sp.max_tokens,
            min_new_tokens=sp.max_tokens if sp.ignore_eos else 0,
            eos_token_id=None if sp.ignore_eos else (stops or None),
            pad_token_id=self.pad_id,
            logits_processor=LogitsProcessorList([_Sampler()]),
            num_beams=1,
            top_k=None,
            top_p=None,
            temperature=None,
        )
        new = seqs[:, width:].cpu()
        lp = torch.stack(logps, dim=1).cpu() if logps else torch.zeros((len(prompts), 0))
        rollouts = []
        for i in range(len(prompts)):
            toks, lps, reason = trim_at_stop(new[i].tolist(), lp[i, : new.shape[1]].tolist(), stops)
            if sp.ignore_eos:
                reason = "length"
            rollouts.append(Rollout(token_ids=toks, logprobs=lps, finish_reason=reason))
        return rollouts

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place; an unknown or mis-shaped name raises a ValueError naming the tensor."""
        with torch.no_grad():
            for name, tensor in weights:
                target = check_weight_names(name, tensor.shape, self._params, "HFGenerator")
                target.copy_(tensor.to(target.device, target.dtype))

    def sleep(self) -> None:
        """Move the weights to CPU (frees accelerator memory; a no-op on CPU)."""
        self.model.to("cpu")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Move the weights back to the generator's device (there is no KV cache to re-allocate)."""
        self.model.to(self.device)

    def shutdown(self) -> None:
        """Drop the model."""
        self._params = {}
        self.model = None


def _top_k_top_p(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top-k and the top-p nucleus; [B, V] -> [B, V]."""
    out = logp.clone()
    if top_k is not None and top_k > 0 and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, dim=-1, descending=True)
        cum = sorted_lp.softmax(-1).cumsum(-1)
        drop = cum - sorted_lp.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_lp[drop] = float("-inf")
        out = torch.full_like(out, float("-inf")).scatter(-1, order, sorted_lp)
    return out
