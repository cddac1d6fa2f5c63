"""Rewards of a completion against a reference answer, for the `dataset` env (docs/envs.md).

- `exact`: 1 when the completion equals the answer, whitespace runs collapsed and ends stripped;
- `numeric`: 1 when the last number in the completion (`1,234.5`, `-3`, `2/3`, `1e-3`) equals the
  answer's number within a relative tolerance of 1e-6;
- `math`: 1 when `math-verify` finds the completion's final answer (a `\\boxed{}` answer, LaTeX, a
  fraction, an expression) mathematically equal to the answer;
- `package.module:function`: your own `function(completion: str, answer: str) -> float`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
from collections.abc import Callable
from fractions import Fraction

from trace_rl.envs.base import EnvError, import_named

Reward = Callable[[str, str], float]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def normalize(text: str) -> str:
    return " ".join(text.split())


def exact_match(completion: str, answer: str) -> float:
    return float(normalize(completion) == normalize(answer))


def parse_number(text: str) -> float | None:
    """The number `text` spells (`1,234`, `-2.5`, `3/4`), else None."""
    cleaned = text.replace(",", "").replace(" ", "")
    try:
        return float(Fraction(cleaned)) if "/" in cleaned else float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def numeric_match(completion: str, answer: str) -> float:
    expected = parse_number(answer.strip())
    if expected is None:
        expected = last_number(answer)
    got = last_number(completion)
    if expected is None or got is None:
        return 0.0
    return float(math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9))


class _NoTimeoutNotice(logging.Filter):
    """math-verify's timeouts use SIGALRM, which works only on the main thread, and rollouts run on others:
    they are off, and its notice that they are is dropped (it would come once per call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def math_match(completion: str, answer: str) -> float:
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTimeoutNotice) for f in logger.filters):
            logger.addFilter(_NoTimeoutNotice())
    gold = parse(answer, parsing_timeout=None) or parse(f"${answer}$", parsing_timeout=None)
    if not gold:
        return 0.0
    predicted = parse(completion, parsing_timeout=None)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=None))


REWARDS: dict[str, Reward] = {"exact": exact_match, "numeric": numeric_match, "math": math_match}


def load_reward(spec: str) -> Reward:
    """A builtin reward by name, or a function by its import path `package.module:function`."""
    if spec in REWARDS:
        if spec == "math" and importlib.util.find_spec("math_verify") is None:
            raise EnvError("reward 'math' needs the math-verify package; pip install 'trace-rl[math]'")
        return REWARDS[spec]
    if ":" not in spec:
        raise EnvError(f"unknown reward {spec!r}; use one of {', '.join(REWARDS)} or 'package.module:function'")
    function = import_named(spec, "reward")
    if not callable(function):
        raise EnvError(f"reward {spec!r} is not a function")
    return function
