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
  memory, and a Transformer Engine <-> local checkpoint load when TE imports; the memory plan's bytes of each
  (``nemo_disco.plan``) beside the measured ones.
- ``moe``: a small Qwen3-MoE (every layer sparse, top-2) built, ``logprobs``, one ``train_minibatch`` and
  ``export_weights()``, in bf16 (TE where it imports) and in fp32 (local): every GPTModel parameter and buffer on
  ``policy.device`` (mcore builds the router on the host), log-probs within the dtype's tolerance of
  transformers' fp32 forward, the exported tensors on one device and finite, the update changes weights.
- ``trainer``: ``algorithm.train_step`` with the Megatron policy (bf16, TE where it imports) and the
  transformers generator on a random model of DeepSeek-R1-Distill-Qwen-1.5B's shape (fixed-length rollouts):
  step time and phases, completion tokens/s, training-pass MFU against ``--peak-tflops`` (790 bf16 on an H200,
  measured), decode tokens/s against the HBM bound (``--hbm-tbps``, 4.3 on an H200), peak memory beside the memory
  plan's peak of the trained policy, mismatch metrics.
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
# The lent GPU machine: one call runs at most 600 s, 15 minutes of device time in all (the start, 1-2 min, and idle
# time included). The stages go in two calls, each within CALL_BUDGET_S plus ~20 s of installing the carried
# wheels, which leaves time to rerun one of them: start <= 120 s + 3 x (240 + 20) s = 900 s.
CALLS = {1: ("collectives", "grad_step", "logprob_parity", "offload_checkpoint", "moe"), 2: ("trainer", "trl")}
CALL_BUDGET_S = 240
# Estimated seconds per stage on one H100 (process start, imports, the model built, the first forward compiling
# Megatron's fused bias / SwiGLU / bias-dropout kernels through torch.compile): estimates until a device run
# replaces them (docs/benchmarks.md). Call 1: ~200 s; call 2: ~220 s.
STAGE_ESTIMATE_S = {
    "collectives": 20,
    "logprob_parity": 45,
    "grad_step": 35,
    "offload_checkpoint": 50,
    "moe": 50,
    "trainer": 120,
    "trl": 100,
}
# Seconds per stage process at most (a hung stage must leave time for the others and for packing the results).
STAGE_TIMEOUT_S = {
    "collectives": 90,
    "logprob_parity": 150,
    "grad_step": 120,
    "offload_checkpoint": 150,
    "moe": 150,
    "trainer": 240,
    "trl": 200,
}
MIN_STAGE_S = 15  # a stage is not started with less of the budget left (recorded as skipped)
PACK_RESERVE_S = 10  # budget kept for packing the results
# What the device tool returns from $OUT: at most 8 files, 16 MiB each, 64 MiB in all, names of letters, digits,
# '.', '_' and '-', at most two folders down.
RETURN_LIMITS = {"files": 8, "file_bytes": 16 * 2**20, "total_bytes": 64 * 2**20, "folders_down": 2}
ARCHIVE = "gpu-check.tar.gz"
# Dense bf16 peaks and HBM bandwidth by device name (SXM parts; the PCIe H100 is lower: 756 TFLOP/s, 2.0 TB/s).
DEVICE_PEAKS = {
    "H200": {"bf16_tflops": 989.0, "hbm_tbps": 4.8},
    "H100 PCIe": {"bf16_tflops": 756.0, "hbm_tbps": 2.0},
    "H100": {"bf16_tflops": 989.0, "hbm_tbps": 3.35},
    "A100": {"bf16_tflops": 312.0, "hbm_tbps": 2.0},
}
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


def device_peaks(name: str) -> dict[str, float] | None:
    """Nominal dense bf16 TFLOP/s and HBM TB/s of a device by its name (the first key of ``DEVICE_PEAKS`` in it)."""
    return next((dict(v) for k, v in DEVICE_PEAKS.items() if k in name), None)


