"""User-facing errors: each one is a single readable line naming the problem and the fix."""

from __future__ import annotations


class AutoplanError(Exception):
    """A problem with the user's input or request. The CLI prints it as one line and exits 2."""


class MemoryInfeasibleError(AutoplanError):
    """No plan fits the per-device memory budget."""

    def __init__(self, message: str, least_memory_bytes: float) -> None:
        super().__init__(message)
        self.least_memory_bytes = least_memory_bytes

    def __reduce__(self) -> tuple[type[MemoryInfeasibleError], tuple[str, float]]:
        # pickled whole: an exact plan planned in another process returns it as its outcome
        return type(self), (str(self), self.least_memory_bytes)
