"""torchrun worker for the Megatron policy tests: runs one scenario, writes ``rank<R>.json`` with measurements.

Scenarios (``--scenario``):
  parallel    for each model: layout (--tp, --pp, and --ep for a MoE model) round trip, log-probs / entropy /
              gradient vs transformers, one optimizer update vs HFPolicy, NaN skip; then TP1 x PP1 x DP=world
              (EP 1) on the same models (round trip, log-probs, gradient with the rows split over DP ranks) and
              layout vs TP1 gradient. MoE routers are trained here (freeze_router=false) so that every
              gradient is compared with transformers'.
  checkpoint  TP2 (x --ep) train / save / second update; re-initialise at TP1 x DP2, load, compare; convert
              both ways.
  converted   --models HF_DIR CONVERTED: a checkpoint that `nemo-disco convert --from-hf --tp N` wrote in ONE
              process, loaded at TP --tp: weights bit-exact, log-probs equal transformers' and those of the HF
              folder loaded directly at the same TP.
  single      one process without torchrun (a one-rank gloo group is created): activation checkpointing,
              offload / onload, micro-batch and chunk invariance.
  router      one process, a MoE model: the reported load-balancing loss and the gradient of the optional one
              against transformers' router logits; a frozen router gets no update; recomputation counts once.
  gpu         CUDA only: bf16, TE spec and packing (when TE imports), distributed optimizer, offload, save / load.
  placement   one process, GPU placement emulated on ``meta``: trained and reference policies (dense, MoE),
              parameters / buffers / gradient buffers / exported weights on the policy's device, bf16 norms.
  gpu_rules   one process on CPU: the GPU rules a CPU can show (optimizer decay groups of both paths, fusion
              flags against mcore's constructors, cross-spec checkpoint loads, the forward-only reference).
The pytest side (test_megatron_*.py) builds the tiny models, launches this script and asserts on the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

torch.set_num_threads(1)
TEMPERATURE = 0.7
ENT_COEF = 0.25


def make_cfg(world: int, tp: int = 1, pp: int = 1, **over: object):  # noqa: ANN201
    """The test run config (fp32, lr 1e-3, clip 0.5, 30-token micro-batches); ``over``: dotted keys."""
    from nemo_disco import config

    raw = config.RunConfig().model_dump(mode="json")
    raw["policy"].update(
        dtype="float32",
        lr=1e-3,
        weight_decay=0.0,
        grad_clip=0.5,
        # A large epsilon makes the first Adam step a smooth function of the gradient (with 1e-8, components
        # of size ~1e-8 would turn 1e-9 differences into lr-sized ones).
        adam_eps=1e-3,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        microbatch_tokens=30,
        logprob_chunk_size=5,
    )
    raw["generation"]["temperature"] = TEMPERATURE
    raw["cluster"]["gpus_per_node"] = world
    raw["algorithm"].update(prompts_per_step=8, minibatch_prompts=4, rollouts_per_prompt=world)
    for key, value in over.items():
        section, name = key.split(".")
        raw[section][name] = value
    return config.validate(raw)


def make_batch(seed: int = 0, n: int = 8):  # noqa: ANN201
    """Random prompts (2-6 tokens) and responses (0-7 tokens, one empty) of ids 5..99."""
    from nemo_disco.batch import collate

    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(5, 100, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts = [draw(2, 7) for _ in range(n)]
    responses = [draw(1, 8) for _ in range(n)]
    responses[3] = []  # an empty response: all-False mask row
    return collate(prompts, responses, [[0.0] * len(r) for r in responses], list(range(n)), [1.0] * n, pad_id=0)


def coefficients(n: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n)


def surrogate(coef: torch.Tensor, global_rows: torch.Tensor | None = None):  # noqa: ANN201
    """sum_i c_i * sum_t logp_it + ENT_COEF * sum entropy; ``rows`` index the (sub-)batch given to the policy."""

    def fn(rows, lp, ent):  # noqa: ANN001, ANN202
        g = rows if global_rows is None else global_rows[rows]
        out = (coef[g].unsqueeze(1) * lp).sum()
        return out + ENT_COEF * ent.sum() if ent is not None else out

    return fn


def hf_reference(model_dir: Path, batch) -> dict:  # noqa: ANN001
    """transformers' own forward, one unpadded sequence at a time: log-probs, entropy, gradient of the surrogate.

    The GPU validation's reference (benchmarks/gpu_check.py), with the same temperature and surrogate as here.
    Gradients are named as in checkpoints (a MoE layer's fused expert tensors split per expert).
    """
    import sys

    from nemo_disco import weights

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_check

    assert (gpu_check.TEMPERATURE, gpu_check.ENT_COEF) == (TEMPERATURE, ENT_COEF)
    ref = gpu_check.hf_reference(model_dir, batch, grads=True)
    grads = dict(weights.to_checkpoint_layout(ref["grads"].items()))
    return {"lp": ref["lp"], "ent": ref["ent"], "grads": grads}


def is_moe(model_dir: Path) -> bool:
    return json.loads((Path(model_dir) / "config.json").read_text())["model_type"] == "qwen3_moe"


def moe_over(model_dir: Path, ep: int) -> dict:
    """Config overrides of a MoE model: ``ep``-way expert parallelism, the router trained (compared with HF's)."""
    return {"policy.expert_parallel_size": ep, "policy.freeze_router": False} if is_moe(model_dir) else {}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def round_trip(policy, model_dir: Path) -> dict:  # noqa: ANN001
    from safetensors.torch import load_file

    ref = load_file(str(model_dir / "model.safetensors"))
    got = {name: t.clone() for name, t in policy.export_weights()}
    return {
        "names_equal": sorted(got) == sorted(ref),
        "not_bit_exact": sorted(k for k in ref if k not in got or not torch.equal(got[k], ref[k])),
    }


def dist_all_floats(value: float, group) -> list[float]:  # noqa: ANN001
    """``value`` of every rank of ``group``."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def rank_spread(t: torch.Tensor) -> float:
    """Largest difference of ``t`` between any two ranks (0 when every rank holds the same tensor)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return max(float((p - parts[0]).abs().max()) for p in parts)


def check_model(policy, model_dir: Path, batch, ref: dict, rows: torch.Tensor | None) -> tuple[dict, dict]:  # noqa: ANN001
    """Round trip, log-probs and gradient of one policy; ``rows``: this DP rank's rows (None = all)."""
    out = round_trip(policy, model_dir)
    lp, ent = policy.logprobs(batch, entropy=True)
    out["lp_diff"] = float((lp - ref["lp"]).abs().max())
    out["ent_diff"] = float((ent - ref["ent"]).abs().max())
    out["lp_rank_spread"] = rank_spread(lp)
    out["padding_zero"] = bool((lp[~batch.response_mask] == 0).all() and (ent[~batch.response_mask] == 0).all())
    coef = coefficients(len(batch))
    if rows is None:
        policy.accumulate_gradients(batch, surrogate(coef), entropy=True)
    else:
        policy.accumulate_gradients(batch.select(rows), surrogate(coef, rows), entropy=True)
    grads = {name: g.clone() for name, g in policy.export_gradients()}
    out["grad_diff"] = max_diff(grads, ref["grads"])
    out["grad_scale"] = max(float(g.abs().max()) for g in ref["grads"].values())
    return out, grads


def train_vs_hf(policy, cfg_hf, model_dir: Path, batch, rows: torch.Tensor | None = None) -> dict:  # noqa: ANN001
    """One clipped AdamW update against HFPolicy's, then a NaN surrogate that must be skipped.

    HFPolicy is data-parallel over the whole world: each rank gives it its share of the rows. ``rows``: the
    Megatron policy's own share (None: the whole batch, at data-parallel size 1).
    """
    import torch.distributed as dist

    from nemo_disco.policy.hf import HFPolicy

    coef = coefficients(len(batch))
    hf = HFPolicy.from_run_config(cfg_hf, model_dir)
    if rows is None:
        ours = policy.train_minibatch(batch, surrogate(coef), entropy=True)
    else:
        ours = policy.train_minibatch(batch.select(rows), surrogate(coef, rows), entropy=True)
        ours["surrogate"] = sum(dist_all_floats(ours["surrogate"], policy.dp_group))
    router_stats = {k: v for k, v in ours.items() if k.startswith("router_")}
    hf_rows = torch.arange(len(batch))[hf.dp_rank :: hf.dp_size]
    theirs = hf.train_minibatch(batch.select(hf_rows), surrogate(coef, hf_rows), entropy=True)
    hf_total = torch.tensor([theirs["surrogate"]], dtype=torch.float64)
    dist.all_reduce(hf_total)
    theirs["surrogate"] = float(hf_total)
    after = {name: t.clone() for name, t in policy.export_weights()}
    hf_after = {name: p.detach() for name, p in hf.export_weights()}
    out = {
        "grad_norm": ours["grad_norm"],
        "hf_grad_norm": theirs["grad_norm"],
        "lr": ours["lr"],
        "skipped": ours["skipped"],
        "surrogate": ours["surrogate"],
        "hf_surrogate": theirs["surrogate"],
        "weights_diff": max_diff(after, hf_after),
        "updates": policy.updates,
        "router_stats": router_stats,
    }
    nan = policy.train_minibatch(batch, lambda rows, lp, ent: lp.sum() * float("nan"), entropy=True)
    unchanged = all(torch.equal(t, after[name]) for name, t in policy.export_weights())
    out.update(nan_skipped=nan["skipped"], nan_unchanged=unchanged, updates_after_nan=policy.updates)
    return out


def scenario_parallel(args: argparse.Namespace, world: int, rank: int) -> dict:
    import torch.distributed as dist

    from nemo_disco.policy.base import Policy
    from nemo_disco.policy.megatron import MegatronPolicy

    batch = make_batch()
    results: dict = {}
    layout_grads = {}
    refs = {Path(m).name: hf_reference(Path(m), batch) for m in args.models}
    for model_dir in map(Path, args.models):
        name = model_dir.name
        ref = refs[name]
        over = moe_over(model_dir, args.ep)
        cfg = make_cfg(world, args.tp, args.pp, **over)
        policy = MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
        # Data-parallel ranks (TP1 x EP2 has two) each take a share of the rows, of unequal sizes: the ranks of
        # an expert-parallel group then run different numbers of micro-batches.
        rows = None
        if policy.dp_size > 1:
            shares = torch.arange(len(batch)).tensor_split([3 * len(batch) // 4]) if policy.dp_size == 2 else None
            rows = shares[policy.dp_rank] if shares else torch.arange(len(batch))[policy.dp_rank :: policy.dp_size]
        res, layout_grads[name] = check_model(policy, model_dir, batch, ref, rows=rows)
        res["is_policy"] = isinstance(policy, Policy)
        res["dp"] = [policy.dp_rank, policy.dp_size]
        res["ep"] = policy.ep
        if policy.ep > 1:  # micro-batches added to keep the expert-parallel group in step
            res["fillers"] = sum(
                mb.filler for mb in policy._microbatches(batch if rows is None else batch.select(rows))
            )
        hf_over = {"policy.backend": "hf", "policy.freeze_router": False}
        res["train"] = train_vs_hf(policy, make_cfg(1, **hf_over), model_dir, batch, rows)
        if is_moe(model_dir):
            res["hf_balance_loss"] = float(hf_router_balance(model_dir, batch)[1].mean())
        results[name] = {"layout": res}
        del policy
    dist.barrier()
    # Same models at TP1 x PP1, data-parallel over every rank: each rank backwards its own rows only.
    for model_dir in map(Path, args.models):
        name = model_dir.name
        ref = refs[name]
        cfg = make_cfg(world, 1, 1, **moe_over(model_dir, 1))
        policy = MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
        rows = torch.arange(len(batch))[policy.dp_rank :: policy.dp_size]
        res, grads = check_model(policy, model_dir, batch, ref, rows=rows)
        res["dp"] = [policy.dp_rank, policy.dp_size]
        res["layout_vs_tp1_grad_diff"] = max_diff(layout_grads[name], grads)
        results[name]["tp1_dp"] = res
        del policy
    return results


def scenario_checkpoint(args: argparse.Namespace, world: int, rank: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_disco import config, convert, weights
    from nemo_disco.policy.megatron import MegatronPolicy

    model_dir = Path(args.models[0])
    out = Path(args.out)
    step = out / "checkpoints" / "step_1"
    batch, batch2 = make_batch(0), make_batch(1)
    coef = coefficients(len(batch))
    cfg_tp2 = make_cfg(world, tp=2, **moe_over(model_dir, args.ep))
    a = MegatronPolicy.from_run_config(cfg_tp2, model_dir, vocab_multiple=args.vocab_multiple)
    a.train_minibatch(batch, surrogate(coef), entropy=True)
    a.save(step / "policy")
    if rank == 0:
        config.save(cfg_tp2, step / "config.yaml")
    dist.barrier()
    w1 = {name: t.clone() for name, t in a.export_weights()}
    lp1, _ = a.logprobs(batch)
    second = a.train_minibatch(batch2, surrogate(coef), entropy=True)
    w2 = {name: t.clone() for name, t in a.export_weights()}
    del a
    # Reshard: TP1 x DP2, each rank with half of the rows (summed over DP = the full-batch gradient).
    b = MegatronPolicy.from_run_config(
        make_cfg(world, tp=1, **moe_over(model_dir, 1)), model_dir, vocab_multiple=args.vocab_multiple
    )
    b.load(step / "policy")
    res: dict = {"updates_after_load": b.updates, "dp": [b.dp_rank, b.dp_size]}
    lp_b, _ = b.logprobs(batch)
    res["lp_after_load_diff"] = float((lp_b - lp1).abs().max())
    rows = torch.arange(len(batch2))[b.dp_rank :: b.dp_size]
    second_b = b.train_minibatch(batch2.select(rows), surrogate(coef, rows), entropy=True)
    res["second_update_grad_norm"] = [second["grad_norm"], second_b["grad_norm"]]
    res["second_update_lr"] = [second["lr"], second_b["lr"]]
    res["weights_after_second_update_diff"] = max_diff({n: t.clone() for n, t in b.export_weights()}, w2)
    del b
    # Megatron -> HF from the step dir (config.yaml found next to policy/) and from the policy dir itself.
    convert.megatron_to_hf(step, out / "hf_from_step")
    convert.megatron_to_hf(step / "policy", out / "hf_from_policy")
    if rank == 0:
        for tag in ("hf_from_step", "hf_from_policy"):
            hf = AutoModelForCausalLM.from_pretrained(str(out / tag), dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(str(out / tag))
            loaded = dict(hf.named_parameters())
            loaded = dict(weights.to_checkpoint_layout(loaded.items()))
            res[tag] = {
                "not_bit_exact": sorted(k for k in w1 if not torch.equal(loaded[k].detach(), w1[k])),
                "tokenizer_vocab": len(tok),
                "generation_config": json.loads((out / tag / "generation_config.json").read_text()),
                "files": sorted(os.listdir(out / tag)),
            }
    dist.barrier()
    # HF -> Megatron at TP2, then used as a model_dir at PP2: the weights come back bit-exactly.
    convert.hf_to_megatron(model_dir, out / "converted", tp=2, vocab_multiple=args.vocab_multiple)
    c = MegatronPolicy.from_run_config(make_cfg(world, pp=2, **moe_over(model_dir, 1)), out / "converted")
    res["converted_at_pp2"] = round_trip(c, model_dir)
    res["converted_updates"] = c.updates
    return res


def scenario_converted(args: argparse.Namespace, world: int, rank: int) -> dict:
    from nemo_disco.policy.megatron import MegatronPolicy

    model_dir, converted = Path(args.models[0]), Path(args.models[1])
    batch = make_batch()
    ref = hf_reference(model_dir, batch)
    policy = MegatronPolicy.from_run_config(make_cfg(world, tp=args.tp), converted)
    res: dict = round_trip(policy, model_dir)
    lp, _ = policy.logprobs(batch)
    res.update(tp=policy.tp, padded_vocab=policy.padded_vocab, lp_diff=float((lp - ref["lp"]).abs().max()))
    del policy
    direct = MegatronPolicy.from_run_config(make_cfg(world, tp=args.tp), model_dir)
    lp_direct, _ = direct.logprobs(batch)
    res["lp_vs_direct_diff"] = float((lp - lp_direct).abs().max())
    return res


def scenario_single(args: argparse.Namespace, world: int, rank: int) -> dict:
    from nemo_disco.policy.megatron import MegatronPolicy

    model_dir = Path(args.models[0])
    batch = make_batch()
    ref = hf_reference(model_dir, batch)
    res: dict = {}
    for tag, over in {
        "plain": {},
        "recompute": {"policy.activation_checkpointing": True},
        "one_microbatch_big_chunks": {"policy.microbatch_tokens": 100_000, "policy.logprob_chunk_size": 4096},
    }.items():
        policy = MegatronPolicy.from_run_config(make_cfg(1, **over), model_dir, vocab_multiple=args.vocab_multiple)
        out, _ = check_model(policy, model_dir, batch, ref, rows=None)
        policy.offload()
        policy.onload()
        lp, _ = policy.logprobs(batch)
        out["lp_diff_after_offload"] = float((lp - ref["lp"]).abs().max())
        res[tag] = out
    return res


def hf_router_balance(model_dir: Path, batch) -> tuple:  # noqa: ANN001
    """transformers' per-layer load-balancing losses of ``batch`` (differentiable) and the model.

    The batch is laid out as the policy lays it out (each sequence from position 0, padding after it), the
    routers' logits are captured; per layer over the N real tokens: f_i = top-k picks of expert i / (N k),
    P_i = mean softmax probability of expert i, loss = E sum_i f_i P_i.
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    experts, k = hf.config.num_experts, hf.config.num_experts_per_tok
    lens = (batch.prompt_mask.sum(1) + batch.response_mask.sum(1)).tolist()
    width = max(lens)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    for i in range(len(batch)):
        seq = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i]], batch.response_ids[i][batch.response_mask[i]]])
        ids[i, : len(seq)] = seq
    real = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # [B, S]
    logits: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: logits.append(out[0])) for layer in hf.model.layers]
    hf(input_ids=ids, attention_mask=real.long())
    for h in hooks:
        h.remove()
    per_layer = []
    for lg in logits:  # [B * S, E], batch-major
        scores = torch.softmax(lg[real.reshape(-1)].float(), -1)  # [N, E]
        n = scores.shape[0]
        picks = torch.zeros_like(scores).scatter_(1, scores.topk(k, dim=-1).indices, 1.0).sum(0)  # [E]
        per_layer.append(experts / (k * n * n) * (scores.sum(0) * picks).sum())
    return hf, torch.stack(per_layer)


def scenario_router(args: argparse.Namespace, world: int, rank: int) -> dict:
    """A MoE model in one process: router statistics and the optional load-balancing loss against transformers.

    Reference: transformers' forward of the same padded batch (sequences from position 0), its routers'
    logits captured; per layer over the real tokens, f_i = top-k picks of expert i / (N k), P_i = mean softmax
    probability, loss = E sum_i f_i P_i. Megatron's gradient with router_aux_loss_coef = c minus its gradient
    with c = 0 must equal c x d(sum over layers of the loss)/d theta (one micro-batch, one rank).
    """
    from nemo_disco import weights
    from nemo_disco.policy.megatron import MegatronPolicy
    from nemo_disco.policy.megatron_moe import is_router

    model_dir = Path(args.models[0])
    batch = make_batch()
    coef = coefficients(len(batch))
    one_mb = {"policy.microbatch_tokens": 100_000}
    res: dict = {}

    hf, aux = hf_router_balance(model_dir, batch)
    res["hf_balance_loss"] = float(aux.mean().detach())
    hf.zero_grad()
    aux.sum().backward()
    aux_grad = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    aux_grad = dict(weights.to_checkpoint_layout(aux_grad.items()))

    def grads_with(c: float, **over: object) -> tuple[dict, dict]:
        cfg = make_cfg(1, **{"policy.router_aux_loss_coef": c, "policy.freeze_router": False, **one_mb, **over})
        policy = MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
        policy.accumulate_gradients(batch, surrogate(coef), entropy=True)
        return {n: g.clone() for n, g in policy.export_gradients()}, dict(policy.last_router_stats)

    base, stats = grads_with(0.0)
    res["stats"] = stats
    c = 0.5
    with_aux, stats_aux = grads_with(c)
    res["stats_with_aux"] = stats_aux
    res["aux_grad_diff"] = max(float(((with_aux[n] - base[n]) - c * aux_grad.get(n, 0.0)).abs().max()) for n in base)
    res["aux_grad_scale"] = max(float((c * g).abs().max()) for g in aux_grad.values())
    _, stats_recompute = grads_with(0.0, **{"policy.activation_checkpointing": True})
    res["stats_recompute"] = stats_recompute

    # Frozen (the default): no gradient, no update, for the router only.
    policy = MegatronPolicy.from_run_config(make_cfg(1, **one_mb), model_dir, vocab_multiple=args.vocab_multiple)
    before = {n: t.clone() for n, t in policy.export_weights()}
    out = policy.train_minibatch(batch, surrogate(coef), entropy=True)
    after = dict(policy.export_weights())
    res["frozen_train"] = {k_: v for k_, v in out.items()}
    res["frozen_requires_grad"] = sorted(
        n for n, p in policy.gpt.named_parameters() if is_router(n) and p.requires_grad
    )
    res["router_changed"] = sorted(
        n for n in before if n.endswith("mlp.gate.weight") and not torch.equal(before[n], after[n])
    )
    res["others_unchanged"] = sorted(
        n for n in before if not n.endswith("mlp.gate.weight") and torch.equal(before[n], after[n])
    )
    res["routers"] = sorted(n for n in before if n.endswith("mlp.gate.weight"))
    return res


def scenario_gpu(args: argparse.Namespace, world: int, rank: int) -> dict:
    """bf16 on CUDA: TE spec + packing when TE imports, distributed optimizer, save / load, offload / onload."""
    from nemo_disco.policy.megatron import MegatronPolicy

    model_dir = Path(args.models[0])
    batch = make_batch()
    ref = hf_reference(model_dir, batch)
    from nemo_disco.policy.megatron_model import te_import_error

    te = "auto" if te_import_error() is None else False  # auto stops a 16-bit GPU run without TE
    over = {"policy.dtype": "bfloat16", "policy.use_distributed_optimizer": True, "policy.transformer_engine": te}
    cfg = make_cfg(world, args.tp, 1, **over)
    policy = MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
    res: dict = {"use_te": policy.use_te, "packed": policy.packed}
    from safetensors.torch import load_file

    hf_bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    got = {name: t.cpu() for name, t in policy.export_weights()}
    res["export_not_bit_exact_bf16"] = sorted(k for k in hf_bf16 if not torch.equal(got[k], hf_bf16[k]))
    lp, ent = policy.logprobs(batch, entropy=True)
    res["lp_diff"] = float((lp - ref["lp"]).abs().max())
    res["ent_diff"] = float((ent - ref["ent"]).abs().max())
    coef = coefficients(len(batch)).cuda()

    def fn(rows, lp, ent):  # noqa: ANN001, ANN202
        return (coef[rows.to(lp.device)].unsqueeze(1) * lp).sum() + ENT_COEF * ent.sum()

    res["train"] = policy.train_minibatch(batch, fn, entropy=True)
    res["nan"] = policy.train_minibatch(batch, lambda rows, lp, ent: lp.sum() * float("nan"), entropy=True)
    lp1, _ = policy.logprobs(batch)
    before = torch.cuda.memory_allocated()
    policy.offload()
    res["memory_freed_by_offload"] = before - torch.cuda.memory_allocated()
    policy.onload()
    lp2, _ = policy.logprobs(batch)
    res["lp_diff_after_onload"] = float((lp2 - lp1).abs().max())
    policy.save(Path(args.out) / "policy")
    other = MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
    other.load(Path(args.out) / "policy")
    lp3, _ = other.logprobs(batch)
    res["lp_diff_after_load"] = float((lp3 - lp1).abs().max())
    res["updates_after_load"] = other.updates
    return res


def scenario_gpu_rules(args: argparse.Namespace, world: int, rank: int) -> dict:
    """GPU rules checked on CPU: decay groups of both optimizer paths, fusion flags against mcore's
    constructors, cross-spec checkpoint loads, the forward-only reference policy, the recorded layer spec."""
    import dataclasses

    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from nemo_disco.policy import cpu_compat
    from nemo_disco.policy import megatron as mp
    from nemo_disco.policy import megatron_model as mm

    model_dir = Path(args.models[0])
    batch = make_batch()
    cfg = make_cfg(1, **{"policy.weight_decay": 0.1})
    policy = mp.MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
    names = {id(p): n for n, p in policy.model.named_parameters()}

    def decays(groups: list[dict]) -> dict[str, float]:
        return {names[id(p)]: float(g["weight_decay"]) for g in groups for p in g["params"]}

    res: dict = {"decay_cpu": decays(policy.optimizer.param_groups)}
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0, params_dtype=torch.float32)
    with cpu_compat.device_scope():
        raw = get_megatron_optimizer(opt_config, [policy.model])  # what the GPU path held before the fix
    res["decay_megatron_raw"] = decays(raw.param_groups)
    res["decay_megatron"] = decays(policy._build_megatron_optimizer().param_groups)

    # Fusion flags against mcore's constructors: the old gradient_accumulation_fusion=use_te on a GPU without
    # apex raises in the output layer's constructor; the flags fusion_flags gives such a GPU build.
    try:
        mm.build_gpt_model(
            policy.spec,
            dataclasses.replace(policy.tf_config, gradient_accumulation_fusion=True),
            policy.padded_vocab,
            False,
        )
        res["old_grad_acc_fusion_error"] = ""
    except RuntimeError as err:
        res["old_grad_acc_fusion_error"] = str(err)
    flags = mm.fusion_flags(on_gpu=True, use_te=True)
    res["gpu_flags"] = flags
    new_cfg = dataclasses.replace(
        policy.tf_config, **{k: flags[k] for k in ("gradient_accumulation_fusion", "masked_softmax_fusion")}
    )
    res["new_flags_build"] = mm.build_gpt_model(policy.spec, new_cfg, policy.padded_vocab, False) is not None

    # Cross-spec loads. A Transformer Engine model also asks for _extra_state objects (its core attention's)
    # that a local-spec checkpoint lacks, and a TE checkpoint holds ones a local model does not ask for.
    te_extra = "decoder.layers.self_attention.core_attention._extra_state"
    local_dir = Path(args.out) / "local_ckpt"
    mm.save_model_checkpoint(policy.gpt, local_dir)
    target = mp.MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple, trainable=False).gpt
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    plain_sd = target.sharded_state_dict

    def te_like(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        sd = plain_sd(*a, **kw)
        sd["decoder.layers.0.self_attention.core_attention._extra_state"] = ShardedObject(te_extra, None, (1,), (0,))
        return sd

    target.sharded_state_dict = te_like
    try:
        mm.load_model_checkpoint(target, local_dir)
        res["te_loads_local"] = all(
            torch.equal(a, b) for a, b in zip(target.parameters(), policy.gpt.parameters(), strict=True)
        )
    except Exception as err:  # noqa: BLE001
        res["te_loads_local"] = f"{type(err).__name__}: {err}"
    te_dir = Path(args.out) / "te_ckpt"
    mm.save_model_checkpoint(target, te_dir)
    target.sharded_state_dict = plain_sd
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    mm.load_model_checkpoint(target, te_dir)
    res["local_loads_te"] = all(
        torch.equal(a, b) for a, b in zip(target.parameters(), policy.gpt.parameters(), strict=True)
    )

    def missing_weight(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        sd = plain_sd(*a, **kw)
        extra = sd["decoder.final_layernorm.weight"]
        sd["decoder.final_layernorm.extra"] = dataclasses.replace(extra, key="decoder.final_layernorm.extra")
        return sd

    target.sharded_state_dict = missing_weight
    try:
        mm.load_model_checkpoint(target, local_dir)
        res["missing_weight_error"] = ""
    except ValueError as err:
        res["missing_weight_error"] = str(err)

    # The forward-only reference policy.
    ref_policy = mp.MegatronPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple, trainable=False)
    res["ref_optimizer_none"] = ref_policy.optimizer is None
    res["ref_unwrapped"] = ref_policy.model is ref_policy.gpt
    res["ref_requires_grad"] = any(p.requires_grad for p in ref_policy.gpt.parameters())
    res["ref_main_grad"] = any(hasattr(p, "main_grad") for p in ref_policy.gpt.parameters())
    lp_ref, _ = ref_policy.logprobs(batch)
    lp_pol, _ = policy.logprobs(batch)
    res["ref_lp_equal"] = bool(torch.equal(lp_ref, lp_pol))
    try:
        ref_policy.train_minibatch(batch, lambda rows, lp, ent: lp.sum())
        res["ref_train_error"] = ""
    except RuntimeError as err:
        res["ref_train_error"] = str(err)
    ref_policy.offload()
    ref_policy.onload()
    res["ref_lp_after_offload_equal"] = bool(torch.equal(ref_policy.logprobs(batch)[0], lp_ref))

    policy.save(Path(args.out) / "policy")
    res["meta_layer_spec"] = json.loads((Path(args.out) / "policy" / "megatron.json").read_text())["layer_spec"]

    # Overlapped gradient reduction with a varying number of micro-batches per update (token-budgeted micro-batches
    # vary with the rollouts): mcore learns each bucket's "gradient ready" count on the first update; the
    # schedules must run all micro-batches but the last under DDP's no_sync, or a later update with fewer
    # micro-batches never issues its reduction (or one with more issues it early).
    grads: dict[bool, list[dict[str, torch.Tensor]]] = {}
    for overlap in (True, False):
        pol = mp.MegatronPolicy.from_run_config(make_cfg(1, **{"policy.overlap_grad_reduce": overlap}), model_dir)
        grads[overlap] = []
        for b in (batch, make_batch(seed=1, n=4), batch):
            try:
                pol.accumulate_gradients(b, surrogate(coefficients(len(b))), entropy=True)
                grads[overlap].append({n: g.clone() for n, g in pol.export_gradients()})
            except Exception as err:  # noqa: BLE001
                grads[overlap].append({"error": f"{type(err).__name__}: {err}"})
        res[f"overlap_{overlap}_microbatches"] = [len(pol._microbatches(b)) for b in (batch, make_batch(seed=1, n=4))]
    res["overlap_errors"] = [g["error"] for g in grads[True] if "error" in g]
    res["overlap_grads_equal"] = not res["overlap_errors"] and all(
        all(torch.equal(a[n], b[n]) for n in b) for a, b in zip(grads[True], grads[False], strict=True)
    )
    return res


def _error_of(fn, *args, **kwargs) -> str | None:  # noqa: ANN001, ANN002, ANN003
    """``type: message`` (first line) of what ``fn(*args, **kwargs)`` raises, None when it returns."""
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def scenario_dist_optimizer(args: argparse.Namespace, world: int, rank: int) -> dict:
    """The GPU path's optimizer on CPU: mcore's distributed optimizer over torch's AdamW (no TE, no apex), as on a
    GPU without either. One update, save, a freshly built policy loads it, then both take the same next update.

    mcore refuses host tensors by their type name (``torch.cuda.*Tensor``) when it builds the distributed
    optimizer; the shim below reports host tensors under the CUDA names for that check, nothing else changes.
    """
    from megatron.core.optimizer import distrib_optimizer

    from nemo_disco.policy import cpu_compat
    from nemo_disco.policy import megatron as mp

    class GpuOptimizerPolicy(mp.MegatronPolicy):
        MCORE_OPTIMIZER_ON_CPU = True

    host_type = torch.Tensor.type

    def cuda_type_name(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        name = host_type(self, *a, **kw)
        return name.replace("torch.", "torch.cuda.", 1) if not (a or kw) and ".cuda." not in name else name

    torch.Tensor.type = cuda_type_name
    model_dir = Path(args.models[0])
    batch, coef = make_batch(), coefficients(8)
    res: dict = {"have_apex_or_te": distrib_optimizer.HAVE_APEX_OR_TE}
    with cpu_compat.device_scope():
        for dtype in ("bfloat16", "float32"):
            over = {"policy.dtype": dtype, "policy.use_distributed_optimizer": True, "policy.weight_decay": 0.1}
            cfg = make_cfg(1, **over)
            first = GpuOptimizerPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
            inner = mp._torch_adams(first.optimizer)
            r: dict = {
                "distributed": first.model.ddp_config.use_distributed_optimizer,
                "inner": sorted({type(o).__name__ for o in inner}),
            }
            first.train_minibatch(batch, surrogate(coef), entropy=True)
            # The calls the policy made before: mcore's defaults fail on a save, and on a fresh optimizer's load.
            r["plain_save_error"] = _error_of(first.optimizer.sharded_state_dict, first.gpt.sharded_state_dict())
            first.save(Path(args.out) / f"ckpt_{dtype}")
            second = GpuOptimizerPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
            plain_load = second.optimizer.sharded_state_dict
            r["plain_fresh_load_error"] = _error_of(plain_load, second.gpt.sharded_state_dict(), is_loading=True)
            try:
                second.load(Path(args.out) / f"ckpt_{dtype}")
                r["load_error"] = None
            except Exception as err:  # noqa: BLE001  (the defect: an AssertionError inside mcore)
                r["load_error"] = f"{type(err).__name__}: {err}"
                res[dtype] = r
                continue
            r["updates_after_load"] = second.updates
            a = first.train_minibatch(batch, surrogate(coef), entropy=True)
            b = second.train_minibatch(batch, surrogate(coef), entropy=True)
            r["next_grad_norms"] = [a["grad_norm"], b["grad_norm"]]
            r["next_weights_equal"] = all(
                torch.equal(x, y)
                for (_, x), (_, y) in zip(first.export_weights(), second.export_weights(), strict=True)
            )
            steps = [s["step"] for o in mp._torch_adams(second.optimizer) for s in o.state.values()]
            r["steps"] = sorted({float(s) for s in steps})
            r["step_tensors_distinct"] = len({id(s) for s in steps}) == len(steps)
            # The zero state given to a fresh optimizer (so that it can load) is what its first step starts from.
            fresh = GpuOptimizerPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
            init = GpuOptimizerPolicy.from_run_config(cfg, model_dir, vocab_multiple=args.vocab_multiple)
            mp.init_torch_adam_state(init.optimizer)
            fresh.train_minibatch(batch, surrogate(coef), entropy=True)
            init.train_minibatch(batch, surrogate(coef), entropy=True)
            r["initialised_first_step_equal"] = all(
                torch.equal(x, y) for (_, x), (_, y) in zip(fresh.export_weights(), init.export_weights(), strict=True)
            )
            res[dtype] = r
    torch.Tensor.type = host_type
    return res


def scenario_placement(args: argparse.Namespace, world: int, rank: int) -> dict:
    """Device placement as on a GPU, on PyTorch's ``meta`` device (cpu_compat.emulate_device): per model, the
    trained and the reference policy in bf16; where every parameter, buffer, gradient buffer and exported tensor
    is, each floating parameter's dtype, a forward through the schedule (dense) and each MoE router's gating."""
    from nemo_disco.policy import cpu_compat

    cpu_compat.emulate_device("meta")
    from nemo_disco.policy import megatron as mp

    res: dict = {}
    for model_dir in map(Path, args.models):
        cfg = make_cfg(1, **{"policy.dtype": "bfloat16"})
        for trainable in (True, False):
            policy = mp.MegatronPolicy.from_run_config(
                cfg, model_dir, vocab_multiple=args.vocab_multiple, trainable=trainable
            )
            r: dict = {"policy_device": str(policy.device)}

            def off(named: object, device: torch.device = policy.device) -> list[str]:
                return sorted(f"{n} ({t.device.type})" for n, t in named if t.device != device)

            r["params_off_device"] = off(policy.gpt.named_parameters())
            r["buffers_off_device"] = off(policy.gpt.named_buffers())
            r["params_not_bf16"] = sorted(
                f"{n} ({p.dtype})"
                for n, p in policy.gpt.named_parameters()
                if p.is_floating_point() and p.dtype != torch.bfloat16
            )
            if trainable:
                r["main_grads_off_device"] = off(
                    (n, p.main_grad) for n, p in policy.gpt.named_parameters() if p.requires_grad
                )
                r["grad_buffers_off_device"] = sorted(
                    str(b.grad_data.device) for b in policy._param_buffers() if b.grad_data.device != policy.device
                )
            try:
                exported = list(policy.export_weights())
                r["export_off_device"] = sorted(n for n, t in exported if t.device != policy.device)
                r["export_count"] = len(exported)
            except Exception as err:  # noqa: BLE001
                r["export_error"] = f"{type(err).__name__}: {err}"
            if policy.spec.is_moe:
                from megatron.core.transformer.moe.router import TopKRouter

                hidden = torch.zeros(4, 1, policy.spec.hidden_size, dtype=torch.bfloat16, device=policy.device)
                gating = []
                for router in (m for m in policy.gpt.modules() if isinstance(m, TopKRouter)):
                    try:
                        gating.append(str(router.gating(hidden).device))
                    except Exception as err:  # noqa: BLE001
                        gating.append(f"{type(err).__name__}: {str(err).splitlines()[0]}")
                r["router_gating"] = gating
            else:
                batch = make_batch()
                seen: list[str] = []

                def record(mb, lp, ent, seen: list[str] = seen) -> torch.Tensor:  # noqa: ANN001
                    seen.append(str(lp.device))
                    return lp.new_zeros(())

                try:
                    policy._run(policy._microbatches(batch), batch.response_ids.shape[1], False, record, True)
                    r["forward_logprob_devices"] = sorted(set(seen))
                except Exception as err:  # noqa: BLE001
                    r["forward_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            res[f"{model_dir.name}_{'trained' if trainable else 'reference'}"] = r
            del policy
    return res


def launch(scenario: str, models: list[Path], out: Path, nproc: int, timeout: int = 300, **flags: object) -> list[dict]:
    """Run this worker (torchrun with ``nproc`` processes, or plain python for ``nproc=0``); per-rank results."""
    import socket
    import sys

    root = Path(__file__).resolve().parents[2]
    args = ["--scenario", scenario, "--models", *map(str, models), "--out", str(out)]
    for key, value in flags.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    if nproc == 0:
        cmd = [sys.executable, __file__, *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd += [__file__, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(root / "tests"))
    from procs import run_group

    proc = run_group(cmd, env=env, cwd=root, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(max(nproc, 1))]


# ----------------------------------------------------------------------------------------------------------------------
# pytest side. Each test_megatron_<layout>.py builds the models with `build_models`, defines a module-scoped
# `parallel_results` fixture (one `parallel` launch) and imports the checks below, which pytest then collects.

_LLAMA31_ROPE = {  # Llama-3.1-8B's config.json rope_scaling
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# One tiny model per family, shaped like the real checkpoints (tiny settings, transformers config overrides).
MODELS = {
    # DeepSeek-R1-Distill-Qwen-1.5B: Qwen2, q / k / v biases, tied embeddings.
    "qwen2_tied": ({"architecture": "qwen2", "tie_word_embeddings": True}, {}),
    # Qwen2.5-7B / Qwen2.5-Math-7B: untied embeddings, rope theta 1e6.
    "qwen25_untied": (
        {"architecture": "qwen2", "tie_word_embeddings": False},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    # Llama-3.1-8B(-Instruct): untied, llama3 rope scaling.
    "llama31": ({"architecture": "llama", "tie_word_embeddings": False}, {"rope_parameters": _LLAMA31_ROPE}),
    # Qwen3-4B: q / k norms, no biases, head_dim 32 != hidden 64 / 4 heads (the real one: 2560 / 32 heads of 128),
    # tied embeddings.
    "qwen3_tied": (
        {"architecture": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    # Qwen3-30B-A3B: every layer MoE (here 4 experts, top-2, renormalised), no shared expert, untied.
    "qwen3_moe": (
        {"architecture": "qwen3_moe", "head_dim": 32, "tie_word_embeddings": False, "moe_intermediate_size": 32},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
}
TOL = 1e-5


def build_models(root: Path, names: tuple[str, ...] = tuple(MODELS)) -> list[Path]:
    """Tiny random HF folders (2 layers, hidden 64, GQA 4 / 2, vocab 128), one per name.

    Every norm weight is drawn around 1 (transformers initialises them to exactly 1), so that a norm loaded
    into the wrong place (q_norm as k_norm, say) changes the log-probs.
    """
    from safetensors.torch import load_file, save_file

    from nemo_disco.config import TinyModelConfig
    from nemo_disco.tiny import build_model

    out = []
    for i, name in enumerate(names):
        tiny, overrides = MODELS[name]
        folder = build_model(TinyModelConfig(**tiny), root / name, seed=i, hf_overrides=overrides)
        state = load_file(str(folder / "model.safetensors"))
        g = torch.Generator().manual_seed(100 + i)
        for key, t in state.items():
            if key.endswith("norm.weight"):
                state[key] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        out.append(folder)
    return out


def _phases(results: list[dict]):  # noqa: ANN202
    for rank, per_rank in enumerate(results):
        for model, phases in per_rank.items():
            for phase, res in phases.items():
                yield f"rank {rank} {model} {phase}", res


def test_round_trip_is_bit_exact(parallel_results: list[dict]) -> None:
    """HF -> Megatron shards -> export_weights gives every HF tensor back bit for bit (padding removed)."""
    for where, res in _phases(parallel_results):
        assert res["names_equal"] and res["not_bit_exact"] == [], where


def test_logprobs_and_entropy_match_transformers(parallel_results: list[dict]) -> None:
    """Log-probs / entropy at temperature 0.7 equal transformers' unpadded forward; same on every rank."""
    for where, res in _phases(parallel_results):
        assert res["lp_diff"] <= TOL and res["ent_diff"] <= TOL, (where, res["lp_diff"], res["ent_diff"])
        assert res["lp_rank_spread"] == 0.0 and res["padding_zero"], where


def test_gradients_match_transformers_and_tp1(parallel_results: list[dict]) -> None:
    """The summed micro-batch gradient equals transformers' autograd; the layout's equals TP1 x DP=world's.

    In the TP1 phase each of the DP ranks backwards only its own rows, so the match also proves that
    DDP sums (not averages) over data-parallel ranks and the schedule does not divide by micro-batches.
    """
    world = len(parallel_results)
    for where, res in _phases(parallel_results):
        assert res["grad_diff"] <= TOL, (where, res["grad_diff"], res["grad_scale"])
        if "layout_vs_tp1_grad_diff" in res:
            assert res["dp"][1] == world, where
            assert res["layout_vs_tp1_grad_diff"] <= TOL, (where, res["layout_vs_tp1_grad_diff"])


def test_update_matches_hf_policy(parallel_results: list[dict]) -> None:
    """One clipped AdamW update (grad_clip 0.5 active) gives HFPolicy's gradient norm and weights."""
    for where, res in _phases(parallel_results):
        if "train" not in res:
            continue
        t = res["train"]
        assert t["skipped"] == 0.0 and t["updates"] == 1 and t["lr"] == 1e-3, where
        assert abs(t["grad_norm"] - t["hf_grad_norm"]) <= TOL * t["hf_grad_norm"], (where, t)
        assert abs(t["surrogate"] - t["hf_surrogate"]) <= TOL * abs(t["hf_surrogate"]), (where, t)
        assert t["weights_diff"] <= TOL, (where, t["weights_diff"])


def test_router_statistics_match_transformers(parallel_results: list[dict]) -> None:
    """A MoE model's reported load-balancing loss (summed over DP / TP slices / PP stages) is transformers'."""
    seen = 0
    for where, res in _phases(parallel_results):
        if "hf_balance_loss" in res:
            stats = res["train"]["router_stats"]
            assert abs(stats["router_balance_loss"] - res["hf_balance_loss"]) <= TOL, (where, stats, res)
            assert 1.0 <= stats["router_max_load"] <= 2.0, where  # E x max_i f_i; top-2 of 4 experts: <= 4 / 2
            seen += 1
    assert seen == len(parallel_results), "every rank reports the MoE model's router statistics"


def test_non_finite_surrogate_skips_the_update(parallel_results: list[dict]) -> None:
    for where, res in _phases(parallel_results):
        if "train" in res:
            t = res["train"]
            assert t["nan_skipped"] == 1.0 and t["nan_unchanged"] and t["updates_after_nan"] == 1, where


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--scenario",
        required=True,
        choices=[
            "parallel",
            "checkpoint",
            "converted",
            "single",
            "router",
            "gpu",
            "gpu_rules",
            "placement",
            "dist_optimizer",
        ],
    )
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of MoE models")
    parser.add_argument("--vocab-multiple", type=int, default=96)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    fn = {
        "parallel": scenario_parallel,
        "checkpoint": scenario_checkpoint,
        "converted": scenario_converted,
        "single": scenario_single,
        "router": scenario_router,
        "gpu": scenario_gpu,
        "placement": scenario_placement,
        "gpu_rules": scenario_gpu_rules,
        "dist_optimizer": scenario_dist_optimizer,
    }[args.scenario]
    result = fn(args, world, rank)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    from nemo_disco import distributed

    distributed.shutdown()  # a gloo group alive at exit can abort the process (exit -6) after it succeeded


if __name__ == "__main__":
    main()
