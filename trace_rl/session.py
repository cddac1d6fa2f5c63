"""Moved to `trace_rl.pipeline.session` on 2026-11-24: this path imports it, with a DeprecationWarning, until the next release."""

import trace_rl.pipeline.session as new
from trace_rl.moved import alias_module

alias_module(__name__, new)