def measure_roofline(smoke: bool) -> dict[str, float]:
    """A large bf16 matmul and a device-to-device copy, timed here (the ceilings the stage's figures sit under).

    Matmul: 8192^3 bf16, the mean of 10 after 3 warm-ups (2 n^3 FLOPs each). Copy: 1 GiB, bytes read plus written.
    On the CPU (smoke) tiny sizes keep the code path alive; the figures mean nothing there.
    """
    torch = _torch()
    dev = "cuda" if _cuda() else "cpu"
    n, copy_bytes, reps = (256, 2**22, 2) if smoke or not _cuda() else (8192, 2**30, 10)
    dtype = torch.bfloat16 if _cuda() else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    src = torch.empty(copy_bytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)

    def timed(fn: Callable[[], Any]) -> float:
        for _ in range(3):
            fn()
        _sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync()
        return (time.perf_counter() - t0) / reps

    mm_s, copy_s = timed(lambda: a @ b), timed(lambda: dst.copy_(src))
    return {"matmul_tflops": 2 * n**3 / mm_s / 1e12, "copy_tbps": 2 * copy_bytes / copy_s / 1e12, "matmul_n": n}


def check_returnable(out: Path) -> list[str]:
    """What in ``out`` the device tool would not return (``RETURN_LIMITS``), one line each; empty when all of it."""
    import re

    out = Path(out)
    files = sorted(p for p in out.rglob("*") if not p.is_dir())
    problems = []
    if len(files) > RETURN_LIMITS["files"]:
        problems.append(f"{len(files)} files, at most {RETURN_LIMITS['files']} come back")
    total = 0
    for p in files:
        rel = p.relative_to(out)
        size = p.lstat().st_size
        total += size
        if p.is_symlink() or not p.is_file():
            problems.append(f"{rel}: not a plain file")
        if size > RETURN_LIMITS["file_bytes"]:
            problems.append(f"{rel}: {size} bytes, over {RETURN_LIMITS['file_bytes']}")
        if any(not re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts):
            problems.append(f"{rel}: a name other than letters, digits, '.', '_' and '-'")
        if len(rel.parts) - 1 > RETURN_LIMITS["folders_down"]:
            problems.append(f"{rel}: more than {RETURN_LIMITS['folders_down']} folders down")
    if total > RETURN_LIMITS["total_bytes"]:
        problems.append(f"{total} bytes in all, over {RETURN_LIMITS['total_bytes']}")
    return problems


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
    info: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable}
    info |= {"torch": torch.__version__, "cuda": torch.version.cuda}
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


