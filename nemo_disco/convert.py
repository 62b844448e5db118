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

import contextlib
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nemo_disco import distributed, weights
from nemo_disco.config import RunConfig, load_resolved
from nemo_disco.files import TOKENIZER_FILES, save_safetensors
from nemo_disco.policy import cpu_compat
from nemo_disco.policy import megatron_model as mm

HF_POLICY_STATE = "policy_state.json"
_DTYPE_NAMES = {dtype: name for name, dtype in weights.DTYPES.items()}
#: Third-party warnings a conversion meets every time, noise to the user converting weights: megatron-core's at
#: every ``TransformerConfig`` built with its own default ``cuda_graph_scope`` ("full"; a conversion captures no
#: CUDA graph), and torch's two deprecations met by megatron-core's checkpoint loader (``load_state_dict``,
#: ``ShardedTensor``). (message regex, category) each; only these are silenced, and only where they are raised.
KNOWN_WARNINGS = (
    (r"full scope is deprecated", UserWarning),
    (r"`load_state_dict` is deprecated", FutureWarning),
    (r"Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning),
    # torch.distributed.checkpoint under megatron-core 0.19's load in one process (what a conversion is):
    (r"torch.distributed is disabled, unavailable or uninitialized", UserWarning),
    (r"The argument order of load has been changed", UserWarning),
)


@contextlib.contextmanager
def _known_warnings_silenced() -> Iterator[None]:
    """:data:`KNOWN_WARNINGS` ignored inside; any other warning shows as it would."""
    with warnings.catch_warnings():
        for message, category in KNOWN_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _transformer_config(spec: weights.ModelSpec, *, tp: int, pp: int, dtype: torch.dtype) -> Any:
    """The conversion's ``TransformerConfig`` (local spec, no recompute), without megatron-core's known warning."""
    with _known_warnings_silenced():
        return mm.transformer_config(spec, tp=tp, pp=pp, dtype=dtype, use_te=False, recompute=False)


def _hf_dtype(config: dict) -> str:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in weights.DTYPES:
        raise ValueError(f"config.json: dtype={name!r} is not one of {sorted(weights.DTYPES)}")
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

    Megatron's distributed checkpoints store every tensor globally, so the result loads at any TP / PP: ``tp``
    and ``pp`` are the layout the checkpoint is meant for (recorded in ``megatron.json``; the vocabulary is
    padded for ``tp``). When the processes running the conversion do not form that layout (one process, the
    usual case: ``nemo-disco convert --from-hf DIR --tp 2``), the tensors are written from a TP 1 x PP 1 model:
    the same checkpoint, no launcher needed. Under torchrun with a multiple of ``tp x pp`` processes each rank
    converts only its shard.

    Args:
        hf_dir: Hugging Face folder (config.json, safetensors, tokenizer).
        out_dir: the policy directory to write (replaced if it exists).
        tp: tensor-parallel size the checkpoint is meant for (it loads at any TP / PP).
        pp: pipeline-parallel size the checkpoint is meant for.
        dtype: parameter dtype stored ("float32", "bfloat16", "float16"); default: the HF config's.
        vocab_multiple: vocabulary padding multiple (see ``weights.padded_vocab_size``).

    Returns:
        ``out_dir``.
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"--tp {tp} --pp {pp}: both must be >= 1")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    spec = weights.ModelSpec.from_dir(hf_dir)
    dtype = dtype or _hf_dtype(json.loads((hf_dir / "config.json").read_text()))
    cpu_compat.apply()
    world = distributed.read_env().world_size
    run_tp, run_pp = (tp, pp) if world % (tp * pp) == 0 else (1, 1)  # the layout the processes can form
    mm.init_parallel(run_tp, run_pp, ep=1 if spec.is_moe else None)
    padded = weights.padded_vocab_size(spec.vocab_size, tp, vocab_multiple)
    config = _transformer_config(spec, tp=run_tp, pp=run_pp, dtype=weights.DTYPES[dtype])
    model = mm.build_gpt_model(spec, config, padded, use_te=False)
    mm.load_hf_weights(model, hf_dir, spec, padded)
    if distributed.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    mm.save_model_checkpoint(model, out_dir / "model")
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
            "written_at": {"tensor_parallel_size": run_tp, "pipeline_parallel_size": run_pp},
        }
        mm.write_policy_files(out_dir, hf_dir, meta)
    distributed.barrier()
    return out_dir


