"""batch cancellation: batches.cancelled_at, and the episode status `cancelled`

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BEFORE = ("queued", "running", "completed", "truncated", "aborted", "failed")
AFTER = (*BEFORE, "cancelled")


def _status_check(statuses: Sequence[str]) -> None:
    """Replaces the check on episodes.status (SQLite: by copying the table, as batch mode does)."""
    with op.batch_alter_table("episodes") as batch:
        batch.drop_constraint(op.f("ck_episodes_status"), type_="check")
        batch.create_check_constraint(
            "status", "status IN ({})".format(", ".join(f"'{s}'" for s in statuses))
        )


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True))
    _status_check(AFTER)


def downgrade() -> None:
    op.execute("UPDATE episodes SET status = 'failed', error = 'cancelled' WHERE status = 'cancelled'")
    _status_check(BEFORE)
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("cancelled_at")
