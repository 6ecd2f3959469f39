"""``InferenceEngine``: a Hugging Face (or any) model split over the tensor-parallel ranks for inference.

DeepSpeed's ``init_inference`` on zerotune's AutoTP. Construction, in order:

1. ``torch.distributed`` up (a world of one without a launcher), the tp group: the given ``tp_group``, else
   consecutive ranks of ``tp_size`` (the world is ``dp x tp``; each dp replica serves on its own);
2. the model cast to ``dtype`` (DeepSpeed's order: cast, then split) and put in eval mode (a model built from
   a config starts in training mode, and dropout on split activations would desynchronise the ranks);
3. with tp > 1: rank 0's weights broadcast (every tp rank must split the same tensors), then AutoTP splits
   the layers in place -- the built-in plan of GPT-2 / Llama / Mistral / Qwen2 / BERT, or the
   ``injection_policy`` -- with the vocabulary-parallel LM head gathering its logits to the full vocabulary,
   so ``generate``, sampling and the model's own loss see every token; the ranks' RNG states are made equal,
   so sampling draws the same tokens on each (their logits are bitwise equal: the all-reduces and the
   all-gather give every rank the same bits);
4. the model moved to this rank's device (split first: a model too big for one device never lands on it whole),
   unless ``keep_module_on_host``.

``engine(...)`` / ``engine.forward`` call the module; ``engine.generate`` is the module's ``generate`` after
DeepSpeed's prompt-length check; other attributes (``config``, ``device``, ``generation_config``...) are the
module's, so the engine can stand in for the model inside a transformers pipeline.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from zerotune.distributed import comm
from zerotune.distributed.env import DistEnv, init_distributed
from zerotune.distributed.mesh import ParallelDims, ProcessMesh
from zerotune.inference.config import InferenceConfig
from zerotune.inference.injection import rules_from_injection_policy
from zerotune.initialize_phases import broadcast_from_rank0
from zerotune.monitor.logging import log_rank0
from zerotune.parallel.tensor.autotp import TensorParallelPlanError, apply_autotp
from zerotune.parallel.tensor.plans import PLANS


class InferenceEngine(nn.Module):
    """The split model and its inference entry points (DeepSpeed's ``deepspeed.inference.engine.InferenceEngine``)."""

    def __init__(self, model: nn.Module, config: InferenceConfig | dict | None = None) -> None:
        super().__init__()
        config = InferenceConfig.from_source(config)
        self.module = model
        self._config = config
        self._env = env = init_distributed()
        for key, note in config.notes:
            log_rank0("init_inference %s: %s", key, note, rank=env.rank)
        self.mp_group, self._mesh = _tp_group(config, env)
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(f"init_inference: {type(model).__name__} has parameters on the meta device; load real "
                             "weights (e.g. from_pretrained) first: init_inference splits the weights it is given")
        model.to(config.dtype)
        model.eval()
        self.sharded: list = []
        if self.mp_world_size > 1:
            if self.mp_group is None:  # (_tp_group gives a group for every tp_size > 1)
                raise RuntimeError(f"init_inference: no process group for tensor parallel size {self.mp_world_size}")
            self.sharded = _split(model, config, self.mp_group, env)
        if not config.keep_module_on_host:
            model.to(env.device)
        self._times: list[float] | None = None
        self._is_compiled = False
        log_rank0("init_inference: %s on %s, %s, tensor parallel %d%s", type(model).__name__, env.device,
                  str(config.dtype).replace("torch.", ""), self.mp_world_size,
                  f" ({len(self.sharded)} layers split)" if self.sharded else "", rank=env.rank)

    @property
    def mp_world_size(self) -> int:
        """Ranks the model is split over (DeepSpeed's name for the tensor-parallel size)."""
        return self._config.tp_size

    @property
    def dtype(self) -> torch.dtype:
        return self._config.dtype

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward (logits over the full vocabulary on every tp rank)."""
        if self._times is None:
            return self.module(*inputs, **kwargs)
        self._synchronize()
        start = time.perf_counter()
        outputs = self.module(*inputs, **kwargs)
        self._synchronize()
        self._times.append((time.perf_counter() - start) * 1e3)
        return outputs

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's ``generate``; a prompt longer than ``max_out_tokens`` is refused (DeepSpeed's check).
        Every tp rank must call it with the same arguments: each step's forward is collective."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"init_inference: {type(self.module).__name__} has no generate(); call the engine "
                                 "itself for a forward pass")
        prompt = kwargs.get("input_ids", inputs[0] if inputs else None)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[-1] > self._config.max_out_tokens:
            raise RuntimeError(f"init_inference: the prompt has {prompt.shape[-1]} tokens, more than max_out_tokens="
                               f"{self._config.max_out_tokens}; raise max_out_tokens (max_tokens) in the config")
        reset_cache = getattr(self.module, "reset_cache", None)  # (a model's own method: no type declares it)
        if reset_cache is not None:
            reset_cache()
        return generate(*inputs, **kwargs)

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Time each forward from now on (milliseconds, device synchronised); read with ``model_times()``."""
        del use_cuda_events  # the device is synchronised around each forward either way
        if self._times is None:
            self._times = []

    def model_times(self) -> list[float]:
        """The forwards' times since the last call, in milliseconds."""
        if self._times is None:
            raise RuntimeError("init_inference: model_times() needs profile_model_time() first")
        times, self._times = self._times, []
        return times

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """``torch.compile`` the module in place (once)."""
        if not self._is_compiled:
            self.module.compile(backend=backend, **(compile_kwargs or {}))
            self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    def _synchronize(self) -> None:
        if self._env.device.type == "cuda":
            torch.cuda.synchronize(self._env.device)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)


