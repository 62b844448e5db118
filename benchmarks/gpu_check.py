"""GPU validation of the project's own GPU code: one command, independent stages, one JSON file each.

Meant for one CUDA GPU with no network, torch and transformers installed, and the wheels that
``scripts/gpu-check-wheels.sh`` prepares per Python version (megatron-core, pydantic, omegaconf, hydra-core,
math-verify, trl ...) installed by ``scripts/gpu-check.sh``. No vLLM and no Transformer Engine are needed: what
needs them is reported as skipped, never replaced silently. ``--smoke`` runs every stage on the CPU with tiny
shapes (what CI runs, so the script cannot rot); its figures mean nothing.

Precision and layer spec: every stage sets ``policy.transformer_engine`` explicitly (never "auto") and records the
spec it ran. fp32 runs use the local spec with TF32 off: Transformer Engine computes fp32 GEMMs in TF32 whatever
torch's flags say and has no fp32 attention for packed (THD) inputs, so it would fail a 1e-4 tolerance for reasons
of its own. TE is checked in bf16 only, against bf16 tolerances (``BF16_TOL``).

Stages (each in a process of its own, so one failure leaves the others standing; each writes
``<out>/<stage>.json`` with ``status`` "ok", "failed" (the traceback's tail) or "skipped", its ``pass_rule``
(and ``tolerance`` where figures are compared), ``timeout_s`` and ``timed_out``):

- ``collectives``: every helper of ``nemo_disco.distributed`` with the tensors the trainer gives it (host
  tensors: reward counts, log-probs after ``.cpu()``, the signal flag, rollout records) on the default and
  Megatron's data-parallel groups (NCCL on a GPU, one rank), and the defect they prevent: a host tensor
  handed to NCCL directly raises.
- ``logprob_parity``: ``MegatronPolicy`` on a small Qwen2 (tied) and a small Llama: per-token log-probs and
  entropy against transformers' fp32 forward, in bf16 on the local spec, in bf16 on TE (when TE imports on
  CUDA; else recorded as skipped) and in fp32 on the local spec; bf16 max 0.15 / mean 0.02, fp32 max 1e-4.
- ``grad_step``: fp32, local spec, TF32 off: the exact gradient of a surrogate against transformers' autograd,
  one optimizer update (mcore's optimizer on GPU) against a reference AdamW with the same decay groups and
  clipping, and a non-finite surrogate that must leave the weights untouched.
- ``offload_checkpoint``: bf16 (TE where it imports), with and without the distributed optimizer: three offload
  / onload rounds (allocated memory after freeing gradients + optimizer state, after the weights, after onload;
  log-probs bitwise equal after each onload), a dist-checkpoint round trip, the forward-only reference policy's
  memory, and a Transformer Engine <-> local checkpoint load when TE imports.
- ``moe``: a small Qwen3-MoE (every layer sparse, top-2) built, ``logprobs``, one ``train_minibatch`` and
  ``export_weights()``, in bf16 (TE where it imports) and in fp32 (local): every GPTModel parameter and buffer on
  ``policy.device`` (mcore builds the router on the host), log-probs within the dtype's tolerance of
  transformers' fp32 forward, the exported tensors on one device and finite, the update changes weights.
- ``trainer``: ``algorithm.train_step`` with the Megatron policy (bf16, TE where it imports) and the
  transformers generator on a random model of DeepSeek-R1-Distill-Qwen-1.5B's shape (fixed-length rollouts):
  step time and phases, completion tokens/s, training-pass MFU against ``--peak-tflops`` (790 bf16 on an H200,
  measured), decode tokens/s against the HBM bound (``--hbm-tbps``, 4.3 on an H200), peak memory, mismatch metrics.
- ``trl``: TRL's GRPOTrainer on the same model, prompts, sizes and lengths (bf16, transformers generate), for
  the ratio that ``summary.json`` reports next to ``trainer``.

``environment.json`` also records what torch.compile needs for Megatron's fused bias / SwiGLU / bias-dropout
kernels (the Triton version or its import error, ``$CC`` and cc / gcc / clang); a GPU run without them warns in
the summary. The first compile takes minutes: the model stages get 600 s each by default (``--stage-timeout``
sets one limit for all).

Run::

    bash scripts/gpu-check.sh                 # on the GPU machine: results in $OUT (or --out DIR)
    bash scripts/gpu-check.sh --smoke         # tiny shapes on CPU
    python benchmarks/gpu_check.py --stages collectives,grad_step --out runs/gpu-check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

STAGES = ("collectives", "logprob_parity", "grad_step", "offload_checkpoint", "moe", "trainer", "trl")
# Default seconds per stage process. The model stages' first forward on a GPU compiles Megatron's fused
# bias / SwiGLU / bias-dropout kernels (torch.compile: Triton and a host C compiler), which alone can take minutes.
STAGE_TIMEOUT_S = {name: 600 for name in STAGES} | {"collectives": 300}
# Log-prob / entropy tolerances against transformers' fp32 forward (absolute, nats, over the real response tokens).
# bf16 holds 8 mantissa bits: ~0.4% per rounding, ~0.05 nats at the tails of a random model's distribution.
BF16_TOL = {"max": 0.15, "mean": 0.02}
# fp32 with TF32 off on the local layer spec (Transformer Engine runs fp32 GEMMs in TF32 and has no fp32
# attention for packed sequences, so an fp32 stage never builds it).
FP32_TOL = {"max": 1e-4}
TOLERANCES = {"bfloat16": BF16_TOL, "float32": FP32_TOL}
TEMPERATURE = 0.7
ENT_COEF = 0.25  # weight of the entropy in the check surrogate
TRAINER_SHAPE = {  # DeepSeek-R1-Distill-Qwen-1.5B's config.json (a Qwen2), random weights
    "hidden_size": 1536,
    "num_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}
SMOKE_TRAINER_SHAPE = {**TRAINER_SHAPE, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4}
SMOKE_TRAINER_SHAPE.update(intermediate_size=128, vocab_size=512)


# ----------------------------------------------------------------------------------------------------------------------
# Shared pieces


def _torch() -> Any:
    import torch

    return torch


def _cuda() -> bool:
    return _torch().cuda.is_available()


def _strict_fp32() -> None:
    """Full float32 matmuls (parity checks): TF32 would round to ~1e-3."""
    torch = _torch()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _sync() -> None:
    if _cuda():
        _torch().cuda.synchronize()


def _allocated() -> int | None:
    if not _cuda():
        return None
    _sync()
    return int(_torch().cuda.memory_allocated())


def compile_toolchain() -> dict[str, Any]:
    """What torch.compile needs for Megatron's fused kernels on a GPU: Triton and a host C compiler.

    Triton compiles the kernels; its launcher stubs are C, built with ``$CC`` or the first of cc / gcc / clang.
    """
    try:
        import triton

        triton_info: dict[str, Any] = {"version": triton.__version__, "error": None}
    except Exception as err:  # noqa: BLE001  (a broken install raises more than ImportError)
        triton_info = {"version": None, "error": f"{type(err).__name__}: {err}"}
    cc_env = os.environ.get("CC")
    found = {name: shutil.which(name) for name in ("cc", "gcc", "clang")}
    compiler = (shutil.which(cc_env) if cc_env else None) or next((p for p in found.values() if p), None)
    return {"triton": triton_info, "CC": cc_env, "which": found, "c_compiler": compiler}


def toolchain_warnings(env: dict[str, Any]) -> list[str]:
    """One line per missing piece of torch.compile's toolchain, on a GPU run only (the CPU path compiles nothing)."""
    if env.get("device", {}).get("name") == "cpu":
        return []
    tc = env.get("torch_compile", {})
    out = []
    if tc.get("triton", {}).get("error"):
        out.append(f"triton does not import ({tc['triton']['error']}): Megatron's fused kernels will fail or fall back")
    if not tc.get("c_compiler"):
        out.append("no C compiler (CC, cc, gcc, clang): Triton cannot build its launchers, fused kernels will fail")
    return out


