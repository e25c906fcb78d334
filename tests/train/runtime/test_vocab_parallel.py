"""The vocabulary-parallel loss and embedding (``runtime.vocab_parallel``) against one process's cross-entropy and
lookup with the whole weight: real gloo processes, uneven vocabulary shards and token counts, ignored targets, a
padding row, a different upstream gradient per rank and per token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ladle.data.packing import IGNORE
from tests.helpers import run_ranks

VOCAB, HIDDEN = 50, 8  # 50 rows over 3 ranks: 17, 17, 16 (torch.chunk, as FSDP2 shards dim 0)


def problem(world: int):
    """Every rank's hidden states, targets and upstream gradient, and the whole head (seeded: each rank builds
    the same)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    hidden, targets = [], []
    for rank in range(world):
        n = 5 + 2 * rank  # a different token count on each rank
        hidden.append(torch.randn(n, HIDDEN, generator=g, dtype=torch.float64))
        t = torch.randint(0, VOCAB, (n,), generator=g)
        t[rank] = IGNORE  # an ignored target on each rank
        targets.append(t)
    scales = [0.5 + rank for rank in range(world)]
    return weight, hidden, targets, scales


def embedding_reference(world: int):
    """Each rank's embeddings of its targets (as token ids; ignored ones as the padding id) and the embedding's
    gradient FSDP2 would hold for upstream gradients ``scales[rank] * hidden[rank]``."""
    weight, hidden, targets, scales = problem(world)
    w = weight.clone().requires_grad_(True)
    outs = []
    for h, t, s in zip(hidden, targets, scales, strict=True):
        out = F.embedding(ids_of(t), w, padding_idx=PADDING)
        (out * h * s / world).sum().backward()
        outs.append(out.detach())
    return outs, w.grad


PADDING = 3


def ids_of(targets: torch.Tensor) -> torch.Tensor:
    return torch.where(targets == IGNORE, PADDING, targets)


def token_weights(count: int) -> torch.Tensor:
    """Unequal upstream gradients, one per token (a preference pair's loss weighs each token's log-probability)."""
    return 1.0 + 0.5 * torch.sin(torch.arange(count, dtype=torch.float32))


def reference(world: int):
    """Each rank's loss and hidden-state gradient, and the head's gradient FSDP2 would hold (mean over ranks of
    each rank's scaled gradient), all in one process with the whole head."""
    weight, hidden, targets, scales = problem(world)
    w = weight.clone().requires_grad_(True)
    losses, d_hidden = [], []
    for h, t, s in zip(hidden, targets, scales, strict=True):
        h = h.clone().requires_grad_(True)
        per_token = F.cross_entropy(h @ w.t(), t, ignore_index=IGNORE, reduction="none")
        loss = (per_token * token_weights(len(t))).sum()
        (loss * s / world).backward()  # the mean over ranks FSDP2's reduce-scatter takes
        losses.append(loss.detach())
        d_hidden.append(h.grad * world)  # undo the 1/world: a rank's own gradient is not averaged
    return losses, d_hidden, w.grad


def rank_main(rank: int, world: int, port: int, queue, budget: int) -> None:
    import torch.distributed as dist

    from ladle.train.runtime.vocab_parallel import VocabParallelEmbedding, VocabParallelLoss

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        weight, hidden, targets, scales = problem(world)
        per = -(-VOCAB // world)
        start = min(rank * per, VOCAB)
        w = weight[start : start + per].clone().requires_grad_(True)
        h = hidden[rank].clone().requires_grad_(True)
        per_token = VocabParallelLoss.apply(h, w, targets[rank], start, dist.group.WORLD, budget)
        loss = (per_token * token_weights(len(per_token))).sum()
        (loss * scales[rank]).backward()
        e = weight[start : start + per].clone().requires_grad_(True)
        out = VocabParallelEmbedding.apply(e, ids_of(targets[rank]), start, dist.group.WORLD, e.dtype, PADDING)
        (out * hidden[rank] * scales[rank]).sum().backward()
        # numpy arrays travel by value; tensors would be shared memory this process frees when it exits
        arrays = (loss.detach(), h.grad, w.grad, out.detach(), e.grad)
        queue.put((rank, *(a.numpy() for a in arrays), start))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "budget"),
    [(2, 2**20), (3, 3 * 4 * 17)],  # the logits in one chunk; in chunks of 3 rows (the last one shorter)
)
def test_matches_whole_weight_cross_entropy_and_lookup(world, budget):
    got = sorted(run_ranks(rank_main, world, budget), key=lambda item: item[0])
    losses, d_hidden, d_weight = reference(world)
    embedded, d_embedding = embedding_reference(world)
    for rank, *arrays, start in got:
        loss, h_grad, w_grad, out, e_grad = map(torch.from_numpy, arrays)
        torch.testing.assert_close(out, embedded[rank], rtol=0, atol=0)
        torch.testing.assert_close(e_grad, d_embedding[start : start + e_grad.size(0)], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(loss, losses[rank], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(h_grad, d_hidden[rank], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(w_grad, d_weight[start : start + w_grad.size(0)], rtol=1e-9, atol=1e-10)
    assert sum(len(item[3]) for item in got) == VOCAB  # the shards cover the vocabulary once


def chunk_peak_main(rank: int, world: int, port: int, queue) -> None:
    """This rank's peak of tensor bytes during the loss's forward and backward (torch's MemTracker, which counts
    the tensors the ops see: the head rows and hidden states among them), for float32 and bfloat16 runs."""
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from ladle.train.runtime.vocab_parallel import VocabParallelLoss

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tokens, vocab, hidden = 256, 8192, 32
        per = vocab // world
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            h = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_(True)
            w = torch.randn(per, hidden, generator=g).to(dtype)
            targets = torch.randint(0, vocab, (tokens,), generator=g)
            tracker = MemTracker()
            with tracker:
                loss = VocabParallelLoss.apply(h, w, targets, rank * per, dist.group.WORLD, 2**20).sum()
                loss.backward()
            peak = tracker.get_tracker_snapshot("peak")[h.device]["Total"]
            # Beside the chunk: every rank's hidden states (gathered, the partial gradient, this rank's own and
            # its gradient: at most 4 copies) and a few per-token vectors (maxima, sums, targets, masks).
            small = world * tokens * (4 * hidden * dtype.itemsize + 64)
            out[str(dtype)] = (peak, small, per * hidden * dtype.itemsize)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_the_loss_holds_one_chunk_of_logits_as_the_memory_model_counts():
    """Measured tensor bytes of the chunked loss on 2 gloo ranks against ``sizing.vocab_parallel_logits_bytes``:
    a chunk of float32 logits (plus, in a 16-bit run, its 16-bit twin), one chunk alive at a time."""
    from ladle import sizing

    world, tokens, vocab, hidden = 2, 256, 8192, 32
    got = run_ranks(chunk_peak_main, world)
    shape = sizing.ModelShape(0, 0, 1, hidden, 0, 0, 1, vocab, 0, 0)
    for _, measured in got:
        for name, dtype_bytes in (("torch.float32", 4), ("torch.bfloat16", 2)):
            extra, small, weight = measured[name]
            counted = sizing.vocab_parallel_logits_bytes(shape, tokens, dtype_bytes, world, 2**20)
            # 2 ** 20 bytes of float32 rows of a 4 096-row shard: 64 rows at a time, of 512 (every rank's tokens).
            assert counted == 64 * 4096 * (4 if dtype_bytes == 4 else 6)
            # Two chunks alive at once (the next one made before the last is freed) would fail this.
            assert counted <= extra - weight <= counted + small, (name, extra, counted, small, weight)
