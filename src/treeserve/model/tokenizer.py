"""A checkpoint's tokenizer, loaded with transformers' AutoTokenizer from the local files only."""
from __future__ import annotations

from pathlib import Path

from treeserve.model.hf_config import read_json


def _light_config(model_dir: Path, named: dict) -> dict:
    """`config=` for AutoTokenizer where the tokenizer's class is named in tokenizer_config.json.

    AutoTokenizer otherwise builds the model's full transformers config, whose import costs ~2 s of
    every server's start; it reads only the model type and name from it, which a plain
    PretrainedConfig carries. Without a named class (or with remote code) it keeps its own way.
    """
    config = model_dir / "config.json"
    if not named or not config.is_file():
        return {}
    raw = read_json(config)
    if not named.get("tokenizer_class") or "auto_map" in named or "auto_map" in raw or not raw.get("model_type"):
        return {}
    from transformers import PretrainedConfig

    light = PretrainedConfig(name_or_path=str(model_dir), tokenizer_class=raw.get("tokenizer_class"))
    light.model_type = raw["model_type"]
    return {"config": light}


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'tokenizer.json'}: file not found (nor tokenizer_config.json)")
    if (model_dir / "tokenizer.json").is_file():
        read_json(model_dir / "tokenizer.json")  # names the file if it is malformed
    named = read_json(model_dir / "tokenizer_config.json") if (model_dir / "tokenizer_config.json").is_file() else {}
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **_light_config(model_dir, named))
    except Exception as exc:  # transformers raises many types; name the directory
        raise ValueError(f"{model_dir}: could not load the tokenizer ({exc})") from exc
