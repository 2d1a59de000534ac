"""Argument-table variants made from PTX: the rewrite, its refusals, and ptxas's verdict.

The variant's loads are checked here on text (and assembled by ``ptxas`` where
the CUDA toolkit is installed); that it runs and computes what the kernel does
is shown on the GPU (``test_graph_exec``, ``test_pipeline_graphs``).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from accy_async.backends.cuda._table_ptx import TABLE_SUFFIX, NoTableVariant, table_variant

# What NVRTC emits for a kernel of three pointers, an unsigned and a float (trimmed), beside
# a second entry that must be left alone.
SAXPY = """
.version 9.0
.target sm_90
.address_size 64

	// .globl	saxpy

.visible .entry saxpy(
	.param .u64 saxpy_param_0,
	.param .u64 saxpy_param_1,
	.param .u64 saxpy_param_2,
	.param .u32 saxpy_param_3,
	.param .f32 saxpy_param_4
)
.maxntid 256, 1, 1
{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<4>;
	.reg .b32 	%r<3>;
	.reg .b64 	%rd<12>;
	// demoted variable
	.shared .align 4 .b8 _ZZ5saxpyE5tile[128];

	ld.param.u64 	%rd1, [saxpy_param_0];
	ld.param.u64 	%rd2, [saxpy_param_1];
	ld.param.u64 	%rd3, [saxpy_param_2];
	ld.param.u32 	%rd4, [saxpy_param_3];
	ld.param.f32 	%f1, [saxpy_param_4];
	mov.u32 	%r1, %tid.x;
	cvt.u64.u32 	%rd5, %r1;
	setp.ge.u64 	%p1, %rd5, %rd4;
	@%p1 bra 	$L__BB0_2;
	{
	cvta.to.global.u64 	%rd6, %rd2;
	cvta.to.global.u64 	%rd7, %rd3;
	cvta.to.global.u64 	%rd8, %rd1;
	}
	shl.b64 	%rd9, %rd5, 2;
	add.s64 	%rd10, %rd6, %rd9;
	ld.global.f32 	%f2, [%rd10];
	add.s64 	%rd11, %rd7, %rd9;
	ld.global.f32 	%f3, [%rd11];
	fma.rn.f32 	%f2, %f2, %f1, %f3;
	add.s64 	%rd11, %rd8, %rd9;
	st.global.f32 	[%rd11], %f2;

$L__BB0_2:
	ret;

}
	// .globl	other
