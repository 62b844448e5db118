"""Checkpoint conversion between Hugging Face folders and Megatron policy directories.

- :func:`hf_to_megatron`: an HF folder -> a weights-only policy directory (``megatron.json``, HF ``config.json``
  and tokenizer files, ``model/`` dist checkpoint) that :class:`~nemo_disco.policy.megatron.MegatronPolicy`
  accepts as ``model_dir`` or loads with ``load``, at any TP / PP. Collective: run it in one process or
  under torchrun with a multiple of ``tp x pp`` processes (each converts only its shard).
- :func:`megatron_to_hf`: a training checkpoint (``<run>/checkpoints/step_N/`` holding ``config.yaml`` and
  ``policy/``) or a policy directory -> ``model.safetensors``, ``config.json``, tokenizer files and
  ``generation_config.json`` that ``transformers`` loads. Runs in one process (or collectively, every rank
  holding the full model at TP = PP = 1; rank 0 writes).

Every family of ``nemo_disco.weights`` converts (a MoE model with all its experts on each rank: expert
parallelism 1; the checkpoint stores experts globally, so it loads at any ``policy.expert_parallel_size``).
Both build the local layer spec whatever the machine: conversion moves weights only, and a checkpoint of
either spec loads into a model of either (``megatron.load_model_checkpoint``), so the result does not depend
on whether Transformer Engine happens to import where the conversion runs (``slurm/convert.sbatch`` has no GPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from nemo_disco import distributed, weights
from nemo_disco.config import RunConfig, load_resolved
from nemo_disco.policy import cpu_compat
from nemo_disco.policy import megatron as mp

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _hf_dtype(config: dict) -> str:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in mp._DTYPES:
        raise ValueError(f"config.json: dtype={name!r} is not one of {sorted(mp._DTYPES)}")
    return name


def hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    *,
    dtype: str | None = None,
    vocab_multiple: int = weights.DEFAULT_VOCAB_MULTIPLE,
) -> Path:
    """Convert an HF folder into a Megatron policy directory (weights only, update counter 0).

    Args:
        hf_dir: Hugging Face folder (config.json, safetensors, tokenizer).
        out_dir: the policy directory to write (replaced if it exists).
        tp: tensor-parallel size used for the conversion (the result loads at any TP / PP).
        pp: pipeline-parallel size used for the conversion.
        dtype: parameter dtype stored ("float32", "bfloat16", "float16"); default: the HF config's.
        vocab_multiple: vocabulary padding multiple (see ``weights.padded_vocab_size``).

    Returns:
        ``out_dir``.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    spec = weights.ModelSpec.from_dir(hf_dir)
    dtype = dtype or _hf_dtype(json.loads((hf_dir / "config.json").read_text()))
    cpu_compat.apply()
    mp.init_parallel(tp, pp, ep=1 if spec.is_moe else None)
    padded = weights.padded_vocab_size(spec.vocab_size, tp, vocab_multiple)
    config = mp.transformer_config(spec, tp=tp, pp=pp, dtype=mp._DTYPES[dtype], use_te=False, recompute=False)
    model = mp.build_gpt_model(spec, config, padded, use_te=False)
    mp.load_hf_weights(model, hf_dir, spec, padded)
    if distributed.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    mp.save_model_checkpoint(model, out_dir / "model")
    if distributed.rank() == 0:
        meta = {
            "updates": 0,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "dtype": dtype,
            "vocab_size": spec.vocab_size,
            "padded_vocab_size": padded,
            "vocab_multiple": vocab_multiple,
            "layer_spec": "local",
        }
        mp.write_policy_files(out_dir, hf_dir, meta)
    distributed.barrier()
    return out_dir


def find_policy_dir(checkpoint_dir: str | Path) -> Path:
    """The policy directory of a step checkpoint (``<step>/policy``) or the directory itself.

    Raises:
        ValueError: neither holds a ``megatron.json``.
    """
    path = Path(checkpoint_dir)
    for candidate in (path / "policy", path):
        if mp.is_checkpoint_dir(candidate):
            return candidate
    raise ValueError(f"{path}: neither it nor {path / 'policy'} is a Megatron policy directory (no megatron.json)")


def megatron_to_hf(checkpoint_dir: str | Path, out_dir: str | Path, config: RunConfig | None = None) -> Path:
    """Write a Hugging Face folder from a Megatron checkpoint.

    Args:
        checkpoint_dir: ``<run>/checkpoints/step_N`` or its ``policy/`` directory (or an ``hf_to_megatron`` output).
        out_dir: the HF folder to write.
        config: the run config; default: ``config.yaml`` next to ``policy/`` when present. It sets the default
            sampling in ``generation_config.json`` (the temperature / top-p / top-k the policy was trained with).

    Returns:
        ``out_dir``.
    """
    from safetensors.torch import save_file

    policy_dir = find_policy_dir(checkpoint_dir)
    meta = mp.read_checkpoint_meta(policy_dir)
    if config is None and (policy_dir.parent / "config.yaml").is_file() and policy_dir.name == "policy":
        config = load_resolved(policy_dir.parent / "config.yaml")
    spec = weights.ModelSpec.from_dir(policy_dir)
    dtype = mp._DTYPES[meta["dtype"]]
    cpu_compat.apply()
    mp.init_parallel(1, 1, ep=1 if spec.is_moe else None)
    tf_config = mp.transformer_config(spec, tp=1, pp=1, dtype=dtype, use_te=False, recompute=False)
    model = mp.build_gpt_model(spec, tf_config, int(meta["padded_vocab_size"]), use_te=False)
    mp.load_model_checkpoint(model, policy_dir / "model")
    # Own contiguous copies: the q / k / v (and gate / up) views share storage, which safetensors refuses.
    state = {
        name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for name, t in weights.export_hf(dict(model.named_parameters()), spec)
    }
    out_dir = Path(out_dir)
    if distributed.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        hf_config = json.loads((policy_dir / "config.json").read_text())
        hf_config["dtype"] = _DTYPE_NAMES[dtype]
        hf_config.pop("torch_dtype", None)
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for name in mp.TOKENIZER_FILES:
            if (policy_dir / name).is_file() and name != "generation_config.json":
                shutil.copyfile(policy_dir / name, out_dir / name)
        (out_dir / "generation_config.json").write_text(
            json.dumps(_generation_config(policy_dir, hf_config, config), indent=2) + "\n"
        )
    distributed.barrier()
    return out_dir


def _generation_config(policy_dir: Path, hf_config: dict, config: RunConfig | None) -> dict:
    """The source's generation config (or the special token ids of config.json), with the run's sampling."""
    source = policy_dir / "generation_config.json"
    gen = json.loads(source.read_text()) if source.is_file() else {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if hf_config.get(key) is not None:
            gen.setdefault(key, hf_config[key])
    if config is not None:
        g = config.generation
        gen.update(do_sample=True, temperature=g.temperature, top_p=g.top_p)
        if g.top_k > 0:
            gen["top_k"] = g.top_k
    gen.pop("transformers_version", None)
    return gen
