"""dead_agent_token: an agent-driven episode's token of its last dead attempt (re-queued), kept to
tell its driver so (a 409) and nobody else

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.add_column(sa.Column("dead_agent_token", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:
        batch.drop_column("dead_agent_token")
