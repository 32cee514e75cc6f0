"""A checkpoint directory's safetensors files: which files (one, or the shards an index names), their
tensors' names, the tensors read one at a time, and a file's header as the format lays it out (an
8-byte little-endian length, then JSON naming each tensor's dtype, shape and byte range)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from treeserve.model.hf_config import read_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# the file's bytes a load reads through one safetensors handle: a handle maps the whole file, and
# the pages its tensors touched stay in the process's RSS until it closes (a 1B bfloat16 load's
# peak RSS was the file's 2.3 GiB on top of the weights it holds)
REOPEN_BYTES = 64 << 20


def safetensors_files(model_dir: Path) -> list[Path]:
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: missing or empty 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard listed in {INDEX_FILE} not found")
        return files
    raise FileNotFoundError(f"{model_dir / SINGLE_FILE}: file not found (nor {INDEX_FILE})")


def iter_checkpoint_tensors(model_dir: Path,
                            wanted: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor (those `wanted` by name) whole."""
    for path in safetensors_files(model_dir):
        yield from read_tensors(path, lambda handle, name: handle.get_tensor(name) if wanted(name) else None)


def read_tensors(path: Path, read: Callable[[Any, str], torch.Tensor | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, `read(handle, name)`) for each tensor of one safetensors file that `read` returns, through
    a handle opened anew after each REOPEN_BYTES read."""
    names = tensor_names(path)
    try:
        handle, since_open = None, REOPEN_BYTES
        for name in names:
            if since_open >= REOPEN_BYTES:
                handle, since_open = None, 0  # (the last one's pages go with its last tensor)
                handle = safe_open(str(path), framework="pt")
            tensor = read(handle, name)
            if tensor is not None:
                since_open += tensor.nbytes
                yield name, tensor
    except SafetensorError as exc:
        raise ValueError(f"{path}: malformed safetensors file ({exc})") from exc


def checkpoint_tensor_names(model_dir: Path) -> list[str]:
    return [name for path in safetensors_files(model_dir) for name in tensor_names(path)]


def tensor_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except SafetensorError as exc:
        raise ValueError(f"{path}: malformed safetensors file ({exc})") from exc


def read_header(path: Path) -> dict[str, tuple[torch.dtype | None, list[int], int, int]]:
    """Each tensor of the safetensors file `path`: (dtype, None where not a float one; shape; first
    byte; end byte in the file)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    return {name: (_DTYPES.get(entry["dtype"]), entry["shape"], 8 + length + entry["data_offsets"][0],
                   8 + length + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}
