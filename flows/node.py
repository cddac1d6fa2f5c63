"""Node K of a multi-node trainer (`[trainer] nnodes > 1`) as a Prefect flow, for work pools (prefect.yaml's
`trainer-node` deployment): the same as `trace-rl trainer-node CONFIG --node-rank K` (docs/scaling.md).

Each of nodes 1 .. M-1 runs one flow run of it on its own machine; it ends when the run has trained its last step.
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from trace_rl.config import Config
from trace_rl.runs.loading import check_config
from trace_rl.trainer.nodes import serve_node


@flow(name="trainer-node", flow_run_name="{config.name}-node-{node_rank}", log_prints=True)
def trainer_node_flow(config: Config, node_rank: int, wait_s: float | None = None) -> None:
    """Serve node `node_rank`'s trainer workers for the run `config` describes (the same config as its train flow);
    each wait for node 0's session lasts at most `wait_s` s (default: the rendezvous timeout)."""
    check_config(config)
    serve_node(config, node_rank, wait_s, say=get_run_logger().info)
