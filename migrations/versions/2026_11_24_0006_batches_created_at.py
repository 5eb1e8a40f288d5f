"""batches newest first (GET /batches): an index on (created_at, id)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 16:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_batches_created_at_id", "batches", ["created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_batches_created_at_id", table_name="batches")
