"""The fine-tuning recipe: bundled recipes, overrides, one-line errors, paths, engine config derivation."""

from __future__ import annotations

import json
import pickle

import pytest
import yaml

from zerotune.config import ConfigError, load_config, resolve_config
from zerotune.finetune.recipe import (
    BUNDLED_RECIPES,
    Recipe,
    RecipeError,
    bundled_recipe_path,
    load_recipe,
    recipe_engine_config,
    recipe_to_dict,
)
from zerotune.finetune.recipe_sections import EngineSection, ModelSection, TrainSection

MINIMAL = {"model": {"name_or_path": "all-MiniLM-L6-v2"}, "task": "sequence-classification",
           "data": {"bundled": "rotten_tomatoes"}}


def recipe(**sections) -> dict:
    """MINIMAL with sections replaced/added (a fresh deep copy each time)."""
    raw = json.loads(json.dumps(MINIMAL))
    raw.update(sections)
    return raw


def error_of(source, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_recipe(source, overrides)
    error = info.value
    text = str(error)
    assert "\n" not in text and text.startswith("zerotune recipe: ")
    return error


# --- bundled recipes -----------------------------------------------------------------------

def test_default_recipe_is_the_bundled_classification_run():
    r = load_recipe(None)
    assert isinstance(r, Recipe)
    assert r.model.name_or_path == "all-MiniLM-L6-v2" and r.task == "sequence-classification"
    assert r.data.bundled == "rotten_tomatoes" and r.data.train_files is None
    assert r.data.max_length == 64 and r.data.max_eval_samples == 1000
    assert r.method.type == "full"
    assert r.train.max_steps is not None and 60 <= r.train.max_steps <= 100 and r.train.epochs is None
    assert r.train.micro_batch_size * r.launch.nproc_per_node == 16 and r.train.eval_every == 0
    assert (r.engine.zero_stage, r.engine.precision, r.launch.nproc_per_node) == (2, "fp32", 2)


def test_smollm2_recipe_is_causal_lm_lora():
    r = load_recipe("smollm2-lora")
    assert r.task == "causal-lm" and r.model.name_or_path == "SmolLM2-135M-Instruct"
    assert r.data.bundled == "chatterbot_corpus_english"
    assert r.method.type == "lora" and r.method.r == 8
    assert r.method.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert r.train.max_steps == 30 and r.train.micro_batch_size * r.launch.nproc_per_node == 8


@pytest.mark.parametrize("name", list(BUNDLED_RECIPES))
def test_bundled_recipes_ship_and_derive_a_valid_engine_config(name):
    path = bundled_recipe_path(name)
    assert path.is_file() and path.parent.name == "recipes"
    r = load_recipe(path)
    config = recipe_engine_config(r, dp_world_size=r.launch.nproc_per_node)
    resolved = resolve_config(load_config(config), dp_world_size=2)
    assert resolved.train_micro_batch_size_per_gpu == r.train.micro_batch_size
    assert resolved.train_batch_size == r.train.micro_batch_size * 2
    assert resolved.zero_optimization.stage == 2 and not resolved.bf16.enabled and not resolved.fp16.enabled
    assert resolved.optimizer.type == "AdamW" and resolved.optimizer.params["lr"] == r.train.lr
    assert resolved.scheduler.type == "WarmupDecayLR"
    assert resolved.scheduler.params["total_num_steps"] == r.train.max_steps + 1  # no step at lr 0 at the end
    assert resolved.gradient_clipping == 1.0


def test_unknown_bundled_recipe_name_lists_the_bundled_ones():
    with pytest.raises(ConfigError, match="default, smollm2-lora"):
        bundled_recipe_path("smollm")
    assert "bundled recipes: default, smollm2-lora" in str(error_of("smollm"))


# --- documentation: every field says what it means ------------------------------------------

def test_every_recipe_field_has_a_description():
    from zerotune.finetune import recipe_sections as sections

    classes = [Recipe, sections.ModelSection, sections.DataSection, sections.MethodSection, TrainSection,
               EngineSection, sections.LaunchSection]
    for cls in classes:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no description"


# --- overrides ---------------------------------------------------------------------------------

def test_overrides_parse_values_as_yaml():
    r = load_recipe(None, ["train.lr=3e-5", "method.type=lora", "method.r=4", "train.max_steps=10",
                           "engine.zero_stage=1", "data.max_eval_samples=null"])
    assert r.train.lr == 3e-5 and isinstance(r.train.lr, float)
    assert (r.method.type, r.method.r, r.train.max_steps, r.engine.zero_stage) == ("lora", 4, 10, 1)
    assert r.data.max_eval_samples is None


def test_override_list_of_files_resolves_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_recipe(recipe(data={"text_column": "t"}), ["data.train_files=[a.csv, sub/b.csv]"])
    assert r.data.train_files == [str(tmp_path / "a.csv"), str(tmp_path / "sub" / "b.csv")]


def test_override_of_an_engine_config_key_reaches_the_engine_config():
    r = load_recipe(None, ["engine.zero_optimization.reduce_bucket_size=1000"])
    assert recipe_engine_config(r)["zero_optimization"] == {"reduce_bucket_size": 1000, "stage": 2}


def test_override_unknown_key_gets_did_you_mean():
    error = error_of(None, ["train.lrr=1e-4"])
    assert error.path == "train.lrr" and "did you mean 'lr'" in str(error)
    error = error_of(None, ["trian.lr=1e-4"])
    assert error.path == "trian" and "did you mean 'train'" in str(error)


@pytest.mark.parametrize("override", ["train.lr", "=3", "train..lr=3", ".lr=3"])
def test_malformed_override_says_the_form(override):
    assert "must look like section.key=value" in str(error_of(None, [override]))


def test_overrides_must_be_a_list_of_strings():
    assert "must be a list" in str(error_of(None, "train.lr=1"))
    assert "must look like" in str(error_of(None, [3]))


def test_override_with_invalid_yaml_names_the_key():
    error = error_of(None, ["data.train_files=[a.csv"])
    assert error.path == "data.train_files" and "not valid YAML" in str(error)


def test_scientific_notation_is_a_number_in_recipe_yaml(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe()) + "train:\n  lr: 5e-5\n  weight_decay: 1E-2\n")
    r = load_recipe(path)
    assert (r.train.lr, r.train.weight_decay) == (5e-5, 0.01)


