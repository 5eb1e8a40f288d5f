"""initial: batches and their episodes (the episode row is the job)

Revision ID: 0001
Revises:
Create Date: 2026-11-22 02:05:06.573946
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("env", sa.String(length=128), nullable=False),
        sa.Column("task_split", sa.String(length=64), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    op.create_table(
        "episodes",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=128), nullable=False),
        sa.Column("group_index", sa.Integer(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("env", sa.String(length=128), nullable=False),
        sa.Column("task_split", sa.String(length=64), nullable=False),
        sa.Column("task_index", sa.Integer(), nullable=False),
        sa.Column("sampling_params", sa.JSON(), nullable=False),
        sa.Column("max_turns", sa.Integer(), nullable=False),
        sa.Column("max_response_tokens", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("prompt_ids", sa.LargeBinary(), nullable=True),
        sa.Column("response_ids", sa.LargeBinary(), nullable=True),
        sa.Column("loss_mask", sa.LargeBinary(), nullable=True),
        sa.Column("rollout_logprobs", sa.LargeBinary(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("info", sa.JSON(), nullable=True),
        sa.Column("turns", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("num_turns", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'completed', 'truncated', 'aborted', 'failed')",
            name=op.f("ck_episodes_status"),
        ),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_episodes_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_episodes")),
    )
    op.create_index(op.f("ix_episodes_batch_id"), "episodes", ["batch_id"])
    op.create_index("ix_episodes_status_created_at", "episodes", ["status", "created_at"])
    op.create_index("ix_episodes_status_lease_expires_at", "episodes", ["status", "lease_expires_at"])


def downgrade() -> None:
    op.drop_index("ix_episodes_status_lease_expires_at", table_name="episodes")
    op.drop_index("ix_episodes_status_created_at", table_name="episodes")
    op.drop_index(op.f("ix_episodes_batch_id"), table_name="episodes")
    op.drop_table("episodes")
    op.drop_table("batches")
