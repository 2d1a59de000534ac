"""Fuzzed plans: valid plans round-trip; mutated ones are refused with a path, running nothing.

A quick profile runs in CI; ``ACCY_FUZZ_EXAMPLES=10000`` (``make fuzz-long``) runs the long
one. ``run_fuzz`` runs both properties outside pytest for ``docs/reliability.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import anyio
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.errors import AccyError, PlanError
from accy_async.pipeline import PipelineLaunch, launch_pipeline

from . import strategies

EXAMPLES = int(os.environ.get("ACCY_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
COUNTS: dict[str, int] = {
    "valid plans round-tripped (JSON and MessagePack)": 0,
    "mutated plans rejected with a path": 0,
    "mutated plans still valid (then launched on the recording backend)": 0,
    "rejected launches that allocated nothing": 0,
}

SEEDS = [
    msgspec.json.decode(p.encode_json(document))
    for document in (
        library.prefix_sum(p.DType.F32, 256),
        library.saxpy(p.DType.F32),
        library.reduce_sum(p.DType.F32),
        library.tuning_document(p.ArtifactFormat.CPU, 1000),
    )
]
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**31, 2**32, 2**60, 2**63, 2**64]),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(["os.system", "../../etc/passwd", "__import__('os')", "", "f32", "u64"]),
    st.lists(st.integers(-3, 3), max_size=4),
    st.dictionaries(st.sampled_from(["type", "kind", "x", "value"]), st.integers(), max_size=2),
)


def _paths(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, (*path, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_paths(value, (*path, index)))
    return found


def _at(node: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        node = node[step]
    return node


@st.composite
def mutated(draw: st.DrawFn) -> Any:
    """A real plan (a built-in one or a generated one) with one to three mutations."""
    if draw(st.booleans()):
        raw = json.loads(json.dumps(draw(st.sampled_from(SEEDS))))
    else:
        raw = msgspec.json.decode(p.encode_json(draw(strategies.documents)))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(raw)
        path = draw(st.sampled_from(paths))
        if not path:
            raw = draw(ODD_VALUES)
            continue
        parent, key = _at(raw, path[:-1]), path[-1]
        action = draw(st.sampled_from(["replace", "delete", "add", "duplicate", "empty"]))
        if action == "replace":
            parent[key] = draw(ODD_VALUES)
        elif action == "delete":
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["unknown_field", "x", "code"]))] = draw(ODD_VALUES)
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(parent[key])
        elif isinstance(parent[key], list | dict):
            parent[key] = type(parent[key])()
        else:
            parent[key] = draw(ODD_VALUES)
    return raw


def _scalars(document: p.PipelineDocument) -> list[p.ScalarArgument]:
    pipeline = document.pipeline
    types = list(pipeline.runtime_scalar_types) or ["u32"] * pipeline.runtime_scalar_argument_count
    return [p.scalar(kind, 1.0 if kind.startswith("f") else 1) for kind in types]


async def _launch(document: p.PipelineDocument) -> None:
    """Launch an accepted pipeline on a recording backend; a refusal must allocate nothing."""
    backend = accy.RecordingBackend()
    try:
        fmt = next(iter(sorted(document.registry.formats(), key=lambda f: f.value)), None)
        if fmt is None:
            return
        operands = [
            backend.external_buffer(1 << 20).bind() for _ in range(document.pipeline.operand_count)
        ]
        results = [
            backend.external_buffer(1 << 20).bind() for _ in range(document.pipeline.result_count)
        ]
        try:
            await launch_pipeline(
                backend,
                PipelineLaunch(
                    pipeline=document.pipeline,
                    registry=document.registry,
                    format=fmt,
                    operands=operands,
                    results=results,
                    runtime_scalar_arguments=_scalars(document),
                ),
            )
        except AccyError:
            assert backend.calls["allocate"] == 0, "a refused launch allocated"
            assert backend.calls["create"] == 0, "a refused launch created an artifact"
            assert backend.calls["launch"] == 0, "a refused launch launched"
            COUNTS["rejected launches that allocated nothing"] += 1
        assert not backend.live_objects(owned_only=True), "a launch left objects alive"
    finally:
        await backend.aclose()


def check_mutated(raw: Any) -> None:
    """Decoding either refuses with a :class:`PlanError` that has a path, or yields a plan
    that round-trips (and, for pipelines, launches or is refused without allocating)."""
    document, error = _decode(json.dumps(raw).encode(), p.decode_json)
    if error is not None:
        assert error.path is not None, f"no path: {error!r}"
        assert error.path.startswith("$"), f"not a path: {error!r}"
        COUNTS["mutated plans rejected with a path"] += 1
        try:
            packed = msgspec.msgpack.encode(raw)
        except OverflowError:  # an integer MessagePack cannot hold: JSON alone carries it
            return
        _, again = _decode(packed, p.decode_msgpack)
        assert again is None or again.path is not None, f"no path: {again!r}"
        return
    assert document is not None
    COUNTS["mutated plans still valid (then launched on the recording backend)"] += 1
    assert p.decode_json(p.encode_json(document), p.PlanDocument) == document
    if isinstance(document, p.PipelineDocument):
        anyio.run(_launch, document)
    elif isinstance(document, p.LaunchGraphDocument) and document.graph is not None:
        with contextlib.suppress(AccyError):  # any other exception fails the test
            document.graph.validate(document.artifact_plan)


def _decode(data: bytes, decode: Any) -> tuple[p.PlanDocument | None, PlanError | None]:
    try:
        return decode(data, p.PlanDocument), None
    except PlanError as exc:
        return None, exc


@FUZZ_SETTINGS
@given(mutated())
def test_mutated_plans_are_refused_with_a_path_and_run_nothing(raw: Any) -> None:
    check_mutated(raw)


@FUZZ_SETTINGS
@given(strategies.documents)
def test_valid_plans_round_trip(document: p.PlanDocument) -> None:
    round_trip(document)


def round_trip(document: p.PlanDocument) -> None:
    """A valid plan decodes back to itself from JSON and from MessagePack."""
    assert p.decode_json(p.encode_json(document), p.PlanDocument) == document
    assert p.decode_msgpack(p.encode_msgpack(document), p.PlanDocument) == document
    COUNTS["valid plans round-tripped (JSON and MessagePack)"] += 1


def run_fuzz(examples: int) -> dict[str, int]:
    """Run both properties with ``examples`` cases each; the counts, for the report."""
    for key in COUNTS:
        COUNTS[key] = 0
    chosen = settings(FUZZ_SETTINGS, max_examples=examples)
    chosen(given(mutated())(check_mutated))()
    chosen(given(strategies.documents)(round_trip))()
    return dict(COUNTS)
