"""``etrain``: run the controller or a node agent, submit and watch jobs, run the local demo.

Every flag can also come from the environment variable named in its help (flags win). Errors are one
line on stderr; exit codes: 0 ok, 1 the job/command failed, 2 bad settings or etcd unreachable, 3 API
error (HTTP status shown).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from elastic.etcd import EtcdConnectionError
from service.cli.common import add_flag, env_or, fail, first_line
from service.cli.render import (
    METRIC_COLUMNS,
    event_line,
    job_table,
    job_text,
    metric_rows,
    metric_table,
    node_table,
    progress_line,
)
from service.cli.servers import add_server_commands
from service.client import ApiClient, ApiError, load_job_file
from service.core.config import ConfigError
from service.core.states import TERMINAL_STATES, JobState

__all__ = ["main"]

ENV_SERVER = "ETRAIN_SERVER"
ENV_TOKEN = "ETRAIN_TOKEN"
ENV_TOKEN_FILE = "ETRAIN_TOKEN_FILE"


def _client(args: argparse.Namespace) -> ApiClient:
    token = env_or(ENV_TOKEN)
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {args.token_file}: {exc.strerror or exc}") from exc
    return ApiClient(args.server, token)


def cmd_submit(args: argparse.Namespace) -> int:
    with _client(args) as api:
        job = api.submit(load_job_file(args.file))
        print(job["id"])
        if args.follow:
            return _follow(api, job["id"])
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    with _client(args) as api:
        jobs = api.jobs(args.state)
    print(json.dumps(jobs, indent=2) if args.json else job_table(jobs))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as api:
        job = api.job(args.id)
    print(json.dumps(job, indent=2) if args.json else job_text(job))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    with _client(args) as api:
        events = api.events(args.id)
    for e in events:
        print(json.dumps(e) if args.json else event_line(e))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    with _client(args) as api:
        series = api.metrics(args.id, since=args.since, max_points=args.max_points)
    if args.json:
        print(json.dumps(series, indent=2))
    elif args.csv:
        out = csv.DictWriter(sys.stdout, fieldnames=METRIC_COLUMNS, lineterminator="\n")
        out.writeheader()
        out.writerows(metric_rows(series))
    else:
        print(metric_table(series))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as api:
        job = api.cancel(args.id)
    print(f"{job['id']}: cancel requested (state {job['state']})")
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with _client(args) as api:
        nodes = api.nodes()
    print(json.dumps(nodes, indent=2) if args.json else node_table(nodes))
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    with _client(args) as api:
        node = api.node_op(args.name, args.action, args.reason)
    print(json.dumps(node, indent=2) if args.json else node["message"])
    return 0


def cmd_resize(args: argparse.Namespace) -> int:
    if args.min is None and args.max is None:
        return fail("resize: give --min, --max or both")
    with _client(args) as api:
        job = api.resize(args.id, args.min, args.max)
    spec = job["spec"]
    print(
        f"{job['id']}: min_nodes {spec['min_nodes']}, max_nodes {spec['max_nodes']} (state {job['state']}, "
        f"{len(job['nodes'])} node(s) now)"
    )
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    with _client(args) as api:
        trace = api.trace(args.id)
    text = json.dumps(trace, separators=(",", ":"))
    if args.output in (None, "-"):
        print(text)
        return 0
    try:
        Path(args.output).write_text(text + "\n")
    except OSError as exc:
        return fail(f"cannot write {args.output}: {exc.strerror or exc}")
    print(
        f"{args.id}: {len(trace.get('traceEvents', []))} trace events written to {args.output} "
        "(open it in https://ui.perfetto.dev or chrome://tracing)",
        file=sys.stderr,
    )
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    with _client(args) as api:
        try:
            for chunk in api.logs(args.id, node=args.node, generation=args.generation, follow=args.follow):
                out.write(chunk)
                out.flush()  # as the lines come
        except BrokenPipeError:  # the reader had enough (| head): no traceback, nor one at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _follow(api: ApiClient, job_id: str, interval: float = 1.0, out: Callable[[str], None] = print) -> int:
    """Print new events and a progress line until the job ends; exit code 0 only if it succeeded."""
    last_event: str | None = None
    last_line = ""
    tty = sys.stdout.isatty()
    while True:
        job = api.job(job_id)
        for e in api.events(job_id, after=last_event):
            if tty and last_line:
                sys.stdout.write("\r\033[K")
            out(event_line(e))
            last_event = e["id"]
            last_line = ""
        line = progress_line(job)
        if line != last_line:
            if tty:
                sys.stdout.write("\r\033[K" + line)
                sys.stdout.flush()
            else:
                out(line)
            last_line = line
        if job["state"] in TERMINAL_STATES:
            if tty:
                sys.stdout.write("\n")
            out(job_text(job))
            return 0 if job["state"] == "succeeded" else 1
        time.sleep(interval)


def cmd_follow(args: argparse.Namespace) -> int:
    with _client(args) as api:
        return _follow(api, args.id)


def cmd_demo(args: argparse.Namespace) -> int:
    from service.cli.demo import run_demo

    return run_demo(Path(args.workdir).resolve(), keep=args.keep)


# -- parser --------------------------------------------------------------------------------------------------
class _NoTokenOnCommandLine(argparse.Action):
    """``--token`` is refused: a token on the command line is in every process listing."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        parser.error(f"--token puts the token in the process list: set {ENV_TOKEN} or use --token-file")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etrain", description="Fault-tolerant elastic training service")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def client_cmd(
        name: str, fn: Callable[[argparse.Namespace], int], help: str, under: Any = None
    ) -> argparse.ArgumentParser:
        p = (under or sub).add_parser(name, help=help)
        add_flag(p, "--server", ENV_SERVER, "controller URL", "http://127.0.0.1:8080")
        add_flag(p, "--token-file", ENV_TOKEN_FILE, f"file holding the API bearer token (or set {ENV_TOKEN})")
        p.add_argument("--token", action=_NoTokenOnCommandLine, help=argparse.SUPPRESS)
        p.set_defaults(fn=fn)
        return p

    add_server_commands(sub)

    p = client_cmd("submit", cmd_submit, "submit a job file (YAML/JSON)")
    p.add_argument("file")
    p.add_argument("--follow", action="store_true", help="then follow it")
    p = client_cmd("list", cmd_list, "list jobs")
    p.add_argument("--state", choices=sorted(s.value for s in JobState))
    p.add_argument("--json", action="store_true")
    p = client_cmd("status", cmd_status, "a job's status with its world-size history")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p = client_cmd("follow", cmd_follow, "follow a job's progress and events until it ends")
    p.add_argument("id")
    p = client_cmd("cancel", cmd_cancel, "cancel a job")
    p.add_argument("id")
    p = client_cmd("events", cmd_events, "a job's events")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p = client_cmd("metrics", cmd_metrics, "a job's metric series from its start (step, loss, steps/s, world size)")
    p.add_argument("id")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", action="store_true", help="CSV, a row per window or point, every column")
    fmt.add_argument("--json", action="store_true", help="the API's answer as it is")
    p.add_argument("--since", type=float, help="only reports after this time (seconds since the epoch)")
    p.add_argument("--max-points", type=int, help="at most this many rows (older reports merged; default 2000)")
    p = client_cmd("trace", cmd_trace, "a job's history as Chrome trace JSON (Perfetto, chrome://tracing)")
    p.add_argument("id")
    p.add_argument("-o", "--output", help="write it to this file (default: stdout)")
    p = client_cmd("logs", cmd_logs, "a job's torchrun logs, read from its nodes' agents")
    p.add_argument("id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the job's torchruns end")
    p.add_argument("--node", help="only this node's log (default: every node of the generation, each headed)")
    p.add_argument("--generation", type=int, help="this generation's logs (default: the current or last one)")
    p = client_cmd("nodes", cmd_nodes, "live nodes (and nodes cordoned or drained), with their mode")
    p.add_argument("--json", action="store_true")
    p = client_cmd("resize", cmd_resize, "change a job's min_nodes and/or max_nodes")
    p.add_argument("id")
    p.add_argument("--min", type=int, help="new min_nodes")
    p.add_argument("--max", type=int, help="new max_nodes")
    node = sub.add_parser("node", help="cordon, drain or uncordon a node")
    node_sub = node.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (
        ("cordon", "place no new job on the node (its jobs stay)"),
        ("drain", "cordon the node and move its jobs off (planned scale-down)"),
        ("uncordon", "take back a cordon or drain: the node takes new jobs again"),
    ):
        p = client_cmd(action, cmd_node, text, under=node_sub)
        p.add_argument("name", metavar="NODE")
        p.add_argument("--reason", help="why (shown with the node)")
        p.add_argument("--json", action="store_true", help="print the node as JSON")

    p = sub.add_parser("demo", help="local cluster demo: etcd, controller, 3 agents, a job, an agent killed")
    p.add_argument("--workdir", default=".demo", help="where etcd data, logs and checkpoints go")
    p.add_argument("--keep", action="store_true", help="leave the cluster running at the end (Ctrl-C stops it)")
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except ApiError as exc:
        return fail(str(exc), 3 if exc.status else 2)
    except EtcdConnectionError as exc:
        return fail(first_line(exc))
    except ConfigError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `etrain list | head`: the reader left; say nothing more, as a shell tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush would raise (and print) again
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
