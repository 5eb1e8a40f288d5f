"""Client of the rollout service for training jobs: submit episodes, wait, pull exact token arrays.

    from rollout_client import RolloutClient
    with RolloutClient("http://rollouts:8000", api_key) as client:
        submitted = client.submit("tau-bench/retail", [0, 1, 2], samples_per_task=8, task_split="train")
        client.wait(submitted.batch_id)
        for episode in client.batch(submitted.batch_id):
            episode.response_ids, episode.loss_mask, episode.rollout_logprobs  # numpy arrays

slime's hooks: rollout_client.slime.
"""

from rollout_client.batch import Batch, EpisodeArrays
from rollout_client.client import AsyncRolloutClient, RolloutClient
from rollout_client.errors import RequestError, RolloutError, ServiceUnavailable, WaitTimeout
from rollout_client.plans import GroupsPage, Submission

__all__ = [
    "AsyncRolloutClient",
    "Batch",
    "EpisodeArrays",
    "GroupsPage",
    "RequestError",
    "RolloutClient",
    "RolloutError",
    "ServiceUnavailable",
    "Submission",
    "WaitTimeout",
]
