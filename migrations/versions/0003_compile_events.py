"""compile_events: torch.compile cudagraph-tree skips and re-records seen by graph-inspector watch.

Revision ID: 0003_compile_events
Revises: 0002
Created: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_compile_events"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "compile_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("function", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_compile_events_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_compile_events")),
    )
    op.create_index(op.f("ix_compile_events_run_id"), "compile_events", ["run_id", "kind"])
    op.create_index(op.f("ix_compile_events_first_seen_at"), "compile_events", ["first_seen_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_compile_events_first_seen_at"), table_name="compile_events")
    op.drop_index(op.f("ix_compile_events_run_id"), table_name="compile_events")
    op.drop_table("compile_events")
