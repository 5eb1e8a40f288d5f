"""OpenRLHF's agent file for the rollout service: `--train.agent_func_path examples/openrlhf/agent_func.py`.

OpenRLHF loads this file in each vLLM actor and builds its `AgentExecutor`; the one here runs every
prompt's samples as one group in the rollout service (see README.md beside this file).
"""

from rollout_client.openrlhf import AgentExecutor

__all__ = ["AgentExecutor"]
