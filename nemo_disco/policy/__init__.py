"""Training policies: one protocol, a Megatron-Core backend and a transformers backend."""

from nemo_disco.policy.base import Policy, SurrogateFn

__all__ = ["Policy", "SurrogateFn", "build_policy"]


def build_policy(cfg, tokenizer_dir):  # noqa: ANN001, ANN201  (imports stay lazy: megatron is heavy)
    """Build the policy named by ``cfg.policy.backend`` (``cfg`` is a :class:`~nemo_disco.config.RunConfig`)."""
    if cfg.policy.backend == "hf":
        from nemo_disco.policy.hf import HFPolicy

        return HFPolicy(cfg, tokenizer_dir)
    from nemo_disco.policy.megatron import MegatronPolicy

    return MegatronPolicy(cfg, tokenizer_dir)
