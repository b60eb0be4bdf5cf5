"""`graph-inspector db upgrade|current`: create or migrate the database, or show its schema revision."""

from __future__ import annotations

import argparse


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