def test_yaml_alias_bomb_in_a_recipe_or_an_override_is_refused_naming_the_bound(tmp_path):
    from tests.test_config import alias_bomb

    path = tmp_path / "bomb.yaml"
    path.write_text(yaml.safe_dump(recipe()) + alias_bomb().replace("steps_per_print", "notes"))
    error = error_of(path)
    assert "recipe file" in str(error) and "bomb.yaml" in str(error) and "100000 values" in str(error)
    override = "train.lr=" + alias_bomb().split(": ", 1)[1]
    error = error_of(None, [override])
    assert error.path == "train.lr" and "100000 values" in str(error)


# --- error paths ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, path, words", [
    (recipe(train={"lrr": 1}), "train.lrr", "did you mean 'lr'"),
    (recipe(modle={}), "modle", "did you mean 'model'"),
    (recipe(data={"bundled": "rotten_tomatoes", "text_colum": "x"}), "data.text_colum", "did you mean 'text_column'"),
    (recipe(method={"type": "lora", "rank": 4}), "method.rank", "unknown key"),
    (recipe(engine={"zero_stag": 2}), "engine.zero_stag", "did you mean 'zero_stage'"),
    (recipe(engine={"zero_optimisation": {}}), "engine.zero_optimisation", "did you mean 'zero_optimization'"),
    (recipe(engine={"zero_optimization": {"stag": 2}}), "engine.zero_optimization.stag", "did you mean 'stage'"),
])
def test_unknown_keys_at_any_level_get_did_you_mean(raw, path, words):
    error = error_of(raw)
    assert error.path == path and words in str(error)


