"""Step times and decode batches (issue 25).

- ``step_times``: one row per run and graph key, the sums and sample counts of the timed replays
  (``graph_*``) and of the same step run eagerly (``eager_*``), and the clock that timed them;
- ``batch_size_counts``: ``uniform_batches``, the batches of each size that replayed a
  uniform-decode graph (NULL for the rows written before: not told).

A new table and a nullable column: nothing existing is rewritten.

Revision ID: 0008_step_times
Revises: 0007_engine_graphs
Created: 2027-01-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_step_times"
down_revision = "0007_engine_graphs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "step_times",
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("captured_size", sa.Integer(), nullable=False),
        sa.Column("num_reqs", sa.Integer(), nullable=True),
        sa.Column("uniform", sa.Boolean(), nullable=False),
        sa.Column("has_lora", sa.Boolean(), nullable=False),
        sa.Column("num_active_loras", sa.Integer(), nullable=False),
        sa.Column("descriptor_key", sa.String(length=128), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("graph_id", sa.Integer(), nullable=True),
        sa.Column("clock", sa.String(length=16), nullable=False),
        sa.Column("graph_samples", sa.BigInteger(), nullable=False),
        sa.Column("graph_seconds", sa.Float(), nullable=False),
        sa.Column("eager_samples", sa.BigInteger(), nullable=False),
        sa.Column("eager_seconds", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["graph_id"], ["graphs.id"], name=op.f("fk_step_times_graph_id_graphs"),
                                ondelete="SET NULL"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_step_times_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_times")),
        sa.UniqueConstraint("run_id", "mode", "descriptor_key", name=op.f("uq_step_times_run_id")),
    )
    op.create_index(op.f("ix_step_times_graph_id"), "step_times", ["graph_id"], unique=False)
    # A plain ADD COLUMN (batch mode would copy the table on SQLite: a fleet's is large).
    op.add_column("batch_size_counts", sa.Column("uniform_batches", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batch_size_counts") as batch:
        batch.drop_column("uniform_batches")
    op.drop_index(op.f("ix_step_times_graph_id"), table_name="step_times")
    op.drop_table("step_times")