def te_for_bf16() -> tuple[bool, str]:
    """Whether the bf16 stages build Transformer Engine (it imports on CUDA), and why: set explicitly, never "auto"."""
    from nemo_disco.policy import megatron_model as mm

    if not _cuda():
        return False, "no CUDA"
    err = mm.te_import_error()
    return (err is None), ("transformer_engine imports" if err is None else err)


def within(r: dict[str, Any], tol: dict[str, float]) -> bool:
    """Log-prob and entropy differences (``_diff`` results) both inside ``tol`` (max, and mean where given)."""
    return all(
        r[k]["max"] <= tol["max"] and r[k]["mean"] <= tol.get("mean", math.inf)
        for k in ("logprob_diff", "entropy_diff")
    )


def environment() -> dict[str, Any]:
    """Device, library versions, the optional GPU modules (imported or the reason they are not), compile toolchain."""
    from importlib.metadata import PackageNotFoundError, version

    torch = _torch()
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for pkg in ("megatron-core", "transformers", "trl", "accelerate", "math-verify", "pydantic", "vllm"):
        try:
            info[pkg] = version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    if _cuda():
        p = torch.cuda.get_device_properties(0)
        info["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": p.total_memory / 2**30}
    else:
        info["device"] = {"name": "cpu"}
    from nemo_disco.policy import megatron_model as mm

    info["transformer_engine_import_error"] = mm.te_import_error() if _cuda() else "not tried (no CUDA)"
    info["fusions_on_this_machine"] = mm.fusion_flags(_cuda(), use_te=False)
    info["torch_compile"] = compile_toolchain()
    return info