@pytest.mark.parametrize("raw, path, words", [
    (recipe(train={"lr": "fast"}), "train.lr", 'invalid value "fast": expected a number'),
    (recipe(train={"max_steps": 2.5}), "train.max_steps", "expected an integer"),
    (recipe(train={"epochs": "3"}), "train.epochs", "expected a number"),
    (recipe(train={"micro_batch_size": 0}), "train.micro_batch_size", "greater than or equal to 1"),
    (recipe(model={"name_or_path": "x", "trust_remote_code": "yes"}), "model.trust_remote_code", "boolean"),
    (recipe(data={"bundled": "rotten_tomatoes", "eval_fraction": 1.5}), "data.eval_fraction", "less than or equal to 1"),
    (recipe(train=[1, 2]), "train", "expected a mapping"),
    (recipe(task="classification"), "task", "'sequence-classification' or 'causal-lm'"),
    (recipe(method={"type": "adapter"}), "method.type", "'full', 'lora', 'qlora', 'prefix' or 'freeze'"),
    (recipe(model={"name_or_path": "x", "dtype": "float32"}), "model.dtype", "'auto', 'fp32', 'bf16' or 'fp16'"),
    (recipe(engine={"precision": "fp8"}), "engine.precision", "'fp32', 'bf16' or 'fp16'"),
    (recipe(engine={"zero_stage": 4}), "engine.zero_stage", "less than or equal to 3"),
    (recipe(data={"bundled": "imdb"}), "data.bundled", "'rotten_tomatoes' or 'chatterbot_corpus_english'"),
    ({"task": "causal-lm", "data": {"bundled": "rotten_tomatoes"}}, "model", "required key is missing"),
])
def test_wrong_types_and_enum_values_name_the_key_and_the_valid_values(raw, path, words):
    error = error_of(raw)
    assert error.path == path and words in str(error), str(error)


@pytest.mark.parametrize("raw, path, words", [
    (recipe(train={"epochs": 2, "max_steps": 10}), "train.max_steps", "set exactly one"),
    (recipe(train={"warmup_steps": 5, "warmup_ratio": 0.1}), "train.warmup_ratio", "set at most one"),
    (recipe(data={"bundled": "rotten_tomatoes", "train_files": ["a.csv"]}), "data.bundled", "set exactly one"),
    (recipe(data={}), "data", "set data.train_files"),
    (recipe(data={"bundled": "rotten_tomatoes", "eval_files": ["e.csv"]}), "data.eval_files", "only with data.train_files"),
    (recipe(data={"train_files": ["a.csv"], "eval_files": ["e.csv"], "eval_fraction": 0.2}), "data.eval_fraction",
     "unused"),
    (recipe(method={"type": "full", "r": 4}), "method.r", "a lora / qlora option, but method.type is 'full'"),
    (recipe(method={"type": "lora", "num_virtual_tokens": 4}), "method.num_virtual_tokens", "a prefix option"),
    (recipe(method={"type": "prefix", "target_modules": ["q"]}), "method.target_modules", "set method.type=lora"),
    (recipe(task="causal-lm", model={"name_or_path": "x", "num_labels": 2}), "model.num_labels",
     "only used by task 'sequence-classification'"),
    (recipe(task="causal-lm", data={"bundled": "rotten_tomatoes", "label_column": "y"}), "data.label_column", "only used"),
    (recipe(data={"bundled": "rotten_tomatoes", "prompt_column": "q", "response_column": "a"}), "data.prompt_column",
     "'causal-lm'"),
    (recipe(task="causal-lm", data={"bundled": "rotten_tomatoes", "prompt_column": "q"}), "data.response_column",
     "give both"),
    (recipe(launch={"nnodes": 2}), "launch.rdzv_endpoint", "required when launch.nnodes is 2"),
    (recipe(launch={"nnodes": 2, "rdzv_endpoint": "h:1", "node_rank": 2}), "launch.node_rank", "not below"),
])
def test_cross_field_errors_name_the_key_to_change(raw, path, words):
    error = error_of(raw)
    assert error.path == path and words in str(error), str(error)


def test_switching_method_by_override_drops_the_recipes_options_of_the_old_method_but_flags_given_ones():
    # issue 17: --set method.type=full on the LoRA recipe was refused for the recipe's own r / alpha / ...
    assert load_recipe("smollm2-lora", ["method.type=full"]).method.model_fields_set == {"type"}
    error = error_of("smollm2-lora", ["method.type=full", "method.alpha=8"])
    assert error.path == "method.alpha"


