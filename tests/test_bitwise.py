"""tests/bitwise.py: a failed bitwise comparison of weights names the tensors that differ, in one short line."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save

from tests.bitwise import difference


def test_weights_that_differ_are_named_with_how_many_values_and_by_how_much():
    weights = {"a.weight": np.ones((4, 8), np.float32), "b.bias": np.zeros(8, np.float32)}
    other = {name: value.copy() for name, value in weights.items()}
    other["b.bias"][[1, 5]] = [2.5e-7, -1e-3]
    assert difference(save(weights), save(weights)) is None
    why = difference(save(weights), save(other))
    assert why == "1 of 2 tensors differ: b.bias in 2 of 8 values (by up to 0.001)"
    other["c"] = np.zeros(1, np.float32)
    assert difference(save(weights), save(other)) == "other tensors: ['c']"


def test_other_files_say_their_sizes_and_first_differing_byte():
    assert difference(b"PAR1abc", b"PAR1abd") == "7 against 7 bytes, the first difference at byte 6"
    assert difference(b"PAR1", b"PAR1x") == "4 against 5 bytes, the first difference at byte 4"
