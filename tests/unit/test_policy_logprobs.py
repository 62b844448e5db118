import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_disco.policy.logprobs import token_logprobs

torch.manual_seed(0)


def _reference(logits, targets, temperature, vocab_size):
    """float64 log_softmax over the real vocabulary (columns >= vocab_size are padding)."""
    logp = torch.log_softmax(logits[..., :vocab_size].double() / temperature, -1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
@pytest.mark.parametrize("view", [False, True])
def test_values_and_gradients_match_log_softmax(chunk, view):
    vocab, padded = 45, 50
    base = torch.randn(3, 9, padded, dtype=torch.float32, requires_grad=True)
    # view=True: a non-contiguous slice of a [B, S+2, V] tensor, as the policy passes response positions.
    logits = base[:, 1:8] if view else base
    targets = torch.randint(0, vocab, logits.shape[:-1])
    lp, ent = token_logprobs(logits, targets, temperature=0.7, vocab_size=vocab, chunk_size=chunk, entropy=True)
    ref_lp, ref_ent = _reference(logits, targets, 0.7, vocab)
    assert lp.dtype == torch.float32 and lp.shape == targets.shape
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-6, rtol=0)
    w1, w2 = torch.randn(targets.shape), torch.randn(targets.shape)
    (g,) = torch.autograd.grad((w1 * lp + w2 * ent).sum(), base)
    (ref_g,) = torch.autograd.grad((w1 * ref_lp + w2 * ref_ent).sum(), base)
    torch.testing.assert_close(g, ref_g, atol=1e-6, rtol=0)
    assert torch.all(g[..., vocab:] == 0)  # padding columns get no gradient


def test_two_dimensional_input_and_no_entropy():
    logits = torch.randn(7, 11, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    lp, ent = token_logprobs(logits, targets, chunk_size=2)
    assert ent is None
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1))
    (g,) = torch.autograd.grad(lp.sum(), logits)
    # d log p(y) / dz = onehot(y) - softmax(z): each row sums to 0.
    torch.testing.assert_close(g.sum(-1), torch.zeros(7), atol=1e-6, rtol=0)


def test_input_is_not_modified():
    """Unlike mcore's vocab_parallel_cross_entropy, which overwrites its input logits in place."""
    logits = torch.randn(2, 5, 13, requires_grad=True)
    before = logits.detach().clone()
    lp, ent = token_logprobs(logits, torch.randint(0, 13, (2, 5)), temperature=0.6, chunk_size=3, entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.equal(logits.detach(), before)


class _LargestFloat32(TorchDispatchMode):
    """Records the largest float32 storage any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_no_full_float32_copy_of_the_logits():
    """bf16 logits [4 x 64 tokens, vocab 1000], chunk 32: no float32 tensor beyond one [32, 1000] block."""
    tokens, vocab, chunk = 256, 1000, 32
    logits = torch.randn(4, 64, vocab).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, vocab, (4, 64))
    with _LargestFloat32() as mode:
        lp, ent = token_logprobs(logits, targets, chunk_size=chunk, entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert mode.largest <= chunk * vocab * 4  # 128 kB; the naive float32 log_softmax would make 1 MB tensors
    assert mode.largest < tokens * vocab * 4
    assert logits.grad.dtype == torch.bfloat16


class _AtenOps(TorchDispatchMode):
    """Records the names of the aten ops that run."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_no_matmul_in_the_float32_statistics():
    """On GPUs that allow TF32, a bmm / mm of float32 blocks keeps ~10 mantissa bits: the entropy's
    sum_v e_v (z_v - m) would be off by ~1e-3. It is an elementwise product and a sum instead."""
    logits = torch.randn(2, 6, 50, requires_grad=True)
    with _AtenOps() as mode:
        lp, ent = token_logprobs(logits, torch.randint(0, 50, (2, 6)), temperature=0.7, chunk_size=4, entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert not mode.ops & {"bmm", "mm", "matmul", "baddbmm", "addmm", "einsum", "dot", "mv"}, sorted(mode.ops)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"logits \(2, 3, 5\) do not match targets \(2, 4\)"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size=0"):
        token_logprobs(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), chunk_size=0)


def test_a_vocabulary_shard_without_the_target_gives_it_no_gradient():
    """One TP shard (columns 20..44 of 50) alone: tokens whose target lies on another shard get only -p_v."""
    vocab, start, padded = 45, 20, 50
    base = torch.randn(2, 7, padded, requires_grad=True)
    logits = base[..., start:]  # a non-contiguous view, as a shard of the policy's logits
    targets = torch.randint(0, vocab, (2, 7))
    targets[0, :3] = torch.tensor([0, start, vocab - 1])  # off the shard, its first and its last real column
    lp, _ = token_logprobs(logits, targets, temperature=0.7, vocab_start=start, vocab_size=vocab, chunk_size=3)
    z = logits[..., : vocab - start].double() / 0.7
    here = targets >= start
    local = (targets - start).clamp(min=0).unsqueeze(-1)
    ref = torch.where(here, z.gather(-1, local).squeeze(-1), 0.0) - torch.logsumexp(z, -1)
    torch.testing.assert_close(lp.double(), ref, atol=2e-6, rtol=0)
    w = torch.randn(targets.shape)
    (g,) = torch.autograd.grad((w * lp).sum(), base)
    (ref_g,) = torch.autograd.grad((w * ref).sum(), base)
    torch.testing.assert_close(g, ref_g, atol=1e-6, rtol=0)


def test_no_host_sync_per_chunk():
    """On a GPU a nonzero, .item() or boolean-mask index waits for the device: once per chunk in the loop."""
    from host_syncs import HostSyncs

    vocab, start = 45, 20
    logits = torch.randn(2, 7, 50)[..., start:].requires_grad_(True)  # a shard: some targets elsewhere
    targets = torch.randint(0, vocab, (2, 7))
    with HostSyncs() as syncs:
        lp, ent = token_logprobs(logits, targets, vocab_start=start, vocab_size=vocab, chunk_size=3, entropy=True)
    assert syncs.calls == [], syncs.calls
    with HostSyncs() as syncs:
        (lp.sum() + ent.sum()).backward()
    assert syncs.calls == [], syncs.calls
