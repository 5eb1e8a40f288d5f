"""Stand-in for tau_bench: same interface as tau-bench 0.1.0, a tiny domain, no litellm."""

from tau_bench.envs.base import Env as Env

STANDIN = True
