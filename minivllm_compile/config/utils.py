"""What vLLM keeps in vllm/config/utils.py that this project needs: `Range`, the inclusive range of
token counts a compiled entry serves (vLLM's compile ranges and compile sizes are both Ranges)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """An inclusive range of num_tokens, [start, end]."""

    start: int
    end: int

    def __post_init__(self):
        if not 1 <= self.start <= self.end:
            raise ValueError(f"Range needs 1 <= start <= end, got Range({self.start}, {self.end})")

    def is_single_size(self) -> bool:
        return self.start == self.end

    def __contains__(self, size: int) -> bool:
        return self.start <= size <= self.end

    def __repr__(self) -> str:
        return f"Range({self.start}, {self.end})"
