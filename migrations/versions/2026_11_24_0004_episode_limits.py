"""episode limits of POST /episodes: max_staleness and episode_timeout_seconds

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("max_staleness", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("episode_timeout_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("episode_timeout_seconds")
        batch.drop_column("max_staleness")
