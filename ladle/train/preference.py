"""Preference tuning's loss (``training.objective: dpo``): DPO, IPO, robust DPO and SimPO over pair rows; and
KTO's (``kto``) over rows of a judged answer beside a mismatched one (``KtoLoss``).

A pair's row holds the chosen side, then the rejected side (``ladle.data.preference``), labels on the completions
only. One forward over a micro-batch of pair rows gives every labelled token's log-probability; a side's
log-probability is the sum over its tokens (``pair_logps``). The head runs as the SFT loss runs it: the chunked
fused head (per-token log-probabilities a chunk of tokens at a time, recomputed in backward: never full-vocabulary
float32 logits for both sides at once), FSDP2's vocabulary-parallel head, or the model's own head.

The loss of a pair, with ``d`` the chosen side's log-ratio against the reference minus the rejected side's (as
TRL's ``DPOTrainer`` computes them, ``trl`` 1.16):

- ``sigmoid`` (DPO): ``-log sigmoid(beta d)``;
- ``ipo``: ``(d' - 1/(2 beta))^2`` with ``d'`` from per-token averages (TRL's normalisation);
- ``robust``: ``(-(1-e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2e)``, ``e`` the label smoothing;
- ``simpo`` (reference-free, TRL's CPO with ``loss_type=simpo``, ``cpo_alpha=0``): ``-(1-e) log sigmoid(beta m) -
  e log sigmoid(-beta m)`` with ``m`` the difference of the policy's per-token average log-probabilities minus
  ``gamma / beta``.

The step's loss is the mean over the global batch's pairs: the loss function returns the pairs' summed loss and
their count, and the runtimes divide by the global count as they divide token sums for SFT, so every strategy that
runs the model's whole forward on whole rows trains pairs without a change of its own.

The reference: ``precomputed`` log-probabilities (one no-grad pass over the pairs by the model as loaded, before
the first step: LoRA's adapters start at zero and a full fine-tune at the base, so that model is the reference;
kept with the run's artifacts and reused on resume), or, with LoRA, ``adapters_off``: the same model with its
adapters disabled, one no-grad forward per micro-batch. Either way no second copy of the weights is held.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ladle.data.packing import IGNORE
from ladle.train import run_state
from ladle.train.loss import batch_rows

REFERENCE_FILE = "reference_logps.json"


def sides(position_ids: torch.Tensor) -> torch.Tensor:
    """Which side each token of pair rows (rows x length) is on: 0 chosen, 1 rejected, 2 and up padding (each
    starts again at position 0)."""
    return torch.cumsum((position_ids == 0).long(), dim=1) - 1


def ranked_right(margins: torch.Tensor) -> torch.Tensor:
    """1 where a pair's reward margin ranks chosen above rejected, 0.5 for a tie, 0 below (so the reference, every
    margin 0, scores 0.5)."""
    return (margins > 0).double() + 0.5 * (margins == 0).double()


def pair_logps(model, data: dict[str, torch.Tensor], rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's summed log-probability of its chosen and rejected completion (pairs x 2, float32, with the
    graph) and each side's completion tokens (pairs x 2), for the pair rows ``rows``."""
    ids, labels, positions = batch_rows(model, data, rows, device)
    targets = labels[:, 1:]
    keep = targets != IGNORE
    logps = token_logps(model, ids, labels, positions, keep)
    # The side each labelled target belongs to: the example (position ids restart at 0) of the token it predicts.
    starts = (positions == 0).reshape(-1)
    example = (torch.cumsum(starts.long(), 0) - 1).reshape(positions.shape)[:, 1:][keep]
    # Sides with labels come in (chosen, rejected) order, pair after pair; padding examples carry no labels.
    sides, side = torch.unique_consecutive(example, return_inverse=True)
    if sides.numel() != 2 * len(rows):
        raise RuntimeError(f"{len(rows)} pair rows hold {sides.numel()} labelled sides, not two each")
    total = torch.zeros(2 * len(rows), dtype=logps.dtype, device=logps.device).index_add(0, side, logps)
    count = torch.zeros(2 * len(rows), dtype=torch.long, device=logps.device).index_add(0, side, torch.ones_like(side))
    return total.view(-1, 2), count.view(-1, 2)