def find_policy_dir(checkpoint_dir: str | Path) -> Path:
    """The policy directory of a step checkpoint (``<step>/policy``) or the directory itself.

    Raises:
        ValueError: neither holds a ``megatron.json``.
    """
    path = Path(checkpoint_dir)
    for candidate in (path / "policy", path):
        if mm.is_checkpoint_dir(candidate):
            return candidate
    raise ValueError(f"{path}: neither it nor {path / 'policy'} is a Megatron policy directory (no megatron.json)")


def is_hf_policy_dir(path: str | Path) -> bool:
    """Whether ``path`` is a policy directory written by the transformers policy (``policy.backend=hf``)."""
    state = Path(path) / HF_POLICY_STATE
    if not state.is_file():
        return False
    try:
        return json.loads(state.read_text()).get("backend") == "hf"
    except (json.JSONDecodeError, AttributeError):
        return False


def verify_checkpoint(checkpoint_dir: str | Path) -> None:
    """Check a step checkpoint against its manifest, as a resume does (a policy directory alone has none).

    Raises:
        ValueError: a missing, truncated or changed file; one line naming the checkpoint and the first problems.
    """
    from nemo_disco import checkpoint

    path = Path(checkpoint_dir)
    step = path.parent if path.name == "policy" and (path.parent / "trainer_state.json").is_file() else path
    if not (step / "trainer_state.json").is_file():
        return  # a bare policy directory (hf_to_megatron's output): nothing to check against
    problems, _ = checkpoint.verify(step)
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise ValueError(f"checkpoint {step} is damaged: {'; '.join(problems[:2])}{more}; convert another step")


def checkpoint_to_hf(
    checkpoint_dir: str | Path, out_dir: str | Path, config: RunConfig | None = None, *, verify: bool = True
) -> Path:
    """Write a Hugging Face folder from any checkpoint a run writes, whatever its policy backend.

    ``<run>/checkpoints/step_N`` (or its ``policy/``) of a Megatron run goes through :func:`megatron_to_hf`; one
    of a transformers-policy run (``policy.backend=hf``, the CPU demo) through :func:`hf_policy_to_hf`. The
    checkpoint is verified against its manifest first (``verify``).

    Raises:
        ValueError: not a checkpoint of either kind, or a damaged one (one line naming it).
    """
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    if verify:
        verify_checkpoint(path)
    for candidate in (path / "policy", path):
        if mm.is_checkpoint_dir(candidate):
            return megatron_to_hf(candidate, out_dir, config)
        if is_hf_policy_dir(candidate):
            return hf_policy_to_hf(candidate, out_dir, config)
    raise ValueError(
        f"{path}: neither it nor {path / 'policy'} is a policy checkpoint (no megatron.json of the Megatron policy, "
        f"no {HF_POLICY_STATE} of the transformers policy)"
    )


def _run_config(policy_dir: Path) -> RunConfig | None:
    """The resolved ``config.yaml`` saved next to ``policy/`` in a step checkpoint, if any."""
    if policy_dir.name == "policy" and (policy_dir.parent / "config.yaml").is_file():
        return load_resolved(policy_dir.parent / "config.yaml")
    return None


def tokenizer_source(policy_dir: Path, config: RunConfig | None) -> Path:
    """Where a checkpoint's tokenizer files are.

    The checkpoint itself (the policies save them with every checkpoint), else, for a checkpoint written before
    they did, the model the run started from: ``policy.model_path``, or ``<run>/init_model`` for a model built
    in code.

    Raises:
        ValueError: none of these holds tokenizer files (the places tried are named).
    """
    tried = [policy_dir]
    if config is not None:
        if config.policy.model_path is not None:
            tried.append(Path(config.policy.model_path).expanduser())
        step = policy_dir.parent
        tried.append(step.parent.parent / "init_model")  # <run>/checkpoints/step_N -> <run>/init_model
        tried.append(Path(config.logging.run_dir) / "init_model")
    for folder in tried:
        if any((folder / name).is_file() for name in TOKENIZER_FILES if name != "generation_config.json"):
            return folder
    raise ValueError(
        f"{policy_dir}: no tokenizer files in the checkpoint, nor where the run started "
        f"(tried {', '.join(str(t) for t in tried)})"
    )


