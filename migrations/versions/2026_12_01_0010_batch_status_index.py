"""a batch's episodes by status: an index on (batch_id, status) in place of the one on batch_id,
which (batch_id, group_index) also serves

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01 01:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_episodes_batch_id_status", "episodes", ["batch_id", "status"])
    op.drop_index("ix_episodes_batch_id", table_name="episodes")


def downgrade() -> None:
    op.create_index("ix_episodes_batch_id", "episodes", ["batch_id"])
    op.drop_index("ix_episodes_batch_id_status", table_name="episodes")
