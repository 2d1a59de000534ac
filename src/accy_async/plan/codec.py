"""JSON and MessagePack codecs, JSON Schema export, and validation of built plans.

Decoding never runs code: CPU kernels are named, CUDA kernels are text or bytes.
Every failure is a :class:`~accy_async.errors.PlanError` whose ``path`` names the
bad field, with msgspec's error on ``__cause__``.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeAlias, TypeVar, overload

import msgspec

from .._cache import IdentityCache
from ..errors import PlanError
from ._base import Base, Name, convert_plan, plan_error, translate_validation_error
from .artifact_plan import ArtifactPlan
from .geometry import Fixed, Quantity
from .graph import LaunchGraphPlan
from .pipeline import KernelCallPipeline
from .registry import KernelCallRegistry
from .scalars import DType, ScalarArgument
from .tuning import KernelTuningProblem

__all__ = [
    "LaunchGraphDocument",
    "PipelineBuffer",
    "PipelineDocument",
    "PipelineTuningProblem",
    "PlanDocument",
    "TuningDocument",
    "decode_json",
    "decode_msgpack",
    "encode_json",
    "encode_msgpack",
    "json_schema",
    "validate_plan",
]

T = TypeVar("T")


class PipelineBuffer(Base, frozen=True):
    """The shape of one operand or result: ``extent`` elements of ``dtype``, by name."""

    name: Name
    dtype: DType
    extent: Quantity


class PipelineDocument(Base, tag="pipeline", tag_field="kind", frozen=True):
    """A plan file holding a pipeline and the registry its stages call.

    ``operands``, ``results`` and ``runtime_scalar_names`` are optional; when
    given they describe the caller's buffers (sized from the runtime scalars)
    and name the scalars, so tools such as ``accy-async run`` can allocate them.
    """

    pipeline: KernelCallPipeline
    registry: KernelCallRegistry
    description: str = ""
    operands: tuple[PipelineBuffer, ...] = ()
    results: tuple[PipelineBuffer, ...] = ()
    runtime_scalar_names: tuple[Name, ...] = ()

    def __post_init__(self) -> None:
        pipeline = self.pipeline
        for field, given, expected in (
            ("operands", len(self.operands), pipeline.operand_count),
            ("results", len(self.results), pipeline.result_count),
            (
                "runtime_scalar_names",
                len(self.runtime_scalar_names),
                pipeline.runtime_scalar_argument_count,
            ),
        ):
            if given and given != expected:
                raise plan_error(f"{given} {field} described for a pipeline of {expected}", field)
        for field, buffers in (("operands", self.operands), ("results", self.results)):
            for index, buffer in enumerate(buffers):
                extent = buffer.extent
                if not isinstance(extent, Fixed) and (
                    extent.argument_index >= pipeline.runtime_scalar_argument_count
                ):
                    raise plan_error(
                        f"runtime scalar argument {extent.argument_index} does not exist",
                        field,
                        index,
                        "extent",
                        "argument_index",
                    )


class LaunchGraphDocument(Base, tag="launch_graph", tag_field="kind", frozen=True):
    """A plan file holding an artifact plan and, optionally, a launch graph over it."""

    artifact_plan: ArtifactPlan
    graph: LaunchGraphPlan | None = None
    description: str = ""


_MAX_PIPELINE_CANDIDATES: Final = 64


class PipelineTuningProblem(Base, frozen=True):
    """Tune a pipeline end to end: each candidate is a whole pipeline document.

    Candidates must agree on operands, results and runtime scalars (the same
    problem, solved differently, say with other block sizes), and describe
    their operands and results so they can be sized and allocated.
    """

    name: Name
    candidates: Annotated[
        tuple[PipelineDocument, ...],
        msgspec.Meta(min_length=1, max_length=_MAX_PIPELINE_CANDIDATES),
    ]
    runtime_scalar_arguments: tuple[ScalarArgument, ...] = ()

    def __post_init__(self) -> None:
        first = self.candidates[0]
        for index, candidate in enumerate(self.candidates):
            pipeline = candidate.pipeline
            if (
                len(candidate.operands) != pipeline.operand_count
                or len(candidate.results) != pipeline.result_count
            ):
                raise plan_error(
                    "a pipeline candidate must describe its operands and results",
                    "candidates",
                    index,
                )
            if (candidate.operands, candidate.results) != (first.operands, first.results):
                raise plan_error(
                    "every candidate must take the first candidate's operands and results",
                    "candidates",
                    index,
                )
            if pipeline.runtime_scalar_argument_count != len(self.runtime_scalar_arguments):
                raise plan_error(
                    f"the pipeline takes {pipeline.runtime_scalar_argument_count} runtime "
                    f"scalars, {len(self.runtime_scalar_arguments)} are given",
                    "candidates",
                    index,
                )


class TuningDocument(Base, tag="tuning", tag_field="kind", frozen=True):
    """A plan file of tuning problems, read by ``accy-async tune``."""

    kernels: tuple[KernelTuningProblem, ...] = ()
    pipelines: tuple[PipelineTuningProblem, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        if not self.kernels and not self.pipelines:
            raise plan_error("a tuning document needs at least one problem", "kernels")
        names: set[str] = set()
        labelled = [("kernels", index, p.name) for index, p in enumerate(self.kernels)]
        labelled += [("pipelines", index, p.name) for index, p in enumerate(self.pipelines)]
        for field, index, name in labelled:
            if name in names:
                raise plan_error(f"duplicate problem name {name!r}", field, index)
            names.add(name)


PlanDocument: TypeAlias = PipelineDocument | LaunchGraphDocument | TuningDocument
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


_validated: IdentityCache[bool] = IdentityCache(512)


def validate_plan(plan: T) -> T:
    """Check every bound and invariant of a plan built in Python, once.

    msgspec checks value bounds (``Meta``) only when decoding, so a struct
    built by calling its constructor could hold, say, a negative count. This
    round-trips the plan through built-in values and back, which checks
    everything a decode would, and remembers the plans it passed (by identity)
    so the launch paths pay for it once. Returns ``plan`` itself.
    """
    if _validated.get((plan,)):
        return plan
    if not isinstance(plan, msgspec.Struct):
        raise PlanError(f"expected a plan struct, got {type(plan).__name__}", path="$")
    convert_plan(msgspec.to_builtins(plan, builtin_types=(bytes,)), type(plan))
    _validated.put((plan,), True)
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