def small_model(root: Path, architecture: str, tied: bool, smoke: bool) -> Path:
    """A random small Qwen2 / Llama HF folder (char tokenizer): tiny on CPU, head_dim 64 on GPU."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    shape = {} if smoke else {"hidden_size": 512, "num_attention_heads": 8, "num_layers": 4, "intermediate_size": 1408}
    tiny = TinyModelConfig(architecture=architecture, tie_word_embeddings=tied, max_position_embeddings=512, **shape)
    name = f"{architecture}_{'tied' if tied else 'untied'}"
    return build_model(tiny, root / name, seed=0)


def moe_model(root: Path, smoke: bool) -> Path:
    """A random Qwen3-MoE HF folder (all layers sparse, top-2, untied): tiny on CPU, head_dim 64 on GPU."""
    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    shape = (
        {"head_dim": 32, "moe_intermediate_size": 32}
        if smoke
        else {"hidden_size": 512, "num_attention_heads": 8, "num_layers": 4, "head_dim": 64}
        | {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
    )
    tiny = TinyModelConfig(architecture="qwen3_moe", tie_word_embeddings=False, max_position_embeddings=512, **shape)
    return build_model(tiny, root / "qwen3_moe", seed=0)


def random_batch(smoke: bool, seed: int = 0) -> Any:
    """Random prompts and responses (token ids 5..99 of the char tokenizer), one empty response."""
    from nemo_disco.batch import collate

    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    n, (p_lo, p_hi), (r_lo, r_hi) = (8, (2, 7), (1, 8)) if smoke else (16, (8, 33), (16, 129))

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(5, 100, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts = [draw(p_lo, p_hi) for _ in range(n)]
    responses = [draw(r_lo, r_hi) for _ in range(n)]
    responses[3] = []
    return collate(prompts, responses, [[0.0] * len(r) for r in responses], list(range(n)), [1.0] * n, pad_id=0)


def run_config(model_dir: Path, run_dir: Path, **over: Any) -> Any:
    """The exemplar recipe on one process with this model; ``over``: ``section.key`` -> value."""
    from nemo_disco import config

    overrides = [
        "cluster.gpus_per_node=1",
        f"policy.model_path={model_dir}",
        f"logging.run_dir={run_dir}",
        f"generation.temperature={TEMPERATURE}",
        "algorithm.prompts_per_step=8",
        "algorithm.minibatch_prompts=4",
        "algorithm.rollouts_per_prompt=1",
        "policy.microbatch_tokens=512",
        "policy.logprob_chunk_size=64",
    ]
    overrides += [f"{k}={v}" for k, v in over.items()]
    return config.load(C.ROOT / "recipes" / "disco.yaml", overrides)


def coefficients(n: int) -> Any:
    return _torch().linspace(-1.0, 1.0, n)


def surrogate(coef: Any, ent_coef: float = ENT_COEF) -> Callable:
    """sum_i c_i * sum_t logp_it + ent_coef * sum entropy (a stand-in for any loss's surrogate)."""

    def fn(rows, lp, ent):  # noqa: ANN001, ANN202
        out = (coef.to(lp.device)[rows.to(lp.device)].unsqueeze(1) * lp).sum()
        return out + ent_coef * ent.sum() if ent is not None else out

    return fn


def hf_reference(model_dir: Path, batch: Any, *, grads: bool) -> dict[str, Any]:
    """transformers' fp32 forward one unpadded sequence at a time: log-probs, entropy, surrogate gradient."""
    from transformers import AutoModelForCausalLM

    torch = _torch()
    device = "cuda" if _cuda() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    n, width = batch.response_ids.shape
    lp, ent = torch.zeros(n, width), torch.zeros(n, width)
    coef = coefficients(n)
    model.zero_grad()
    for i in range(n):
        p = batch.prompt_ids[i][batch.prompt_mask[i]]
        r = batch.response_ids[i][batch.response_mask[i]]
        if len(r) == 0:
            continue
        with torch.set_grad_enabled(grads):
            logits = model(input_ids=torch.cat([p, r]).unsqueeze(0).to(device)).logits[0] / TEMPERATURE
            logp_all = torch.log_softmax(logits[len(p) - 1 : -1].float(), -1)
            lpi = logp_all.gather(-1, r.to(device).unsqueeze(-1)).squeeze(-1)
            enti = -(logp_all.exp() * logp_all).sum(-1)
            if grads:
                (coef[i] * lpi.sum() + ENT_COEF * enti.sum()).backward()
        lp[i, : len(r)] = lpi.detach().cpu()
        ent[i, : len(r)] = enti.detach().cpu()
    out: dict[str, Any] = {"lp": lp, "ent": ent, "model": model}
    if grads:
        out["grads"] = {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}
    return out


def _diff(a: Any, b: Any, mask: Any) -> dict[str, float]:
    d = (a - b).abs()[mask]
    return {"max": float(d.max()) if d.numel() else 0.0, "mean": float(d.mean()) if d.numel() else 0.0}


# ----------------------------------------------------------------------------------------------------------------------
# Stages


def stage_collectives(args: argparse.Namespace) -> dict[str, Any]:
    torch = _torch()
    import torch.distributed as dist  # the check shows the raw defect; the package itself never does this

    from nemo_disco import distributed
    from nemo_disco.policy import cpu_compat
    from nemo_disco.policy import megatron_model as mm

    cpu_compat.apply()
    mm.init_parallel(1, 1)
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_group()
    res: dict[str, Any] = {
        "default_backends": distributed.backend_devices(),
        "data_parallel_backends": distributed.backend_devices(dp),
    }
    checks: dict[str, Any] = {}

    def check(name: str, fn: Callable[[], Any], expect: Any) -> None:
        try:
            got = fn()
            checks[name] = {"ok": got == expect, "got": got}
        except Exception as err:  # noqa: BLE001
            checks[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}

    lp_host = torch.arange(12, dtype=torch.float32).view(3, 4)  # policy.logprobs(...) returns host tensors
    check("reward_counts_sum_floats", lambda: distributed.sum_floats([1.0, 2.0], dp), [1.0, 2.0])
    check("logprob_rows_all_gather_rows", lambda: distributed.all_gather_rows(lp_host, dp).tolist(), lp_host.tolist())
    check("logprob_rows_stay_on_host", lambda: str(distributed.all_gather_rows(lp_host, dp).device), "cpu")
    check("signal_max_int", lambda: distributed.max_int(10), 10)
    check("skip_flag_any_rank", lambda: distributed.any_rank(True), True)
    check("records_all_gather_object", lambda: distributed.all_gather_object([{"q": 1}]), [[{"q": 1}]])
    check("broadcast_object", lambda: distributed.broadcast_object({"a": 1}, 0), {"a": 1})
    host = torch.ones(3)
    check("host_all_reduce_in_place", lambda: distributed.all_reduce(host, "sum", dp) is host, True)
    if _cuda():
        dev = torch.ones(3, device="cuda")
        check("device_broadcast_in_place", lambda: distributed.broadcast(dev, 0, dp) is dev, True)
        try:
            dist.all_reduce(torch.ones(1), group=dp)
            res["raw_host_tensor_on_nccl"] = "accepted (unexpected)"
        except Exception as err:  # noqa: BLE001
            res["raw_host_tensor_on_nccl"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    res["checks"] = checks
    res["pass_rule"] = "every check returns the expected value (results back on the caller's device)"
    res["status"] = "ok" if all(c["ok"] for c in checks.values()) else "failed"
    return res


def _parity_one(
    model_dir: Path, dtype: str, use_te: bool, batch: Any, ref: dict[str, Any], run_dir: Path
) -> dict[str, Any]:
    from nemo_disco.policy.megatron import MegatronPolicy
    from nemo_disco.policy.megatron_model import LAYER_SPECS

    over = {"policy.dtype": dtype, "policy.transformer_engine": use_te}
    policy = MegatronPolicy.from_run_config(run_config(model_dir, run_dir, **over), model_dir)
    t0 = time.perf_counter()
    lp, ent = policy.logprobs(batch, entropy=True)
    _sync()
    mask = batch.response_mask
    out = {
        "dtype": dtype,
        "transformer_engine": use_te,
        "layer_spec": policy.layer_spec,
        "packed": policy.packed,
        "logprob_diff": _diff(lp, ref["lp"], mask),
        "entropy_diff": _diff(ent, ref["ent"], mask),
        "forward_s": time.perf_counter() - t0,
        "tolerance": TOLERANCES[dtype],
    }
    out["spec_as_asked"] = policy.layer_spec == LAYER_SPECS[0 if use_te else 1]
    out["within_tolerance"] = within(out, TOLERANCES[dtype])
    del policy
    return out


def stage_logprob_parity(args: argparse.Namespace) -> dict[str, Any]:
    _strict_fp32()
    root = Path(tempfile.mkdtemp(prefix="gpu_check_parity_"))
    batch = random_batch(args.smoke)
    te, te_why = te_for_bf16()
    # fp32 only on the local spec; TE only in bf16, where TF32 GEMMs and bf16 attention are inside the tolerance.
    runs = [("bfloat16_local", "bfloat16", False), ("float32_local", "float32", False)]
    if te:
        runs.insert(1, ("bfloat16_transformer_engine", "bfloat16", True))
    res: dict[str, Any] = {
        "tolerance": TOLERANCES,
        "pass_rule": "every run: log-prob and entropy |diff| vs transformers fp32 within its dtype's tolerance "
        "(bfloat16 max and mean, float32 max; TF32 off) on the layer spec it asked for",
        "transformer_engine_run": "ran" if te else f"skipped: {te_why}",
    }
    ok = True
    for arch, tied in (("qwen2", True), ("llama", False)):
        model_dir = small_model(root, arch, tied, args.smoke)
        ref = hf_reference(model_dir, batch, grads=False)
        del ref["model"]
        per: dict[str, Any] = {}
        for key, dtype, use_te in runs:
            per[key] = r = _parity_one(model_dir, dtype, use_te, batch, ref, root / "run")
            ok = ok and r["within_tolerance"] and r["spec_as_asked"]
        if not te:
            per["bfloat16_transformer_engine"] = {"status": "skipped", "why": te_why}
        res[f"{arch}_{'tied' if tied else 'untied'}"] = per
    res["status"] = "ok" if ok else "failed"
    return res


def stage_grad_step(args: argparse.Namespace) -> dict[str, Any]:
    _strict_fp32()
    torch = _torch()
    from nemo_disco.policy.megatron import MegatronPolicy

    root = Path(tempfile.mkdtemp(prefix="gpu_check_grad_"))
    model_dir = small_model(root, "qwen2", True, args.smoke)
    batch = random_batch(args.smoke)
    over = {
        "policy.dtype": "float32",
        "policy.transformer_engine": False,  # fp32 parity: TE would compute its GEMMs in TF32
        "policy.lr": 1e-3,
        "policy.weight_decay": 0.1,
        "policy.adam_eps": 1e-3,  # a smooth first Adam step (tiny gradient components would amplify rounding)
        "policy.grad_clip": 0.5,
    }
    policy = MegatronPolicy.from_run_config(run_config(model_dir, root / "run", **over), model_dir)
    coef = coefficients(len(batch))
    ref = hf_reference(model_dir, batch, grads=True)
    policy.accumulate_gradients(batch, surrogate(coef), entropy=True)
    grads = {name: g.detach().cpu().clone() for name, g in policy.export_gradients()}
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    grad_diff = max(float((grads[k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
    # One update against a reference AdamW over transformers' parameters with the same decay groups and clipping.
    model = ref["model"]
    params = [p for _, p in model.named_parameters()]
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
    coeff = min(1.0, 0.5 / (norm + 1e-6))
    for p in params:
        p.grad.mul_(coeff)
    groups = [
        {"params": [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]},
        {
            "params": [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1],
            "weight_decay": 0.0,
        },
    ]
    reference = torch.optim.AdamW(groups, lr=1e-3, eps=1e-3, weight_decay=0.1, betas=(0.9, 0.999))
    reference.step()
    out = policy.train_minibatch(batch, surrogate(coef), entropy=True)
    after = {name: t.detach().cpu().clone() for name, t in policy.export_weights()}
    expected = {name: p.detach().cpu() for name, p in model.named_parameters()}
    weight_diff = max(float((after[k] - expected[k]).abs().max()) for k in expected)
    nan = policy.train_minibatch(batch, lambda rows, lp, ent: lp.sum() * float("nan"), entropy=True)
    unchanged = all(torch.equal(t.detach().cpu(), after[k]) for k, t in policy.export_weights())
    res = {
        "layer_spec": policy.layer_spec,
        "tolerance": {"grad_max_abs_diff": "1e-4 x max(grad_scale, 1)", "weights_max_abs_diff_after_step": 1e-5},
        "pass_rule": "local spec, fp32 (TF32 off); gradient and one update vs transformers autograd + reference "
        "AdamW within tolerance; the NaN surrogate skips its update and leaves every weight bitwise unchanged; "
        "exactly 1 update counted",
        "optimizer": type(policy.optimizer).__name__,
        "distributed_optimizer": bool(policy.model.ddp_config.use_distributed_optimizer),
        "grad_max_abs_diff": grad_diff,
        "grad_scale": scale,
        "grad_norm": out["grad_norm"],
        "reference_grad_norm": norm,
        "weights_max_abs_diff_after_step": weight_diff,
        "nan_skipped": nan["skipped"],
        "nan_weights_unchanged": unchanged,
        "updates": policy.updates,
    }
    ok = grad_diff <= 1e-4 * max(scale, 1.0) and weight_diff <= 1e-5 and nan["skipped"] == 1.0 and unchanged
    res["status"] = "ok" if ok and policy.updates == 1 and policy.layer_spec == "local" else "failed"
    return res


def _off_device(policy: Any) -> list[str]:
    """Parameters and buffers of the GPTModel that are not on ``policy.device`` (name: device)."""
    named = [*policy.gpt.named_parameters(), *policy.gpt.named_buffers()]
    return [f"{name}: {t.device}" for name, t in named if t.device != policy.device]


def _moe_one(
    model_dir: Path, dtype: str, use_te: bool, batch: Any, ref: dict[str, Any], run_dir: Path
) -> dict[str, Any]:
    """One Qwen3-MoE policy: device placement, log-prob parity, one update, the exported weights."""
    torch = _torch()
    from nemo_disco.policy.megatron import MegatronPolicy
    from nemo_disco.policy.megatron_model import LAYER_SPECS

    over = {"policy.dtype": dtype, "policy.transformer_engine": use_te, "policy.lr": 1e-3}
    policy = MegatronPolicy.from_run_config(run_config(model_dir, run_dir, **over), model_dir)
    off_built = _off_device(policy)  # mcore builds the MoE router on the host
    lp, ent = policy.logprobs(batch, entropy=True)
    mask = batch.response_mask
    r: dict[str, Any] = {
        "dtype": dtype,
        "transformer_engine": use_te,
        "layer_spec": policy.layer_spec,
        "spec_as_asked": policy.layer_spec == LAYER_SPECS[0 if use_te else 1],
        "device": str(policy.device),
        "off_device_after_build": off_built,
        "logprob_diff": _diff(lp, ref["lp"], mask),
        "entropy_diff": _diff(ent, ref["ent"], mask),
        "tolerance": TOLERANCES[dtype],
    }
    r["within_tolerance"] = within(r, TOLERANCES[dtype])
    before = {name: t.detach().cpu().clone() for name, t in policy.export_weights()}
    step = policy.train_minibatch(batch, surrogate(coefficients(len(batch))), entropy=True)
    r["off_device_after_step"] = _off_device(policy)
    devices, nonfinite, changed = set(), [], []
    for name, t in policy.export_weights():
        devices.add(str(t.device))
        if not bool(torch.isfinite(t).all()):
            nonfinite.append(name)
        if not torch.equal(t.detach().cpu(), before[name]):
            changed.append(name)
    r.update(
        step={k: v for k, v in step.items() if k in ("grad_norm", "skipped") or k.startswith("router")},
        exported_tensors=len(before),
        exported_devices=sorted(devices),
        exported_nonfinite=nonfinite,
        exported_changed=len(changed),
        # Frozen routers (policy.freeze_router, the default) keep their weights; everything else trains (in bf16,
        # norm weights at 1.0 round back to 1.0 after one small step; the optimizer's fp32 main copy moves).
        exported_unchanged=sorted(set(before) - set(changed)),
    )
    r["ok"] = (
        r["spec_as_asked"]
        and not off_built
        and not r["off_device_after_step"]
        and r["within_tolerance"]
        and step["skipped"] == 0.0
        and math.isfinite(step["grad_norm"])
        and len(devices) == 1
        and not nonfinite
        and len(changed) > 0
    )
    del policy
    return r


def stage_moe(args: argparse.Namespace) -> dict[str, Any]:
    _strict_fp32()
    root = Path(tempfile.mkdtemp(prefix="gpu_check_moe_"))
    model_dir = moe_model(root, args.smoke)
    batch = random_batch(args.smoke)
    ref = hf_reference(model_dir, batch, grads=False)
    del ref["model"]
    te, te_why = te_for_bf16()
    res: dict[str, Any] = {
        "tolerance": TOLERANCES,
        "pass_rule": "each run: every GPTModel parameter and buffer on policy.device after build and after the "
        "step; log-probs and entropy vs transformers fp32 within the dtype's tolerance; the update not skipped, "
        "grad norm finite; export_weights() on one device, every tensor finite, at least one changed",
        "transformer_engine": te,
        "transformer_engine_why": te_why,
    }
    runs = {
        "bfloat16_" + ("transformer_engine" if te else "local"): ("bfloat16", te),
        "float32_local": ("float32", False),
    }
    ok = True
    for key, (dtype, use_te) in runs.items():
        res[key] = _moe_one(model_dir, dtype, use_te, batch, ref, root / "run")
        ok = ok and res[key]["ok"]
    res["status"] = "ok" if ok else "failed"
    return res


def _offload_rounds(policy: Any, batch: Any, rounds: int = 3) -> dict[str, Any]:
    torch = _torch()
    lp0, _ = policy.logprobs(batch)
    readings = []
    equal = True
    for _ in range(rounds):
        r = {"resident": _allocated()}
        policy.offload(weights=False)
        r["after_optimizer_offload"] = _allocated()
        policy.offload()
        r["after_weights_offload"] = _allocated()
        policy.onload()
        r["after_onload"] = _allocated()
        lp, _ = policy.logprobs(batch)
        equal = equal and bool(torch.equal(lp, lp0))
        readings.append(r)
    return {"rounds": readings, "logprobs_bitwise_equal_after_onload": equal}


def stage_offload_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    torch = _torch()
    from nemo_disco.policy.megatron import MegatronPolicy

    root = Path(tempfile.mkdtemp(prefix="gpu_check_offload_"))
    model_dir = small_model(root, "qwen2", False, args.smoke)
    batch = random_batch(args.smoke)
    coef = coefficients(len(batch))
    te, te_why = te_for_bf16()  # bf16: the production spec (TE where it imports), set explicitly
    res: dict[str, Any] = {
        "transformer_engine": te,
        "transformer_engine_why": te_why,
        "pass_rule": "per optimizer layout: on a GPU each offload phase frees memory; log-probs bitwise equal after "
        "every onload and after a checkpoint round trip; the restored policy counts 1 update and its next update's "
        "grad norm matches the original's (rel 1e-3). te_cross_spec is reported, not required",
    }
    ok = True
    for dist_opt in (True, False):
        over = {
            "policy.dtype": "bfloat16",
            "policy.transformer_engine": te,
            "policy.use_distributed_optimizer": dist_opt,
        }
        cfg = run_config(model_dir, root / "run", **over)
        before = _allocated()
        policy = MegatronPolicy.from_run_config(cfg, model_dir)
        policy.train_minibatch(batch, surrogate(coef), entropy=True)  # optimizer state exists from here on
        r: dict[str, Any] = {
            "layer_spec": policy.layer_spec,
            "policy_bytes": None if before is None else _allocated() - before,
        }
        r.update(_offload_rounds(policy, batch))
        if _cuda():
            first = r["rounds"][0]
            r["freed_by_optimizer_offload"] = first["resident"] - first["after_optimizer_offload"]
            r["freed_by_weights_offload"] = first["after_optimizer_offload"] - first["after_weights_offload"]
            ok = ok and r["freed_by_optimizer_offload"] > 0 and r["freed_by_weights_offload"] > 0
        ok = ok and r["logprobs_bitwise_equal_after_onload"]
        ckpt = root / f"ckpt_{dist_opt}"
        lp_saved, _ = policy.logprobs(batch)
        policy.save(ckpt)
        other = MegatronPolicy.from_run_config(cfg, model_dir)
        other.load(ckpt)
        r["checkpoint_logprobs_equal"] = bool(torch.equal(other.logprobs(batch)[0], lp_saved))
        r["checkpoint_updates"] = other.updates
        # The next update from the restored optimizer state matches the original's (GPU backward kernels may
        # accumulate in a different order: reported, not required to be bitwise).
        a = policy.train_minibatch(batch, surrogate(coef), entropy=True)
        b = other.train_minibatch(batch, surrogate(coef), entropy=True)
        r["next_update_grad_norm"] = [a["grad_norm"], b["grad_norm"]]
        r["next_update_weights_max_abs_diff"] = max(
            float((x.float() - y.float()).abs().max())
            for (_, x), (_, y) in zip(policy.export_weights(), other.export_weights(), strict=True)
        )
        same_norm = math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-3)
        ok = ok and r["checkpoint_logprobs_equal"] and r["checkpoint_updates"] == 1 and same_norm
        res[f"distributed_optimizer_{str(dist_opt).lower()}"] = r
        del policy, other
        if _cuda():
            torch.cuda.empty_cache()
    before = _allocated()
    ref_policy = MegatronPolicy.from_run_config(
        run_config(model_dir, root / "run", **{"policy.dtype": "bfloat16", "policy.transformer_engine": te}),
        model_dir,
        trainable=False,
    )
    res["reference_policy"] = {
        "bytes": None if before is None else _allocated() - before,
        **_offload_rounds(ref_policy, batch, rounds=1),
    }
    del ref_policy
    res["te_cross_spec"] = _te_cross_spec(model_dir, root, batch)
    res["status"] = "ok" if ok else "failed"
    return res


def _te_cross_spec(model_dir: Path, root: Path, batch: Any) -> dict[str, Any]:
    """A checkpoint written by a Transformer Engine model loads into a local-spec one and back (TE only)."""
    from nemo_disco.policy import megatron as mp

    te, why = te_for_bf16()
    if not te:
        return {"status": "skipped", "why": why}
    te_over = {"policy.dtype": "bfloat16", "policy.transformer_engine": True}
    te = mp.MegatronPolicy.from_run_config(run_config(model_dir, root / "run", **te_over), model_dir)
    te.save(root / "te_ckpt")
    lp_te, _ = te.logprobs(batch)
    local_over = {"policy.dtype": "bfloat16", "policy.transformer_engine": False}
    local = mp.MegatronPolicy.from_run_config(run_config(model_dir, root / "run", **local_over), model_dir)
    local.load(root / "te_ckpt")
    lp_local, _ = local.logprobs(batch)
    local.save(root / "local_ckpt")
    te.load(root / "local_ckpt")
    return {
        "status": "ok",
        "te_to_local_logprob_diff": _diff(lp_local, lp_te, batch.response_mask),
        "local_to_te_logprob_diff": _diff(te.logprobs(batch)[0], lp_te, batch.response_mask),
    }


def trainer_model(root: Path, smoke: bool) -> Path:
    """A random model of DeepSeek-R1-Distill-Qwen-1.5B's shape (bf16 on GPU) with the char tokenizer."""
    torch = _torch()
    from transformers import AutoModelForCausalLM

    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_tokenizer, hf_config

    shape = dict(SMOKE_TRAINER_SHAPE if smoke else TRAINER_SHAPE)
    vocab = shape.pop("vocab_size")
    out = root / "r1_qwen_1p5b_shape"
    tok = build_tokenizer(out)
    config = hf_config(
        TinyModelConfig(architecture="qwen2", max_position_embeddings=4096, **shape),
        vocab_size=vocab,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    dtype = torch.float32 if smoke else torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda" if _cuda() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.dtype = "float32" if smoke else "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    from nemo_disco.files import honour_umask_tree

    honour_umask_tree(out)
    return out


def _trainer_sizes(args: argparse.Namespace) -> dict[str, int]:
    return (
        {"prompts": 4, "rollouts": 4, "tokens": 8, "steps": 1}
        if args.smoke
        else {
            "prompts": 16,
            "rollouts": 8,
            "tokens": 256,
            "steps": 2,
        }
    )


def _matmul_params(shape: dict[str, int]) -> int:
    h, layers, ffn, vocab = shape["hidden_size"], shape["num_layers"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return layers * (2 * h * h + 2 * h * kv + 3 * h * ffn) + h * vocab


def stage_trainer(args: argparse.Namespace) -> dict[str, Any]:
    torch = _torch()
    from transformers import AutoTokenizer

    from nemo_disco.data import encode_prompts, load_problems

    sizes = _trainer_sizes(args)
    root = Path(tempfile.mkdtemp(prefix="gpu_check_trainer_"))
    model_dir = trainer_model(root, args.smoke)
    import bench_e2e_trl as E

    # bf16 on a GPU with TE where it imports (the production spec); the CPU smoke run is fp32 on the local spec.
    te = te_for_bf16()[0] and not args.smoke
    over = E.nd_overrides(model_dir, "disco", sizes["tokens"], 1 + sizes["steps"])
    over += [
        f"algorithm.prompts_per_step={sizes['prompts']}",
        f"algorithm.minibatch_prompts={sizes['prompts']}",
        f"algorithm.rollouts_per_prompt={sizes['rollouts']}",
        f"generation.hf_batch_size={sizes['prompts'] * sizes['rollouts']}",
        "policy.backend=megatron",
        "policy.dtype=" + ("float32" if args.smoke else "bfloat16"),
        f"policy.transformer_engine={str(te).lower()}",
        "policy.microbatch_tokens=16384",
        "policy.logprob_chunk_size=1024",
        "cluster.gpus_per_node=1",
    ]
    cfg = C.load_config(root / "run", over)
    if _cuda():
        torch.cuda.reset_peak_memory_stats()
    out = C.nd_steps(cfg, sizes["steps"], 1, fixed_length=True)
    phases = [C.step_phases(m) for m in out["metrics"]]
    step_s = statistics.median(out["wall_s"])
    rollouts = sizes["prompts"] * sizes["rollouts"]
    completion = statistics.median(out["completion_tokens"])
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems, _ = load_problems(cfg.data.train, synthetic_size=cfg.data.synthetic_size, seed=cfg.data.seed)
    ids, _, _ = encode_prompts(tok, problems, template=cfg.data.prompt_template, use_chat_template=False)
    # The prompts' mean length stands for the sampled ones' (the sampler draws uniformly from them).
    prompt_mean = statistics.fmean(len(x) for x in ids)
    shape = SMOKE_TRAINER_SHAPE if args.smoke else TRAINER_SHAPE
    n_matmul = _matmul_params(shape)
    tokens = rollouts * (prompt_mean + sizes["tokens"])
    # One update per step: the backward pass (forward + backward, 6 N per token) over every token; the old
    # log-probs are a forward pass (2 N per token). Attention FLOPs are left out (short sequences here).
    train_s = statistics.median(p["train"] for p in phases)
    logprob_s = statistics.median(p["old_logprobs"] for p in phases)
    generate_s = statistics.median(p["generate"] for p in phases)
    peak = args.peak_tflops * 1e12
    weight_bytes = 2 * (n_matmul + shape["hidden_size"] * shape["vocab_size"])  # bf16 weights incl. the embedding
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_layers"] * shape["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    ctx = prompt_mean + sizes["tokens"] / 2
    bound_s = sizes["tokens"] * (weight_bytes + rollouts * ctx * kv_per_token) / (args.hbm_tbps * 1e12)
    metrics = out["metrics"][-1]
    res = {
        "layer_spec": "transformer_engine" if te else "local",
        "pass_rule": "every metric of every step finite (the figures are measurements, not pass criteria)",
        "sizes": sizes,
        "model_matmul_params": n_matmul,
        "step_s": step_s,
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "completion_tokens_per_step": completion,
        "completion_tokens_per_s": completion / step_s,
        "decode_tokens_per_s": rollouts * sizes["tokens"] / generate_s,
        "decode_hbm_bound_tokens_per_s": rollouts * sizes["tokens"] / bound_s,
        "train_pass_mfu": 6 * n_matmul * tokens / train_s / peak,
        "logprob_pass_mfu": 2 * n_matmul * tokens / logprob_s / peak,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if _cuda() else None,
        "mismatch": {k: v for k, v in metrics.items() if k.startswith("mismatch/")},
        "finite": all(math.isfinite(v) for m in out["metrics"] for v in m.values()),
    }
    res["status"] = "ok" if res["finite"] else "failed"
    (Path(args.out) / "trainer_model.txt").write_text(str(model_dir))
    return res


def stage_trl(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import trl  # noqa: F401
    except ImportError as err:
        return {"status": "skipped", "why": f"trl does not import: {err}"}
    import bench_e2e_trl as E

    sizes = _trainer_sizes(args)
    model_dir = trainer_model(Path(tempfile.mkdtemp(prefix="gpu_check_trl_")), args.smoke)
    out = E.run_trl(
        model_dir,
        sizes["tokens"],
        sizes["steps"],
        1,
        prompts_per_step=sizes["prompts"],
        rollouts_per_prompt=sizes["rollouts"],
        bf16=_cuda(),
    )
    out["completion_tokens_per_s"] = out["completion_tokens_per_step"] / out["s_per_step"]
    out["pass_rule"] = "runs to the end (skipped when trl does not import)"
    out["status"] = "ok"
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Driver


def run_stage(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one stage in this process; never raises (a failure is the result)."""
    t0 = time.perf_counter()
    try:
        res = globals()[f"stage_{name}"](args)
    except Exception as err:  # noqa: BLE001
        res = {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
    res["stage"] = name
    res["wall_s"] = time.perf_counter() - t0
    return res


def summarize(results: dict[str, dict[str, Any]], env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-stage status, the stages that hit their timeout, warnings, and the trainer / TRL ratio."""
    out: dict[str, Any] = {
        "status": {k: v.get("status") for k, v in results.items()},
        "timed_out": [k for k, v in results.items() if v.get("timed_out")],
        "warnings": toolchain_warnings(env or {}),
    }
    tr, trl = results.get("trainer", {}), results.get("trl", {})
    if tr.get("status") == "ok" and trl.get("status") == "ok":
        out["completion_tokens_per_s_vs_trl"] = tr["completion_tokens_per_s"] / trl["completion_tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or C.ROOT / "runs" / "gpu-check"))
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    ap.add_argument(
        "--stage-timeout",
        type=int,
        default=None,
        help="seconds per stage process (default: 300 for collectives, 600 for the model stages, whose first "
        "forward on a GPU compiles Megatron's fused kernels)",
    )
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul peak for MFU (H200: 790)")
    ap.add_argument("--hbm-tbps", type=float, default=4.3, help="HBM bandwidth for the decode bound (H200: 4.3)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:  # a child: one stage, one JSON file
        (args.out / f"{args.stage}.json").write_text(json.dumps(run_stage(args.stage, args), indent=1, default=str))
        if "nemo_disco.distributed" in sys.modules:  # the stage's groups end before the interpreter does
            sys.modules["nemo_disco.distributed"].shutdown()
        return 0
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; choose from {list(STAGES)}")
    env = environment()
    (args.out / "environment.json").write_text(json.dumps(env, indent=1, default=str))
    for warning in toolchain_warnings(env):
        print(f"gpu-check WARNING: {warning}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for name in stages:
        cmd = [sys.executable, __file__, "--stage", name, "--out", str(args.out)]
        cmd += ["--peak-tflops", str(args.peak_tflops), "--hbm-tbps", str(args.hbm_tbps)]
        cmd += ["--smoke"] if args.smoke else []
        timeout = args.stage_timeout or STAGE_TIMEOUT_S[name]
        path = args.out / f"{name}.json"
        path.unlink(missing_ok=True)  # a result left by an earlier run in this folder must not stand for this one
        t0 = time.perf_counter()
        timed_out = False
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            timed_out = True
            out, errs = (
                x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr)
            )
            log = f"timed out after {timeout} s\n{out}{errs}"
        (args.out / f"{name}.log").write_text(log)
        if path.is_file():
            results[name] = json.loads(path.read_text())
        else:
            why = f"timed out after {timeout} s" if timed_out else "no result"
            results[name] = {"stage": name, "status": "failed", "error": f"{why}; see {name}.log"}
        results[name].update(timeout_s=timeout, timed_out=timed_out)
        path.write_text(json.dumps(results[name], indent=1, default=str))
        print(f"gpu-check {name:20s} {results[name]['status']:8s} {time.perf_counter() - t0:7.1f} s", flush=True)
    summary = summarize(results, env)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for warning in summary["warnings"]:
        print(f"gpu-check WARNING: {warning}", flush=True)
    print("GPU_CHECK_SUMMARY " + json.dumps(summary, default=str), flush=True)
    return 0 if all(v in ("ok", "skipped") for v in summary["status"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