def test_unreadable_recipe_files_are_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    error = error_of(missing)
    assert error.path == "" and f"recipe file '{missing}' does not exist" in str(error)
    assert "is a directory" in str(error_of(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert f"recipe file '{bad}' is not valid YAML" in str(error_of(bad))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"model": }')
    assert "is not valid JSON" in str(error_of(bad_json))
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    assert "must hold a mapping" in str(error_of(scalar))
    with pytest.raises(ConfigError, match="expected a recipe file path"):
        load_recipe(42)


def test_recipe_error_is_a_config_error_and_pickles():
    error = RecipeError("train.lr", "bad")
    assert isinstance(error, ConfigError) and isinstance(error, ValueError)
    assert str(error) == "zerotune recipe: train.lr: bad"
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.path, str(copy)) == (RecipeError, "train.lr", str(error))


# --- defaults and paths -------------------------------------------------------------------------

def test_minimal_recipe_gets_documented_defaults():
    r = load_recipe(recipe())
    assert r.train.epochs == 1.0 and r.train.max_steps is None and r.train.lr == 5e-5
    assert (r.train.micro_batch_size, r.train.gradient_accumulation_steps, r.train.seed) == (16, 1, 42)
    assert (r.train.warmup_steps, r.train.warmup_ratio, r.train.gradient_clipping) == (0, None, 1.0)
    assert (r.method.type, r.method.r, r.method.alpha, r.method.dropout) == ("full", 8, 16, 0.05)
    assert r.method.target_modules is None and r.method.num_virtual_tokens == 20
    assert (r.data.eval_fraction, r.data.max_length) == (0.1, 128)
    assert (r.data.text_column, r.data.label_column, r.data.text_pair_column) == ("text", "label", None)
    assert (r.data.prompt_column, r.data.response_column) == (None, None)
    assert (r.model.dtype, r.model.trust_remote_code, r.model.num_labels) == ("auto", False, None)
    assert (r.launch.nproc_per_node, r.launch.nnodes, r.launch.rdzv_backend) == (2, 1, "c10d")
    assert r.launch.rdzv_endpoint is None and r.launch.node_rank is None


def test_relative_paths_resolve_against_the_recipe_directory(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "recipes"
    (recipe_dir / "models" / "tiny").mkdir(parents=True)
    (recipe_dir / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    raw = {"model": {"name_or_path": "models/tiny"}, "task": "sequence-classification",
           "data": {"train_files": "data/train.csv", "eval_files": ["data/eval.csv", "/abs/e.csv"]},
           "engine": {"config_path": "ds.json"}}
    path = recipe_dir / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    r = load_recipe(path)
    assert r.data.train_files == [str(recipe_dir / "data" / "train.csv")]
    assert r.data.eval_files == [str(recipe_dir / "data" / "eval.csv"), "/abs/e.csv"]
    assert r.model.name_or_path == str(recipe_dir / "models" / "tiny")
    assert r.engine.config_path == str(recipe_dir / "ds.json")
    assert recipe_engine_config(r)["zero_optimization"]["stage"] == 1


def test_bundled_and_hub_style_model_names_stay_as_written(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(recipe(model={"name_or_path": "org/some-model"})))
    assert load_recipe(path).model.name_or_path == "org/some-model"
    assert load_recipe(recipe()).model.name_or_path == "all-MiniLM-L6-v2"


def test_a_single_file_is_a_list_of_one():
    r = load_recipe(recipe(data={"train_files": "/d/a.csv"}))
    assert r.data.train_files == ["/d/a.csv"]


def test_recipe_round_trips_through_recipe_to_dict():
    for source in (None, "smollm2-lora"):
        r = load_recipe(source)
        again = load_recipe(recipe_to_dict(r))
        assert again == r
        assert load_recipe(r) == r


# --- the engine config -------------------------------------------------------------------------

def test_engine_config_from_train_settings():
    r = load_recipe(recipe(train={"epochs": 2, "lr": 3e-5, "weight_decay": 0.1, "micro_batch_size": 4,
                                  "gradient_accumulation_steps": 2, "warmup_steps": 10, "gradient_clipping": 0.5}))
    config = recipe_engine_config(r, total_steps=100)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.1}}
    assert config["scheduler"] == {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 101, "warmup_min_lr": 0.0, "warmup_max_lr": 3e-5, "warmup_num_steps": 10,
        "warmup_type": "linear", "last_batch_iteration": 1}}
    assert config["gradient_clipping"] == 0.5
    assert "zero_optimization" not in config and "bf16" not in config
    resolved = resolve_config(load_config(config), dp_world_size=2)
    assert resolved.train_batch_size == 16


