"""End-to-end step throughput on CPU: nemo_disco (loss=grpo and loss=disco) against TRL's GRPOTrainer.

Both sides get the same random tiny Qwen2 (4 layers, hidden 128; built once with nemo_disco.tiny), the same
character-level tokenizer, the same synthetic arithmetic prompts (nemo_disco.data, prompt template
``{problem}=``), 16 prompts x 8 rollouts per step, the same completion length, AdamW with the same learning
rate, betas, eps, weight decay (0), gradient clip (1.0) and constant schedule, one optimizer update per step
from one micro-batch of all 128 rollouts, the same sampling (temperature 1, no top-k / top-p), no KL /
reference model, and the same reward (nemo_disco's math grader pool). Generation is forced to exactly
``max tokens``: nemo_disco with ``SamplingParams.ignore_eos`` (the generator is wrapped), TRL with
``generation_kwargs={"min_new_tokens": max}`` (transformers masks EOS until the budget is reached). Each
completion length measured is reported, so a run that stopped early would show. Each side samples with its
own code: nemo_disco's transformers generator with its KV-cached decode loop (``generation/kv_decode.py``),
TRL with transformers' ``generate``; both on the same model in float32 on the CPU.

Runs alternate in one process tree (a fresh child process per run: nd-grpo, nd-disco, trl, nd-grpo, ...),
so slow phases of a shared machine hit every framework alike; the figures are medians over rounds, the
ratio is TRL's seconds per step over nemo_disco's (= completion tokens/s of nemo_disco over TRL's).

Run::

    .venv/bin/python benchmarks/bench_e2e_trl.py                 # 3 rounds at 32 and 128 tokens
    .venv/bin/python benchmarks/bench_e2e_trl.py --quick         # 1 round, 32 tokens, 2 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

PROMPTS_PER_STEP = 16
ROLLOUTS_PER_PROMPT = 8
MAX_PROMPT_TOKENS = 32
LR = 1e-5
SEED = 1
KINDS = ("nd-grpo", "nd-disco", "trl")


def _rollouts() -> int:
    return PROMPTS_PER_STEP * ROLLOUTS_PER_PROMPT


def nd_overrides(model_dir: Path, loss: str, tokens: int, steps: int) -> list[str]:
    """The nemo_disco side of the comparison (tiny-cpu recipe + these)."""
    return [
        f"policy.model_path={model_dir}",
        f"loss.name={loss}",
        f"algorithm.prompts_per_step={PROMPTS_PER_STEP}",
        f"algorithm.minibatch_prompts={PROMPTS_PER_STEP}",  # one optimizer update per step, as TRL below
        f"algorithm.rollouts_per_prompt={ROLLOUTS_PER_PROMPT}",
        f"algorithm.steps={steps}",
        f"algorithm.seed={SEED}",
        f"generation.max_response_tokens={tokens}",
        f"generation.max_prompt_tokens={MAX_PROMPT_TOKENS}",
        f"generation.hf_batch_size={_rollouts()}",  # one generate call for the whole step, as TRL
        "generation.temperature=1.0",
        "generation.top_p=1.0",
        "generation.top_k=-1",
        f"policy.lr={LR}",
        "policy.weight_decay=0.0",
        "policy.grad_clip=1.0",
        "policy.lr_schedule=constant",
        # One micro-batch holding all 128 rollouts, as TRL's per_device_train_batch_size=128.
        f"policy.microbatch_tokens={_rollouts() * (MAX_PROMPT_TOKENS + tokens)}",
        "loss.kl_coef=0.0",
    ]


# ----------------------------------------------------------------------------------------------------------------------
# Children


def child_nd(args: argparse.Namespace) -> dict[str, Any]:
    """One nemo_disco run: setup, warm-up steps, measured steps."""
    loss = args.child.removeprefix("nd-")
    with tempfile.TemporaryDirectory(prefix="bench_nd_") as tmp:
        cfg = C.load_config(Path(tmp), nd_overrides(args.model_dir, loss, args.tokens, args.warmup + args.steps))
        prof = Path(args.profile) if args.profile else None
        out = C.nd_steps(cfg, args.steps, args.warmup, fixed_length=True, profile=prof)
    phases = [C.step_phases(m) for m in out["metrics"]]
    return {
        "kind": args.child,
        "tokens": args.tokens,
        "setup_s": out["setup_s"],
        "wall_s": out["wall_s"],
        "s_per_step": statistics.median(out["wall_s"]),
        "generate_s": statistics.median(p["generate"] for p in phases),
        "grade_s": statistics.median(p["grade"] for p in phases),
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "completion_tokens_per_step": statistics.median(out["completion_tokens"]),
    }


def _prompt_dataset(model_dir: Path, size: int) -> tuple[list[str], list[str]]:
    """The synthetic prompts exactly as nemo_disco encodes them (decoded back to text for TRL) and their answers."""
    from transformers import AutoTokenizer

    from nemo_disco.data import encode_prompts, load_problems

    cfg = C.load_config(Path(tempfile.gettempdir()), nd_overrides(model_dir, "grpo", 32, 1))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems, _ = load_problems(
        cfg.data.train, split=cfg.data.split, on_bad_row="error", synthetic_size=size, seed=cfg.data.seed
    )
    ids, kept, _ = encode_prompts(
        tok,
        problems,
        template=cfg.data.prompt_template,
        use_chat_template=cfg.data.use_chat_template,
        max_prompt_tokens=cfg.generation.max_prompt_tokens,
    )
    texts = [tok.decode(x) for x in ids]
    if [tok(t, add_special_tokens=False)["input_ids"] for t in texts[:50]] != [list(x) for x in ids[:50]]:
        raise RuntimeError("prompt text does not re-tokenize to nemo_disco's prompt ids")
    return texts, [problems[i].answer for i in kept]


def run_trl(
    model_dir: Path,
    tokens: int,
    steps: int,
    warmup: int,
    *,
    prompts_per_step: int = PROMPTS_PER_STEP,
    rollouts_per_prompt: int = ROLLOUTS_PER_PROMPT,
    bf16: bool = False,
) -> dict[str, Any]:
    """TRL's GRPOTrainer with the model, prompts, sizes, optimizer and grader of the nemo_disco side.

    On the CPU in float32 (``bf16=False``), or on the GPU in bf16 (``bf16=True``, CUDA required).
    ``warmup + steps`` optimizer steps; the first ``warmup`` are not timed.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_disco.rewards import GraderPool

    rollouts = prompts_per_step * rollouts_per_prompt
    cfg = C.load_config(Path(tempfile.gettempdir()), nd_overrides(model_dir, "grpo", tokens, 1))
    texts, answers = _prompt_dataset(model_dir, cfg.data.synthetic_size)
    dataset = Dataset.from_dict({"prompt": texts, "answer": answers})
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    grader = GraderPool(cfg.reward.grader, timeout_s=cfg.reward.timeout_s, workers=cfg.reward.workers)
    grade_s: list[float] = []

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        t0 = time.perf_counter()
        scores, _metrics = grader.score(list(completions), list(answer))
        grade_s.append(time.perf_counter() - t0)
        return [float(s) for s in scores]

    gen_s: list[float] = []

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            gen_s.append(time.perf_counter() - t0)
            return out

    ends: list[float] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            ends.append(time.perf_counter())

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    total = warmup + steps
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as tmp:
        targs = GRPOConfig(
            output_dir=tmp,
            use_cpu=not bf16,
            bf16=bf16,
            fp16=False,
            seed=SEED,
            max_steps=total,
            per_device_train_batch_size=rollouts,
            gradient_accumulation_steps=1,
            num_generations=rollouts_per_prompt,
            max_completion_length=tokens,
            generation_kwargs={"min_new_tokens": tokens},
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            adam_beta1=cfg.policy.adam_beta1,
            adam_beta2=cfg.policy.adam_beta2,
            adam_epsilon=cfg.policy.adam_eps,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="grpo",
            num_iterations=1,
            epsilon=cfg.loss.clip_eps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": torch.bfloat16 if bf16 else torch.float32},
        )
        trainer = Timed(
            model=str(model_dir),
            reward_funcs=reward,
            args=targs,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            grader.close()
        train_s = time.perf_counter() - t0
    # A step's wall time runs from the previous step's end (the first measured step starts at the last warm-up's).
    walls = [b - a for a, b in zip(ends[warmup - 1 : -1], ends[warmup:], strict=True)]
    return {
        "kind": "trl",
        "tokens": tokens,
        "train_s": train_s,
        "wall_s": walls,
        "s_per_step": statistics.median(walls),
        "generate_s": statistics.median(gen_s[warmup:]),
        "grade_s": statistics.median(grade_s[warmup:]),
        "completion_tokens_per_step": statistics.median(lengths[warmup:]) * rollouts,
    }


def child_trl(args: argparse.Namespace) -> dict[str, Any]:
    """One TRL GRPOTrainer run with the same model, prompts, sizes, optimizer and grader (CPU, float32)."""
    return run_trl(args.model_dir, args.tokens, args.steps, args.warmup)


# ----------------------------------------------------------------------------------------------------------------------
# Parent


def _child_args(kind: str, tokens: int, model_dir: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--child",
        kind,
        "--tokens",
        str(tokens),
        "--model-dir",
        str(model_dir),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds of every kind at every token budget; medians and ratios."""
    model_dir = C.build_bench_model(C.RESULTS / "e2e_model")
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for tokens in args.tokens:
            for kind in args.kinds:
                res = C.run_child(
                    Path(__file__), _child_args(kind, tokens, model_dir, args), timeout=1800, threads=args.threads
                )
                res["round"] = rnd
                runs.append(res)
                print(
                    f"round {rnd} {kind:8s} {tokens:4d} tokens: {res['s_per_step']:.3f} s/step "
                    f"(generate {res['generate_s']:.3f} s, {res['completion_tokens_per_step']:.0f} tokens/step)",
                    flush=True,
                )
    table: dict[str, Any] = {}
    for tokens in args.tokens:
        row: dict[str, Any] = {}
        for kind in args.kinds:
            mine = [r for r in runs if r["kind"] == kind and r["tokens"] == tokens]
            sps = C.summarize(r["s_per_step"] for r in mine)
            tps = C.summarize(r["completion_tokens_per_step"] / r["s_per_step"] for r in mine)
            row[kind] = {
                "s_per_step": sps,
                "completion_tokens_per_s": tps,
                "generate_s": C.summarize(r["generate_s"] for r in mine),
                "completion_tokens_per_step": C.summarize(r["completion_tokens_per_step"] for r in mine),
            }
        if "trl" in args.kinds:
            for kind in args.kinds:
                if kind == "trl":
                    continue
                # Per-round ratios (same round = neighbouring runs) and the ratio of the medians.
                paired = []
                for rnd in range(args.rounds):
                    a = [r for r in runs if r["round"] == rnd and r["tokens"] == tokens and r["kind"] == kind]
                    b = [r for r in runs if r["round"] == rnd and r["tokens"] == tokens and r["kind"] == "trl"]
                    if a and b:
                        ta = a[0]["completion_tokens_per_step"] / a[0]["s_per_step"]
                        tb = b[0]["completion_tokens_per_step"] / b[0]["s_per_step"]
                        paired.append(ta / tb)
                row[kind]["tokens_per_s_vs_trl"] = {
                    "ratio_of_medians": row[kind]["completion_tokens_per_s"]["median"]
                    / row["trl"]["completion_tokens_per_s"]["median"],
                    "per_round": C.summarize(paired),
                }
        table[str(tokens)] = row
    return {"settings": vars(args) | {"model_dir": str(model_dir)}, "runs": runs, "table": table}


def _print_table(result: dict[str, Any]) -> None:
    print("\ntokens  kind       s/step (median, min-max)      completion tok/s   generate s   vs TRL")
    for tokens, row in result["table"].items():
        for kind, r in row.items():
            s = r["s_per_step"]
            ratio = r.get("tokens_per_s_vs_trl", {}).get("ratio_of_medians")
            print(
                f"{tokens:>6}  {kind:9s}  {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"
                f"{'':10s}{r['completion_tokens_per_s']['median']:10.0f}   {r['generate_s']['median']:9.3f}"
                f"   {'' if ratio is None else f'{ratio:.2f}x'}"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help="(child) write a cProfile of the measured nemo_disco steps here")
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128], help="completion tokens (fixed length)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (one run of every kind per round)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per run (at least 1)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--threads", type=int, default=1, help=C.THREADS_HELP)
    ap.add_argument("--quick", action="store_true", help="1 round at 32 tokens, 2 measured steps")
    args = ap.parse_args(argv)
    if args.child:
        if args.tokens and len(args.tokens) != 1:
            ap.error("--child takes one --tokens value")
        args.tokens = args.tokens[0]
        C.emit(child_nd(args) if args.child.startswith("nd-") else child_trl(args))
        return 0
    if args.warmup < 1:
        ap.error("--warmup must be at least 1")
    if args.quick:
        args.rounds, args.tokens, args.steps = 1, [32], 2
    if "trl" in args.kinds:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed: pip install trl==1.16.0 (see benchmarks/README.md); nemo_disco only")
            args.kinds = [k for k in args.kinds if k != "trl"]
    result = compare(args)
    _print_table(result)
    path = C.write_json("e2e_trl", result)
    print(f"\nwrote {path}")
    print(json.dumps(result["table"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
