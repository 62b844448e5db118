"""The Policy protocol on a transformers causal LM (CPU demo, tests, single-GPU debugging).

Data parallelism: every rank holds a full replica; gradients are SUMMED over ranks (the surrogate
carries global normalisation), never averaged. ``trainable=False`` builds a forward-only model (the
reference policy): no optimizer, no gradients.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from nemo_disco import distributed, files, weights
from nemo_disco.batch import RolloutBatch, split_microbatches
from nemo_disco.config import ConfigError, PolicyConfig, RunConfig
from nemo_disco.policy.base import RunValues, SurrogateFn
from nemo_disco.policy.schedule import lr_at


def response_logprobs(
    logits: torch.Tensor, batch: RolloutBatch, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the response tokens from full-sequence logits.

    Args:
        logits: [n, P + R, V] for ``batch`` (n rows).
        batch: the rows the logits belong to.
        temperature: the sampling temperature (log-probs of logits / temperature, as the generator samples).
        entropy: also return the per-token entropy of that distribution.

    Returns:
        logprobs [n, R] (float32) and entropy [n, R] or None; zero on padding.
    """
    p = batch.prompt_ids.shape[1]
    r = batch.response_ids.shape[1]
    # The token at position p + t is predicted by the logits at p + t - 1.
    pred = logits[:, p - 1 : p + r - 1, :].float()  # [n, R, V]
    if temperature != 1.0:  # x / 1.0 is x: no division (and none in the backward) at the default temperature
        pred = pred / temperature
    logp_all = torch.log_softmax(pred, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)  # [n, R]
    mask = batch.response_mask
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    ent = None
    if entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)  # [n, R]
        ent = torch.where(mask, ent, torch.zeros_like(ent))
    return logp, ent


