"""The main job, `python -m service demo`, end to end on a small batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.demo import python_command, run_demo


def test_the_demo_runs_a_batch_and_summarizes_it(
    tmp_path: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keys in the environment (a deployment's) do not lock the demo out of its own service.
    monkeypatch.setenv("API_KEYS", "admin-key")
    monkeypatch.setenv("API_PROJECTS", '{"team-a": {"keys": ["key-a"]}}')
    assert run_demo(database_url=f"sqlite+aiosqlite:///{tmp_path}/demo.db", tasks=3, samples=2) == 0
    out = capsys.readouterr().out
    assert "submitted batch" in out and "3 tasks x 2 samples of builtin/shop" in out
    assert "episodes   6 in 3 groups" in out
    assert "reward     mean" in out and "sampled, loss mask 1" in out
    assert "pulled     6 rows as Arrow" in out
    # The closing hint names the python that has the service installed (the venv's), not `python`.
    hint = next(line for line in out.splitlines() if line.startswith("look at it:"))
    assert f" {python_command()} -m service serve" in hint and Path(python_command()).exists()


def test_the_summary_leaves_out_episodes_without_a_reward() -> None:
    import pyarrow as pa

    from service.demo import summarize

    table = pa.table(
        {
            "group_index": [0, 0, 1],
            "status": ["completed", "aborted", "truncated"],
            "reward": [1.0, None, 0.0],  # an aborted episode before any env step has no reward
            "loss_mask": [[1, 0], [1], [1, 1]],
            "response_ids": [[5, 6], [7], [8, 9]],
            "prompt_ids": [[1], [1], [1]],
            "num_turns": [2, 1, 1],
        }
    )
    summary = summarize(table, {"completed": 1, "aborted": 1, "truncated": 1}, elapsed=1.0)
    assert "reward     mean 0.500 over 2 completed or truncated" in summary
    assert "tokens     prompt 3, response 5 (4 sampled" in summary
