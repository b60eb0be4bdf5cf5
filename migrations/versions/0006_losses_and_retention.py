"""Losses counted as events, and retention's folded windows.

- ``runs``: ``dropped_events`` becomes a 64-bit count of events (it held records), beside it the
  events by kind, ``dropped_captures``, ``dropped_violations``, ``dropped_replays``,
  ``dropped_eager_batches``, and ``dropped_real_tokens`` (0 for the runs recorded before);
- ``replay_windows``, ``eager_fallbacks``, ``batch_size_counts``: ``windows``, how many flush
  windows a row holds (1 for every row so far);
- ``window_folds``: one row per retention transaction (``graph-inspector db prune``);
- ``batch_size_counts``: an index by run and time, which retention folds by (the only index this
  revision builds over existing rows: minutes on a database of a hundred million rows).

Adding columns with a constant default rewrites no table (SQLite's ALTER TABLE ADD COLUMN,
PostgreSQL 11+), so a database of a hundred million windows upgrades at once; ``dropped_events``'s
type change rebuilds the small runs table on SQLite (batch mode) and alters it in place on
PostgreSQL.

Revision ID: 0006_losses_and_retention
Revises: 0005_ranks
Created: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_losses_and_retention"
down_revision = "0005_ranks"
branch_labels = None
depends_on = None

DROPPED = ("dropped_captures", "dropped_violations", "dropped_replays", "dropped_eager_batches",
           "dropped_real_tokens")
FOLDABLE = ("replay_windows", "eager_fallbacks", "batch_size_counts")
SIZES_BY_TIME = "ix_batch_size_counts_run_id_window_start"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.alter_column("dropped_events", existing_type=sa.Integer(), type_=sa.BigInteger(),
                           existing_nullable=False)
        for name in DROPPED:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))
    for table in FOLDABLE:
        op.add_column(table, sa.Column("windows", sa.Integer(), nullable=False, server_default="1"))
    op.create_index(SIZES_BY_TIME, "batch_size_counts", ["run_id", "window_start"])
    op.create_table(
        "window_folds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("folded_at", sa.Float(), nullable=False),
        sa.Column("range_start", sa.Float(), nullable=False),
        sa.Column("range_end", sa.Float(), nullable=False),
        sa.Column("grain", sa.Float(), nullable=False),
        sa.Column("rows_removed", sa.BigInteger(), nullable=False),
        sa.Column("rows_added", sa.BigInteger(), nullable=False),
        sa.Column("last_replay_window_id", sa.BigInteger(), nullable=False),
        sa.Column("last_eager_fallback_id", sa.BigInteger(), nullable=False),
        sa.Column("last_batch_size_id", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_window_folds_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_window_folds")),
    )
    op.create_index(op.f("ix_window_folds_run_id"), "window_folds", ["run_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_window_folds_run_id"), table_name="window_folds")
    op.drop_table("window_folds")
    op.drop_index(SIZES_BY_TIME, table_name="batch_size_counts")
    for table in FOLDABLE:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("windows")
    with op.batch_alter_table("runs") as batch:
        for name in DROPPED:
            batch.drop_column(name)
        batch.alter_column("dropped_events", existing_type=sa.BigInteger(), type_=sa.Integer(),
                           existing_nullable=False)
