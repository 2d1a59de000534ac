"""What a fresh interpreter loads when it imports some modules: for tests of import costs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence


def modules_loaded(
    imports: Sequence[str], prefixes: Sequence[str], *, already: Sequence[str] = ()
) -> list[str]:
    """The modules whose names start with one of ``prefixes`` that importing ``imports`` loads.

    Runs in a new interpreter; what importing ``already`` loaded first does not count.
    """
    code = (
        "import importlib, json, sys\n"
        f"for name in {list(already)!r}:\n"
        "    importlib.import_module(name)\n"
        "before = set(sys.modules)\n"
        f"for name in {list(imports)!r}:\n"
        "    importlib.import_module(name)\n"
        f"new = [m for m in set(sys.modules) - before if m.startswith({tuple(prefixes)!r})]\n"
        "print(json.dumps(sorted(new)))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    loaded: list[str] = json.loads(found)
    return loaded
