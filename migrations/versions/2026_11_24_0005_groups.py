"""groups: every batch's GRPO groups, and the stream of complete ones (GET /groups)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24 12:00:00

The groups of batches stored before are inserted unlogged: the service's first sweep logs the
complete ones (in the order their last episode finished) with their reward statistics.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "groups",
        sa.Column("batch_id", sa.String(length=128), nullable=False),
        sa.Column("group_index", sa.Integer(), nullable=False),
        sa.Column("env", sa.String(length=128), nullable=False),
        sa.Column("task_index", sa.Integer(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reward_count", sa.Integer(), nullable=True),
        sa.Column("reward_mean", sa.Float(), nullable=True),
        sa.Column("reward_std", sa.Float(), nullable=True),
        sa.Column("reward_min", sa.Float(), nullable=True),
        sa.Column("reward_max", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_groups_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("batch_id", "group_index", name=op.f("pk_groups")),
        sa.UniqueConstraint("seq", name=op.f("uq_groups_seq")),
    )
    op.create_index(
        op.f("ix_episodes_batch_id_group_index"), "episodes", ["batch_id", "group_index"], unique=False
    )
    op.execute(
        "INSERT INTO groups (batch_id, group_index, env, task_index, size, created_at) "
        "SELECT batch_id, group_index, MIN(env), MIN(task_index), COUNT(*), MIN(created_at) "
        "FROM episodes GROUP BY batch_id, group_index"
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_episodes_batch_id_group_index"), table_name="episodes")
    op.drop_table("groups")
