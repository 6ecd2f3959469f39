"""hf_pipeline_layers: the layer list run in sequence is the HF model, loss and gradients included."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models import make_gpt2, make_llama
from zerotune.pipe.hf_layers import hf_pipeline_layers

VOCAB, ROWS, SEQ = 96, 3, 10


def make_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.0,
                         tie_word_embeddings=False, use_sliding_window=True, sliding_window=4,
                         layer_types=["full_attention", "sliding_attention"])
    return Qwen2ForCausalLM(config)


def make_mistral(seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.0,
                           tie_word_embeddings=False, sliding_window=4)
    return MistralForCausalLM(config)


def make_bert(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, type_vocab_size=2)
    return BertForMaskedLM(config)


def make_llama_eager(seed: int = 0):
    model = make_llama(seed)
    model.set_attn_implementation("eager")
    return model


MAKERS = {"gpt2": make_gpt2, "llama": make_llama, "llama_eager": make_llama_eager, "qwen2": make_qwen2,
          "mistral": make_mistral, "bert": make_bert}


def make_batch(kind: str, *, padded: bool, seed: int = 7) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=generator)
    batch = {"input_ids": ids}
    if kind == "bert":
        labels = torch.full_like(ids, -100)
        labels[:, ::3] = torch.randint(0, VOCAB, labels[:, ::3].shape, generator=generator)
        batch["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(ROWS, SEQ).clone()
    else:
        labels = ids.clone()
    if padded:
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # right padding
        mask[1, :2] = 0   # left padding
        labels = labels.masked_fill(mask == 0, -100)
        batch["attention_mask"] = mask
    batch["labels"] = labels
    return batch


def run_layers(layers: list[nn.Module], loss_fn, batch_fn, batch: dict) -> torch.Tensor:
    inputs, labels = batch_fn(batch)
    for layer in layers:
        inputs = layer(inputs)
    return loss_fn(inputs, labels)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_pipeline_matches_model(model: nn.Module, batch: dict, **model_kwargs) -> None:
    layers, loss_fn, batch_fn = hf_pipeline_layers(model)
    model.zero_grad(set_to_none=True)
    expected = model(**batch, **model_kwargs).loss
    expected.backward()
    expected_grads = grads_of(model)

    model.zero_grad(set_to_none=True)
    actual = run_layers(layers, loss_fn, batch_fn, batch)
    actual.backward()
    actual_grads = grads_of(model)

    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    assert actual_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padded"])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_layers_reproduce_loss_and_grads(kind: str, padded: bool) -> None:
    assert_pipeline_matches_model(MAKERS[kind](), make_batch(kind, padded=padded))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "mistral", "bert"])
def test_explicit_all_ones_mask_and_position_ids(kind: str) -> None:
    batch = make_batch(kind, padded=False)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["position_ids"] = torch.arange(SEQ).unsqueeze(0) + 2
    assert_pipeline_matches_model(MAKERS[kind](), batch)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_packed_sequences_without_mask(kind: str) -> None:
    """Position ids restarting mid-row and no mask: each packed sequence attends only to itself.

    HF detects packing only without a KV cache, i.e. with use_cache=False (training); the layers never use a cache."""
    batch = make_batch(kind, padded=False)
    batch["position_ids"] = torch.cat([torch.arange(4), torch.arange(SEQ - 4)]).expand(ROWS, SEQ).clone()
    assert_pipeline_matches_model(MAKERS[kind](), batch, use_cache=False)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_hf_gradient_checkpointing_still_matches(kind: str) -> None:
    """The blocks are HF GradientCheckpointingLayers: called directly they still checkpoint themselves."""
    model = MAKERS[kind]()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert_pipeline_matches_model(model, make_batch(kind, padded=True))


def test_layers_hold_the_models_own_parameters() -> None:
    for kind, maker in MAKERS.items():
        model = maker()
        layers, _, _ = hf_pipeline_layers(model)
        model_ids = {id(p) for p in model.parameters()}
        seen: dict[int, int] = {}
        for layer in layers:
            for p in layer.parameters():
                seen[id(p)] = seen.get(id(p), 0) + 1
        assert set(seen) == model_ids, kind
        shared = {pid for pid, count in seen.items() if count > 1}
        if kind == "gpt2":
            assert shared == {id(model.transformer.wte.weight)}
            assert layers[-1].lm_head.weight is layers[0].wte.weight
        elif kind == "bert":
            assert shared == {id(model.bert.embeddings.word_embeddings.weight)}
            assert layers[-1].cls.predictions.decoder.weight is layers[0].embeddings.word_embeddings.weight
        else:
            assert shared == set(), kind
        assert len(layers) == model.config.num_hidden_layers + 2


def test_layer_names_and_parameter_counts() -> None:
    model = make_llama()
    layers, _, _ = hf_pipeline_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["LlamaEmbeddingLayer", "LlamaBlockLayer",
                                                         "LlamaBlockLayer", "LlamaHeadLayer"]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    assert counts[0] == model.model.embed_tokens.weight.numel()
    assert counts[1] == sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts[-1] == model.lm_head.weight.numel() + model.model.norm.weight.numel()
    assert sum(counts) == sum(p.numel() for p in model.parameters())
    qwen_layers, _, _ = hf_pipeline_layers(make_qwen2())
    assert [layer.sliding for layer in qwen_layers[1:-1]] == [False, True]
    assert [type(layer).__name__ for layer in hf_pipeline_layers(make_gpt2())[0]] == [
        "GPT2EmbeddingLayer", "GPT2BlockLayer", "GPT2BlockLayer", "GPT2HeadLayer"]
    assert [type(layer).__name__ for layer in hf_pipeline_layers(make_bert())[0]] == [
        "BertEmbeddingLayer", "BertBlockLayer", "BertBlockLayer", "BertHeadLayer"]


def test_batch_fn_gives_uniform_tensor_tuples() -> None:
    _, _, batch_fn = hf_pipeline_layers(make_gpt2())
    plain, _ = batch_fn(make_batch("gpt2", padded=False))
    padded, labels = batch_fn(make_batch("gpt2", padded=True))
    assert all(isinstance(t, torch.Tensor) for t in plain + padded)
    assert [(t.shape, t.dtype) for t in plain] == [(t.shape, t.dtype) for t in padded]
    assert bool(plain[1].eq(1).all()) and plain[2].tolist() == [list(range(SEQ))] * ROWS
    assert labels.shape == (ROWS, SEQ)


def test_loss_fn_reads_model_loss_function_at_call_time() -> None:
    model = make_llama()
    layers, loss_fn, batch_fn = hf_pipeline_layers(model)
    calls = []

    def replacement(logits, labels, vocab_size):
        calls.append(vocab_size)
        return logits.sum() * 0

    model.loss_function = replacement
    run_layers(layers, loss_fn, batch_fn, make_batch("llama", padded=False))
    assert calls == [VOCAB]


def test_unsupported_model_is_named() -> None:
    from transformers import GPT2Model

    with pytest.raises(ValueError, match=r"GPT2Model is not supported.*GPT2LMHeadModel.*LlamaForCausalLM.*"
                                         r"MistralForCausalLM.*Qwen2ForCausalLM.*BertForMaskedLM"):
        hf_pipeline_layers(make_gpt2().transformer)
    assert GPT2Model  # the class the error names
    with pytest.raises(ValueError, match="Linear is not supported"):
        hf_pipeline_layers(nn.Linear(2, 2))


def test_bad_batches_are_named() -> None:
    _, _, batch_fn = hf_pipeline_layers(make_gpt2())
    batch = make_batch("gpt2", padded=False)
    with pytest.raises(ValueError, match=r"unsupported key\(s\) \['token_type_ids'\].*valid keys: input_ids"):
        batch_fn({**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])})
    with pytest.raises(ValueError, match="needs 'labels'"):
        batch_fn({"input_ids": batch["input_ids"]})