def hf_policy_to_hf(policy_dir: str | Path, out_dir: str | Path, config: RunConfig | None = None) -> Path:
    """Write a Hugging Face folder from a transformers-policy checkpoint (``policy.backend=hf``).

    The weights are the policy's own safetensors (copied, mode from the umask); ``config.json`` and the
    tokenizer files come with them, and ``generation_config.json`` carries the run's sampling as
    :func:`megatron_to_hf` writes it. The optimizer state is left out.
    """
    policy_dir, out_dir = Path(policy_dir), Path(out_dir)
    if config is None:
        config = _run_config(policy_dir)
    weights_files = sorted(policy_dir.glob("*.safetensors")) + sorted(policy_dir.glob("*.safetensors.index.json"))
    if not weights_files or not (policy_dir / "config.json").is_file():
        raise ValueError(f"{policy_dir}: a transformers-policy checkpoint without config.json or *.safetensors")
    tokenizer_dir = tokenizer_source(policy_dir, config)
    if distributed.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in weights_files:
            shutil.copyfile(f, out_dir / f.name)  # a new file: the umask's mode, not the source's
        shutil.copyfile(policy_dir / "config.json", out_dir / "config.json")
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file() and name != "generation_config.json":
                shutil.copyfile(tokenizer_dir / name, out_dir / name)
        hf_config = json.loads((policy_dir / "config.json").read_text())
        source = policy_dir if (policy_dir / "generation_config.json").is_file() else tokenizer_dir
        (out_dir / "generation_config.json").write_text(
            json.dumps(_generation_config(source, hf_config, config), indent=2) + "\n"
        )
    distributed.barrier()
    return out_dir


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
    policy_dir = find_policy_dir(checkpoint_dir)
    meta = mm.read_checkpoint_meta(policy_dir)
    if config is None:
        config = _run_config(policy_dir)
    spec = weights.ModelSpec.from_dir(policy_dir)
    dtype = weights.DTYPES[meta["dtype"]]
    cpu_compat.apply()
    mm.init_parallel(1, 1, ep=1 if spec.is_moe else None)
    tf_config = _transformer_config(spec, tp=1, pp=1, dtype=dtype)
    model = mm.build_gpt_model(spec, tf_config, int(meta["padded_vocab_size"]), use_te=False)
    try:
        with _known_warnings_silenced():
            mm.load_model_checkpoint(model, policy_dir / "model")
    except (ValueError, KeyboardInterrupt, SystemExit):
        raise
    # A truncated or changed file of a checkpoint without a manifest: torch's CheckpointException (a
    # BaseException) wrapping the EOFError / UnpicklingError of each rank.
    except BaseException as err:
        err = next(iter(getattr(err, "failures", {}).values()), err)
        err = err[0] if isinstance(err, tuple) and err else err
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"checkpoint {policy_dir} cannot be read: {type(err).__name__}{': ' + text[:200] if text else ''} "
            "(damaged or incomplete)"
        ) from None
    # Own contiguous copies: the q / k / v (and gate / up) views share storage, which safetensors refuses.
    state = {
        name: t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        for name, t in weights.export_hf(dict(model.named_parameters()), spec)
    }
    out_dir = Path(out_dir)
    if distributed.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_safetensors(state, out_dir / "model.safetensors", metadata={"format": "pt"})
        hf_config = json.loads((policy_dir / "config.json").read_text())
        hf_config["dtype"] = _DTYPE_NAMES[dtype]
        hf_config.pop("torch_dtype", None)
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for name in TOKENIZER_FILES:
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
