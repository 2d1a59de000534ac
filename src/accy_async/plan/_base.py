"""The base of every plan struct, the shared value bounds, and the error helper."""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, TypeVar

import msgspec

from ..errors import PlanError

__all__ = [
    "MAX_LAUNCH_ARGUMENTS",
    "U32",
    "U64",
    "ArgumentCount",
    "ArgumentIndex",
    "Base",
    "Name",
    "ObjectId",
    "Tagged",
    "Version",
    "convert_plan",
    "plan_error",
    "translate_validation_error",
]

T = TypeVar("T")

MAX_LAUNCH_ARGUMENTS: Final = 32
"""Most buffers, and most scalars, one kernel launch may take (the seed's limit)."""

_MAX_NAME_BYTES: Final = 256

U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0)]
"""Non-negative; values past 2**64 - 1 are refused by the decoders themselves."""
ObjectId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Version = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
ArgumentCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_LAUNCH_ARGUMENTS)]
ArgumentIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAUNCH_ARGUMENTS)]
Name = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=_MAX_NAME_BYTES,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.\-]*$",
        description="A dotted identifier such as `accy.scan.block_scan`.",
    ),
]


class Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Frozen, unknown fields refused: the base of every plan struct."""


class Tagged(Base, tag_field="type", frozen=True):
    """Base of the members of a tagged union; each subclass sets its own ``tag``."""


def plan_error(message: str, *fields: str | int) -> PlanError:
    """A :class:`PlanError` whose path is ``$`` followed by ``fields``.

    Strings become ``.name`` and integers ``[index]``, so
    ``plan_error("dangling", "stages", 1, "target")`` names ``$.stages[1].target``.
    Raised from ``__post_init__`` while decoding, msgspec puts the struct's
    own location in front; :func:`accy_async.plan.codec` joins the two.
    """
    return PlanError(message, path=_join_path("$", fields))


def _join_path(prefix: str, fields: tuple[str | int, ...]) -> str:
    """Join ``prefix`` and the given field names and indices into one path."""
    parts = (f"[{field}]" if isinstance(field, int) else f".{field}" for field in fields)
    return prefix + "".join(parts)


_AT_PATH = re.compile(r"^(?P<message>.*) - at `(?P<path>\$[^`]*)`$", re.DOTALL)


def translate_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> PlanError:
    """Turn msgspec's error into a :class:`PlanError` whose ``path`` names the bad field.

    When the error came from a :class:`PlanError` raised in ``__post_init__``,
    its own path (relative to the struct) is appended to msgspec's location.
    """
    text = str(exc)
    match = _AT_PATH.match(text)
    message, path = (match["message"], match["path"]) if match else (text, "$")
    cause = exc.__cause__
    if isinstance(cause, PlanError):
        message = cause.message
        if cause.path is not None and cause.path != "$":
            path = path + cause.path[1:]
    return PlanError(message, path=path)


def convert_plan(value: Any, plan_type: type[T]) -> T:
    """Convert built-in values (or a struct) into ``plan_type``, checking every bound."""
    try:
        return msgspec.convert(value, plan_type, from_attributes=True)
    except msgspec.ValidationError as exc:
        raise translate_validation_error(exc) from exc
