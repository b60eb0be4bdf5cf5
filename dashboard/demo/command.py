"""`graph-inspector demo`: check the options, build the workload, record its traffic, summarise, serve."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from dashboard.demo import console, options, traffic, workload
    from inspector.recording.recorder import Recorder
    from inspector.storage.store import open_store, resolve_url

    # Everything a user can get wrong is refused before the database is created or touched.
    options.check(args)
    trace = workload.load_traffic(args)
    backend = workload.choose_backend(args.backend)
    model_config, model_name = workload.model_config(args, backend)
    url = resolve_url(args.db)
    # A bad or unwritable database fails here, before any work.
    with open_store(url, upgrade=True) as store:
        runner = workload.build_runner(args, backend, model_config)
        config = workload.run_config(args, backend, model_name, runner, trace)
        recorder = Recorder(url, label="demo", config=config)
        runner.runtime.observer = recorder
        console.announce(backend, model_name, runner, trace, args)
        recorder.start()
        try:
            runner.capture()
            result = traffic.serve_traffic(runner, trace, args)
            runner.runtime.collect_step_times()  # the last timed replays' CUDA events, read now
        finally:
            recorder.close()
        console.print_summary(store, recorder.run_id, runner, result, url)
        if recorder.dropped:
            print(f"  warning: the recorder dropped {recorder.dropped} events ({recorder.last_error})")

    if args.no_serve:
        print(f"\nServe it later with: graph-inspector serve --db {url}")
        return 0
    from dashboard.app import create_app
    from dashboard.commands.serve import serve

    print()
    return serve(create_app(url, token=args.token), args.host, args.port)
