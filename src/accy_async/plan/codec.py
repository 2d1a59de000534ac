"""JSON and MessagePack codecs, JSON Schema export, and validation of built plans.

Decoding never runs code: CPU kernels are named, CUDA kernels are text or bytes.
Every failure is a :class:`~accy_async.errors.PlanError` whose ``path`` names the
bad field, with msgspec's error on ``__cause__``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Final, TypeAlias, TypeVar, overload

import msgspec

from ..errors import PlanError
from ._base import Base, convert_plan, translate_validation_error
from .artifact_plan import ArtifactPlan
from .graph import LaunchGraphPlan
from .pipeline import KernelCallPipeline
from .registry import KernelCallRegistry

__all__ = [
    "LaunchGraphDocument",
    "PipelineDocument",
    "PlanDocument",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
    "json_schema",
    "validate_plan",
]

T = TypeVar("T")


class PipelineDocument(Base, tag="pipeline", tag_field="kind", frozen=True):
    """A plan file holding a pipeline and the registry its stages call."""

    pipeline: KernelCallPipeline
    registry: KernelCallRegistry
    description: str = ""


class LaunchGraphDocument(Base, tag="launch_graph", tag_field="kind", frozen=True):
    """A plan file holding an artifact plan and, optionally, a launch graph over it."""

    artifact_plan: ArtifactPlan
    graph: LaunchGraphPlan | None = None
    description: str = ""


PlanDocument: TypeAlias = PipelineDocument | LaunchGraphDocument
"""What a plan file holds; its ``kind`` field says which."""


def encode_json(plan: msgspec.Struct) -> bytes:
    """Encode a plan as JSON (bytes as base64)."""
    return _JSON_ENCODER.encode(plan)


def encode_msgpack(plan: msgspec.Struct) -> bytes:
    """Encode a plan as MessagePack."""
    return _MSGPACK_ENCODER.encode(plan)


@overload
def decode_json(data: bytes | str, plan_type: type[T]) -> T: ...
@overload
def decode_json(data: bytes | str, plan_type: Any) -> Any: ...
def decode_json(data: bytes | str, plan_type: Any) -> Any:
    """Decode JSON into ``plan_type`` (a struct or a union such as :data:`PlanDocument`).

    Raises :class:`PlanError` naming the bad field.
    """
    try:
        return _json_decoder(plan_type).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _translate(exc, "JSON") from exc


@overload
def decode_msgpack(data: bytes, plan_type: type[T]) -> T: ...
@overload
def decode_msgpack(data: bytes, plan_type: Any) -> Any: ...
def decode_msgpack(data: bytes, plan_type: Any) -> Any:
    """Decode MessagePack into ``plan_type``; raise :class:`PlanError` naming the bad field."""
    try:
        return _msgpack_decoder(plan_type).decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _translate(exc, "MessagePack") from exc


def json_schema(plan_type: Any = PlanDocument) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``plan_type``, plan files by default."""
    schema = msgspec.json.schema(plan_type)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


_VALIDATED_CAPACITY: Final = 512
_validated: OrderedDict[int, msgspec.Struct] = OrderedDict()


def validate_plan(plan: T) -> T:
    """Check every bound and invariant of a plan built in Python, once.

    msgspec checks value bounds (``Meta``) only when decoding, so a struct
    built by calling its constructor could hold, say, a negative count. This
    round-trips the plan through built-in values and back, which checks
    everything a decode would, and remembers the plans it passed (by identity)
    so the launch paths pay for it once. Returns ``plan`` itself.
    """
    key = id(plan)
    if _validated.get(key) is plan:
        _validated.move_to_end(key)
        return plan
    if not isinstance(plan, msgspec.Struct):
        raise PlanError(f"expected a plan struct, got {type(plan).__name__}", path="$")
    convert_plan(msgspec.to_builtins(plan, builtin_types=(bytes,)), type(plan))
    _validated[key] = plan
    if len(_validated) > _VALIDATED_CAPACITY:
        _validated.popitem(last=False)
    return plan


_JSON_ENCODER: Final = msgspec.json.Encoder()
_MSGPACK_ENCODER: Final = msgspec.msgpack.Encoder()


def _json_decoder(plan_type: Any) -> msgspec.json.Decoder[Any]:
    decoder = _json_decoders.get(plan_type)
    if decoder is None:
        decoder = _json_decoders[plan_type] = msgspec.json.Decoder(plan_type)
    return decoder


def _msgpack_decoder(plan_type: Any) -> msgspec.msgpack.Decoder[Any]:
    decoder = _msgpack_decoders.get(plan_type)
    if decoder is None:
        decoder = _msgpack_decoders[plan_type] = msgspec.msgpack.Decoder(plan_type)
    return decoder


_json_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
_msgpack_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def _translate(exc: msgspec.ValidationError | msgspec.DecodeError, what: str) -> PlanError:
    if isinstance(exc, msgspec.ValidationError):
        return translate_validation_error(exc)
    return PlanError(f"malformed {what}: {exc}", path="$")
