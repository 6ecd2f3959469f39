"""DeepSpeed's model-state estimators, by their DeepSpeed names and with their figures.

Scripts and notebooks call ``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live``
(and ``_all_cold``, and the stage-3 variants) to size a job; under the ``deepspeed`` alias they print the
same table and return the same numbers as DeepSpeed's. Their rules, as DeepSpeed documents them: per GPU,
16-bit parameters (2 bytes each) plus 18 bytes per parameter / GPUs for 16-bit and fp32 gradients, fp32
masters and Adam's two moments; with CPU offload, those live in host memory, sized with an
``additional_buffer_factor`` (default 1.5); stage 3 also holds the largest layer's parameters whole
(4 bytes each). ``zerotune plan`` (``plan/``) goes further: activations, buckets, temporaries.
"""

from __future__ import annotations

import torch

GiB = 2**30


def _setup_lines(total_params: int, num_gpus_per_node: int, num_nodes: int, largest: int | None = None) -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    model = f"SW: Model with {int(total_params / 1e6)}M total params"
    model += f", {int(largest / 1e6)}M largest layer params." if largest is not None else "."
    return (f"Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n{model}")


# ---- ZeRO 2 (deepspeed.runtime.zero.stage_1_and_2) ----------------------------------------------------

def estimate_zero2_model_states_mem_needs(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                          cpu_offload: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(bytes per CPU, bytes per GPU) of model state at ZeRO 2."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def model_to_params(model: torch.nn.Module) -> int:
    """Parameters counted once even when shared (tied embeddings)."""
    return sum({p.data_ptr() if p.device.type != "meta" else id(p): p.numel() for p in model.parameters()}.values())


def estimate_zero2_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print ZeRO 2's model-state needs for ``model`` with and without optimizer offload."""
    estimate_zero2_model_states_mem_needs_all_cold(model_to_params(model), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print ZeRO 2's model-state needs for a hypothetical model of ``total_params``."""
    print(_setup_lines(total_params, num_gpus_per_node, num_nodes))
    print("  per CPU  |  per GPU |   Options")
    for cpu_offload in (True, False):
        cpu, gpu = estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                                         additional_buffer_factor)
        device = "cpu " if cpu_offload else "none"
        print(f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | offload_optimizer={device}")


# ---- ZeRO 3 (deepspeed.runtime.zero.stage3) -----------------------------------------------------------

def estimate_zero3_model_states_mem_needs(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                          num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                          zero_init: bool = True,
                                          additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(bytes per CPU, bytes per GPU, bytes of the largest layer) of model state at ZeRO 3."""
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu = largest
            factor = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        else:
            gpu = largest + int(2 * total_params / total_gpus)
            factor = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        cpu = total_params * factor * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest


def model_to_params_and_largest_layer(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters counted once, the most parameters any one module holds directly)."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return model_to_params(model), largest


def estimate_zero3_model_states_mem_needs_all_live(model: torch.nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print ZeRO 3's model-state needs for ``model`` for each offload / zero.Init option."""
    total, largest = model_to_params_and_largest_layer(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print ZeRO 3's model-state needs for a hypothetical model."""
    print(_setup_lines(total_params, num_gpus_per_node, num_nodes, largest_layer_params))
    print("  per CPU  |  per GPU |   Options")
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = estimate_zero3_model_states_mem_needs(total_params, largest_layer_params,
                                                                    num_gpus_per_node, num_nodes, cpu_offload,
                                                                    cpu_offload_params, zero_init,
                                                                    additional_buffer_factor)
                options = (f"offload_param={'cpu ' if cpu_offload_params else 'none'}, "
                           f"offload_optimizer={'cpu ' if cpu_offload else 'none'}, zero_init={int(zero_init)}")
                print(f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | {options}")
