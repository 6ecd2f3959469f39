"""NEFTune (``train.neftune_noise_alpha``): uniform noise on a causal LM's input embeddings while training.

The noise is uniform in [-1, 1] x alpha / sqrt(sequence length x hidden size), added to the embedding layer's
output only while the layer is in training mode, so evaluation and generation see the clean embeddings (Jain et
al., "NEFTune: Noisy Embeddings Improve Instruction Finetuning", 2023). The hook is transformers' own
``neftune_post_forward_hook`` -- the one HF Trainer and TRL register -- so a recipe trains exactly as those do;
it reads the module's ``neftune_noise_alpha`` attribute.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle


def neftune_hook() -> Callable[[torch.nn.Module, Any, torch.Tensor], torch.Tensor]:
    """transformers' NEFTune forward hook (``transformers.integrations.neftune`` in transformers 5, earlier in
    ``trainer_utils``), or the same formula here where neither has it."""
    try:
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:
        try:
            from transformers.trainer_utils import neftune_post_forward_hook  # type: ignore[attr-defined,no-redef]
        except ImportError:
            return noisy_embeddings
    return neftune_post_forward_hook


def noisy_embeddings(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """The NEFTune hook as transformers writes it: noise only in training mode, bound alpha / sqrt(L x d)."""
    del inputs
    if not module.training:
        return output
    bound = float(module.neftune_noise_alpha) / (output.size(1) * output.size(2)) ** 0.5  # type: ignore[arg-type]
    return output + torch.zeros_like(output).uniform_(-bound, bound)


def activate_neftune(model: Any, noise_alpha: float) -> RemovableHandle:
    """Add NEFTune noise of ``noise_alpha`` to ``model``'s input embeddings in training mode (a peft model's too:
    ``get_input_embeddings`` reaches through to the base model's layer); the handle removes it."""
    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = noise_alpha
    return embeddings.register_forward_hook(neftune_hook())
