"""An untied embedding matrix read in place from the checkpoint file's pages, not copied into the
process's memory: a step looks up one row a token, so only the pages of the tokens seen become
resident, and they are file pages the kernel may drop and read again (llama.cpp maps its weights so).
A 128k x 2048 bfloat16 embedding is 0.49 GiB: in a 1B-shaped model with 4-bit layers and head, nearly
as much as all the rest (0.65 GiB).

Where the LM head is the same matrix (tied word embeddings) every step reads it whole, so it stays
in memory (packed for the head's kernel, model/packed_linear.py); on a GPU, on tensor parallelism
(each rank's rows zero-padded to its shard) and where the file's dtype is not the model's, the
embedding is loaded as any weight, and with `load_format="safetensors"` too. The mapping is private:
the file is never written, and a write to the tensor would stay in this process. Rewriting the file
in place under a running server changes the rows it has not read yet, and truncating it makes the
next lookup of such a row fault (SIGBUS), as with llama.cpp's mmap; deleting or renaming it is safe.

The safetensors header gives the matrix's bytes (`checkpoint_files.read_header`)."""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from treeserve.model.checkpoint_files import read_header

TARGET = "embed_tokens.weight"


def map_tensor(path: Path, entry: tuple[torch.dtype, list[int], int, int]) -> torch.Tensor:
    """The tensor at `entry` (its `read_header` entry) of the safetensors file `path`, over a private
    mapping of its bytes."""
    dtype, shape, begin, end = entry
    start = begin - begin % mmap.ALLOCATIONGRANULARITY
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = mmap.mmap(fd, end - start, offset=start, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    count = (end - begin) // dtype.itemsize
    return torch.frombuffer(pages, dtype=dtype, count=count, offset=begin - start).view(shape)


def map_embedding(model: nn.Module, locate: Callable[[], tuple[Path, str] | None], dtype: torch.dtype,
                  device: torch.device) -> bool:
    """The model's embedding matrix mapped from its checkpoint file where that serves: an untied
    `nn.Embedding` on the CPU whose file holds it in `dtype` and its shape. `locate`: the file holding
    it and the tensor's name (None: no file does), asked only for such a model. Returns whether it
    mapped (the loader then skips the tensor)."""
    embedding = getattr(model, "embed_tokens", None)
    if device.type != "cpu" or type(embedding) is not nn.Embedding:
        return False
    if getattr(model, "lm_head", None) is None and getattr(model, "head_name", None) is None:
        return False  # tied: the LM head reads the whole matrix every step
    checkpoint = locate()
    if checkpoint is None:
        return False
    path, name = checkpoint
    entry = read_header(path)[name]
    if entry[0] != dtype or tuple(entry[1]) != tuple(embedding.weight.shape):
        return False
    embedding.weight = nn.Parameter(map_tensor(path, entry), requires_grad=False)
    return True
