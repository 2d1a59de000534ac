"""Whether a backend can still be used: one object, shared with the backend's parts.

A backend is open, poisoned by a sticky device fault, or closed (a poisoned
backend may be closed too). :attr:`Health.refusal` is the one field the hot
paths read: ``None`` while calls may go on.
"""

from __future__ import annotations

from typing import NoReturn

from ..errors import AccyError, BackendClosed, DeviceFault

__all__ = ["Health"]


class Health:
    """A backend's state: its fault, whether it is closed, and what every call now raises."""

    __slots__ = ("closed", "fault", "kind", "refusal")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fault: DeviceFault | None = None
        """The sticky fault that poisoned the backend, if any."""
        self.closed = False
        """Whether the backend has closed."""
        self.refusal: AccyError | None = None
        """What calls raise once the backend is poisoned or closed; ``None`` while open."""

    def poison(self, fault: DeviceFault) -> bool:
        """Remember the first sticky fault; whether this one was it."""
        if self.fault is not None:
            return False
        self.fault = fault
        self.refusal = fault
        return True

    def close(self) -> None:
        """The backend is closed; a fault, if any, stays what calls raise."""
        self.closed = True
        if self.refusal is None:
            self.refusal = BackendClosed(f"the {self.kind} backend is closed")

    def check(self) -> None:
        """Raise if the backend may no longer be used."""
        if self.refusal is not None:
            self.refuse()

    def refuse(self) -> NoReturn:
        """Raise a fresh error saying why the backend may no longer be used."""
        error = self.refusal
        assert error is not None
        if isinstance(error, DeviceFault):
            raise DeviceFault(
                f"the {self.kind} backend is poisoned by an earlier device fault and runs "
                f"nothing more (open a new backend): {error.message}"
            ) from error
        raise BackendClosed(error.message)
