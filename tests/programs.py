"""Worker programs for transport tests; imported by worker processes, so no torch here."""

from __future__ import annotations

from typing import Any


class PaddedProgram:
    """Runs ``program``, carrying ``pad_bytes`` of ballast: a program larger than any
    pipe holds (Linux caps a pipe at 1 MiB by default)."""

    def __init__(self, program: Any, pad_bytes: int) -> None:
        self.program = program
        self.ballast = b"\0" * pad_bytes

    def __call__(self, end: Any) -> None:
        self.program(end)
