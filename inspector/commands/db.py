"""`graph-inspector db upgrade|current|prune`: create or migrate the database, show its schema
revision, or fold old traffic windows into coarser ones (retention)."""

from __future__ import annotations

import argparse


def run_upgrade(args: argparse.Namespace) -> int:
    from inspector.storage.store import open_store

    with open_store(args.db, upgrade=True) as store:
        print(f"{store.display_url}: schema at revision {store.current_revision()} (newest)")
    return 0


def run_current(args: argparse.Namespace) -> int:
    from inspector.storage.schema import head_revision
    from inspector.storage.store import open_store

    with open_store(args.db, upgrade=False) as store:
        current = store.current_revision()
    head = head_revision()
    if current == head:
        print(f"{store.display_url}: schema at revision {current} (newest)")
        return 0
    print(
        f"{store.display_url}: schema at revision {current or 'none (empty database)'}; newest is {head}: "
        "run `graph-inspector db upgrade`"
    )
    return 1


def run_prune(args: argparse.Namespace) -> int:
    from inspector.errors import UsageError
    from inspector.storage.retention import Policy, Tier, parse_duration, prune
    from inspector.storage.store import open_store

    try:
        policy = Policy((Tier(parse_duration(args.older_than), parse_duration(args.grain)),))
    except ValueError as error:
        raise UsageError(f"--older-than/--grain: {error}") from None
    with open_store(args.db, upgrade=True) as store:
        print(f"{store.display_url}: {prune(store, policy).line()}")
    return 0
