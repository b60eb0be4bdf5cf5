"""`graph-inspector db upgrade|current`: create or migrate the database, or show its schema revision."""

from __future__ import annotations

import argparse

DB_HELP = "database URL (default: $GRAPH_INSPECTOR_DB, else sqlite:///graph-inspector.db)"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "db",
        help="create or upgrade the database, or show its schema revision",
        description="Manage the inspector's database schema (Alembic migrations, run in-process).",
    )
    actions = parser.add_subparsers(dest="db_action", metavar="ACTION", required=True)
    upgrade = actions.add_parser("upgrade", help="create the database or upgrade it to the newest schema")
    upgrade.add_argument("--db", metavar="URL", help=DB_HELP)
    upgrade.set_defaults(func=run_upgrade)
    current = actions.add_parser("current", help="show the database's schema revision and the newest one")
    current.add_argument("--db", metavar="URL", help=DB_HELP)
    current.set_defaults(func=run_current)


def run_upgrade(args: argparse.Namespace) -> int:
    from inspector.store import open_store

    store = open_store(args.db, upgrade=True)
    try:
        print(f"{store.display_url}: schema at revision {store.current_revision()} (newest)")
    finally:
        store.dispose()
    return 0


def run_current(args: argparse.Namespace) -> int:
    from inspector.schema import head_revision
    from inspector.store import open_store

    store = open_store(args.db, upgrade=False)
    try:
        current = store.current_revision()
    finally:
        store.dispose()
    head = head_revision()
    if current == head:
        print(f"{store.display_url}: schema at revision {current} (newest)")
        return 0
    print(
        f"{store.display_url}: schema at revision {current or 'none (empty database)'}; newest is {head}: "
        "run `graph-inspector db upgrade`"
    )
    return 1
