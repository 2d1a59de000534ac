"""Plans round-trip through JSON and MessagePack, and bad plans fail naming the bad field."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

import accy_async as accy
from accy_async import library
from accy_async import plan as p
from accy_async.errors import PlanError

from . import strategies
from .plans import artifact_plan
from .seed_fixtures import SEED_PIPELINE, SEED_REGISTRY

PLAN_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PLAN_SETTINGS
@given(strategies.documents)
def test_documents_round_trip_through_json_and_msgpack(document: p.PlanDocument) -> None:
    assert p.decode_json(p.encode_json(document), p.PlanDocument) == document
    assert p.decode_msgpack(p.encode_msgpack(document), p.PlanDocument) == document
    assert p.validate_plan(document) is document


@PLAN_SETTINGS
@given(strategies.pipelines())
def test_pipelines_round_trip(pipeline: p.KernelCallPipeline) -> None:
    assert p.decode_json(p.encode_json(pipeline), p.KernelCallPipeline) == pipeline
    assert p.decode_msgpack(p.encode_msgpack(pipeline), p.KernelCallPipeline) == pipeline


@PLAN_SETTINGS
@given(strategies.launch_graphs())
def test_launch_graphs_round_trip(graph: p.LaunchGraphPlan) -> None:
    assert p.decode_json(p.encode_json(graph), p.LaunchGraphPlan) == graph
    assert p.decode_msgpack(p.encode_msgpack(graph), p.LaunchGraphPlan) == graph


@settings(max_examples=25, deadline=None)
@given(strategies.documents)
def test_encoded_documents_satisfy_the_exported_schema(document: p.PlanDocument) -> None:
    schema = p.json_schema()
    jsonschema.validate(json.loads(p.encode_json(document)), schema)


def _seed_document() -> dict[str, Any]:
    document = p.PipelineDocument(pipeline=SEED_PIPELINE, registry=SEED_REGISTRY)
    decoded: dict[str, Any] = json.loads(p.encode_json(document))
    return decoded


def _graph_document() -> dict[str, Any]:
    spec = p.ArtifactSpec(
        kernel_name="k",
        format=p.ArtifactFormat.CPU,
        payload=p.CpuKernelPayload("tests.copy_f32"),
        argument_count=3,
        scalar_argument_count=1,
    )
    plan = artifact_plan(
        {1: 16, 2: 16},
        p.PlannedKernel(
            kernel_id=7, work_item_id=0, artifact=spec, output_slot_id=2, input_slot_ids=(1,)
        ),
    )
    graph = p.LaunchGraphPlan(
        nodes=(
            p.GraphNode(kernel_index=0),
            p.GraphNode(kernel_index=0),
            p.GraphNode(kernel_index=0),
        ),
        dependencies=(p.GraphDependency(producer_node_index=0, consumer_node_index=1),),
    )
    decoded: dict[str, Any] = json.loads(
        p.encode_json(p.LaunchGraphDocument(artifact_plan=plan, graph=graph))
    )
    return decoded


Mutation = Callable[[dict[str, Any]], None]


def _set(path: list[Any], value: Any) -> Mutation:
    def mutate(document: dict[str, Any]) -> None:
        node: Any = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


def _append(path: list[Any], value: Any) -> Mutation:
    def mutate(document: dict[str, Any]) -> None:
        node: Any = document
        for key in path:
            node = node[key]
        node.append(value)

    return mutate


BAD_PIPELINES: list[tuple[str, Mutation, str, str]] = [
    ("unknown field", _set(["pipeline", "stagez"], []), "$.pipeline", "unknown field `stagez`"),
    (
        "wrong tag",
        _set(["pipeline", "stages", 0, "buffers", 0, "type"], "operant"),
        "$.pipeline.stages[0].buffers[0].type",
        "Invalid value 'operant'",
    ),
    ("wrong document kind", _set(["kind"], "pipe"), "$.kind", "Invalid value 'pipe'"),
    ("negative count", _set(["pipeline", "operand_count"], -1), "$.pipeline.operand_count", ">= 0"),
    (
        "oversized argument count",
        _set(["registry", "entries", 0, "argument_count"], 33),
        "$.registry.entries[0].argument_count",
        "<= 32",
    ),
    (
        "oversized divisor",
        _set(["pipeline", "intermediates", 0, "extent", "divisor"], 2**33),
        "$.pipeline.intermediates[0].extent.divisor",
        "<= 4294967296",
    ),
    (
        "zero block",
        _set(["registry", "entries", 0, "launch", "block"], [0, 1, 1]),
        "$.registry.entries[0].launch.block[0]",
        ">= 1",
    ),
    (
        "too many threads",
        _set(["registry", "entries", 0, "launch", "block"], [1024, 2, 1]),
        "$.registry.entries[0].launch.block",
        "exceeds the limit of 1024",
    ),
    (
        "dangling operand",
        _set(["pipeline", "stages", 0, "buffers", 1, "index"], 3),
        "$.pipeline.stages[0].buffers[1].index",
        "operand 3 does not exist",
    ),
    (
        "dangling intermediate",
        _set(["pipeline", "stages", 1, "buffers", 0, "index"], 2),
        "$.pipeline.stages[1].buffers[0].index",
        "intermediate 2 does not exist",
    ),
    (
        "dangling runtime scalar",
        _set(["pipeline", "stages", 1, "scalars", 0, "argument_index"], 1),
        "$.pipeline.stages[1].scalars[0].argument_index",
        "runtime scalar argument 1 does not exist",
    ),
    (
        "scalar count above arguments",
        _set(["registry", "entries", 1, "runtime_scalar_argument_count"], 4),
        "$.registry.entries[1].runtime_scalar_argument_count",
        "exceeds argument_count 3",
    ),
    (
        "payload of the wrong kind",
        _set(["registry", "entries", 0, "payload"], {"type": "cpu_kernel", "name": "os.system"}),
        "$.registry.entries[0].payload",
        "needs a 'text' payload, got 'cpu_kernel'",
    ),
    (
        "duplicate registry entry",
        lambda d: d["registry"]["entries"].append(copy.deepcopy(d["registry"]["entries"][0])),
        "$.registry.entries[3]",
        "duplicate entry",
    ),
    ("empty target", _set(["pipeline", "target"], ""), "$.pipeline.target", "length >= 1"),
    (
        "target that is not an identifier",
        _set(["pipeline", "target"], "os.system('x')"),
        "$.pipeline.target",
        "matching regex",
    ),
    (
        "string where a number belongs",
        _set(["pipeline", "version"], "1"),
        "$.pipeline.version",
        "Expected `int`, got `str`",
    ),
    (
        "bound with min above max",
        _set(["pipeline", "runtime_scalar_bounds"], [{"argument_index": 0, "min": 5, "max": 1}]),
        "$.pipeline.runtime_scalar_bounds[0].min",
        "min 5 exceeds max 1",
    ),
    ("no stages", _set(["pipeline", "stages"], []), "$.pipeline.stages", "length >= 1"),
    (
        "non-finite float",
        _set(
            ["pipeline", "stages", 0, "scalars", 0],
            {"type": "constant", "value": {"type": "f32", "value": 1e39}},
        ),
        "$.pipeline.stages[0].scalars[0].value.value",
        "not a finite float32",
    ),
]

BAD_GRAPHS: list[tuple[str, Mutation, str, str]] = [
    (
        "cycle",
        lambda d: d["graph"]["dependencies"].extend(
            [
                {"producer_node_index": 1, "consumer_node_index": 2},
                {"producer_node_index": 2, "consumer_node_index": 0},
            ]
        ),
        "$.graph.dependencies[2]",
        "cycle: 2 -> 0 -> 1 -> 2",
    ),
    (
        "backward dependency",
        _append(["graph", "dependencies"], {"producer_node_index": 2, "consumer_node_index": 1}),
        "$.graph.dependencies[1]",
        "comes after its consumer",
    ),
    (
        "dependency on a missing node",
        _append(["graph", "dependencies"], {"producer_node_index": 0, "consumer_node_index": 9}),
        "$.graph.dependencies[1].consumer_node_index",
        "node 9 does not exist",
    ),
    (
        "self dependency",
        _append(["graph", "dependencies"], {"producer_node_index": 1, "consumer_node_index": 1}),
        "$.graph.dependencies[1]",
        "depends on itself",
    ),
    (
        "missing stream",
        _set(["graph", "nodes", 1, "stream"], 0),
        "$.graph.nodes[1].stream",
        "stream 0 does not exist",
    ),
    (
        "missing event",
        _set(["graph", "nodes", 2, "wait_events"], [3]),
        "$.graph.nodes[2].wait_events[0]",
        "event 3 does not exist",
    ),
    (
        "loop past the end",
        _set(["graph", "loops"], [{"first_node_index": 1, "node_count": 5, "trip_count": 2}]),
        "$.graph.loops[0].node_count",
        "loop covers nodes up to 5",
    ),
    (
        "overlapping loops",
        _set(
            ["graph", "loops"],
            [
                {"first_node_index": 1, "node_count": 2, "trip_count": 2},
                {"first_node_index": 0, "node_count": 2, "trip_count": 2},
            ],
        ),
        "$.graph.loops[0].first_node_index",
        "loops overlap",
    ),
    (
        "dangling slot",
        _set(["artifact_plan", "kernels", 0, "input_slot_ids"], [1, 5]),
        "$.artifact_plan.kernels[0].input_slot_ids[1]",
        "input slot 5 is not a slot",
    ),
    (
        "duplicate slot",
        _append(["artifact_plan", "slots"], {"slot_id": 1}),
        "$.artifact_plan.slots[2].slot_id",
        "duplicate slot_id 1",
    ),
    (
        "too many launch arguments",
        _set(["artifact_plan", "kernels", 0, "input_slot_ids"], [1] * 32),
        "$.artifact_plan.kernels[0].input_slot_ids",
        "33 buffers, more than 32",
    ),
    (
        "too many scalars",
        _set(
            ["artifact_plan", "kernels", 0, "static_arguments"], [{"type": "u32", "value": 1}] * 33
        ),
        "$.artifact_plan.kernels[0].static_arguments",
        "33 scalars, more than 32",
    ),
    (
        "fill pattern beyond u32",
        _set(["artifact_plan", "kernels", 0, "output_fill_pattern"], 2**32),
        "$.artifact_plan.kernels[0].output_fill_pattern",
        "<= 4294967295",
    ),
    (
        "trip count beyond u32",
        _set(["graph", "loops"], [{"first_node_index": 0, "node_count": 1, "trip_count": 2**32}]),
        "$.graph.loops[0].trip_count",
        "<= 4294967295",
    ),
]


@pytest.mark.parametrize(
    ("mutation", "path", "message"),
    [case[1:] for case in BAD_PIPELINES],
    ids=[case[0] for case in BAD_PIPELINES],
)
def test_bad_pipelines_fail_naming_the_field(mutation: Mutation, path: str, message: str) -> None:
    _check_rejected(_seed_document(), mutation, path, message)


@pytest.mark.parametrize(
    ("mutation", "path", "message"),
    [case[1:] for case in BAD_GRAPHS],
    ids=[case[0] for case in BAD_GRAPHS],
)
def test_bad_graphs_fail_naming_the_field(mutation: Mutation, path: str, message: str) -> None:
    _check_rejected(_graph_document(), mutation, path, message)


def _check_rejected(document: dict[str, Any], mutation: Mutation, path: str, message: str) -> None:
    p.decode_json(json.dumps(document), p.PlanDocument)  # the base document is valid
    mutation(document)
    encoded = json.dumps(document)
    decoders: list[Callable[[], object]] = [
        lambda: p.decode_json(encoded, p.PlanDocument),
        lambda: p.decode_msgpack(msgspec.msgpack.encode(document), p.PlanDocument),
    ]
    for decode in decoders:
        with pytest.raises(accy.PlanError) as caught:
            decode()
        assert caught.value.path == path, str(caught.value)
        assert message in caught.value.message, str(caught.value)
        assert str(caught.value).endswith(f"- at `{path}`")


def test_malformed_json_is_a_plan_error() -> None:
    with pytest.raises(accy.PlanError, match="malformed JSON") as caught:
        p.decode_json(b'{"kind": "pipeline",', p.PlanDocument)
    assert caught.value.path == "$"
    assert isinstance(caught.value.__cause__, msgspec.DecodeError)


def test_structs_built_in_python_are_checked_once_by_validate_plan() -> None:
    bad = p.KernelCallPipeline(
        target="t",
        version=1,
        operand_count=-4,
        stages=(p.PipelineStage(target="s", version=1, buffers=()),),
    )
    with pytest.raises(accy.PlanError) as caught:
        p.validate_plan(bad)
    assert caught.value.path == "$.operand_count"
    assert p.validate_plan(SEED_PIPELINE) is SEED_PIPELINE


def test_semantic_errors_raised_in_python_carry_paths() -> None:
    with pytest.raises(accy.PlanError) as caught:
        p.KernelCallPipeline(
            target="t",
            version=1,
            operand_count=1,
            stages=(p.PipelineStage(target="s", version=1, buffers=(p.Operand(0), p.Operand(1))),),
        )
    assert caught.value.path == "$.stages[0].buffers[1].index"
    assert isinstance(caught.value, ValueError)


def test_scalar_helper_checks_ranges() -> None:
    assert p.scalar("u32", 7) == p.U32(7)
    with pytest.raises(accy.PlanError) as caught:
        p.scalar("u32", -1)
    assert caught.value.path == "$.value"
    with pytest.raises(accy.PlanError):
        p.scalar("i32", 2**31)
    with pytest.raises(accy.PlanError, match="not finite"):
        p.scalar("f64", float("nan"))


def test_schema_names_every_plan_document_kind() -> None:
    schema = p.json_schema()
    assert {"PipelineDocument", "LaunchGraphDocument"} <= set(schema["$defs"])
    jsonschema.validate(_seed_document(), schema)
    bad = _seed_document()
    bad["pipeline"]["operand_count"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: p.U32(1e6), "not an int"),  # type: ignore[arg-type]
        (lambda: p.U32(-1), "outside"),
        (lambda: p.U32(2**32), "outside"),
        (lambda: p.I32(2**31), "outside"),
        (lambda: p.I64(True), "not an int"),
        (lambda: p.U64(2**64), "outside"),
        (lambda: p.F32("1"), "not a float"),  # type: ignore[arg-type]
        (lambda: p.F32(1e39), "not a finite float32"),
    ],
)
def test_scalar_constructors_refuse_values_that_do_not_fit(
    make: Callable[[], object], message: str
) -> None:
    with pytest.raises(PlanError, match=message) as caught:
        make()
    assert caught.value.path == "$.value"


def test_plain_numbers_are_typed_by_the_plan() -> None:
    pipeline = library.prefix_sum(p.DType.F32, 256).pipeline
    assert pipeline.validate_runtime_scalar_arguments([1000]) == (p.U32(1000),)
    with pytest.raises(accy.LaunchArgumentMismatch, match="runtime scalar argument 0") as caught:
        pipeline.validate_runtime_scalar_arguments([-1])
    assert caught.value.path == "$.runtime_scalar_arguments[0]"


def test_an_entry_built_with_a_plain_string_payload_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match="needs a 'text' payload, got a str") as caught:
        p.RegistryEntry(
            target="t",
            version=1,
            format=p.ArtifactFormat.CUDA_SOURCE,
            entry_name="k",
            argument_count=1,
            runtime_scalar_argument_count=0,
            payload="extern C __global__ void k() {}",  # type: ignore[arg-type]
            launch=p.FixedLaunch(geometry=p.LaunchGeometry()),
        )
    assert caught.value.path == "$.payload"
