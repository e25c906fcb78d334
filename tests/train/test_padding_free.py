"""Padding-free micro-batches (``training.kernels.padding_free``): joined rows train as the padded rows do, and
the rows are joined only where that computes less."""

from __future__ import annotations

import pytest
import torch

from ladle.data.packing import IGNORE, pack_examples
from ladle.data.tokenize import Example
from ladle.plan import kernels as plan_kernels
from ladle.train import run_state
from ladle.train.loss import token_loss
from ladle.train.padding_free import JoinRows, install
from tests.train.test_kernels import cfg_with, close, tiny


def packed(vocab: int, seq_len: int = 48) -> dict[str, torch.Tensor]:
    """Rows of examples of 9-40 tokens, padded; one example trained from its first token on (no prompt), so a
    joined row's boundary would train across examples unless its first label is dropped."""
    g = torch.Generator().manual_seed(3)
    examples = []
    for n, length in enumerate([40, 31, 25, 22, 17, 12, 9, 48]):
        ids = torch.randint(1, vocab, (length,), generator=g).tolist()
        prompt = 0 if n in (1, 7) else min(5, length - 1)
        examples.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
    rows = pack_examples(examples, seq_len, pad_id=0).to_table().to_pydict()
    return {key: torch.tensor(value, dtype=torch.long) for key, value in rows.items()}


def loss_and_grads(model, data, rows):
    model.zero_grad(set_to_none=True)
    loss, count = token_loss(model, data, rows, "cpu")
    loss.backward()
    return loss.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_joined_rows_train_as_the_padded_rows(lora):
    model = tiny(lora)
    data = packed(model.config.vocab_size)
    rows = list(range(len(data["input_ids"])))
    assert len(rows) > 1 and (data["real_tokens"] < 48).any() and (data["real_tokens"] == 48).any()
    plain, plain_count, plain_grads = loss_and_grads(model, data, rows)
    joiner = JoinRows(per_token=1.0, per_pair=0.0)  # always worth joining: the comparison, not the cost model
    run_state.on(model).joiner = joiner
    loss, count, grads = loss_and_grads(model, data, rows)
    assert joiner.joined == joiner.batches == 1
    assert joiner.computed == int(data["real_tokens"].sum()) < joiner.row_tokens
    assert count == plain_count > 0
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)
    assert grads.keys() == plain_grads.keys() and grads
    for name, grad in grads.items():
        assert close(grad, plain_grads[name], 1e-4), name
    # The joined row: the real tokens only, positions restarting per example, no label across a row boundary.
    from ladle.train.loss import batch_rows

    ids, labels, positions = batch_rows(model, data, rows, "cpu")
    assert ids.shape == (1, int(data["real_tokens"].sum()))
    assert int((positions == 0).sum()) == 8  # one start per example
    assert int((labels[:, 1:] != IGNORE).sum()) == count


def test_joined_rows_attend_within_each_example_only():
    """Changing one example's tokens changes no other example's logits in the joined row."""
    model = tiny(lora=False).eval()
    data = packed(model.config.vocab_size)
    run_state.on(model).joiner = JoinRows(per_token=1.0, per_pair=0.0)
    from ladle.train.loss import batch_rows

    ids, _, positions = batch_rows(model, data, [0, 1], "cpu")
    starts = (positions[0] == 0).nonzero().squeeze(1).tolist()
    first_end = starts[1]
    changed = ids.clone()
    changed[0, :first_end] = (changed[0, :first_end] + 1) % model.config.vocab_size
    with torch.no_grad():  # no cache, as token_loss runs it: a cache turns transformers' packed-row mask off
        a = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        b = model(input_ids=changed, position_ids=positions, use_cache=False).logits
    assert not torch.allclose(a[0, :first_end], b[0, :first_end])
    assert torch.allclose(a[0, first_end:], b[0, first_end:], atol=1e-5)


def decoder(hidden: int, heads: int, kv_heads: int, inner: int):
    """A decoder's config as ``JoinRows.for_config`` reads it (a gated SiLU MLP)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inner,
        hidden_act="silu",
    )


def test_rows_are_joined_only_where_that_computes_less():
    smollm2 = decoder(hidden=576, heads=9, kv_heads=3, inner=1536)
    joiner = JoinRows.for_config(smollm2)
    # 576 x (2 x 576 + 2 x 192) + 3 x 576 x 1536 multiply-adds per token; 2 x 576 per query-key pair
    assert (joiner.per_token, joiner.per_pair) == (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536, 2 * 576)
    assert joiner.worth([97, 100, 60, 120], 128)  # a quarter padding at 128 tokens: joined
    assert joiner.worth([5], 4096)  # one row: its padding is dropped, nothing added
    assert not joiner.worth([4000] * 8, 4096)  # nearly full long rows: the attention added costs more
    assert not joiner.worth([128, 128], 128)  # no padding: nothing to gain
    llama8b = decoder(hidden=4096, heads=32, kv_heads=8, inner=14336)
    assert JoinRows.for_config(llama8b).worth([3000, 3100], 4096)  # 26 % padding outweighs the attention
    data = packed(100)
    joiner.join(data["input_ids"][:2], data["labels"][:2], data["position_ids"][:2], torch.tensor([48, 48]))
    assert joiner.summary() == "on: 0 of 1 micro-batches joined into one row; 0.0% of row tokens (padding) not computed"
    from types import SimpleNamespace

    first, second = SimpleNamespace(config=smollm2), SimpleNamespace(config=smollm2)
    assert install(first, {"padding_free": False}) == "off" and run_state.of(first).joiner is None
    assert install(first, {"padding_free": True}) == "on" and run_state.of(first).joiner is not None
    # per run, on its own model: a second run in the same process does not see the first one's joiner
    assert run_state.of(second).joiner is None and run_state.of(second) is run_state.NOTHING


def test_plan_decides_padding_free_per_strategy_and_refuses_it_where_rows_keep_one_shape():
    auto = cfg_with().training.kernels
    for strategy in ("ddp", "zero3", "fsdp2"):
        decided, why = plan_kernels.decide(auto, strategy, "cpu", "float32")
        assert decided["padding_free"] is True
        assert "padding-free micro-batches per micro-batch, where one row of its real tokens computes less" in why[0]
    decided, why = plan_kernels.decide(auto, "pipeline", "cuda", "bfloat16")
    assert decided["padding_free"] is False and "padding-free micro-batches off: pipeline keeps fixed row" in why[0]
    off = cfg_with("training.kernels.padding_free=false").training.kernels
    assert plan_kernels.decide(off, "ddp", "cpu", "float32")[0]["padding_free"] is False
    forced = cfg_with("training.kernels.padding_free=true").training.kernels
    assert plan_kernels.problems(forced, "ddp", "cpu") == []
    found = plan_kernels.problems(forced, "tp", "cuda")
    assert found == [
        "training.kernels.padding_free = true with parallelism.strategy = tp: tp's stages need rows of one fixed "
        "shape; padding-free micro-batches run with ddp, zero1, zero2, zero3, zero++, fsdp2. Set "
        "training.kernels.padding_free=auto or false."
    ]