def _tp_group(config: InferenceConfig, env: DistEnv) -> tuple[torch.distributed.ProcessGroup | None, Any]:
    """The given group, or the mesh's tp axis over consecutive ranks (the mesh is kept alive with the engine)."""
    if config.tensor_parallel.tp_group is not None:
        if "tp_size" in config.tensor_parallel.model_fields_set and config.tensor_parallel.tp_size != config.tp_size:
            raise ValueError(f"init_inference: tensor_parallel.tp_size={config.tensor_parallel.tp_size} but tp_group "
                             f"has {config.tp_size} ranks; give one of them")
        return config.tensor_parallel.tp_group, None
    tp = config.tp_size
    if tp == 1:
        return None, None
    try:
        mesh = ProcessMesh(ParallelDims.from_world(env.world_size, tp=tp), env.device.type)
    except ValueError as error:
        raise ValueError(f"init_inference: tensor_parallel.tp_size={tp}: {error}; launch a multiple of {tp} "
                         "ranks") from None
    return mesh.group("tp"), mesh


def _split(model: nn.Module, config: InferenceConfig, group: torch.distributed.ProcessGroup,
           env: DistEnv) -> list:
    """Rank 0's weights to every rank, AutoTP's split with full logits, equal RNG states over the group."""
    tp = config.tp_size
    policy = config.injection_policy
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not policy and model_type not in PLANS:
        raise TensorParallelPlanError(
            f"init_inference: tensor_parallel.tp_size={tp}: no built-in AutoTP plan for {type(model).__name__} "
            f"(model_type {model_type!r}); built-in plans: {', '.join(sorted(PLANS))}. Name each block's "
            "row-parallel linears: injection_policy={BlockClass: ('self_attn.o_proj', 'mlp.down_proj')}")
    rules = rules_from_injection_policy(model, policy) if policy else ()
    broadcast_from_rank0(model, staging=env.device)
    try:
        sharded = apply_autotp(model, group, layer_specs=rules, gather_logits=True)
    except TensorParallelPlanError as error:  # its messages name the training key
        raise TensorParallelPlanError(str(error).replace("tensor_parallel.autotp_size",
                                                         "tensor_parallel.tp_size")) from None
    _share_rng_state(group, env.device)
    log_rank0("init_inference: AutoTP split %d layer(s) over %d ranks (%s, ...)", len(sharded), tp,
              ", ".join(f"{layer.name}: {layer.kind}" for layer in sharded[:3]), rank=env.rank)
    return sharded


def _share_rng_state(group: torch.distributed.ProcessGroup, device: torch.device) -> None:
    """The group's rank 0 RNG states everywhere in the group, so sampling picks the same tokens on every rank."""
    states: list[tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]] = [
        (torch.get_rng_state, torch.set_rng_state)]
    if device.type == "cuda":
        states.append((lambda: torch.cuda.get_rng_state(device), lambda s: torch.cuda.set_rng_state(s, device)))
    through_device = torch.distributed.get_backend(group) == "nccl"
    for get, set_ in states:
        state = get()
        staged = state.to(device) if through_device else state
        comm.broadcast(staged, 0, group)
        set_(staged.cpu())
