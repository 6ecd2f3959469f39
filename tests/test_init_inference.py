"""``init_inference``: DeepSpeed's tensor-parallel inference on zerotune's AutoTP.

At tp 2, GPT-2 (fused q|k|v Conv1D, tied vocab-parallel head) and Llama (grouped kv heads) give the unsplit
model's logits (fp32, 1e-5 relative) and its greedy tokens; sampling draws the same tokens on both ranks
(their RNG states are made equal); DeepSpeed's injection_policy splits the same way as the built-in plan;
dtype casts; replace_with_kernel_inject is accepted with a note; bad keys and values are one-line errors.
A DeepSpeed-style script (``tests/deepspeed_clients/inference_tp.py``) runs under ``zerotune run --as-deepspeed``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.harness import run_distributed
from tests.launch import run_client
from tests.models import make_bert, make_gpt2, make_llama
from zerotune.config import ConfigError
from zerotune.inference import InferenceConfig, InferenceEngine, init_inference


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_behind():
    """init_inference in this process (a world of one) starts a process group, as initialize does; later tests
    (zerotune plan's fake groups) need none, so the module ends the one it started."""
    started_here = not torch.distributed.is_initialized()
    yield
    if started_here and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

MAKERS = {"gpt2": make_gpt2, "llama": make_llama, "bert": make_bert}
PROMPT = torch.tensor([[5, 17, 42, 8, 77, 3], [60, 1, 9, 33, 12, 90]])


def _policy(kind: str) -> dict:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {"gpt2": {GPT2Block: ("attn.c_proj", "mlp.c_proj")},
            "llama": {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}}[kind]


def _reference(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    model = MAKERS[kind]().eval()
    with torch.no_grad():
        logits = model(PROMPT).logits
    tokens = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=6, do_sample=False,
                            pad_token_id=0) if kind != "bert" else None
    return logits, tokens


def _tp_run(kind: str, policy: bool) -> dict:
    model = MAKERS[kind](seed=0)
    torch.manual_seed(100 + torch.distributed.get_rank())  # the engine must make the ranks' RNG equal
    extra = {"injection_policy": _policy(kind)} if policy else {}
    engine = init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32, **extra)
    with torch.no_grad():
        logits = engine(PROMPT).logits
    row = {"logits": logits, "mp_world_size": engine.mp_world_size, "split": len(engine.sharded)}
    if kind != "bert":
        mask = torch.ones_like(PROMPT)
        row["greedy"] = engine.generate(PROMPT, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        row["sampled"] = engine.generate(input_ids=PROMPT, attention_mask=mask, max_new_tokens=6, do_sample=True,
                                         top_k=0, pad_token_id=0)
    return row


@pytest.mark.parametrize("kind, policy", [("gpt2", False), ("llama", False), ("gpt2", True), ("llama", True),
                                          ("bert", False)])
def test_tp2_logits_and_greedy_tokens_equal_the_unsplit_model(kind: str, policy: bool) -> None:
    logits, tokens = _reference(kind)
    rows = run_distributed(_tp_run, 2, kind, policy, timeout=180)
    for row in rows:
        assert row["mp_world_size"] == 2 and row["split"] > 0
        assert row["logits"].shape == logits.shape  # the full vocabulary, not this rank's share
        torch.testing.assert_close(row["logits"], logits, rtol=1e-5, atol=1e-5 * logits.abs().max().item())
        if tokens is not None:
            assert torch.equal(row["greedy"], tokens)
    if kind != "bert":
        assert torch.equal(rows[0]["sampled"], rows[1]["sampled"])


def test_autotp_parser_gives_the_built_in_plan_as_an_injection_policy() -> None:
    from zerotune.compat.module_inject import AutoTP

    for kind in ("gpt2", "llama"):
        assert AutoTP.supported(MAKERS[kind]()) and AutoTP.tp_parser(MAKERS[kind]()) == list(_policy(kind).items())
    assert not AutoTP.supported(torch.nn.Linear(2, 2))


def _cast_run() -> list[str]:
    engine = init_inference(make_llama(), tensor_parallel={"tp_size": 2}, dtype="bf16")
    with torch.no_grad():
        logits = engine(PROMPT).logits
    return sorted({str(p.dtype) for p in engine.module.parameters()} | {str(logits.dtype)})


def test_dtype_casts_the_split_model() -> None:
    for dtypes in run_distributed(_cast_run, 2, timeout=120):
        assert dtypes == ["torch.bfloat16"]
    engine = init_inference(make_gpt2(), dtype=torch.bfloat16)  # world of one: cast, no split
    assert engine.dtype is torch.bfloat16 and engine.mp_world_size == 1 and not engine.sharded
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    assert init_inference(make_gpt2()).dtype is torch.float16  # DeepSpeed's default


def test_kernel_injection_is_accepted_with_a_note_and_the_model_runs_as_is() -> None:
    model = make_gpt2().eval()
    with torch.no_grad():
        expected = model(PROMPT).logits
    engine = init_inference(copy.deepcopy(model), config={"replace_with_kernel_inject": True, "dtype": "fp32"},
                            enable_cuda_graph=False, mp_size=1)
    notes = dict(engine._config.notes)
    assert "no fused inference kernels" in notes["replace_with_kernel_inject"]
    assert "CUDA graphs" in notes["enable_cuda_graph"] and "tensor_parallel.tp_size" in notes["mp_size"]
    with torch.no_grad():
        assert torch.equal(engine(PROMPT).logits, expected)
    assert isinstance(engine, InferenceEngine) and engine.config is engine.module.config  # the module's attributes
    with pytest.raises(RuntimeError, match="6 tokens, more than max_out_tokens=4"):
        init_inference(make_gpt2(), dtype=torch.float32, max_tokens=4).generate(PROMPT, max_new_tokens=1)


@pytest.mark.parametrize("kwargs, expected", [
    ({"tp_sise": 2}, "tp_sise: unknown key; did you mean tensor_parallel={'tp_size': 2}?"),
    ({"tp_size": 2}, "tp_size: unknown key; did you mean tensor_parallel={'tp_size': 2}?"),
    ({"enable_cuda_grap": True}, "enable_cuda_grap: unknown key; did you mean 'enable_cuda_graph'?"),
    ({"tensor_parallel": {"tpsize": 2}}, "tensor_parallel.tpsize: unknown key; did you mean 'tp_size'?"),
    ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size: invalid value 0: expected greater than or equal to 1"),
    ({"dtype": "int8"}, "dtype: invalid value \"int8\": int8 inference is DeepSpeed's quantized kernels"),
    ({"dtype": "fp8"}, "dtype: invalid value \"fp8\": expected a floating torch dtype or one of fp16, fp32, bf16"),
    ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, "mp_size: 2 disagrees with tensor_parallel.tp_size 4"),
    ({"checkpoint": "checkpoints.json"}, "checkpoint: loading a DeepSpeed inference checkpoint"),
    ({"tensor_parallel": {"mpu": object()}}, "tensor_parallel.mpu: a Megatron mpu is not supported"),
    ({"injection_policy": {"GPT2Block": 3}}, "injection_policy: invalid value"),
    ({"max_tokens": 0}, "max_out_tokens: invalid value 0"),
    ({"replace_with_kernel_inject": "yes"}, "replace_with_kernel_inject: invalid value \"yes\""),
])
def test_bad_keys_and_values_are_one_line_errors(kwargs: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        InferenceConfig.from_source(None, **kwargs)
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_config_and_keyword_arguments_merge_as_in_deepspeed(tmp_path) -> None:
    path = tmp_path / "inference.json"
    path.write_text('{"dtype": "bf16", "tensor_parallel": {"tp_size": 1}}')
    merged = InferenceConfig.from_source(str(path), max_tokens=64)
    assert merged.dtype is torch.bfloat16 and merged.max_out_tokens == 64 and merged.tp_size == 1
    with pytest.raises(ConfigError, match="dtype: given twice with different values"):
        InferenceConfig.from_source({"dtype": "bf16"}, dtype="fp16")
    assert InferenceConfig(tp={"tp_size": 1}, kernel_inject=True).replace_with_kernel_inject is True


def test_bad_setups_name_the_problem() -> None:
    with pytest.raises(ValueError, match="tp_size=2: world size 1 is not divisible by tensor parallel 2"):
        init_inference(make_gpt2(), tensor_parallel={"tp_size": 2})
    with torch.device("meta"):
        meta = make_gpt2()
    with pytest.raises(ValueError, match="meta device; load real weights"):
        init_inference(meta)


def test_deepspeed_names_resolve_to_the_engine() -> None:
    from zerotune.compat import DeepSpeedFeatureNotSupported, install_deepspeed_alias
    from zerotune.compat.alias import uninstall_deepspeed_alias

    install_deepspeed_alias()
    try:
        import deepspeed
        from deepspeed.inference.config import DeepSpeedInferenceConfig
        from deepspeed.inference.engine import InferenceEngine as Engine
        from deepspeed.module_inject import replace_transformer_layer

        assert deepspeed.init_inference is init_inference and Engine is InferenceEngine
        assert DeepSpeedInferenceConfig(tp={"tp_size": 1}, dtype="fp32").dtype is torch.float32
        with pytest.raises(DeepSpeedFeatureNotSupported, match="replace_transformer_layer: inference kernel injection"):
            replace_transformer_layer(None)
    finally:
        uninstall_deepspeed_alias()


@pytest.mark.slow  # two torchrun launches, ~35 s each on two cores
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_deepspeed_style_inference_script_on_two_ranks(kind: str) -> None:
    rows = run_client("inference_tp.py", "--model", kind, nproc=2)
    for row in rows:
        assert row["mp_world_size"] == 2 and row["vocab_rows"] == 48  # the LM head holds half of the 96 rows
        assert row["tokens"] == row["reference"] and row["pipeline"] == row["reference_text"]
