"""external agents (env `external`): each episode's agent token, and its segments

An agent that rewrites its history starts a new segment of its episode: the episode row holds the
last one, episode_segments the ones before it (see service/agents).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24 17:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("agent_token", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("segments", sa.Integer(), server_default="1", nullable=False))
    op.create_table(
        "episode_segments",
        sa.Column("episode_id", sa.String(length=64), nullable=False),
        sa.Column("segment", sa.Integer(), nullable=False),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=False),
        sa.Column("response_ids", sa.LargeBinary(), nullable=False),
        sa.Column("loss_mask", sa.LargeBinary(), nullable=False),
        sa.Column("rollout_logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("turns", sa.JSON(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["episode_id"],
            ["episodes.id"],
            name="fk_episode_segments_episode_id_episodes",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("episode_id", "segment", name="pk_episode_segments"),
    )


def downgrade() -> None:
    op.drop_table("episode_segments")
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("segments")
        batch.drop_column("agent_token")
