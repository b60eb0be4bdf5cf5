"""Divergences located (issue 25).

- ``divergences``: one row per divergence a probe located after a ``replay_mismatch`` (or on demand):
  the graph's key, the first module whose output differs, its max abs/rel error, the modules before
  it that agree, how the step was probed, and the message.

A new table: nothing existing is rewritten.

Revision ID: 0009_divergences
Revises: 0008_step_times
Created: 2027-01-11
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_divergences"
down_revision = "0008_step_times"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "divergences",
        sa.Column("mode", sa.String(length=32), nullable=False),
        sa.Column("captured_size", sa.Integer(), nullable=False),
        sa.Column("num_reqs", sa.Integer(), nullable=True),
        sa.Column("uniform", sa.Boolean(), nullable=False),
        sa.Column("has_lora", sa.Boolean(), nullable=False),
        sa.Column("num_active_loras", sa.Integer(), nullable=False),
        sa.Column("descriptor_key", sa.String(length=128), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("wrapper", sa.String(length=200), nullable=False),
        sa.Column("module", sa.String(length=500), nullable=True),
        sa.Column("max_abs_error", sa.Float(), nullable=True),
        sa.Column("max_rel_error", sa.Float(), nullable=True),
        sa.Column("agreeing", sa.Text(), nullable=False),
        sa.Column("modules_compared", sa.Integer(), nullable=False),
        sa.Column("reproduced", sa.Boolean(), nullable=False),
        sa.Column("probe", sa.String(length=200), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("injected", sa.Boolean(), nullable=False),
        sa.Column("seen_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_divergences_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_divergences")),
    )
    op.create_index(op.f("ix_divergences_run_id"), "divergences", ["run_id", "mode", "descriptor_key"],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_divergences_run_id"), table_name="divergences")
    op.drop_table("divergences")
