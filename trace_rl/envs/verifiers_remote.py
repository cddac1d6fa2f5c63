"""The `verifiers` env on a verifiers env server (`[[env]] server = "tcp://HOST:PORT"`, docs/remote.md): the
env server (`verifiers.v1.serve`, ZMQ + msgpack) plays each episode, trace-rl picks the tasks and trains on the
traces.

The tasks are the in-process env's (the taskset, loaded here: its module must import in this process too; the same
seeded `batch_size` tasks a step), and each rollout is one `run` request carrying its task's data, verifiers' train
client config (`vf.TrainClientConfig`) of the actor's vLLM server (its renderer built from the tokenizer this run
loaded: the env server must reach the same name or path), the model name its requests name (the LoRA adapter when
one is loaded) and the run's sampling (its seed the rollout's). The env server samples every turn itself, token in
/ token out, from that server's `/inference/v1/generate` (`vllm serve --enable-scale-out`); weights, adapters and
the schedule reach the server as for any vLLM server of a run. The episode it streams back becomes trace-rl traces
as in-process (`trace_rl.envs.verifiers_env.episode_traces`): a failed episode is a failed rollout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from trace_rl.data.trace import Trace
from trace_rl.envs.base import EnvError, Example, Sampler
from trace_rl.envs.verifiers_env import VerifiersEnv, episode_traces, first_line, verifiers_module
from trace_rl.errors import RetryableError
from trace_rl.models.runtime import NEUTRAL_SAMPLING

API_KEY_VAR = "VLLM_API_KEY"  # the variable verifiers' client reads the vLLM server's key from (unset: none)


class VerifiersRemoteEnv(VerifiersEnv):
    """A `VerifiersEnv` whose episodes a verifiers env server at `server` plays (in the runtimes of its machine,
    which this one need not have)."""

    plays_here = False

    def __init__(self, args: Mapping[str, Any] | None, select: dict[str, Any] | None = None,
                 server: str | None = None):
        super().__init__(args, select)
        self.server = server  # None: an env that is only checked (`selection_problems`)

    def check_loaded(self) -> None:
        """Nothing: the seats, their harnesses and their tools live on the server."""

    def taskset(self):
        """The taskset, loaded here without the env (its agents and harnesses live on the server)."""
        vf = verifiers_module()
        try:
            return vf.load_taskset(self.config.taskset)
        except Exception as exc:  # noqa: BLE001 - the taskset's own constructor refused
            raise EnvError(f"env 'verifiers': cannot load taskset {self.config.taskset.id!r}: "
                           f"{type(exc).__name__}: {first_line(exc)}") from None

    async def rollout(self, example: Example, sampler: Sampler) -> list[Trace]:
        vf = verifiers_module()
        from verifiers.v1.serve import EnvClient

        next_endpoint = getattr(sampler.runtime, "next_endpoint", None)
        if next_endpoint is None:
            raise EnvError(f"env 'verifiers' on {self.server}: the env server samples from a vLLM server, but the "
                           f"actor {sampler.runtime.config.key!r} runs in this process; give it a base_url")
        base_url, model = await next_endpoint()
        client = vf.TrainClientConfig(base_url=f"{base_url}/v1", api_key_var=API_KEY_VAR,
                                      renderer_model_name=sampler.runtime.tokenizer.name_or_path)
        sampling = vf.SamplingConfig(
            temperature=sampler.sampling.temperature, top_p=sampler.sampling.top_p,
            max_tokens=sampler.sampling.max_completion_tokens, seed=sampler.seed, stop=sampler.sampling.stop,
            **NEUTRAL_SAMPLING)
        task = self.task_at(example)
        env_client = EnvClient(self.server)
        try:
            request = env_client.run(client, model, sampling, task.data.model_dump(mode="json"))
            episode = await asyncio.wait_for(request, sampler.timeout_s)
        except TimeoutError as exc:
            raise RetryableError(f"verifiers env server {self.server} did not finish the episode of task "
                                 f"{example.id} in {sampler.timeout_s}s") from exc
        except RuntimeError as exc:  # the server refused the request: verifiers' message
            raise EnvError(f"verifiers env server {self.server}: {first_line(exc)}") from None
        finally:
            await env_client.close()
        return episode_traces(episode, self.id, example)
