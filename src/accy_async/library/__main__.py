"""Regenerate the shipped plan files from their builders: ``python -m accy_async.library``."""

from __future__ import annotations

from pathlib import Path

import msgspec

from ..plan import encode_json
from . import BUILTIN_PLANS, builtin_document


def main() -> None:
    """Write every built-in plan to ``accy_async/library/plans/NAME.json``."""
    folder = Path(__file__).parent / "plans"
    for name in BUILTIN_PLANS:
        path = folder / f"{name}.json"
        path.write_bytes(msgspec.json.format(encode_json(builtin_document(name)), indent=2) + b"\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
