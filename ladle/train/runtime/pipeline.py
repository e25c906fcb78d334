"""The worker side of ``ladle.strategies.pipeline``: wrap, step, gather and save (the strategy there decides; this applies)."""

from __future__ import annotations

from ladle.platform import storage
from ladle.train.runtime.base import Runtime


def stage_tensors(model, trainable_only: bool) -> dict:
    """This rank's stage parameters (all, or the trained ones) under the model's own names, where they live
    (``gather_parts_to_rank0`` copies one at a time to the host)."""
    part = model.stage_module.wrapped
    return {n: p for n, p in part.named_parameters() if p.requires_grad or not trainable_only}


class PipelineRuntime(Runtime):
    """The worker side of ``Pipeline`` (``ladle.strategies.pipeline``): what a rank does with the model."""

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        """Split off this rank's stage (of an empty skeleton when ``pending``: the stage then reads only its
        own layers' tensors) and build its schedule."""
        from ladle.train.runtime.pipeline_stage import (
            StageModule,
            build_pipeline,
            causal_lm,
            refuse_trained_tied_embeddings,
        )

        refuse_trained_tied_embeddings(
            causal_lm(model), "keep them frozen (LoRA without modules_to_save on embeddings/head) or use fsdp2"
        )
        stages, stage = plan.world_size, accelerator.process_index
        part = StageModule(model, stage, stages)
        if pending is not None:
            pending.fill(part.wrapped, accelerator.device)
        part.to(accelerator.device)
        kind, microbatches = plan.launcher_config["schedule"], plan.gradient_accumulation
        return build_pipeline(part, model, stage, stages, accelerator.device, kind, microbatches), make_optimizer(part)

    def check_applied(self, accelerator, model, plan) -> dict:
        import torch

        part = model.stage_module
        local = sum(p.numel() for p in part.parameters())
        total = torch.tensor([local], dtype=torch.float64, device=accelerator.device)
        total = float(accelerator.reduce(total, reduction="sum")[0])
        if len(part.layer_ids) == 0:
            raise RuntimeError(f"pipeline stage {model.stage} holds no decoder layers (too many stages for the model)")
        return {
            "wrapper": "PipelineStage",
            "stage": model.stage,
            "stages": model.stages,
            "schedule": model.kind,
            "layers_on_rank0": part.layer_ids,
            "parameter_share": local / total,
        }

    def no_sync(self, accelerator, model):
        from contextlib import nullcontext

        return nullcontext()

    def forward_backward(self, accelerator, model, data, batch, plan, denominator, loss_fn) -> float:
        return model.train_rows(
            data, batch, accelerator.device, denominator
        )  # the raw token sum; zero off the last stage

    def optimizer_step(self, accelerator, model, optimizer, max_grad_norm: float) -> None:
        import torch

        params = [p for p in model.stage_module.parameters() if p.requires_grad and p.grad is not None]
        if max_grad_norm > 0:
            # The norm is global: each stage's squared norm, summed over stages.
            local = sum((p.grad.detach().float() ** 2).sum() for p in params) if params else torch.zeros(())
            squared = torch.tensor([float(local)], dtype=torch.float64, device=accelerator.device)
            norm = float(accelerator.reduce(squared, reduction="sum")[0]) ** 0.5
            scale = min(1.0, max_grad_norm / (norm + 1e-6))
            for p in params:
                p.grad.mul_(scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluate(self, accelerator, model, data, micro: int, loss_fn=None) -> float:
        import torch

        with torch.no_grad():
            return self._evaluate(accelerator, model, data, micro)

    def _evaluate(self, accelerator, model, data, micro: int) -> float:
        import torch

        from ladle.train.runtime.pipeline_stage import IGNORE

        rows = len(data["input_ids"])
        chunk = micro * model.schedule._n_microbatches
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        model.loss.denominator = 1.0
        for start in range(0, rows, chunk):
            index = [min(i, rows - 1) for i in range(start, start + chunk)]  # pad the tail by repeating the last row...
            ids, positions = data["input_ids"][index], data["position_ids"][index]
            labels = data["labels"][index].clone()
            labels[rows - start :] = IGNORE  # ...whose labels are ignored, so it adds nothing
            device = accelerator.device
            losses = model.run(ids.to(device), labels.to(device), positions.to(device), train=False)
            total[0] += sum(float(x) for x in losses)
            total[1] += int((labels[:, 1:] != IGNORE).sum()) if model.stage == 0 else 0
        total = accelerator.reduce(total, reduction="sum")
        return float(total[0] / max(total[1], 1))

    def hf_model(self, accelerator, model):
        return model.skeleton()

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        from ladle.train.runtime.pipeline_stage import gather_to_rank0

        return gather_to_rank0(stage_tensors(model, trainable_only), accelerator.device)

    def full_model_parts(self, accelerator, model, max_bytes: int):
        """The stages' weights sent to rank 0 in parts of at most ``max_bytes``, each written before the next is
        sent (``gather_parts_to_rank0``): rank 0 holds its stage, one part and one tensor, not the model."""
        from ladle.train.runtime.pipeline_stage import gather_parts_to_rank0

        yield from gather_parts_to_rank0(stage_tensors(model, False), accelerator.device, max_bytes)

    def save_state(self, model, optimizer, folder: str, tag: str) -> dict:
        from pathlib import Path

        import torch

        target = Path(folder) / tag
        target.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": model.stage_module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "layers": model.stage_module.layer_ids,
            },
            target / f"stage-{model.stage:03d}.pt",
        )
        return {}  # everything is in this rank's file

    def load_state(self, model, optimizer, payload: dict, url: str, tag: str) -> None:
        import io

        import torch

        # This stage's file only, wherever the checkpoint is stored.
        data = storage.read_bytes(storage.join(url, tag, f"stage-{model.stage:03d}.pt"))
        state = torch.load(io.BytesIO(data), weights_only=True)  # a checkpoint is data: never code to run
        if state["layers"] != model.stage_module.layer_ids:
            raise RuntimeError(
                f"pipeline checkpoint stage {model.stage} holds layers {state['layers']}, this run "
                f"{model.stage_module.layer_ids}"
            )
        model.stage_module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