class HFPolicy:
    """pi_theta as a transformers AutoModelForCausalLM with a torch AdamW optimizer."""

    def __init__(self, pc: PolicyConfig, model_dir: str | Path, run: RunValues, *, trainable: bool = True) -> None:
        """Load the model of an HF folder.

        Args:
            pc: the ``policy`` section of the run config.
            model_dir: an HF folder (config.json + safetensors + tokenizer files).
            run: the run values the policy needs (temperature, total updates).
            trainable: False builds a forward-only model (a reference policy): no optimizer, no gradients.
        """
        from transformers import AutoModelForCausalLM

        if pc.activation_checkpointing == "selective":  # also refused when a RunConfig loads
            raise ConfigError(
                "policy.activation_checkpointing=selective needs policy.backend=megatron (the transformers policy "
                "checkpoints whole layers only: use full or false)"
            )
        self.pc = pc
        self.model_dir = Path(model_dir)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = self.device or torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=weights.DTYPES[pc.dtype], attn_implementation="sdpa"
        ).to(self.device)
        if pc.activation_checkpointing == "full":
            enable = (
                getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
            )
            enable()
        self.model.config.use_cache = False
        if trainable and pc.freeze_router:
            for name, p in self.model.named_parameters():
                if name.endswith(".mlp.gate.weight"):  # an MoE router (a dense MLP's is gate_proj)
                    p.requires_grad_(False)
        self.trainable = trainable
        self.optimizer = None
        if trainable:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=pc.lr,
                betas=(pc.adam_beta1, pc.adam_beta2),
                eps=pc.adam_eps,
                weight_decay=pc.weight_decay,
            )
        else:
            self.model.requires_grad_(False)
        self.updates = 0
        self.total_updates = run.total_updates
        self.temperature = run.temperature
        self.dp_group = None
        self.dp_size = distributed.world_size()
        self.dp_rank = distributed.rank()

    @classmethod
    def from_run_config(cls, cfg: RunConfig, model_dir: str | Path, *, trainable: bool = True) -> HFPolicy:
        """The policy of a run config (its ``policy`` section and :meth:`RunValues.of`)."""
        return cls(cfg.policy, model_dir, RunValues.of(cfg), trainable=trainable)

    # ------------------------------------------------------------------------------------------------------------------
    def _forward(self, batch: RolloutBatch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = batch.input_ids.to(self.device)
        mask = batch.attention_mask.to(self.device).long()
        positions = batch.position_ids.to(self.device)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        on_device = batch.with_(
            response_ids=batch.response_ids.to(self.device), response_mask=batch.response_mask.to(self.device)
        )
        return response_logprobs(logits, on_device, self.temperature, entropy)

    def microbatch_rows(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """Row indices of the micro-batches :meth:`train_minibatch` runs ``batch`` in (see ``Policy``)."""
        return split_microbatches(batch, self.pc.microbatch_tokens, "batch_width")

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, *, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs (and entropy) of ``batch.response_ids``, [N, R] float32 on CPU."""
        self.model.eval()
        lps, ents = [], []
        for rows in self.microbatch_rows(batch):
            lp, ent = self._forward(batch.select(rows), entropy)
            lps.append(lp.cpu())
            if ent is not None:
                ents.append(ent.cpu())
        return torch.cat(lps), (torch.cat(ents) if entropy else None)

    def train_minibatch(
        self,
        batch: RolloutBatch,
        surrogate_fn: SurrogateFn,
        *,
        entropy: bool = False,
    ) -> dict[str, float]:
        """One AdamW update on the summed micro-batch surrogates (see Policy.train_minibatch)."""
        if not self.trainable:
            raise RuntimeError("train_minibatch on a forward-only (reference) policy")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for rows in self.microbatch_rows(batch):
            lp, ent = self._forward(batch.select(rows), entropy)
            loss = surrogate_fn(rows, lp, ent)
            loss.backward()
            total += float(loss.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.dp_size > 1:
            # One flat all-reduce (SUM) instead of one per tensor.
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            distributed.all_reduce(flat, group=self.dp_group)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        clip = self.pc.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        step_lr = lr_at(self.updates, self.pc, self.total_updates)
        if not (torch.isfinite(grad_norm) and torch.isfinite(torch.tensor(total))):
            self.optimizer.zero_grad(set_to_none=True)
            return {"grad_norm": float(grad_norm), "lr": step_lr, "skipped": 1.0, "surrogate": total}
        for group in self.optimizer.param_groups:
            group["lr"] = step_lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1
        return {"grad_norm": float(grad_norm), "lr": step_lr, "skipped": 0.0, "surrogate": total}

    # ------------------------------------------------------------------------------------------------------------------
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF checkpoint name, tensor) for every parameter (tied weights once; MoE experts one by one)."""
        yield from weights.to_checkpoint_layout(self._parameters())

    def _parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, p in self.model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield name, p.detach()

    def save(self, directory: Path) -> None:
        """Weights (HF folder: config + safetensors), optimizer state and the update counter (rank 0 writes).

        The tokenizer files of the model the policy was built from are saved with them, so the checkpoint's
        ``policy/`` is a complete Hugging Face folder (``nemo-disco convert --checkpoint`` exports it).
        """
        if self.dp_rank != 0:
            return
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory, safe_serialization=True)
        files.honour_umask_tree(directory)
        for name in files.TOKENIZER_FILES:
            if (self.model_dir / name).is_file():
                shutil.copyfile(self.model_dir / name, directory / name)
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "policy_state.json").write_text(json.dumps({"updates": self.updates, "backend": "hf"}))

    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` wrote."""
        from safetensors.torch import load_file

        directory = Path(directory)
        state = {}
        for f in sorted(directory.glob("*.safetensors")):
            state.update(load_file(f))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(
                f"{directory}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})"
            )
        self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=self.device))
        self.updates = json.loads((directory / "policy_state.json").read_text())["updates"]

    def offload(self, *, weights: bool = True) -> None:
        """Move optimizer state and (``weights``) the weights to CPU (a no-op on a CPU-only machine)."""
        self._move(torch.device("cpu"), weights=weights)

    def onload(self) -> None:
        """Move weights and optimizer state back to the accelerator."""
        self._move(self.device)

    def _move(self, device: torch.device, *, weights: bool = True) -> None:
        if weights:
            self.model.to(device)
        for state in (self.optimizer.state if self.optimizer is not None else {}).values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(device)
