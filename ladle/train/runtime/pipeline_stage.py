"""The modules a pipeline rank holds: its stage of the decoder, the loss, and the schedule's wrapper.

Kept apart from ``ladle.strategies.pipeline`` so that planning never imports torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch
import torch.nn as nn

IGNORE = -100


def causal_lm(model):
    """The ``*ForCausalLM`` under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def split_layers(layers: int, stages: int) -> list[range]:
    """Contiguous, as-even-as-possible runs of layer indices, earlier stages taking the remainder."""
    base, extra = divmod(layers, stages)
    out, start = [], 0
    for stage in range(stages):
        size = base + (1 if stage < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def refuse_trained_tied_embeddings(lm, fix: str) -> None:
    """A tied input/output embedding lives on the first and the last stage: training it would update two copies.

    Raises:
        RuntimeError: the model ties them and trains them.
    """
    if getattr(lm.config, "tie_word_embeddings", False) and any(
        p.requires_grad for p in lm.get_input_embeddings().parameters()
    ):
        raise RuntimeError(
            "pipeline: this model ties its input and output embeddings, which live on the first and last stage, "
            f"and trains them; {fix}"
        )


def build_pipeline(part, model, stage: int, stages: int, device, kind: str, microbatches: int, group=None):
    """``part`` (this rank's ``StageModule``) under its schedule (``1f1b`` or ``gpipe``) over ``group`` (None: the
    default group): the ``PipelineModel`` the worker trains."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    loss = TokenLoss()
    pipe_stage = PipelineStage(part, stage, stages, device, group=group)
    schedule_cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(pipe_stage, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    peft_config = model.peft_config.get("default") if hasattr(model, "peft_config") else None
    return PipelineModel(part, schedule, loss, stage, stages, kind, causal_lm(model).config, peft_config)


class StageModule(nn.Module):
    """One rank's slice of the decoder; ``forward(x, position_ids)`` takes token ids on the first stage,
    hidden states elsewhere, and returns hidden states, or logits on the last stage."""

    def __init__(self, model, stage: int, stages: int):
        super().__init__()
        lm = causal_lm(model)
        inner = lm.model
        self.first, self.last = stage == 0, stage == stages - 1
        self.layer_ids = list(split_layers(len(inner.layers), stages)[stage])
        inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in self.layer_ids})
        if not self.first:
            inner.embed_tokens = None
        if not self.last:
            inner.norm = None
            lm.lm_head = None
        self.wrapped = model  # registered: parameters() and state_dict() are this stage's, under HF names

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        lm = causal_lm(self.wrapped)
        inner = lm.model
        hidden = inner.embed_tokens(x) if self.first else x
        # position_ids restart at 0 per packed example; the mask keeps attention inside each example.
        mask = create_causal_mask(
            config=lm.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=position_ids
        )
        rotary = inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in inner.layers.values():
            hidden = layer(
                hidden, attention_mask=mask, position_embeddings=rotary, position_ids=position_ids, use_cache=False
            )
        if self.last:
            hidden = lm.lm_head(inner.norm(hidden))
        return hidden


class TokenLoss:
    """Summed next-token cross-entropy over trained tokens, divided by ``denominator`` (set per step)."""

    def __init__(self):
        self.denominator = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        targets = labels[:, 1:]
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        return loss / self.denominator


class PipelineModel(nn.Module):
    """This rank's stage, its schedule and loss (what the worker holds as ``model``)."""

    def __init__(
        self,
        stage_module: StageModule,
        schedule,
        loss: TokenLoss,
        stage: int,
        stages: int,
        kind: str,
        hf_config,
        peft_config,
    ):
        super().__init__()
        self.stage_module = stage_module
        self.schedule, self.loss, self.stage, self.stages, self.kind = schedule, loss, stage, stages, kind
        self.hf_config, self.peft_config = hf_config, peft_config

    def skeleton(self):
        """The whole model on the meta device: no rank holds every module, but saving needs the full
        module tree to map the gathered state dict onto (peft saves module by module)."""
        from ladle.train.runtime.skeleton import meta_skeleton

        return meta_skeleton(self.hf_config, self.peft_config)

    def train_rows(self, data: dict[str, torch.Tensor], rows: list[int], device, denominator: float) -> float:
        """One training pass of ``rows`` through the schedule, the loss divided by ``denominator``; returns their
        summed token loss (zero off the last stage)."""
        index = torch.tensor(rows, dtype=torch.long)
        self.loss.denominator = float(denominator)
        losses = self.run(
            data["input_ids"][index].to(device),
            data["labels"][index].to(device),
            data["position_ids"][index].to(device),
            train=True,
        )
        return sum(float(x) for x in losses) * self.loss.denominator

    def run(self, ids, labels, positions, train: bool) -> list[torch.Tensor]:
        """One schedule pass over whole-batch tensors; the last stage returns the per-microbatch losses."""
        losses: list[torch.Tensor] = []
        args = (ids,) if self.stage_module.first else ()
        target = labels if self.stage_module.last else None
        call = self.schedule.step if train else self.schedule.eval
        if train:
            call(*args, target=target, losses=losses, return_outputs=False, position_ids=positions)
        else:
            call(*args, target=target, losses=losses, position_ids=positions)
        return losses


def gather_to_rank0(
    tensors: dict[str, torch.Tensor], device, lead: bool = True, whole: Callable | None = None
) -> dict[str, torch.Tensor] | None:
    """The stages' tensors merged on rank 0, one tensor at a time: ``gather_parts_to_rank0`` as a single part
    (the adapters). Collective: every rank calls it. Returns the merged dict on rank 0, None elsewhere."""
    merged: dict[str, torch.Tensor] = {}
    for part in gather_parts_to_rank0(tensors, device, None, lead, whole):
        merged.update(part or {})
    return merged if torch.distributed.get_rank() == 0 else None


def gather_parts_to_rank0(
    tensors: dict[str, torch.Tensor],
    device,
    max_bytes: int | None,
    lead: bool = True,
    whole: Callable | None = None,
) -> Iterator[dict[str, torch.Tensor] | None]:
    """The stages' tensors sent to rank 0 in parts of at most ``max_bytes`` (None: one part), in rank order.

    ``tensors`` are this rank's (a stage's) under the model's names; ``whole`` makes one whole for the send (a
    sharded DTensor's ``full_tensor``, a collective over its stage's mesh, which every rank of the stage
    joins); ``lead`` marks the one rank per stage that sends (rank 0 leads stage 0). The leads first tell
    every rank what they hold (names, shapes, dtypes: small objects), so every rank cuts the same parts;
    then one part's tensors travel point to point to rank 0 and the part is yielded (rank 0 writes it)
    before the next is made whole. Rank 0 so holds one part and the tensor being received, never a stage
    or the model: a full fine-tune's pipeline used to gather every stage on rank 0 at once (the whole model
    in host RAM). ``gather_object`` would pickle every stage's dict at once and pad the buffers to the
    largest: measured, it took a 225 MB model's pipeline run above DDP's peak. Collective: every rank
    iterates. Yields the part on rank 0, None elsewhere.
    """
    import torch.distributed as dist

    from ladle.train.saving import group

    rank = dist.get_rank()
    headers: list = [None] * dist.get_world_size()
    mine = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()} if lead else {}
    dist.all_gather_object(headers, mine)
    where = {name: (src, shape, dtype) for src, header in enumerate(headers) for name, (shape, dtype) in header.items()}
    sizes = [(name, math.prod(shape) * dtype.itemsize) for name, (_, shape, dtype) in where.items()]
    for names in group(sizes, max_bytes or sys.maxsize):
        part: dict[str, torch.Tensor] = {}
        for name in names:
            src, shape, dtype = where[name]
            if name in tensors:  # this rank's stage: every rank of it joins the gather
                with whole(tensors[name]) if whole else nullcontext(tensors[name]) as full:
                    if rank == src == 0:
                        part[name] = full.detach().to("cpu", copy=True)
                    elif rank == src:
                        dist.send(full.detach().to(device).contiguous(), dst=0)
            elif rank == 0:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, src=src)
                part[name] = buffer.to("cpu")
        yield part if rank == 0 else None
