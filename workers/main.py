"""Worker process entry: `python -m mii_async.workers.main --router ADDR [--replica R --rank K]`.

The router starts its replicas' workers this way, with a lifeline (the process exits when the router is gone);
`mii-async worker --router tcp://HOST:PORT` starts one on another host, which joins the router's mesh and is
given a replica number. Exit status: 0 after a shutdown, 1 when the model could not be loaded, 3 when the
router could not be reached or refused the worker.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from mii_async.lifecycle import die_with_parent, set_process_name, watch_lifeline


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="mii_async.workers.main", description=__doc__.splitlines()[0])
    p.add_argument("--router", required=True, help="the router's worker address, e.g. tcp://10.0.0.5:5556")
    p.add_argument("--replica", type=int, default=-1, help="replica number (-1: the router assigns one)")
    p.add_argument("--rank", type=int, default=0, help="rank in the replica's tensor-parallel group")
    p.add_argument("--curve-dir", default=None, help="CURVE keys made by `mii-async keys DIR`")
    p.add_argument("--cache-dir", default=None, help="where this host keeps converted models")
    p.add_argument("--lifeline-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=os.environ.get("MII_ASYNC_LOG_LEVEL", "INFO").upper(), type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    return p


def run(args: argparse.Namespace) -> int:
    if args.lifeline_fd is not None:               # the router's to handle, from the first moment (imports)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    from .cpu_plan import set_worker_wait_policy

    set_worker_wait_policy()                       # before torch loads: libgomp reads it once
    from .worker import Worker, install_signal_handlers

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    set_process_name(f"mii-w{max(args.replica, 0)}.{args.rank}")
    if args.lifeline_fd is not None:
        die_with_parent()
        watch_lifeline(args.lifeline_fd, lambda: os._exit(0))
    worker = Worker(args.router, args.replica, args.rank, args.curve_dir, args.cache_dir)
    install_signal_handlers(worker, supervised=args.lifeline_fd is not None)
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
