"""Where a model named by the user lives: a local directory (`~` expanded) or a Hugging Face hub id read from the
local Hugging Face cache, never the network (runs have no network; download with `hf download ID` beforehand), or a
GGUF file (a path, or `pkg:PACKAGE/FILE` inside an installed package) converted once into a directory of the model
cache (gguf.py). The engines, the learner and the tokenizer all load the resolved directory."""

from __future__ import annotations

import json
import re
from pathlib import Path

from treepo_ray.config import UserError
from treepo_ray.engines.gguf import gguf_model_dir, is_gguf_file, is_gguf_ref

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
MODEL_CACHE = ".cache/treepo-ray"
"""model.cache_dir's default: where a converted GGUF file is kept when the caller names no model cache."""


def resolve_model_path(path: str, key: str = "model.path", cache_dir: str | Path | None = None,
                       model_cache: str | Path | None = None) -> str:
    """The local directory of the model `path` names: the directory itself, the cached snapshot of a hub id
    (`cache_dir`: the hub cache, default HF_HUB_CACHE), or a GGUF file's converted directory under `model_cache`
    (model.cache_dir, default MODEL_CACHE). UserError naming `key` when there is none."""
    local = Path(path).expanduser()
    if is_gguf_ref(path) or (local.is_file() and is_gguf_file(local)):
        return gguf_model_dir(path, model_cache or MODEL_CACHE, key)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(f"{key} = {path!r}: the directory holds no config.json (not a Hugging Face model)")
        return str(local)
    if local.exists():
        raise UserError(f"{key} = {path!r} is a file, not a model directory")
    if not _HUB_ID.match(path):
        raise UserError(f"{key} = {path!r}: no such directory")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(path, local_files_only=True, cache_dir=cache_dir)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        cache = cache_dir or constants.HF_HUB_CACHE
        raise UserError(f"{key} = {path!r}: no such directory, and no such model in the Hugging Face cache {cache} "
                        f"(runs are offline: `hf download {path}` first where there is network, or give a local "
                        f"directory)") from None


def model_context_length(path: str | Path) -> int | None:
    """The model's context length from its config.json (max_position_embeddings), None when it does not say."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    data = data.get("text_config", data)  # multimodal configs nest the language model's
    value = data.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None
