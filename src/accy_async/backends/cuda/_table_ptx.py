"""A kernel's argument-table variant, made from its PTX: arguments read from device memory.

A device graph launched with new arguments would otherwise patch every kernel
node through the driver (``cuGraphExecKernelNodeSetParams``, about as costly
as a launch). A node of a table variant instead takes one fixed argument, the
address of its arguments in a device-resident table, and reads the kernel's
real arguments from there: a graph launch with new arguments is then one copy
of the whole table, stream-ordered before the graph.

:func:`table_variant` copies a kernel's ``.entry`` under a new name, with one
``.param .u64`` and every ``ld.param`` of the original parameters rewritten to
a load from the table (argument ``i`` at byte ``8 * i``, the 8-byte slots the
CUDA backend packs arguments into, little-endian). It refuses, with the
reason, a kernel whose parameters are not scalars of at most 8 bytes, that
uses a parameter other than by loading it (taking its address, say), or whose
module declares variables of its own (``__device__`` or ``__constant__``: the
variant's module would hold a second copy of them): those nodes stay patched
by the driver.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "TABLE_SUFFIX",
    "NoTableVariant",
    "TableVariant",
    "declares_module_variables",
    "table_variant",
]

TABLE_SUFFIX: Final = "__accy_table"
"""Appended to a kernel's name to name its table variant."""

_SLOT_BYTES: Final = 8
_SCALAR_TYPES: Final = frozenset(
    f"{kind}{bits}" for kind in "usbf" for bits in (8, 16, 32, 64) if (kind, bits) != ("f", 8)
)
_ENTRY: Final = r"(?P<head>(?:\.(?:visible|weak)\s+)?\.entry\s+)(?P<name>{name})\s*\("
_PARAMETER: Final = re.compile(
    r"^\s*\.param\s+\.(?P<type>[a-z]\d+)(?:\s+\.ptr(?:\s+\.(?:global|const|shared|local))?"
    r"(?:\s+\.align\s+\d+)?)?\s+(?P<name>[A-Za-z_$%][\w$]*)\s*$"
)
_TABLE_REGISTER: Final = "%accy_table"
_MODULE_VARIABLE: Final = re.compile(
    r"^\s*(?:\.(?:visible|extern|weak|common)\s+)*\.(?:global|const)\s", re.MULTILINE
)


def declares_module_variables(ptx: str) -> bool:
    """Whether the module ``ptx`` declares ``.global`` or ``.const`` variables of its own."""
    return _MODULE_VARIABLE.search(ptx) is not None


class NoTableVariant(Exception):
    """The kernel's PTX cannot be given a table variant; the message says why."""


@dataclass(frozen=True, slots=True)
class TableVariant:
    """``ptx`` (the original module with the variant appended) and the variant's ``name``."""

    ptx: str
    name: str


def table_variant(ptx: str, kernel_name: str, argument_count: int) -> TableVariant:
    """The module ``ptx`` with a table variant of ``kernel_name`` appended.

    ``argument_count`` is how many arguments the plan passes; a kernel whose
    PTX declares another number is refused (:class:`NoTableVariant`).
    """
    match = re.search(_ENTRY.format(name=re.escape(kernel_name)), ptx)
    if match is None:
        raise NoTableVariant(f"the PTX has no entry named {kernel_name!r}")
    variable = _MODULE_VARIABLE.search(ptx)
    if variable is not None:  # .global and .const variables live at module scope only
        line = ptx[variable.start() : ptx.find("\n", variable.start())].strip()
        raise NoTableVariant(f"the module declares a variable of its own ({line!r})")
    close = ptx.find(")", match.end())
    if close < 0:
        raise NoTableVariant(f"{kernel_name}'s parameter list is not closed")
    declared = [part for part in ptx[match.end() : close].split(",") if part.strip()]
    parameters: list[tuple[str, str]] = []
    for declaration in declared:
        parameter = _PARAMETER.match(declaration)
        if parameter is None or parameter["type"] not in _SCALAR_TYPES:
            raise NoTableVariant(
                f"{kernel_name} takes a parameter that is not a scalar of at most 8 bytes: "
                f"{' '.join(declaration.split())!r}"
            )
        parameters.append((parameter["type"], parameter["name"]))
    if len(parameters) != argument_count:
        raise NoTableVariant(
            f"{kernel_name} declares {len(parameters)} parameters, the plan passes {argument_count}"
        )
    body_start = ptx.find("{", close)
    if body_start < 0:
        raise NoTableVariant(f"{kernel_name} has no body")
    body_end = _closing_brace(ptx, body_start)
    directives = ptx[close + 1 : body_start]
    body = ptx[body_start + 1 : body_end]
    variant_name = kernel_name + TABLE_SUFFIX
    rewritten = _rewrite_loads(body, kernel_name, parameters)
    entry = (
        f"\n.visible .entry {variant_name}(\n\t.param .u64 {variant_name}_param_0\n)"
        f"{directives}{{\n\t.reg .b64 \t{_TABLE_REGISTER}<2>;\n"
        f"\tld.param.u64 \t{_TABLE_REGISTER}0, [{variant_name}_param_0];\n"
        f"\tcvta.to.global.u64 \t{_TABLE_REGISTER}1, {_TABLE_REGISTER}0;\n"
        f"{rewritten}}}\n"
    )
    return TableVariant(ptx.rstrip("\0") + entry, variant_name)


def _closing_brace(ptx: str, opening: int) -> int:
    depth = 0
    for index in range(opening, len(ptx)):
        character = ptx[index]
        if character == "{":
            depth += 1
        elif character == "}":
            depth -= 1
            if depth == 0:
                return index
    raise NoTableVariant("a kernel's body is not closed")


def _rewrite_loads(body: str, kernel_name: str, parameters: list[tuple[str, str]]) -> str:
    """``body`` with each ``ld.param`` of a parameter made a load from its table slot."""
    slots = {name: index * _SLOT_BYTES for index, (_, name) in enumerate(parameters)}
    if not slots:
        return body
    names = "|".join(re.escape(name) for name in slots)
    load = re.compile(
        r"\bld\.param\.(?P<type>[a-z]\d+)(?P<operands>\s+[^,;{]+,\s*)"
        rf"\[(?P<name>{names})(?:\s*\+\s*(?P<offset>\d+))?\]"
    )

    def to_table(found: re.Match[str]) -> str:
        offset = slots[found["name"]] + int(found["offset"] or 0)
        return f"ld.global.nc.{found['type']}{found['operands']}[{_TABLE_REGISTER}1+{offset}]"

    rewritten = load.sub(to_table, body)
    if re.search(rf"\b(?:{names})\b", rewritten):
        raise NoTableVariant(
            f"{kernel_name} uses a parameter other than by loading it (its address, say)"
        )
    return rewritten
