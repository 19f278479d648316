"""Validation problems and the error that carries them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: where (module, tensor), what, and how to fix it."""

    message: str
    module: str | None = None
    tensor: str | None = None
    fix: str | None = None

    def __str__(self) -> str:
        where = self.tensor or self.module
        text = f"{where}: {self.message}" if where else self.message
        return f"{text} (fix: {self.fix})" if self.fix else text


class Exl3FormatError(ValueError):
    """A checkpoint failed validation; `problems` lists every problem found, not just the first."""

    def __init__(self, problems: list[Problem], source: str = "EXL3 checkpoint"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source} is invalid ({len(self.problems)} problem(s)):\n{lines}")