def planned_policy_bytes(model_dir: Path, dtype_bytes: int = 2) -> dict[str, int]:
    """The memory plan's bytes of a trained policy on one GPU (TP 1, DP 1; ``nemo_disco.plan``, docs/planning.md).

    Beside the measured allocations: weights, fp32 gradient buffers and Adam state (with a float32 master copy in
    bf16), what an optimizer offload and a weights offload should free.
    """
    from nemo_disco import plan

    shapes = plan.Shapes.from_hf_config(json.loads((model_dir / "config.json").read_text()), str(model_dir))
    c = plan.rank_counts(shapes, tp=1, pp=1, ep=1, world=1, stage=0)
    weights, grads = dtype_bytes * c.weights, 4 * c.grads
    optimizer = (12 if dtype_bytes == 2 else 8) * c.optimizer
    return {
        "policy_bytes": weights + grads + optimizer,
        "freed_by_optimizer_offload": grads + optimizer,
        "freed_by_weights_offload": weights,
        "reference_policy_bytes": weights,
    }


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
        "grad norm matches the original's (rel 1e-3). te_cross_spec is reported, not required; plan (the memory "
        "plan's bytes beside the measured ones) is reported, not required",
        "plan": planned_policy_bytes(model_dir),
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
        "planned_bytes": res["plan"]["reference_policy_bytes"],
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
        # The production optimizer (the tiny recipe this inherits from turns it off for the CPU).
        "policy.use_distributed_optimizer=true",
        "cluster.gpus_per_node=1",
    ]
    cfg = C.load_config(root / "run", over)
    measured = measure_roofline(args.smoke)  # its tensors are freed on return (the allocator keeps the blocks)
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
    # log-probs are a forward pass (2 N per token), which a one-pass update skips (its phase then takes ~0 s).
    # Attention FLOPs are left out (short sequences here).
    train_s = statistics.median(p["train"] for p in phases)
    logprob_s = statistics.median(p.get("old_logprobs", 0.0) for p in phases)
    generate_s = statistics.median(p["generate"] for p in phases)
    # The share of the step's rows the log-prob pass forwarded: all but a first mini-batch trained in one pass.
    num_mb = cfg.algorithm.prompts_per_step // cfg.algorithm.minibatch_prompts
    one_pass_first = out["metrics"][-1].get("update/one_pass_updates", 0.0) > 0
    forwarded = 1.0 - (1.0 / num_mb if one_pass_first else 0.0)
    logprob_ran = forwarded > 0 and logprob_s > 0
    peak = args.peak_tflops * 1e12
    weight_bytes = 2 * (n_matmul + shape["hidden_size"] * shape["vocab_size"])  # bf16 weights incl. the embedding
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_per_token = 2 * shape["num_layers"] * shape["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    ctx = prompt_mean + sizes["tokens"] / 2
    decode_bytes = sizes["tokens"] * (weight_bytes + rollouts * ctx * kv_per_token)
    bound_s = decode_bytes / (args.hbm_tbps * 1e12)
    train_flops_per_s = 6 * n_matmul * tokens / train_s
    metrics = out["metrics"][-1]
    res = {
        "layer_spec": "transformer_engine" if te else "local",
        # Asked for; Megatron's distributed optimizer runs on a GPU (the CPU path is torch's AdamW).
        "distributed_optimizer": out["distributed_optimizer"],
        "optimizer": out["optimizer"],
        "pass_rule": "every metric of every step finite (the figures are measurements, not pass criteria)",
        "sizes": sizes,
        "model_matmul_params": n_matmul,
        "step_s": step_s,
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "completion_tokens_per_step": completion,
        "completion_tokens_per_s": completion / step_s,
        "decode_tokens_per_s": rollouts * sizes["tokens"] / generate_s,
        "decode_hbm_bound_tokens_per_s": rollouts * sizes["tokens"] / bound_s,
        "peaks": {"bf16_tflops": args.peak_tflops, "hbm_tbps": args.hbm_tbps, "from": args.peaks_from},
        "measured": measured,
        "train_pass_tflops": train_flops_per_s / 1e12,
        "train_pass_mfu": train_flops_per_s / peak,
        "train_pass_vs_measured_matmul": train_flops_per_s / (measured["matmul_tflops"] * 1e12),
        # Only where that pass ran: a one-pass update (one mini-batch per step) reuses the training forward.
        "logprob_pass_mfu": 2 * n_matmul * tokens * forwarded / logprob_s / peak if logprob_ran else None,
        "logprob_pass": f"ran over {forwarded:.0%} of the rows"
        if logprob_ran
        else "skipped (one-pass update: pi_old from the training forward)",
        "decode_vs_measured_copy": decode_bytes / generate_s / (measured["copy_tbps"] * 1e12),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if _cuda() else None,
        # The memory plan of this run's trained policy (the transformers generator holds its own copy besides).
        "planned_policy_peak_gib": _planned_training_peak(cfg) / 2**30,
        "mismatch": {k: v for k, v in metrics.items() if k.startswith("mismatch/")},
        "finite": all(math.isfinite(v) for m in out["metrics"] for v in m.values()),
    }
    res["status"] = "ok" if res["finite"] else "failed"
    return res


def _planned_training_peak(cfg: Any) -> int:
    """The memory plan's peak of the trained policy alone (its log-prob and training phases, no engine terms)."""
    from nemo_disco import plan

    group = plan.make_plan(cfg).groups[0]
    policy = ("policy weights", "gradient buffers", "optimizer states", "activations", "logits", "log-prob chunk")
    return max(sum(t.phases.get(p, 0) for t in group.terms if t.name in policy) for p in ("logprobs", "training"))


TRL_NEEDS = ("trl", "datasets", "accelerate")  # what bench_e2e_trl.run_trl imports


def trl_missing() -> str | None:
    """Why the TRL stage cannot run here (a module it needs does not import), or None.

    ``import trl`` alone proves little: trl loads its trainers lazily, so a missing ``datasets`` shows only when
    ``GRPOTrainer`` is first touched; that is done here too.
    """
    import importlib

    for name in TRL_NEEDS:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001  (a broken install raises more than ImportError)
            return f"{name} does not import ({type(err).__name__}: {err})"
    try:
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return f"trl's GRPOTrainer does not import ({type(err).__name__}: {err})"
    return None


def stage_trl(args: argparse.Namespace) -> dict[str, Any]:
    missing = trl_missing()
    if missing:
        return {"status": "skipped", "why": missing, "pass_rule": "runs to the end (skipped when a module is missing)"}
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
    out["pass_rule"] = "runs to the end (skipped when a module is missing)"
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
    """Per-stage status, the stages that hit their timeout, warnings, the trainer / TRL ratio, and each stage's
    result without its traceback (the archive holds the whole of it)."""
    out: dict[str, Any] = {
        "status": {k: v.get("status") for k, v in results.items()},
        "timed_out": [k for k, v in results.items() if v.get("timed_out")],
        "warnings": toolchain_warnings(env or {}),
    }
    tr, trl = results.get("trainer", {}), results.get("trl", {})
    if tr.get("status") == "ok" and trl.get("status") == "ok":
        out["completion_tokens_per_s_vs_trl"] = tr["completion_tokens_per_s"] / trl["completion_tokens_per_s"]
    out["stages"] = {k: {f: x for f, x in v.items() if f != "traceback"} for k, v in results.items()}
    if env is not None:
        out["environment"] = env
    return out


def failure_tails(results: dict[str, dict[str, Any]], logs: dict[str, str], room: int = 9000) -> str:
    """The end of each failed stage's traceback (else its log), sharing ``room`` characters: what stdout brings
    back when only the last 12,000 characters of a device call's output return."""
    failed = [k for k, v in results.items() if v.get("status") == "failed"]
    if not failed:
        return ""
    each = room // len(failed)
    parts = []
    for name in failed:
        text = results[name].get("traceback") or logs.get(name) or results[name].get("error", "")
        parts.append(f"----- gpu-check {name} failed: {results[name].get('error', '')}\n{text[-each:]}")
    return "\n".join(parts)


def pack(out: Path, names: list[str]) -> Path:
    """Move ``names`` (files in ``out``) into one gzipped tar ``out/ARCHIVE``; returns its path."""
    import tarfile

    archive = out / ARCHIVE
    tmp = out / (ARCHIVE + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in names:
            if (out / name).is_file():
                tar.add(out / name, arcname=name)
    tmp.replace(archive)
    for name in names:
        (out / name).unlink(missing_ok=True)
    return archive


def stage_plan(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[str]:
    """The stages this run asked for: ``--call N``'s, else ``--stages``."""
    if args.call is not None:
        if args.stages is not None:
            ap.error("--call and --stages exclude each other")
        return list(CALLS[args.call])
    stages = [s for s in (args.stages or ",".join(STAGES)).split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"unknown stage(s) {unknown}; choose from {list(STAGES)}")
    return stages


def run_child(name: str, args: argparse.Namespace, timeout: float) -> tuple[dict[str, Any], str]:
    """One stage in a process of its own, at most ``timeout`` s: its result and its output."""
    cmd = [sys.executable, __file__, "--stage", name, "--out", str(args.out)]
    cmd += ["--peak-tflops", str(args.peak_tflops), "--hbm-tbps", str(args.hbm_tbps), "--peaks-from", args.peaks_from]
    cmd += ["--smoke"] if args.smoke else []
    path = args.out / f"{name}.json"
    path.unlink(missing_ok=True)  # a result left by an earlier run in this folder must not stand for this one
    timed_out = False
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        timed_out = True
        out, errs = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr))
        log = f"timed out after {timeout:.0f} s\n{out}{errs}"
    if path.is_file():
        res = json.loads(path.read_text())
    else:
        why = f"timed out after {timeout:.0f} s" if timed_out else "no result"
        res = {"stage": name, "status": "failed", "error": f"{why}; see {name}.log in {ARCHIVE}"}
    res.update(timeout_s=round(timeout, 1), timed_out=timed_out)
    path.write_text(json.dumps(res, indent=1, default=str))
    return res, log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CI)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or C.ROOT / "runs" / "gpu-check"))
    ap.add_argument(
        "--call",
        type=int,
        choices=sorted(CALLS),
        help="the stages of one device call: " + "; ".join(f"{k}: {','.join(v)}" for k, v in CALLS.items()),
    )
    ap.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} (default: all)")
    ap.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole run, packing included (default: {CALL_BUDGET_S} with --call, else none); a "
        "stage gets at most what is left, and none is started with under "
        f"{MIN_STAGE_S} s left",
    )
    ap.add_argument(
        "--stage-timeout", type=int, default=None, help="seconds per stage process (default: STAGE_TIMEOUT_S's)"
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: by device)")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="HBM bandwidth for the decode bound (by device)")
    ap.add_argument("--peaks-from", default="given", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.stage:  # a child: one stage, one JSON file; its scratch (models, checkpoints) removed after
        with tempfile.TemporaryDirectory(prefix=f"gpu_check_{args.stage}_") as scratch:
            tempfile.tempdir = scratch
            res = run_stage(args.stage, args)
            if "nemo_disco.distributed" in sys.modules:  # the stage's groups end before the interpreter does
                sys.modules["nemo_disco.distributed"].shutdown()
        (args.out / f"{args.stage}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    stages = stage_plan(args, ap)
    budget = args.budget if args.budget is not None else (CALL_BUDGET_S if args.call is not None else math.inf)
    env = environment()
    nominal = device_peaks(env["device"]["name"])
    if args.peak_tflops is None or args.hbm_tbps is None:
        chosen = nominal or DEVICE_PEAKS["H100"]
        args.peaks_from = env["device"]["name"] if nominal else f"H100 SXM (no figures for {env['device']['name']})"
        args.peak_tflops = args.peak_tflops or chosen["bf16_tflops"]
        args.hbm_tbps = args.hbm_tbps or chosen["hbm_tbps"]
    env["peaks"] = {"bf16_tflops": args.peak_tflops, "hbm_tbps": args.hbm_tbps, "from": args.peaks_from}
    env["call"], env["budget_s"] = args.call, budget
    (args.out / "environment.json").write_text(json.dumps(env, indent=1, default=str))
    for warning in toolchain_warnings(env):
        print(f"gpu-check WARNING: {warning}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    logs: dict[str, str] = {}
    for name in stages:
        left = budget - (time.perf_counter() - t_start) - PACK_RESERVE_S
        timeout = min(args.stage_timeout or STAGE_TIMEOUT_S[name], left)
        t0 = time.perf_counter()
        if timeout < MIN_STAGE_S:
            results[name] = {
                "stage": name,
                "status": "skipped",
                "why": f"budget: {max(left, 0):.0f} s left of {budget:.0f}",
            }
            results[name].update(timeout_s=0, timed_out=False)
            (args.out / f"{name}.json").write_text(json.dumps(results[name], indent=1))
        else:
            results[name], logs[name] = run_child(name, args, timeout)
            (args.out / f"{name}.log").write_text(logs[name])
        print(f"gpu-check {name:20s} {results[name]['status']:8s} {time.perf_counter() - t0:7.1f} s", flush=True)
    summary = summarize(results, env)
    summary["wall_s"] = time.perf_counter() - t_start
    loose = ["environment.json", *(f"{n}.json" for n in stages), *(f"{n}.log" for n in stages)]
    pack(args.out, loose)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for warning in summary["warnings"]:
        print(f"gpu-check WARNING: {warning}", flush=True)
    tails = failure_tails(results, logs)
    if tails:
        print(tails, flush=True)
    for problem in check_returnable(args.out):
        print(f"gpu-check WARNING: would not come back from a device call: {problem}", flush=True)
    short = {k: v for k, v in summary.items() if k not in ("stages", "environment")}
    print("GPU_CHECK_SUMMARY " + json.dumps(short, default=str), flush=True)
    return 0 if all(v in ("ok", "skipped") for v in summary["status"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
