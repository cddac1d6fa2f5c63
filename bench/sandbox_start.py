"""What a sandbox costs a rollout: verifiers' runtime lifecycle (start, one program, stop) in the sandbox runtime
(`trace_rl.sandbox.runtime.BwrapRuntime`) against the host's subprocess runtime, interleaved round by round so
that both sides see the same load. `python -m bench.sandbox_start [--rounds N]` prints the median and mean of each
side's wall time per rollout for three programs (`true`, `python -c pass`, `python solution.py` with a one-line
answer, as code_golf runs it, with this environment's Python) and the machine's load average.
docs/sandbox.md#cost has the results."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

# the same interpreter on both sides: `python3` on the host's PATH may be another program (a pyenv shim, a
# shell script, costs about 0.1 s more), while the sandbox's PATH starts with this environment's bin folder
PROGRAMS = {
    "true": ["true"],
    "python -c pass": [sys.executable, "-c", "pass"],
    "python solution.py": [sys.executable, "solution.py"],
}
SOLUTION = b"print(sum(range(10)))\n"


async def rollout(make, argv: list[str]) -> float:
    """Seconds for one rollout's runtime: start, write the answer, run the program, stop."""
    started = time.perf_counter()
    runtime = make()
    await runtime.start()
    try:
        await runtime.write("solution.py", SOLUTION)
        result = await runtime.run(argv, {})
        assert result.exit_code == 0, result.stderr
    finally:
        await runtime.stop()
    return time.perf_counter() - started


async def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime

    from trace_rl.sandbox import SandboxConfig
    from trace_rl.sandbox.runtime import BwrapConfig, BwrapRuntime

    sides = {"host (subprocess)": lambda: SubprocessRuntime(SubprocessConfig()),
             "sandbox (bwrap)": lambda: BwrapRuntime(BwrapConfig.of(SandboxConfig()))}
    times = {name: {side: [] for side in sides} for name in PROGRAMS}
    for name, argv in PROGRAMS.items():
        for side, make in sides.items():  # warm-up: page cache, imports
            await rollout(make, argv)
        for _ in range(rounds):
            for side, make in sides.items():
                times[name][side].append(await rollout(make, argv))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    load_before = os.getloadavg()
    times = asyncio.run(measure(args.rounds))
    load_after = os.getloadavg()
    print(f"{args.rounds} rounds, interleaved; load average (1, 5, 15 min) before {load_before}, after {load_after}")
    print("| program | side | median ms | mean ms |")
    print("|---|---|---|---|")
    for name, sides in times.items():
        for side, values in sides.items():
            print(f"| `{name}` | {side} | {statistics.median(values) * 1e3:.1f} | "
                  f"{statistics.mean(values) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
