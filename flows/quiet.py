"""A quiet terminal by default: progress, warnings and errors; `--verbose` shows every log line.

- `--verbose` shows the library's own INFO lines too (`trace_rl.*` loggers: a model converted, a run resumed,
  the KV cache an engine took), which the root logger's WARNING level would drop;
- the lines trace-rl prints itself (the progress line of each step) go to the flow run's log too, marked
  `extra=PRINTED`: Prefect's console skips them, so the terminal shows each once, also with `--verbose`;

- Prefect's console shows its warnings and errors only (the UI keeps every log line), and not the failure
  reports of task and flow runs (flows/cli.py): the command's last line names the failure;
- vLLM shows no INFO lines and none of the warnings known to be harmless (inference/vllm_logging.py);
- transformers draws no progress bar per step for loading and writing weights (Hub downloads keep theirs);
- the vLLM engines stop in order before the process exits (vLLM's own exit handler warns that the engine
  "exited unexpectedly").

Settings the user made in the environment win.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from trace_rl.inference.vllm_logging import VERBOSE_ENV, verbose

# vLLM touches a deprecated torch attribute while it imports, in this process and in each one it spawns
REDUCE_OP = "`torch.distributed.reduce_op` is deprecated"
PRINTED_FLAG = "trace_rl_printed"
PRINTED = {PRINTED_FLAG: True}  # a log record's `extra`: trace-rl prints this line on the terminal itself


class PrintedLines(logging.Filter):
    """Drops the records marked PRINTED (for Prefect's console handler)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, PRINTED_FLAG, False)


def prefect_console_skips_printed_lines() -> None:
    """Prefect's console handlers (of this process's logging set-up) leave the lines marked PRINTED to trace-rl."""
    from prefect.logging.handlers import PrefectConsoleHandler

    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(isinstance(f, PrintedLines) for f in handler.filters):
            handler.addFilter(PrintedLines())


def by_default(verbose_flag: bool) -> None:
    """Set up this process (and the ones it starts) for a quiet terminal, or for every line with --verbose."""
    if verbose_flag:
        os.environ[VERBOSE_ENV] = "1"
        logging.getLogger("trace_rl").setLevel(logging.INFO)  # the library's INFO lines (the root logger's WARNING)
        return
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    warnings.filterwarnings("ignore", message=REDUCE_OP, category=FutureWarning)
    os.environ.setdefault("PYTHONWARNINGS", f"ignore:{REDUCE_OP}:FutureWarning")


def progress_bars() -> None:
    """No transformers progress bars for the weights it loads and writes each step; Hub downloads keep theirs."""
    if verbose():
        return
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    enable_progress_bars()


def stop_engines() -> None:
    """Stop this process's vLLM engines and torchrun trainer workers (if any started) before it exits."""
    if "trace_rl.inference.vllm_engine" in sys.modules:
        from trace_rl.inference.vllm_engine import shutdown_engines

        shutdown_engines()
    if "trace_rl.trainer.launcher" in sys.modules:
        from trace_rl.trainer.launcher import stop_all

        stop_all()
