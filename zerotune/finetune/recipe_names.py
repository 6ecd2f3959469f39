"""Other fine-tuning tools' names for zerotune's recipe keys, for did-you-mean.

A LLaMA-Factory or axolotl user (or one coming from the Hugging Face Trainer) writes
``learning_rate`` where a recipe says ``train.lr``; a fuzzy match over our own names cannot know
that, and finds nothing or something misleading (``gradient_checkpointing`` -> ``gradient_clipping``).
``recipe_sections.py`` gives each section this table, resolved to the section (``lr`` inside
``train``, ``train.lr`` elsewhere), keeping only targets that exist.
"""

from __future__ import annotations

FOREIGN_KEY_NAMES: dict[str, str] = {
    # model
    "model_name_or_path": "model.name_or_path",
    "base_model": "model.name_or_path",
    "trust_remote_code": "model.trust_remote_code",
    # train
    "learning_rate": "train.lr",
    "num_train_epochs": "train.epochs",
    "num_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "max_grad_norm": "train.gradient_clipping",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "lr_scheduler_type": "train.lr_scheduler",
    "logging_steps": "train.log_every",
    "save_steps": "train.save_every",
    "eval_steps": "train.eval_every",
    "neftune_noise_alpha": "train.neftune_noise_alpha",
    # data
    "train_on_prompt": "data.train_on_prompt",
    "train_on_inputs": "data.train_on_prompt",
    "cutoff_len": "data.max_length",
    "sequence_len": "data.max_length",
    "max_seq_length": "data.max_length",
    "max_samples": "data.max_train_samples",
    "val_size": "data.eval_fraction",
    "val_set_size": "data.eval_fraction",
    "sample_packing": "data.packing",
    "chat_template": "data.template",
    "mask_history": "data.train_on",
    # method
    "finetuning_type": "method.type",
    "adapter": "method.type",
    "lora_rank": "method.r",
    "lora_r": "method.r",
    "lora_alpha": "method.alpha",
    "lora_dropout": "method.dropout",
    "lora_target": "method.target_modules",
    "lora_target_modules": "method.target_modules",
    "quantization_bit": "method.bits",
    "use_dora": "method.dora",
    "peft_use_dora": "method.dora",
    "use_rslora": "method.rslora",
    "peft_use_rslora": "method.rslora",
    "freeze_trainable_layers": "method.trainable_layers",
    "freeze_trainable_modules": "method.trainable_modules",
    # objective
    "stage": "objective.type",
    "rl": "objective.type",
    "pref_beta": "objective.beta",
    "rl_beta": "objective.beta",
    "pref_loss": "objective.loss",
    "simpo_gamma": "objective.gamma",
    "dpo_label_smoothing": "objective.label_smoothing",
    "kto_chosen_weight": "objective.desirable_weight",
    "kto_desirable_weight": "objective.desirable_weight",
    "kto_rejected_weight": "objective.undesirable_weight",
    "kto_undesirable_weight": "objective.undesirable_weight",
    # engine
    "deepspeed": "engine.config_path",
}
