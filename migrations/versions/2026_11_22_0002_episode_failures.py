"""episode failures: failed attempts, apart from the attempt counter (graceful releases do not count)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("failures", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("failures")
