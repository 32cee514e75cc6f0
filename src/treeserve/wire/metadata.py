"""OpenAI's `metadata` (a response's, a conversation's): at most 16 pairs, keys of at most 64
characters, values of at most 512; beyond them a 400 naming the field, as OpenAI's."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

MAX_METADATA_PAIRS = 16
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                          Annotated[str, StringConstraints(max_length=512)]],
                     Field(max_length=MAX_METADATA_PAIRS)]