.visible .entry other(
	.param .u64 other_param_0
)
{
	ret;

}
"""


def _entry(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    return ptx[start : ptx.index("\n}\n", start) + 3]


def test_the_variant_takes_one_pointer_and_loads_each_argument_from_its_slot() -> None:
    variant = table_variant(SAXPY, "saxpy", 5)
    assert variant.name == "saxpy" + TABLE_SUFFIX
    assert variant.ptx.startswith(SAXPY)  # the module as it was, the variant appended
    entry = _entry(variant.ptx, variant.name)
    assert f".param .u64 {variant.name}_param_0\n)" in entry
    assert ".maxntid 256, 1, 1" in entry  # the kernel's directives kept
    loads = [line.split(None, 1) for line in entry.splitlines() if "ld.global.nc" in line]
    assert [(op, operands.replace("\t", "")) for op, operands in loads] == [
        ("ld.global.nc.u64", "%rd1, [%accy_table1+0];"),
        ("ld.global.nc.u64", "%rd2, [%accy_table1+8];"),
        ("ld.global.nc.u64", "%rd3, [%accy_table1+16];"),
        ("ld.global.nc.u32", "%rd4, [%accy_table1+24];"),
        ("ld.global.nc.f32", "%f1, [%accy_table1+32];"),
    ]
    assert "saxpy_param" not in entry
    assert entry.count("{") == entry.count("}")  # the nested block came along whole
    assert variant.ptx.count(".entry other(") == 1


def test_an_offset_into_a_parameter_is_kept() -> None:
    ptx = SAXPY.replace(
        "ld.param.u32 \t%rd4, [saxpy_param_3];", "ld.param.u16 \t%rs1, [saxpy_param_3+2];"
    )
    entry = _entry(table_variant(ptx, "saxpy", 5).ptx, "saxpy" + TABLE_SUFFIX)
    assert "ld.global.nc.u16 \t%rs1, [%accy_table1+26];" in entry


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (("ld.param.f32 \t%f1, [saxpy_param_4];", "mov.b64 \t%rd4, saxpy_param_4;"), "other than"),
        ((".param .f32 saxpy_param_4", ".param .align 8 .b8 saxpy_param_4[16]"), "not a scalar"),
        ((".entry saxpy(", ".entry saxpy2("), "no entry named 'saxpy'"),
    ],
)
def test_what_cannot_be_rewritten_is_refused_with_the_reason(
    change: tuple[str, str], reason: str
) -> None:
    with pytest.raises(NoTableVariant, match=reason):
        table_variant(SAXPY.replace(*change), "saxpy", 5)


@pytest.mark.parametrize(
    "declaration", [".global .align 4 .u32 epoch;", ".const .align 4 .b8 coefficients[16];"]
)
def test_a_module_with_variables_of_its_own_is_refused(declaration: str) -> None:
    # The variant's module would hold a second copy of a __device__ or __constant__ variable.
    ptx = SAXPY.replace(".address_size 64\n", f".address_size 64\n{declaration}\n")
    with pytest.raises(NoTableVariant, match="declares a variable of its own"):
        table_variant(ptx, "saxpy", 5)


def test_a_kernel_without_parameters_gets_a_variant_that_ignores_its_table() -> None:
    variant = table_variant(SAXPY, "other", 1)
    bare = SAXPY.replace(".entry other(\n\t.param .u64 other_param_0\n)", ".entry other()")
    entry = _entry(table_variant(bare, "other", 0).ptx, "other" + TABLE_SUFFIX)
    assert "ld.global" not in entry and "ret;" in entry
    assert variant.name == "other" + TABLE_SUFFIX


def test_a_kernel_declaring_another_argument_count_than_the_plan_is_refused() -> None:
    with pytest.raises(NoTableVariant, match="declares 5 parameters, the plan passes 4"):
        table_variant(SAXPY, "saxpy", 4)


def test_a_name_that_only_starts_like_the_kernel_is_not_taken_for_it() -> None:
    with pytest.raises(NoTableVariant, match="no entry named 'sax'"):
        table_variant(SAXPY, "sax", 5)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas (CUDA toolkit) here")
def test_ptxas_assembles_the_variants_of_the_built_in_kernels(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc here")
    sources = Path(__file__).parents[1] / "src" / "accy_async" / "library" / "cuda"
    kernels = {
        "saxpy.cu": [("saxpy", 5)],
        "reduce.cu": [("partial_sum", 3), ("final_sum", 3)],
        "scan.cu": [("block_scan", 4)],
        "lookback_scan.cu": [("scan_init", 3), ("scan_tiles", 5)],
    }
    for source, entries in kernels.items():
        ptx_file = tmp_path / (source + ".ptx")
        subprocess.run(
            [nvcc, "-arch=compute_90", "-ptx", "-DACCY_ITEMS=4", f"-I{sources}",
             str(sources / source), "-o", str(ptx_file)],
            check=True, capture_output=True,
        )  # fmt: skip
        ptx = ptx_file.read_text()
        for name, count in entries:
            variant_file = tmp_path / f"{name}.ptx"
            variant_file.write_text(table_variant(ptx, name, count).ptx)
            assembled = subprocess.run(
                ["ptxas", "-arch=sm_90", str(variant_file), "-o", str(tmp_path / "out.cubin")],
                capture_output=True,
                text=True,
            )
            assert assembled.returncode == 0, (name, assembled.stderr)