def test_the_first_step_trains_at_the_first_warmup_lr_and_no_step_at_lr_0():
    """Step k applies lr * k / warmup during the warm-up, then decays linearly, ending above 0 (the old
    schedule applied lr 0 at steps 1 and 2, and at the last one)."""
    import torch

    from zerotune.optim import build_scheduler

    r = load_recipe(recipe(train={"max_steps": 8, "lr": 1.0, "warmup_steps": 4}))
    scheduler_config = recipe_engine_config(r)["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(scheduler_config["type"], scheduler_config["params"], optimizer)
    applied = []
    for _ in range(8):  # what each optimizer step trains with, then the engine steps the schedule
        applied.append(optimizer.param_groups[0]["lr"])
        scheduler.step()
    assert applied == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_schedule_without_known_length_or_warmup():
    r = load_recipe(recipe())
    config = recipe_engine_config(r)
    assert config["scheduler"]["type"] == "WarmupLR"
    # No warmup: the lr is flat from the first step instead of starting at 0.
    assert config["scheduler"]["params"]["warmup_min_lr"] == config["scheduler"]["params"]["warmup_max_lr"] == 5e-5


def test_warmup_ratio_uses_the_total_steps():
    r = load_recipe(recipe(train={"max_steps": 200, "warmup_ratio": 0.1}))
    assert recipe_engine_config(r)["scheduler"]["params"]["warmup_num_steps"] == 20
    r = load_recipe(recipe(train={"epochs": 1, "warmup_ratio": 0.25}))
    assert recipe_engine_config(r, total_steps=40)["scheduler"]["params"]["warmup_num_steps"] == 10
    with pytest.raises(ConfigError) as info:
        recipe_engine_config(r)
    assert info.value.path == "train.warmup_ratio"


def test_shortcuts_fill_the_engine_config():
    config = recipe_engine_config(load_recipe(recipe(engine={"zero_stage": 1, "precision": "bf16"})))
    assert config["zero_optimization"] == {"stage": 1}
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    config = recipe_engine_config(load_recipe(recipe(engine={"precision": "fp16", "fp16": {"loss_scale": 128}})))
    assert config["fp16"] == {"loss_scale": 128, "enabled": True}


def test_engine_values_win_and_auto_takes_the_recipe_value():
    engine = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
              "gradient_clipping": 2.0, "zero_optimization": {"stage": 1}, "bfloat16": {"enabled": "auto"}}
    r = load_recipe(recipe(train={"warmup_steps": 7, "weight_decay": 0.02}, engine={**engine, "precision": "bf16"}))
    config = recipe_engine_config(r, dp_world_size=2)
    assert config["optimizer"] == {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.02}}
    # the recipe's warm-up is linear, and its schedule starts at iteration 1 so the first step does not train at lr 0
    assert config["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 7, "warmup_type": "linear",
                                                                  "last_batch_iteration": 1}}
    assert config["gradient_clipping"] == 2.0 and config["zero_optimization"] == {"stage": 1}
    assert config["bf16"] == {"enabled": True}


@pytest.mark.parametrize("train, engine, path, words", [
    ({"lr": 1e-4}, {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, "train.lr",
     "0.0001 conflicts with engine.optimizer.params.lr 0.0003"),
    ({"gradient_clipping": 0.5}, {"gradient_clipping": 1.0}, "train.gradient_clipping", "conflicts"),
    ({}, {"zero_stage": 2, "zero_optimization": {"stage": 1}}, "engine.zero_stage",
     "2 conflicts with engine.zero_optimization.stage 1"),
    ({}, {"precision": "fp32", "bf16": {"enabled": True}}, "engine.precision",
     '"fp32" conflicts with engine.bf16.enabled true'),
    ({"micro_batch_size": 8}, {"train_micro_batch_size_per_gpu": 4}, "train.micro_batch_size", "conflicts"),
    ({"micro_batch_size": 8}, {"train_batch_size": 20}, "engine.train_batch_size", "not divisible"),
    ({"warmup_steps": 3}, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}}, "train.warmup_steps",
     "conflicts"),
])
def test_conflicting_recipe_and_engine_values_are_errors(train, engine, path, words):
    error = error_of(recipe(train=train, engine=engine))
    assert error.path == path and words in str(error), str(error)


