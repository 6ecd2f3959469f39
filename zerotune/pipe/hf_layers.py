"""Split a Hugging Face model into the flat layer list a PipelineModule runs stage by stage.

A pipeline stage receives only what the previous stage sent: a tuple of tensors. So every block
layer gets the travelling tuple, rebuilds what HF's top-level ``forward`` would have handed the
block (the 4D/None attention mask, Llama's rotary cos/sin), runs the model's OWN block module and
passes the tuple on. Nothing is copied: the wrappers hold the HF submodules, so parameters stay the
same objects and weights tied in the HF model (GPT-2's wte / lm_head, BERT's word embeddings /
decoder) are literally one ``nn.Parameter`` seen by two layers -- the pipeline detects ties by
identity.

Travelling tuples (every micro-batch has the same structure, so p2p buffers never change shape):

* causal LMs: ``(input_ids | hidden, attention_mask, position_ids)`` -> head -> logits
* BERT MLM:   ``(input_ids, attention_mask, token_type_ids, position_ids)`` -> ``(hidden, attention_mask)``
  -> head -> prediction scores

The 2D mask always travels (all ones when the batch has none). For causal LMs an all-ones mask is
handed to HF's mask builder as ``None``, exactly what ``model(**batch)`` sees when the batch has no
mask; that keeps HF's packed-sequence detection from ``position_ids`` (only done for a ``None``
mask) and sdpa's ``is_causal`` fast path. The layers never use a KV cache, so they match
``model(**batch, use_cache=False)``; with HF's default ``use_cache=True`` the two differ only for packed
rows (position ids restarting, no mask), which HF then fails to isolate from each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # (transformers is imported only when an HF model is split)
    from transformers import (
        BertForMaskedLM,
        GPT2LMHeadModel,
        LlamaForCausalLM,
        MistralForCausalLM,
        PreTrainedModel,
        Qwen2ForCausalLM,
    )

    LlamaFamilyModel = LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM

SUPPORTED_MODELS = ("GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                    "BertForMaskedLM")

_CAUSAL_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
_BERT_BATCH_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


def hf_pipeline_layers(model: nn.Module) -> tuple[list[nn.Module], Callable, Callable]:
    """(layers, loss_fn, batch_fn) for an HF model: embeddings layer, one layer per transformer block, head layer.

    ``batch_fn(batch) -> (inputs, labels)`` turns the HF keyword batch into the first layer's input
    tuple; ``loss_fn(outputs, labels)`` gives the scalar ``model(**batch).loss`` would."""
    from transformers import (
        BertForMaskedLM,
        GPT2LMHeadModel,
        LlamaForCausalLM,
        MistralForCausalLM,
        Qwen2ForCausalLM,
    )

    if isinstance(model, GPT2LMHeadModel):
        return _gpt2_layers(model), _causal_lm_loss(model), _causal_batch_fn(model)
    if isinstance(model, (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)):
        return _llama_family_layers(model), _causal_lm_loss(model), _causal_batch_fn(model)
    if isinstance(model, BertForMaskedLM):
        return _bert_layers(model), _bert_mlm_loss(model), _bert_batch_fn(model)
    raise ValueError(f"hf_pipeline_layers: {type(model).__name__} is not supported; "
                     f"supported models: {', '.join(SUPPORTED_MODELS)}")


# ----------------------------------------------------------------------------------------------- batches

def _check_batch(batch: Mapping, allowed: tuple[str, ...], model_name: str) -> None:
    if not isinstance(batch, Mapping):
        raise TypeError(f"pipeline batch for {model_name} must be a dict of tensors, got {type(batch).__name__}")
    unknown = sorted(set(batch) - set(allowed))
    if unknown:
        raise ValueError(f"pipeline batch for {model_name} has unsupported key(s) {unknown}; "
                         f"valid keys: {', '.join(allowed)}")
    for key in ("input_ids", "labels"):
        if batch.get(key) is None:
            raise ValueError(f"pipeline batch for {model_name} needs '{key}' (got keys {sorted(batch)})")


def _mask_and_positions(batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """The padding mask (all ones when absent) and position ids (HF's default arange when absent), both (B, S) long.

    Fixed dtype and full batch shape so every micro-batch sends identically shaped buffers."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids, dtype=torch.long) if mask is None else mask.reshape(rows, -1).to(torch.long)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device)
    positions = positions.to(torch.long).expand(rows, seq).contiguous()
    return mask.contiguous(), positions


def _causal_batch_fn(model: nn.Module) -> Callable:
    name = type(model).__name__

    def batch_fn(batch: Mapping) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        _check_batch(batch, _CAUSAL_BATCH_KEYS, name)
        mask, positions = _mask_and_positions(batch)
        return (batch["input_ids"], mask, positions), batch["labels"]

    return batch_fn


def _bert_batch_fn(model: nn.Module) -> Callable:
    name = type(model).__name__

    def batch_fn(batch: Mapping) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        _check_batch(batch, _BERT_BATCH_KEYS, name)
        mask, positions = _mask_and_positions(batch)
        token_types = batch.get("token_type_ids")
        # BertEmbeddings' default is its all-zeros buffer, so explicit zeros give the same embedding.
        token_types = torch.zeros_like(mask) if token_types is None else token_types.to(torch.long).contiguous()
        return (batch["input_ids"], mask, token_types, positions), batch["labels"]

    return batch_fn


# ----------------------------------------------------------------------------------------------- losses

def _causal_lm_loss(model: PreTrainedModel) -> Callable:
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Looked up at call time: the engine may swap in a vocab-parallel loss under tensor parallelism.
        return model.loss_function(logits, labels, vocab_size=model.config.vocab_size)

    return loss_fn


def _bert_mlm_loss(model: BertForMaskedLM) -> Callable:
    def loss_fn(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # As BertForMaskedLM: mean cross-entropy over the positions whose label is not -100.
        return nn.functional.cross_entropy(scores.view(-1, model.config.vocab_size), labels.view(-1),
                                           ignore_index=-100)

    return loss_fn


def _padding_mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
    """None for an all-ones mask: what HF's causal models see when the batch has no mask."""
    return None if bool(mask.all()) else mask


# ----------------------------------------------------------------------------------------------- GPT-2

class GPT2EmbeddingLayer(nn.Module):
    """Token + position embeddings (+ dropout) of GPT2Model."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        input_ids, mask, positions = inputs
        hidden = self.wte(input_ids) + self.wpe(positions)
        return self.drop(hidden), mask, positions


class GPT2BlockLayer(nn.Module):
    """One GPT2Block; rebuilds the causal (+ padding) mask GPT2Model.forward would pass it."""

    def __init__(self, model: GPT2LMHeadModel, index: int) -> None:
        super().__init__()
        self.block = model.transformer.h[index]
        self.config = model.transformer.config

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from transformers.masking_utils import create_causal_mask

        hidden, mask, positions = inputs
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                         attention_mask=_padding_mask_or_none(mask), cache=None,
                                         position_ids=positions)
        hidden = self.block(hidden, attention_mask=causal_mask, position_ids=positions, use_cache=False)
        return hidden, mask, positions


class GPT2HeadLayer(nn.Module):
    """Final LayerNorm + lm_head (whose weight is wte's, when tied)."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.lm_head(self.ln_f(inputs[0]))


def _gpt2_layers(model: GPT2LMHeadModel) -> list[nn.Module]:
    blocks = [GPT2BlockLayer(model, index) for index in range(len(model.transformer.h))]
    return [GPT2EmbeddingLayer(model), *blocks, GPT2HeadLayer(model)]


# ----------------------------------------------------------------------------------------------- Llama family

class LlamaEmbeddingLayer(nn.Module):
    """embed_tokens of a Llama / Mistral / Qwen2 model."""

    def __init__(self, model: LlamaFamilyModel) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        input_ids, mask, positions = inputs
        return self.embed_tokens(input_ids), mask, positions


class LlamaBlockLayer(nn.Module):
    """One decoder layer of a Llama / Mistral / Qwen2 model (named so as not to shadow HF's LlamaDecoderLayer).

    Recomputes rotary (cos, sin) with the model's rotary_emb -- buffers only, so every stage can hold
    it -- and the mask kind the HF model uses for this layer (full causal or sliding window)."""

    def __init__(self, model: LlamaFamilyModel, index: int, sliding: bool) -> None:
        super().__init__()
        self.block = model.model.layers[index]
        self.rotary_emb = model.model.rotary_emb
        self.config = model.model.config
        self.sliding = sliding

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        hidden, mask, positions = inputs
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        causal_mask = make_mask(config=self.config, inputs_embeds=hidden, attention_mask=_padding_mask_or_none(mask),
                                cache=None, position_ids=positions)
        rotary = self.rotary_emb(hidden, position_ids=positions)
        hidden = self.block(hidden, attention_mask=causal_mask, position_ids=positions, use_cache=False,
                            position_embeddings=rotary)
        return hidden, mask, positions

    def extra_repr(self) -> str:
        return f"sliding={self.sliding}"


class LlamaHeadLayer(nn.Module):
    """Final RMSNorm + lm_head of a Llama / Mistral / Qwen2 model."""

    def __init__(self, model: LlamaFamilyModel) -> None:
        super().__init__()
        self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.lm_head(self.norm(inputs[0]))


def _uses_sliding_window(model: LlamaFamilyModel, index: int) -> bool:
    """Mirror each HF model's own choice: Qwen2 per layer_types, Mistral by config.sliding_window, Llama never."""
    from transformers import MistralForCausalLM, Qwen2ForCausalLM

    if isinstance(model, Qwen2ForCausalLM):
        layer_types = model.config.layer_types
        if layer_types is None:  # (Qwen2Config fills it in from the sliding-window settings)
            raise ValueError("Qwen2 model config without layer_types: cannot tell which layers use sliding windows")
        return layer_types[index] == "sliding_attention"
    if isinstance(model, MistralForCausalLM):
        return model.config.sliding_window is not None
    return False


def _llama_family_layers(model: LlamaFamilyModel) -> list[nn.Module]:
    count = model.config.num_hidden_layers  # HF runs layers[:num_hidden_layers]
    blocks = [LlamaBlockLayer(model, index, _uses_sliding_window(model, index)) for index in range(count)]
    return [LlamaEmbeddingLayer(model), *blocks, LlamaHeadLayer(model)]


# ----------------------------------------------------------------------------------------------- BERT

class BertEmbeddingLayer(nn.Module):
    """BertEmbeddings: word + token type + position embeddings, LayerNorm, dropout."""

    def __init__(self, model: BertForMaskedLM) -> None:
        super().__init__()
        self.embeddings = model.bert.embeddings

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        input_ids, mask, token_types, positions = inputs
        hidden = self.embeddings(input_ids=input_ids, token_type_ids=token_types, position_ids=positions)
        return hidden, mask


class BertBlockLayer(nn.Module):
    """One BertLayer; rebuilds the mask as BertModel._create_attention_masks does (bidirectional unless is_decoder)."""

    def __init__(self, model: BertForMaskedLM, index: int) -> None:
        super().__init__()
        self.block = model.bert.encoder.layer[index]
        self.config = model.bert.config

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from transformers.masking_utils import (
            create_bidirectional_mask,
            create_causal_mask,
        )

        hidden, mask = inputs
        if self.config.is_decoder:
            block_mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask, cache=None)
        else:
            block_mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=mask)
        return self.block(hidden, attention_mask=block_mask), mask


class BertHeadLayer(nn.Module):
    """BertOnlyMLMHead: transform + decoder (weight tied to the word embeddings, bias to predictions.bias)."""

    def __init__(self, model: BertForMaskedLM) -> None:
        super().__init__()
        self.cls = model.cls

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.cls(inputs[0])


def _bert_layers(model: BertForMaskedLM) -> list[nn.Module]:
    blocks = [BertBlockLayer(model, index) for index in range(len(model.bert.encoder.layer))]
    return [BertEmbeddingLayer(model), *blocks, BertHeadLayer(model)]
