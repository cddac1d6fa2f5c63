"""Held-out evaluation of a step's weights (`[eval]`, docs/eval.md) and its pass@k estimators."""
