"""Graphs an engine captured: its own key for each, and the graphs it threw away.

- ``graphs.engine_key``: the capturing engine's key in its own words (vLLM's ``BatchDescriptor``,
  its V2 runner's ``BatchExecutionDescriptor``); empty for every graph recorded before;
- ``graphs.discarded``: a graph captured only to be thrown away (vLLM's memory profiling captures
  its largest sizes, measures them and clears them), false for every graph recorded before.

Both are columns with a constant default: no table is rewritten.

Revision ID: 0007_engine_graphs
Revises: 0006_losses_and_retention
Created: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_engine_graphs"
down_revision = "0006_losses_and_retention"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("graphs") as batch:
        batch.add_column(sa.Column("engine_key", sa.String(500), nullable=False, server_default=""))
        batch.add_column(sa.Column("discarded", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("graphs") as batch:
        batch.drop_column("discarded")
        batch.drop_column("engine_key")