def token_logps(model, ids, labels, positions, keep) -> torch.Tensor:
    """Log-probabilities of the labelled targets, in row-major order (float32, with the graph)."""
    targets = labels[:, 1:]
    vocab = getattr(model, "ladle_vocab", None)
    if vocab is not None:
        out = vocab.forward(model, ids, positions)
        if vocab.head_wrapper is not None:
            return -vocab.token_losses(out, targets.reshape(-1))[keep.reshape(-1)]
        logits = out
    else:
        fused = run_state.of(model).fused
        if fused is not None:
            return -fused.run(model, ids, positions, labels, per_token=True)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    picked = logits[:, : targets.size(1)][keep]
    return -F.cross_entropy(picked.float(), targets[keep], reduction="none")


@contextmanager
def adapters_disabled(model):
    """LoRA's adapters (and peft's trained copies of whole modules) off in every layer of ``model``, whatever
    wraps it (DDP, DeepSpeed's engine, FSDP2): the base's own forward."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # an older peft: only modules_to_save's wrapper has the switch
        from peft.utils.other import ModulesToSaveWrapper as AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
    if not layers:
        raise RuntimeError("training.preference.reference = adapters_off: the model has no LoRA layers")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def disable_dropout(model) -> str:
    """Every dropout of ``model`` set to 0 (``training.preference.disable_dropout``, TRL's ``disable_dropout``):
    its ``nn.Dropout`` layers (LoRA's ``lora_dropout`` among them) and the attention modules' dropout rates,
    which transformers' attention reads as a float. What was turned off, in words."""
    layers = rates = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, layers = 0.0, layers + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout:
            module.attention_dropout, rates = 0.0, rates + 1
    if not (layers or rates):
        return "off: the model has none"
    return f"off: {layers} dropout layer(s) and {rates} attention dropout rate(s) set to 0"


class PairLoss:
    """The loss function the runtimes call (``loss_fn(model, data, rows, device) -> (summed loss, pairs)``),
    and the reward statistics of the rows it saw since ``take_stats``."""

    handles_sharded_ends = True  # computes per-token log-probabilities through ``ladle_vocab`` itself
    records_rows = True  # keeps each row's rewards: an evaluation's repeated batch is run with record=False

    def __init__(
        self, loss: str, beta: float, label_smoothing: float, gamma: float, reference: str, sft_weight: float = 0.0
    ) -> None:
        self.loss, self.beta, self.smoothing, self.gamma, self.sft_weight = (
            loss,
            beta,
            label_smoothing,
            gamma,
            sft_weight,
        )
        self.reference = "none" if loss == "simpo" else reference
        self.stats: dict[int, tuple[float, float]] = {}

    @classmethod
    def from_config(cls, cfg, plan_reference: str) -> PairLoss:
        pref = cfg.training.preference
        return cls(pref.loss, pref.beta, pref.label_smoothing, pref.simpo_gamma, plan_reference, pref.sft_weight)

    def __call__(
        self, model, data: dict[str, torch.Tensor], rows: list[int], device, record: bool = True
    ) -> tuple[torch.Tensor, int]:
        logps, counts = pair_logps(model, data, rows, device)
        reference = self.reference_logps(model, data, rows, device)
        losses, rewards = self.losses(logps, counts, reference)
        if record:  # not an evaluation's repeated batch: another rank's row would be counted twice
            for row, (chosen, rejected) in zip(rows, rewards.tolist(), strict=True):
                self.stats[row] = (chosen, rejected)
        return losses.sum(), len(rows)

    def reference_logps(self, model, data, rows: list[int], device) -> torch.Tensor | None:
        if self.reference == "none":
            return None
        if self.reference == "adapters_off":
            with torch.no_grad(), adapters_disabled(model):
                return pair_logps(model, data, rows, device)[0].detach()
        table = data.get("reference")
        if table is None:
            raise RuntimeError("precomputed reference log-probabilities were not loaded with the data")
        return table[torch.tensor(rows, dtype=torch.long)].to(device=device, dtype=torch.float32)

    def losses(
        self, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair losses and (chosen, rejected) rewards, from summed log-probabilities (pairs x 2), with
        ``sft_weight`` times the chosen side's per-token negative log-likelihood added."""
        losses, rewards = self.preference_losses(logps, counts, reference)
        if self.sft_weight:
            losses = losses - self.sft_weight * logps[:, 0] / counts[:, 0].clamp(min=1)
        return losses, rewards

    def preference_losses(
        self, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        beta, e = self.beta, self.smoothing
        if self.loss == "simpo":
            average = logps / counts.clamp(min=1)
            margin = average[:, 0] - average[:, 1] - self.gamma / beta
            losses = -F.logsigmoid(beta * margin) * (1 - e) - F.logsigmoid(-beta * margin) * e
            return losses, (beta * average).detach()
        ratios = logps - reference
        d = ratios[:, 0] - ratios[:, 1]
        if self.loss == "sigmoid":
            losses = -F.logsigmoid(beta * d)
        elif self.loss == "ipo":
            averaged = ratios / counts.clamp(min=1)
            losses = (averaged[:, 0] - averaged[:, 1] - 1 / (2 * beta)) ** 2
        elif self.loss == "robust":
            losses = (-(1 - e) * F.logsigmoid(beta * d) + e * F.logsigmoid(-beta * d)) / (1 - 2 * e)
        else:
            raise ValueError(f"training.preference.loss = {self.loss!r}: unknown")
        return losses, (beta * ratios).detach()

    def at_reference(self, data: dict[str, torch.Tensor]) -> float:
        """The mean pair loss of ``data``'s rows while the policy is still the reference (before the first step,
        when the reference was just scored by this very model): every log-ratio 0, every pair a tie. Recorded in
        the statistics as such; no forward runs."""
        reference = data["reference"]
        self.stats = {}
        if len(reference) == 0:  # no eval rows: the loss an empty split has for SFT too
            return 0.0
        side = sides(data["position_ids"])
        trained = data["labels"] != IGNORE
        counts = torch.stack([(trained & (side == k)).sum(dim=1) for k in (0, 1)], dim=1)
        losses, _ = self.losses(reference, counts, reference)
        self.stats = dict.fromkeys(range(len(reference)), (0.0, 0.0))
        return float(losses.mean())

    def take_stats(self, accelerator) -> dict[str, float]:
        """Rewards, margin and preference accuracy (a tie counts half) over every rank's rows seen since the
        last call (collective: every rank calls it)."""
        values = list(self.stats.values())
        self.stats = {}
        sums = torch.zeros(5, dtype=torch.float64, device=accelerator.device)
        if values:
            chosen, rejected = torch.tensor(values, dtype=torch.float64).T
            right = ranked_right(chosen - rejected)
            local = [len(values), chosen.sum(), rejected.sum(), (chosen - rejected).sum(), right.sum()]
            sums += torch.tensor([float(v) for v in local], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction="sum")
        if float(sums[0]) == 0:  # no pair seen (an empty eval split): no statistics rather than zeros
            return {}
        n = float(sums[0])
        return {
            "rewards_chosen": float(sums[1]) / n,
            "rewards_rejected": float(sums[2]) / n,
            "reward_margin": float(sums[3]) / n,
            "preference_accuracy": float(sums[4]) / n,
        }


class KtoLoss(PairLoss):
    """KTO (``training.objective: kto``), as TRL's ``KTOTrainer`` computes it (``loss_type="kto"``, trl 1.16) over
    kto rows: each row's first side is the judged answer, its second the KL side (another row's answer after this
    row's prompt, ``ladle.data.preference.kto_pairs``), ``data["label"]`` says which answers are desirable.

    With ``r`` an answer's log-ratio against the reference and ``z`` the micro-batch's mean log-ratio of its KL
    sides (no gradient, averaged over the ranks as TRL gathers it, clamped at 0), a desirable answer's loss is
    ``desirable_weight x (1 - sigmoid(beta (r - z)))`` and an undesirable one's ``undesirable_weight x (1 -
    sigmoid(beta (z - r)))``. The step's loss is their mean, as TRL's ``nanmean`` of the micro-batch."""

    def __init__(self, beta: float, reference: str, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        super().__init__("sigmoid", beta, 0.0, 0.0, reference)
        self.weights = (undesirable_weight, desirable_weight)
        self.kls: list[float] = []

    @classmethod
    def from_config(cls, cfg, plan_reference: str) -> KtoLoss:
        pref = cfg.training.preference
        return cls(pref.beta, plan_reference, pref.desirable_weight, pref.undesirable_weight)

    def __call__(
        self, model, data: dict[str, torch.Tensor], rows: list[int], device, record: bool = True
    ) -> tuple[torch.Tensor, int]:
        logps, _ = pair_logps(model, data, rows, device)
        reference = self.reference_logps(model, data, rows, device)
        labels = data["label"][torch.tensor(rows, dtype=torch.long)].to(device=logps.device).bool()
        losses, rewards, kl = self.kto_losses(logps, reference, labels)
        if record:
            self.kls.append(float(kl))
            for row, reward, good in zip(rows, rewards.tolist(), labels.tolist(), strict=True):
                self.stats[row] = (reward, float(good))
        return losses.sum(), len(rows)

    def kto_losses(
        self, logps: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row losses, rewards (beta x the answer's log-ratio) and the KL estimate, from the rows' summed
        log-probabilities (rows x 2: answer, KL side) and the reference's."""
        ratios = logps - reference
        if kl is None:
            kl = ratios[:, 1].detach().mean()
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                world = torch.distributed.get_world_size()
                if world > 1:  # TRL's gather_for_metrics(kl).mean(): every rank's micro-batch estimate
                    kl = kl.clone()
                    torch.distributed.all_reduce(kl)
                    kl = kl / world
            kl = kl.clamp(min=0)
        beta, (bad, good) = self.beta, self.weights
        answer = ratios[:, 0]
        losses = torch.where(
            labels, good * (1 - torch.sigmoid(beta * (answer - kl))), bad * (1 - torch.sigmoid(beta * (kl - answer)))
        )
        return losses, (beta * answer).detach(), kl

    def at_reference(self, data: dict[str, torch.Tensor]) -> float:
        """The mean loss while the policy is the reference: every log-ratio 0, the KL estimate 0, so each row's
        loss is its weight x (1 - sigmoid(0)). No forward runs."""
        reference = data["reference"]
        self.stats, self.kls = {}, []
        if len(reference) == 0:
            return 0.0
        labels = data["label"].bool()
        zero = torch.zeros((), dtype=reference.dtype)
        losses, _, _ = self.kto_losses(reference, reference, labels, zero)
        self.stats = {row: (0.0, float(good)) for row, good in enumerate(labels.tolist())}
        self.kls = [0.0]
        return float(losses.mean())

    def take_stats(self, accelerator) -> dict[str, float]:
        """The desirable and undesirable answers' mean rewards, their margin and the mean KL estimate, over every
        rank's rows since the last call (collective)."""
        values, kls = list(self.stats.values()), self.kls
        self.stats, self.kls = {}, []
        sums = torch.zeros(6, dtype=torch.float64, device=accelerator.device)
        if values:
            reward, good = torch.tensor(values, dtype=torch.float64).T
            local = [good.sum(), (reward * good).sum(), (1 - good).sum(), (reward * (1 - good)).sum()]
            local += [sum(kls), len(kls)]
            sums += torch.tensor([float(v) for v in local], dtype=torch.float64, device=accelerator.device)
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction="sum")
        out = {}
        if float(sums[0]):
            out["rewards_chosen"] = float(sums[1]) / float(sums[0])
        if float(sums[2]):
            out["rewards_rejected"] = float(sums[3]) / float(sums[2])
        if "rewards_chosen" in out and "rewards_rejected" in out:
            out["reward_margin"] = out["rewards_chosen"] - out["rewards_rejected"]
        if float(sums[5]):
            out["kl"] = float(sums[4]) / float(sums[5])
        return out


def reference_table(
    accelerator, model, data: dict[str, torch.Tensor], micro: int, runtime, needed: list[int] | None = None
) -> torch.Tensor:
    """Each pair row's summed (chosen, rejected) log-probability by ``model`` as it is now (rows x 2, float64,
    on CPU, the same on every rank): the ``needed`` rows (all by default; NaN for the others), each data-parallel
    rank scoring its share, every rank running the same number of forwards (a sharded forward is a collective), a
    sum over ranks assembling the table."""
    from ladle.train.runtime.base import even_batches

    rank, replicas = runtime.data_parallel(accelerator)
    rows = len(data["input_ids"])
    if rows == 0:  # an empty split (no eval rows)
        return torch.zeros((0, 2), dtype=torch.float64)
    needed = list(range(rows)) if needed is None else needed
    table = torch.zeros((rows, 2), dtype=torch.float64, device=accelerator.device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for batch, counted in even_batches(needed, rank, replicas, micro):
            logps, _ = pair_logps(model, data, batch, accelerator.device)
            if counted:
                table[torch.tensor(batch, device=accelerator.device)] = logps.double()
    model.train(was_training)
    if accelerator.num_processes > 1:
        table = accelerator.reduce(table, reduction="sum")
    table = table.cpu()
    unscored = torch.ones(rows, dtype=torch.bool)
    unscored[needed] = False
    table[unscored] = float("nan")  # a row no step reads: a NaN loss, never a silent zero, if one ever did
    return table
