"""Running totals per run and graph key (and per eager reason), so scrapes never scan windows.

Revision ID: 0002
Revises: 0001
Created: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replay_totals",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("graph_id", sa.Integer(), nullable=True),
        sa.Column("replays", sa.BigInteger(), nullable=False),
        sa.Column("real_tokens", sa.BigInteger(), nullable=False),
        sa.Column("padded_tokens", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("num_reqs", sa.Integer(), nullable=True),
        sa.Column("uniform", sa.Boolean(), nullable=False),
        sa.Column("has_lora", sa.Boolean(), nullable=False),
        sa.Column("num_active_loras", sa.Integer(), nullable=False),
        sa.Column("descriptor_key", sa.String(length=128), nullable=False),
        sa.ForeignKeyConstraint(
            ["graph_id"], ["graphs.id"], name=op.f("fk_replay_totals_graph_id_graphs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_replay_totals_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_totals")),
        sa.UniqueConstraint("run_id", "mode", "descriptor_key", name=op.f("uq_replay_totals_run_id")),
    )
    op.create_index(op.f("ix_replay_totals_mode"), "replay_totals", ["mode", "num_tokens"])

    op.create_table(
        "eager_totals",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_eager_totals_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eager_totals")),
        sa.UniqueConstraint("run_id", "reason", "mode", name=op.f("uq_eager_totals_run_id")),
    )


def downgrade() -> None:
    op.drop_table("eager_totals")
    op.drop_table("replay_totals")
