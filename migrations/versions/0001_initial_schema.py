"""Initial schema: runs, graphs, replay windows, eager fallbacks, batch-size counts, violations.

Revision ID: 0001
Revises:
Created: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def descriptor_columns() -> list[sa.Column]:
    """The BatchDescriptor's fields, as every table keyed by a graph holds them."""
    return [
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("num_reqs", sa.Integer(), nullable=True),
        sa.Column("uniform", sa.Boolean(), nullable=False),
        sa.Column("has_lora", sa.Boolean(), nullable=False),
        sa.Column("num_active_loras", sa.Integer(), nullable=False),
        sa.Column("descriptor_key", sa.String(length=128), nullable=False),
    ]


def run_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["run_id"], ["runs.id"], name=op.f(f"fk_{table}_run_id_runs"), ondelete="CASCADE"
    )


def graph_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["graph_id"], ["graphs.id"], name=op.f(f"fk_{table}_graph_id_graphs"), ondelete="SET NULL"
    )


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("process", sa.String(length=500), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=200), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("config", sa.Text(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("dropped_events", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_index(op.f("ix_runs_started_at"), "runs", ["started_at"])

    op.create_table(
        "graphs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("wrapper", sa.String(length=200), nullable=False),
        sa.Column("backend", sa.String(length=32), nullable=False),
        sa.Column("input_names", sa.Text(), nullable=False),
        sa.Column("input_addresses", sa.Text(), nullable=False),
        sa.Column("capture_seconds", sa.Float(), nullable=False),
        sa.Column("pool_bytes", sa.BigInteger(), nullable=False),
        sa.Column("warmup_iters", sa.Integer(), nullable=False),
        sa.Column("num_segments", sa.Integer(), nullable=False),
        sa.Column("num_ubatches", sa.Integer(), nullable=False),
        sa.Column("ubatch_slices", sa.Text(), nullable=False),
        sa.Column("unexpected", sa.Boolean(), nullable=False),
        sa.Column("captured_at", sa.Float(), nullable=False),
        *descriptor_columns(),
        run_fk("graphs"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_graphs")),
    )
    op.create_index(op.f("ix_graphs_run_id"), "graphs", ["run_id", "mode", "num_tokens"])
    op.create_index(op.f("ix_graphs_descriptor_key"), "graphs", ["descriptor_key"])
    op.create_index(op.f("ix_graphs_captured_at"), "graphs", ["captured_at"])

    op.create_table(
        "replay_windows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("graph_id", sa.Integer(), nullable=True),
        sa.Column("window_start", sa.Float(), nullable=False),
        sa.Column("window_end", sa.Float(), nullable=False),
        sa.Column("replays", sa.BigInteger(), nullable=False),
        sa.Column("real_tokens", sa.BigInteger(), nullable=False),
        sa.Column("padded_tokens", sa.BigInteger(), nullable=False),
        *descriptor_columns(),
        run_fk("replay_windows"),
        graph_fk("replay_windows"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replay_windows")),
    )
    op.create_index(op.f("ix_replay_windows_run_id"), "replay_windows", ["run_id", "window_start"])
    op.create_index(op.f("ix_replay_windows_graph_id"), "replay_windows", ["graph_id", "window_start"])
    op.create_index(op.f("ix_replay_windows_window_start"), "replay_windows", ["window_start"])

    op.create_table(
        "eager_fallbacks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("window_start", sa.Float(), nullable=False),
        sa.Column("window_end", sa.Float(), nullable=False),
        sa.Column("reason", sa.String(length=64), nullable=False),
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        run_fk("eager_fallbacks"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eager_fallbacks")),
    )
    op.create_index(op.f("ix_eager_fallbacks_run_id"), "eager_fallbacks", ["run_id", "window_start"])
    op.create_index(op.f("ix_eager_fallbacks_reason"), "eager_fallbacks", ["reason"])

    op.create_table(
        "batch_size_counts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("window_start", sa.Float(), nullable=False),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("batches", sa.BigInteger(), nullable=False),
        run_fk("batch_size_counts"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batch_size_counts")),
    )
    op.create_index(op.f("ix_batch_size_counts_run_id"), "batch_size_counts", ["run_id", "num_tokens"])

    op.create_table(
        "violations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("wrapper", sa.String(length=200), nullable=False),
        sa.Column("input_name", sa.String(length=200), nullable=True),
        sa.Column("expected_address", sa.BigInteger(), nullable=True),
        sa.Column("actual_address", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("stack", sa.Text(), nullable=False),
        sa.Column("injected", sa.Boolean(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_seen_at", sa.Float(), nullable=False),
        sa.Column("last_seen_at", sa.Float(), nullable=False),
        *descriptor_columns(),
        run_fk("violations"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_violations")),
    )
    op.create_index(op.f("ix_violations_run_id"), "violations", ["run_id", "kind"])
    op.create_index(op.f("ix_violations_kind"), "violations", ["kind", "first_seen_at"])
    op.create_index(op.f("ix_violations_first_seen_at"), "violations", ["first_seen_at"])


def downgrade() -> None:
    for table in ("violations", "batch_size_counts", "eager_fallbacks", "replay_windows", "graphs", "runs"):
        op.drop_table(table)
