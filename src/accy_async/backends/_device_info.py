"""What a backend is: its device's identity, its limits, and how its waits spend CPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias, get_args

import msgspec

from ..errors import UnsupportedOperation

__all__ = ["WAIT_POLICIES", "DeviceIdentity", "Limits", "WaitPolicy", "check_wait_policy"]

WaitPolicy: TypeAlias = Literal["latency", "balanced", "frugal"]
"""How a wait trades CPU for latency (see :mod:`accy_async.waiting`).

``latency`` watches from the loop the whole time (it may use a core while it
waits); ``balanced`` (the default) sleeps until shortly before the work is
due and watches from then; ``frugal`` wakes about once a wait, a forecast spread
past the due time (the least CPU, more latency).
"""

WAIT_POLICIES: Final[tuple[WaitPolicy, ...]] = get_args(WaitPolicy)


def check_wait_policy(policy: str) -> None:
    """Raise :class:`UnsupportedOperation` unless ``policy`` is one of :data:`WAIT_POLICIES`."""
    if policy not in WAIT_POLICIES:
        raise UnsupportedOperation(
            f"unknown wait policy {policy!r}; expected one of {', '.join(WAIT_POLICIES)}"
        )


class DeviceIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a measurement on a device depends on; tuning results are keyed by it.

    ``uuid`` tells two devices of one model apart; ``driver`` and ``compiler``
    are the versions that decide the code that runs (driver and NVRTC on CUDA,
    NumPy and Python on the CPU).
    """

    kind: str
    name: str
    uuid: str
    driver: str
    compiler: str


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds checked before anything is allocated.

    ``max_buffer_bytes`` caps one allocation (an intermediate of 2**60 bytes is
    refused with :class:`LimitExceeded` without asking the device);
    ``max_total_bytes`` caps what one backend holds at once.
    """

    max_buffer_bytes: int = 2**40
    max_total_bytes: int = 2**42