def test_engine_batch_size_becomes_the_recipe_batch():
    r = load_recipe(recipe(engine={"train_batch_size": 32, "gradient_accumulation_steps": 2}))
    assert (r.train.micro_batch_size, r.train.gradient_accumulation_steps) == (8, 2)  # 32 = 8 x 2 x 2 ranks
    config = recipe_engine_config(r, dp_world_size=2)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (32, 8)
    r = load_recipe(recipe(engine={"train_micro_batch_size_per_gpu": 4}))
    assert r.train.micro_batch_size == 4


def test_engine_config_errors_are_prefixed_with_engine(tmp_path):
    error = error_of(recipe(engine={"zero_optimization": {"stage": 7}}))
    assert error.path == "engine.zero_optimization.stage"
    error = error_of(recipe(engine={"autotuning": {"enabled": True}}))
    assert error.path == "engine.autotuning" and "does not support" in str(error)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"fp16": {"enabled": "yes"}}))
    error = error_of(recipe(engine={"config_path": str(ds)}))
    assert error.path == "engine.fp16.enabled" and str(ds) in str(error)
    error = error_of(recipe(engine={"config_path": str(tmp_path / "missing.json")}))
    assert error.path == "engine.config_path" and "does not exist" in str(error)
    error = error_of(recipe(engine={"config_path": str(ds), "zero_optimization": {"stage": 1}}))
    assert error.path == "engine.config_path" and "use one of them" in str(error)


@pytest.mark.parametrize("engine,path", [
    ({"tensor_parallel": {"autotp_size": 2}}, "engine.tensor_parallel.autotp_size"),
    ({"sequence_parallel_size": 2}, "engine.sequence_parallel_size"),
    ({"pipeline": {"stages": 2}}, "engine.pipeline.stages"),
])
def test_model_parallel_engine_keys_are_refused_by_the_finetune_job(engine, path):
    error = error_of(recipe(engine=engine))
    assert error.path == path, str(error)
    assert "runs data parallel only" in str(error) and "zerotune.initialize" in str(error)
    off = {key: ({inner: 1} if isinstance(value, dict) else 1) for key, value in engine.items()
           for inner in (value if isinstance(value, dict) else [None])}
    load_recipe(recipe(engine=off))  # size 1 means the mode is off: accepted


def test_resolving_for_a_world_size_surfaces_batch_errors():
    r = load_recipe(recipe(engine={"train_batch_size": 32}))  # 16 per rank at 2 ranks
    with pytest.raises(ConfigError) as info:
        recipe_engine_config(r, dp_world_size=3)
    assert info.value.path == "engine.train_batch_size"


def test_model_section_is_strict_about_unknown_keys_in_python_too():
    with pytest.raises(Exception):
        ModelSection(name_or_path="x", nmae="y")


def test_save_total_limit_becomes_the_engines_keep_last():
    r = load_recipe(recipe(train={"save_total_limit": 2}))
    assert recipe_engine_config(r)["checkpoint"] == {"keep_last": 2}
    error = error_of(recipe(train={"save_total_limit": 2}, engine={"checkpoint": {"keep_last": 3}}))
    assert error.path == "train.save_total_limit" and "engine.checkpoint.keep_last" in str(error)


def test_an_override_naming_a_data_source_replaces_the_recipes_own(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    recipe = load_recipe("smollm2-lora", [f"data.train_files=[{chat}]"])
    assert recipe.data.train_files == [str(chat)] and recipe.data.bundled is None
    error = error_of("smollm2-lora", [f"data.train_files=[{chat}]", "data.dataset=some/id"])
    assert error.path == "data.dataset" and "both set" in str(error)
