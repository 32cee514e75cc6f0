"""Fields a vendor's API defines that treeserve does not implement, told apart from fields no vendor
defines: each API lists its own in one place (wire/responses.py's RESPONSES_UNSUPPORTED,
wire/messages.py's MESSAGES_UNSUPPORTED). Such a field sent with a value that asks for something is a
400 naming it that says treeserve does not support it (code `unsupported_parameter`, OpenAI's for a
field it knows and refuses); sent empty (null, false, [], {}: asks for nothing) it is dropped. A field
in no list is the 400 `unknown parameter` (a typo, or another API's habit)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

from treeserve.errors import ParamError

CODE = "unsupported_parameter"


def asks_for_something(value: Any) -> bool:
    return value not in (None, False, "", [], {})


@dataclass(frozen=True)
class Unsupported:
    why: str  # what it asks for, or what to send instead
    asks: Callable[[Any], bool] = asks_for_something  # whether a value asks for what is not supported


class UnsupportedParamError(ParamError):
    """A field (or a value of one) the vendor defines and treeserve does not support."""
    code = CODE

    def __init__(self, param: str, why: str):
        super().__init__(param, message(why))


def message(why: str) -> str:
    return f"not supported by treeserve ({why})"


def drop_or_refuse(data: Any, unsupported: dict[str, Unsupported]) -> Any:
    """A request's raw fields (a model's `mode="before"` validator) without the listed ones that ask
    for nothing; the first that asks for something refused (a validation error naming it, which
    wire/errors.py's from_validation_error makes the 400)."""
    if not isinstance(data, dict):
        return data
    for name, field in unsupported.items():
        if name in data and field.asks(data[name]):
            raise PydanticCustomError(CODE, "{message}", {"param": name, "message": f"{name}: {message(field.why)}"})
    return {name: value for name, value in data.items() if name not in unsupported}


class VendorRequest(BaseModel):
    """A request model of a vendor's API: its UNSUPPORTED fields dropped when empty, else refused."""
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        return drop_or_refuse(data, cls.UNSUPPORTED)
