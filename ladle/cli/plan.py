"""``ladle plan CONFIG``: validate the config against this (or a recorded) machine and show the plan."""

from __future__ import annotations

import typer

from ladle.cli.common import CONFIG, DEEPSPEED, GPUS, JSON, SET, command, console, load, print_json
from ladle.errors import LadleError


def model_size(cfg, model: dict | None) -> dict:
    """Parameter counts of the base (empty when its config.json is not at hand)."""
    from ladle.sizing.params import count_params, lora_params

    if model is None:
        return {}
    params, how = count_params(model)
    lora = cfg.training.lora
    trainable = lora_params(model, lora.r, lora.target_modules, lora.modules_to_save) if lora.enabled else params
    return {
        "params": params,
        "trainable_params": trainable,
        "params_counted_by": how,
        "model_type": model.get("model_type"),
    }


@command
def plan(
    config: str = CONFIG,
    gpus: str | None = GPUS,
    deepspeed: str | None = DEEPSPEED,
    set_: list[str] = SET,
    model_config: str | None = typer.Option(
        None, "--model-config", help="config.json (or its folder) to size the model from."
    ),
    topology_file: str | None = typer.Option(
        None, "--topology-file", help="Plan for a recorded machine (`nvidia-smi topo -m` output)."
    ),
    gpu_memory: float | None = typer.Option(
        None, "--gpu-memory", help="GiB per GPU of the recorded machine (for sizing)."
    ),
    as_json: bool = JSON,
) -> None:
    """Validate the config against this (or a recorded) machine and show the plan, with the launch command."""
    from ladle import compute
    from ladle.machine.topology import probe_file
    from ladle.plan.inputs import local_model_config
    from ladle.plan.planner import make_plan

    if gpu_memory is not None and not (0 < gpu_memory <= 4096):
        raise LadleError(f"--gpu-memory = {gpu_memory}: GiB per GPU must be in (0, 4096], e.g. --gpu-memory 80.")
    cfg = load(config, set_, gpus, deepspeed)
    model = local_model_config(cfg, model_config)
    size = model_size(cfg, model)
    try:
        target = compute.get(cfg)
        topo = probe_file(topology_file, gpu_memory_gib=gpu_memory) if topology_file else target.probe()
        made = make_plan(cfg, topo, config, model=model)
    except LadleError as err:
        raise err.add_details(**size) from None
    command_line = target.launch_text(made, "SPEC.json")
    if as_json:
        print_json({**made.model_dump(mode="json"), **size, "launch_command": command_line})
        return
    console.print(made.to_markdown(), highlight=False)
    if size:
        console.print(
            f"model: {size['model_type']}, {size['params']:,} parameters ({size['params_counted_by']}), "
            f"{size['trainable_params']:,} trainable",
            highlight=False,
        )
    console.print(f"launch: {command_line}", highlight=False, soft_wrap=True)
