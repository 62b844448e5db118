"""Cost of the loss against the cost of a model forward, per token.

Times pass 1 of a mini-batch (``loss.stats`` over all rollouts without grad) plus ``losses.coefficients``
for N rollouts x T tokens (float32, every token valid: the loss's worst case), and, for reference, pass 2's
stats forward + backward over the same tokens. Compares with a no-grad forward of the tiny CPU model
(``nemo_disco.tiny.build_model``) on a subset of the same token count, scaled per token to N x T. The goal is a
loss cost under 1% of that forward.

    .venv/bin/python benchmarks/bench_losses.py                           # default TinyModelConfig (2 x 64)
    .venv/bin/python benchmarks/bench_losses.py --layers 4 --hidden 128

Prints one markdown table row per loss: medians over ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from nemo_disco import losses
from nemo_disco.config import TinyModelConfig
from nemo_disco.tiny import VOCAB_SIZE, build_model

CASES = {
    "disco-logl": ("disco", {"score": "logl", "tau": 10.0}),
    "disco-lratio": ("disco", {"score": "lratio", "tau": 1.0}),
    "discob-logl-k3": ("discob", {"score": "logl", "kl": "k3"}),
    "grpo": ("grpo", {}),
    "dapo": ("dapo", {}),
}


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _forward_seconds_per_token(args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM

    tiny = TinyModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        max_position_embeddings=max(512, args.subset_len),
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(str(build_model(tiny, tmp)), dtype=torch.float32).eval()
    ids = torch.randint(VOCAB_SIZE, (args.subset_seqs, args.subset_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids[:1, :16])  # warm-up
        seconds = _median_time(lambda: model(input_ids=ids).logits, args.repeats)
    return seconds / ids.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rollouts-per-prompt", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=TinyModelConfig().num_layers)
    parser.add_argument("--hidden", type=int, default=TinyModelConfig().hidden_size)
    parser.add_argument("--subset-seqs", type=int, default=16)
    parser.add_argument("--subset-len", type=int, default=512)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    N, T = args.rollouts, args.tokens
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(N, T, generator=g) * 3  # [N, T] float32
    lp = old + 0.01 * torch.randn(N, T, generator=g)
    mask = torch.ones(N, T, dtype=torch.bool)
    group_ids = torch.arange(N) // args.rollouts_per_prompt
    rewards = (torch.rand(N, generator=g) < 0.4).float()

    per_token = _forward_seconds_per_token(args)
    forward = per_token * N * T
    print(
        f"threads {torch.get_num_threads()}; N={N} x T={T} float32; model {args.layers} layers x hidden {args.hidden}; "
        f"forward {per_token * 1e6:.3f} us/token on {args.subset_seqs}x{args.subset_len} -> {forward:.2f} s for N x T"
    )
    print("| loss | pass 1 stats (s) | coefficients (s) | pass 1 + coeffs / forward | pass 2 stats fwd+bwd (s) |")
    print("|---|---|---|---|---|")
    for key in args.cases.split(","):
        name, hp = CASES[key]
        fn = losses.get_loss(name, **hp)

        def pass1(fn=fn, hp=hp) -> torch.Tensor:
            with torch.no_grad():
                return fn.stats(lp, old, mask, **hp)

        stats = pass1()
        losses.coefficients(fn, stats, group_ids, rewards, **hp)  # warm-up
        t_stats = _median_time(pass1, args.repeats)
        t_coef = _median_time(
            lambda fn=fn, hp=hp, stats=stats: losses.coefficients(fn, stats, group_ids, rewards, **hp), args.repeats
        )
        coeffs = losses.coefficients(fn, stats, group_ids, rewards, **hp)[0]

        def pass2(fn=fn, hp=hp, coeffs=coeffs) -> None:
            leaf = lp.clone().requires_grad_(True)
            losses.surrogate(coeffs, fn.stats(leaf, old, mask, **hp)).backward()

        t_pass2 = _median_time(pass2, args.repeats)
        ratio = (t_stats + t_coef) / forward
        print(f"| {key} | {t_stats:.4f} | {t_coef:.4f} | {100 * ratio:.3f}% | {t_pass2:.4f} |")


if __name__ == "__main__":
    main()
