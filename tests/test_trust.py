"""Trusting plans: CUDA payloads by digest, compile options by allowlist, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

import accy_async as accy
from accy_async import cli, library
from accy_async import plan as p
from accy_async.pipeline import load_pipeline_artifacts
from accy_async.trust import (
    TrustPolicy,
    builtin_digests,
    document_digests,
    kernel_digest,
    read_trust_file,
    registry_digests,
)

from .conftest import needs_gpu
from .plans import with_payloads

CUDA = p.ArtifactFormat.CUDA_SOURCE


def changed_document() -> p.PipelineDocument:
    """The built-in f32 prefix sum with one more line in each CUDA source: not trusted."""

    def mine(entry: p.RegistryEntry) -> p.Payload | None:
        if isinstance(entry.payload, p.TextPayload):
            return p.TextPayload(entry.payload.text + "\n// mine\n")
        return None

    return with_payloads(library.load_builtin("prefix_sum_f32"), mine)


def test_digests_cover_what_runs_and_how_it_is_called() -> None:
    entry = next(e for e in library.load_builtin("saxpy_f32").registry.entries if e.format is CUDA)
    spec = entry.artifact_spec()
    digest = kernel_digest(spec)
    assert digest is not None and digest.startswith("sha256:") and len(digest) == 71
    assert kernel_digest(spec) == digest
    for changed in (
        msgspec.structs.replace(spec, kernel_name="other"),
        msgspec.structs.replace(spec, compile_options=(*spec.compile_options, "-DX=1")),
        # A macro named like the kernel rewrites it: another kernel, whatever the source.
        msgspec.structs.replace(
            spec,
            compile_options=(
                "-Dsaxpy=saxpy(unsigned long long a, unsigned long long v)"
                "{*(unsigned long long*)a = v;} __device__ void decoy",
            ),
        ),
        # A scalar where a buffer goes would be an address of the plan's choosing.
        msgspec.structs.replace(spec, scalar_argument_count=spec.argument_count),
    ):
        assert kernel_digest(changed) != digest
        assert not TrustPolicy.builtin().allows(changed)
    cpu_entry = next(
        e
        for e in library.load_builtin("saxpy_f32").registry.entries
        if e.format is p.ArtifactFormat.CPU
    )
    assert kernel_digest(cpu_entry.artifact_spec()) is None


def test_the_builtin_policy_trusts_every_shipped_kernel_and_no_other() -> None:
    policy = TrustPolicy.builtin()
    for name in library.BUILTIN_PLANS:
        policy.check_registry(library.load_builtin(name).registry)
    changed = changed_document()
    with pytest.raises(accy.UntrustedKernel, match="is not trusted") as caught:
        policy.check_registry(changed.registry)
    assert caught.value.path == "$.registry.entries[1]"
    trusted = policy.extended(digest for _, digest in registry_digests(changed.registry))
    trusted.check_registry(changed.registry)
    assert len(builtin_digests()) >= 5


async def test_a_backend_with_a_policy_refuses_untrusted_kernels_before_creating_them(
    recording: accy.RecordingBackend,
) -> None:
    changed = changed_document()
    recording.trust_policy = TrustPolicy.builtin()
    before = dict(recording.live_objects())
    with pytest.raises(accy.UntrustedKernel):
        await load_pipeline_artifacts(recording, changed.pipeline, changed.registry, CUDA)
    assert dict(recording.live_objects()) == before
    builtin = library.load_builtin("prefix_sum_f32")
    async with await load_pipeline_artifacts(recording, builtin.pipeline, builtin.registry, CUDA):
        pass
    recording.trust_policy = recording.trust_policy.extended(
        digest for _, digest in registry_digests(changed.registry)
    )
    async with await load_pipeline_artifacts(recording, changed.pipeline, changed.registry, CUDA):
        pass
    # CPU kernels are named, never shipped: always allowed.
    recording.trust_policy = TrustPolicy()
    saxpy = library.load_builtin("saxpy_f32")
    cpu_spec = next(e for e in saxpy.registry.entries if e.format is p.ArtifactFormat.CPU)
    assert recording.trust_policy.allows(cpu_spec.artifact_spec())


def test_every_candidate_of_the_builtin_tuning_is_trusted() -> None:
    from accy_async.library.tuning import tuning_document

    trusted = builtin_digests()
    for dtype in (p.DType.F32, p.DType.F64):
        rows = document_digests(tuning_document(CUDA, 4096, dtype))
        assert rows
        assert all(digest in trusted for digest, _, _ in rows)


def _tampered(problem: p.KernelTuningProblem) -> p.KernelTuningProblem:
    """A built-in tuning problem whose kernel source gained a comment: no longer trusted."""
    artifact = problem.artifact
    assert isinstance(artifact.payload, p.TextPayload)
    text = artifact.payload.text + "\n// mine\n"
    payload = msgspec.structs.replace(artifact, payload=p.TextPayload(text))
    return msgspec.structs.replace(problem, artifact=payload)


async def test_tuning_an_untrusted_kernel_is_refused_not_recorded_as_failed(
    recording: accy.RecordingBackend,
) -> None:
    from accy_async.library.tuning import tuning_document
    from accy_async.tuning import Tuner

    document = tuning_document(CUDA, 4096)
    tampered = _tampered(document.kernels[0])
    recording.trust_policy = TrustPolicy.builtin()
    async with Tuner(recording) as tuner:
        with pytest.raises(accy.UntrustedKernel, match="not trusted"):
            await tuner.tune(tampered)


def test_trust_files_hold_digests_and_comments(tmp_path: Path) -> None:
    digest = next(iter(builtin_digests()))
    good = tmp_path / "trusted"
    good.write_text(f"# my kernels\n\n{digest}  prefix_sum  # from digests\n")
    assert read_trust_file(good) == {digest}
    bad = tmp_path / "bad"
    bad.write_text(f"{digest}\nsha256:1234\n")
    with pytest.raises(ValueError, match=r"bad:2: 'sha256:1234' is not a sha256"):
        read_trust_file(bad)
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="binary: not a text file"):
        read_trust_file(binary)


@pytest.mark.parametrize(
    "option",
    [
        "-I/etc",
        "--include-path=/etc",
        "-include",
        "--pre-include=/etc/passwd",
        "-arch=sm_90",
        "--gpu-architecture=compute_90",
        "-DX=1\n#include </etc/passwd>",
        "--dopt=maybe",
        "-O9",
    ],
)
def test_compile_options_that_could_read_the_host_are_refused(option: str) -> None:
    entry = library.load_builtin("saxpy_f32").registry.entries[0]
    with pytest.raises(accy.PlanError, match="is not allowed in a plan") as caught:
        msgspec.structs.replace(entry, compile_options=("-DOK=1", option))
    assert caught.value.path is not None and caught.value.path.endswith("compile_options[1]")
    with pytest.raises(accy.PlanError, match="is not allowed in a plan"):
        p.TuningCandidate(
            launch=p.FixedLaunch(geometry=p.LaunchGeometry(grid=(1, 1, 1), block=(1, 1, 1))),
            compile_options=(option,),
        )


def test_ordinary_compile_options_are_allowed() -> None:
    entry = library.load_builtin("saxpy_f32").registry.entries[0]
    options = (
        "-DACCY_T=float",
        "-DFLAG",
        "-UNDEBUG",
        "--use_fast_math",
        "-lineinfo",
        "--std=c++17",
        "-ftz=true",
        "--fmad=false",
        "--maxrregcount=32",
        "-O3",
        "--restrict",
        "-G",
    )
    assert msgspec.structs.replace(entry, compile_options=options).compile_options == options


def test_a_plan_file_with_a_bad_option_is_refused_with_its_path(tmp_path: Path) -> None:
    document = json.loads(p.encode_json(library.load_builtin("saxpy_f32")))
    document["registry"]["entries"][1]["compile_options"] = ["-I/home"]
    with pytest.raises(accy.PlanError, match="-I/home") as caught:
        p.decode_json(json.dumps(document).encode(), p.PipelineDocument)
    assert "registry.entries[1]" in (caught.value.path or "")


def test_the_command_line_prints_digests_and_reads_trust_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changed = tmp_path / "changed.json"
    changed.write_bytes(p.encode_json(changed_document()))
    assert cli.main(["digests", "prefix_sum_f32", str(changed)]) == 0
    lines = capsys.readouterr().out.splitlines()
    kernels = sum(e.format is CUDA for e in library.load_builtin("prefix_sum_f32").registry.entries)
    assert len(lines) == 2 * kernels  # each CUDA kernel of the built-in plan, then of the file
    assert all(line.startswith("sha256:") for line in lines)
    assert f"{changed}  $.registry.entries[1]" in lines[kernels]
    tuning = tmp_path / "tuning.json"
    from accy_async.library.tuning import tuning_document

    tuning.write_bytes(p.encode_json(tuning_document(CUDA, 4096)))
    assert cli.main(["digests", str(tuning)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert any("$.kernels[0].candidates[0]" in row for row in rows)
    assert all(row.split()[0] in builtin_digests() for row in rows)
    bad = tmp_path / "bad"
    bad.write_text("not-a-digest\n")
    status = cli.main(
        ["run", str(changed), "--backend", "cpu", "--scalar", "n=8", "--quiet",
         "--out", str(tmp_path / "o"), "--trust-file", str(bad)]
    )  # fmt: skip
    assert status == 2
    assert "not a sha256" in capsys.readouterr().err
    # On the CPU backend a plan's CUDA kernels are never compiled: nothing to refuse.
    status = cli.main(
        ["run", str(changed), "--backend", "cpu", "--scalar", "n=8", "--quiet",
         "--out", str(tmp_path / "o")]
    )  # fmt: skip
    assert status == 0


@pytest.mark.gpu
@needs_gpu
def test_the_command_line_compiles_untrusted_cuda_only_with_trust(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    changed = tmp_path / "changed.json"
    changed.write_bytes(p.encode_json(changed_document()))
    common = ["run", str(changed), "--backend", "cuda", "--scalar", "n=1000", "--quiet"]
    assert cli.main([*common, "--out", str(tmp_path / "a")]) == 2
    error = capsys.readouterr().err
    assert "UntrustedKernel" in error and "--trust" in error and "digests" in error
    assert not (tmp_path / "a").exists()
    trust_file = tmp_path / "trusted"
    digests = [digest for _, digest in registry_digests(changed_document().registry)]
    trust_file.write_text("\n".join(digests) + "\n")
    assert cli.main([*common, "--out", str(tmp_path / "b"), "--trust-file", str(trust_file)]) == 0
    assert cli.main([*common, "--out", str(tmp_path / "c"), "--trust"]) == 0
    assert cli.main(["run", "prefix_sum_f32", "--backend", "cuda", "--scalar", "n=1000",
                     "--quiet", "--out", str(tmp_path / "d")]) == 0  # fmt: skip


def test_tune_explains_a_refusal_raised_inside_its_task_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuner's task group wraps the refusal in a group: the hint must still be given."""
    from accy_async import tune_command
    from accy_async.library.tuning import tuning_document

    document = tuning_document(CUDA, 4096)
    tampered = _tampered(document.kernels[0])
    plan = tmp_path / "tuning.json"
    plan.write_bytes(p.encode_json(msgspec.structs.replace(document, kernels=(tampered,))))
    # A backend that takes CUDA C without a GPU: the refusal comes before anything compiles.
    monkeypatch.setattr(tune_command, "open_backend", lambda kind: accy.open_backend("recording"))
    status = cli.main(["tune", str(plan), "--sequential", "--quiet", "--no-cache"])
    assert status == 2
    error = capsys.readouterr().err
    assert "UntrustedKernel" in error and "--trust" in error and "digests" in error
