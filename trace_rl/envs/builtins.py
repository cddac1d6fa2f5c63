"""Imports every builtin environment so that each registers its id."""

from trace_rl.envs import alphabet_sort, dataset, gym, link_nav, number_debate, reverse_text  # noqa: F401
