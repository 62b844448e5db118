"""Training policies: one protocol, a Megatron-Core backend and a transformers backend."""

from nemo_disco.policy.base import Policy, SurrogateFn

__all__ = ["Policy", "SurrogateFn", "build_policy"]


def build_policy(cfg, model_dir, *, trainable=True):  # noqa: ANN001, ANN201  (lazy imports: megatron is heavy)
    """Build the policy named by ``cfg.policy.backend`` (``cfg`` is a :class:`~nemo_disco.config.RunConfig`).

    ``trainable=False`` builds a forward-only policy (the reference policy): log-probs, offload and onload
    only; no optimizer, gradient buffers or master weights.
    """
    if cfg.policy.backend == "hf":
        from nemo_disco.policy.hf import HFPolicy

        return HFPolicy.from_run_config(cfg, model_dir, trainable=trainable)
    from nemo_disco.policy.megatron import MegatronPolicy

    return MegatronPolicy.from_run_config(cfg, model_dir, trainable=trainable)
