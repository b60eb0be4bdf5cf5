"""Ranks of one job: runs.job, and step_sequences (the graphs each rank ran, step by step).

Existing runs keep every row and get no job (NULL): they were recorded before jobs were known.

Revision ID: 0005_ranks
Revises: 0004_vocabulary
Created: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_ranks"
down_revision = "0004_vocabulary"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("job", sa.String(length=200), nullable=True))
        batch.create_index(batch.f("ix_runs_job"), ["job", "rank"])
    op.create_table(
        "step_sequences",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("window_start", sa.Float(), nullable=False),
        sa.Column("window_end", sa.Float(), nullable=False),
        sa.Column("sequence", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_step_sequences_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_sequences")),
    )
    op.create_index(op.f("ix_step_sequences_run_id"), "step_sequences", ["run_id", "first_step"])


def downgrade() -> None:
    op.drop_index(op.f("ix_step_sequences_run_id"), table_name="step_sequences")
    op.drop_table("step_sequences")
    with op.batch_alter_table("runs") as batch:
        batch.drop_index(batch.f("ix_runs_job"))
        batch.drop_column("job")
