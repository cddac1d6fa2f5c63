"""Dense similarity scores in [0, 1] for string and list answers."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


def similarity(answer: str | Sequence[str], target: str | Sequence[str]) -> float:
    """difflib's ratio 2*M/T (M: matched elements, T: total elements of both); 1.0 when both are empty."""
    if not answer and not target:
        return 1.0
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()
