"""``etrain``: run the controller or a node agent, submit and watch jobs, run the local demo.

Every flag can also come from the environment variable named in its help (flags win). Errors are one
line on stderr; exit codes: 0 ok, 1 the job/command failed, 2 bad settings or etcd unreachable, 3 API
error (HTTP status shown).
"""

from __future__ import annotations

import argparse
import csv
import ipaddress
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic import compat
from elastic.contract import env as contract
from elastic.etcd import EtcdConnectionError, EtcdError, check_reachable
from elastic.etcd.config import EtcdOptions
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
from service.client import ApiClient, ApiError, load_job_file
from service.core.config import AgentSettings, ConfigError, Settings, UidRange, load_quotas, load_tokens
from service.core.keys import DEFAULT_PREFIX
from service.core.view import Quotas, ReconcileConfig

__all__ = ["main"]

_TERMINAL = {"succeeded", "failed", "cancelled"}

# The variables that give flags their defaults: the CLI's own here; the etcd connection and the node name
# are the names the agent passes to workers (elastic.contract.env), so that one set of variables serves both.
ENV_ETCD_CONNECT_TIMEOUT = "ETRAIN_ETCD_CONNECT_TIMEOUT"
ENV_PREFIX = "ETRAIN_PREFIX"
ENV_LOG_LEVEL = "ETRAIN_LOG_LEVEL"
ENV_HOST = "ETRAIN_HOST"
ENV_PORT = "ETRAIN_PORT"
ENV_TOKENS_FILE = "ETRAIN_TOKENS_FILE"
ENV_CHECKPOINT_ROOT = "ETRAIN_CHECKPOINT_ROOT"
ENV_LEADER_TTL = "ETRAIN_LEADER_TTL"
ENV_NPROC_PER_NODE = "ETRAIN_NPROC_PER_NODE"
ENV_WORK_DIR = "ETRAIN_WORK_DIR"
ENV_RDZV_HOST = "ETRAIN_RDZV_HOST"
ENV_SOCKET_IFNAME = "ETRAIN_SOCKET_IFNAME"
ENV_HEALTH_PORT = "ETRAIN_HEALTH_PORT"
ENV_SPARE = "ETRAIN_SPARE"
ENV_LOGS_PORT = "ETRAIN_LOGS_PORT"
ENV_LOGS_HOST = "ETRAIN_LOGS_HOST"
ENV_LEASE_TTL = "ETRAIN_LEASE_TTL"
ENV_JOB_UID_RANGE = "ETRAIN_JOB_UID_RANGE"
ENV_JOB_OWNER = "ETRAIN_JOB_OWNER"
ENV_PYTHON = "ETRAIN_PYTHON"
ENV_SERVER = "ETRAIN_SERVER"
ENV_TOKEN = "ETRAIN_TOKEN"
ENV_TOKEN_FILE = "ETRAIN_TOKEN_FILE"
ENV_INSECURE = "ETRAIN_INSECURE"
ENV_JOB_RETENTION = "ETRAIN_JOB_RETENTION"
ENV_QUOTAS_FILE = "ETRAIN_QUOTAS_FILE"


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _add(p: argparse.ArgumentParser, flag: str, var: str, help: str = "", default: str | None = None,
         **kwargs: Any) -> None:
    """``flag``, defaulting to ``$var`` (argparse converts a string default with the flag's ``type``)."""
    p.add_argument(flag, default=_env(var, default), help=f"{help} ({var})".lstrip(), **kwargs)


def _first_line(exc: BaseException) -> str:
    """One line for an etcd failure: gRPC errors carry their useful part in ``details = "..."``."""
    text = str(exc)
    found = re.search(r'details = "([^"]*)"', text)
    head = text.splitlines()[0] if text else type(exc).__name__
    if found:
        head = head.split("<_InactiveRpcError")[0].split("<_MultiThreadedRendezvous")[0].rstrip(" :")
        return f"{head}: {found.group(1)}"
    return head


def _fail(message: str, code: int = 2) -> int:
    print(f"etrain: {message}", file=sys.stderr)
    return code


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# -- server commands -------------------------------------------------------------------------------------
def _add_etcd_flags(p: argparse.ArgumentParser) -> None:
    _add(p, "--etcd", contract.ETCD_ENDPOINTS, "etcd endpoints host:port,...")
    _add(p, "--etcd-ca-cert", contract.ETCD_CA_CERT, "CA bundle")
    _add(p, "--etcd-cert", contract.ETCD_CERT, "client certificate")
    _add(p, "--etcd-key", contract.ETCD_KEY, "client key")
    _add(p, "--etcd-user", contract.ETCD_USER, "etcd user")
    _add(p, "--etcd-password-file", contract.ETCD_PASSWORD_FILE, "file holding the etcd password")
    _add(p, "--etcd-connect-timeout", ENV_ETCD_CONNECT_TIMEOUT, "seconds to wait for etcd at start-up", "5",
         type=float)  # fmt: skip
    _add(p, "--prefix", ENV_PREFIX, "etcd key prefix", DEFAULT_PREFIX)
    _add(p, "--log-level", ENV_LOG_LEVEL, default="info")


def _etcd_options(args: argparse.Namespace) -> EtcdOptions:
    if not args.etcd:
        raise ConfigError(f"no etcd endpoints: pass --etcd or set {contract.ETCD_ENDPOINTS}")
    if args.etcd_user and not args.etcd_password_file:
        raise ConfigError("--etcd-user needs --etcd-password-file")
    return EtcdOptions(
        endpoints=args.etcd,
        ca_cert=args.etcd_ca_cert,
        cert=args.etcd_cert,
        cert_key=args.etcd_key,
        user=args.etcd_user,
        password_file=args.etcd_password_file,
        connect_timeout=timedelta(seconds=args.etcd_connect_timeout),
    )


def _check_etcd(options: EtcdOptions) -> None:
    try:
        config = options.config()
    except ValueError as exc:
        raise ConfigError(f"etcd settings: {exc}") from exc
    check_reachable(config, timeout=options.connect_timeout)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _truthy(value: object) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes")


def cmd_controller(args: argparse.Namespace) -> int:
    import uvicorn

    from service.api.app import create_app

    _setup_logging(args.log_level)
    try:
        etcd = _etcd_options(args)
        tokens = load_tokens(args.tokens_file) if args.tokens_file else None
        if tokens is None and not _loopback(args.host) and not _truthy(args.insecure):
            raise ConfigError(
                f"refusing to serve the API on {args.host} without --tokens-file: anyone reaching the port would "
                "be admin (give --tokens-file, bind a loopback --host, or pass --insecure)"
            )
        if args.job_retention <= 0:
            raise ConfigError("--job-retention must be > 0 seconds")
        quotas = load_quotas(args.quotas) if args.quotas else Quotas()
        settings = Settings(
            etcd=etcd,
            prefix=args.prefix,
            host=args.host,
            port=args.port,
            tokens=tokens,
            checkpoint_root=args.checkpoint_root,
            leader_ttl=timedelta(seconds=args.leader_ttl),
            reconcile=ReconcileConfig(terminal_retention=timedelta(seconds=args.job_retention), quotas=quotas),
        )
        _check_etcd(etcd)
    except ConfigError as exc:
        return _fail(str(exc))
    except EtcdError as exc:
        return _fail(f"controller: {_first_line(exc)}")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        lifespan="on",
    )
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from service.agent.node import AgentError, create_agent

    _setup_logging(args.log_level)
    if not args.node_name:
        return _fail(f"agent: --node-name (or {contract.NODE_NAME}) is required")
    try:
        compat.check_torch()  # the torch its torchrun runs on: refuse a node that could not train
    except compat.TorchCompatError as exc:
        return _fail(f"agent: {exc}")
    try:
        uids = UidRange.parse(args.job_uid_range) if args.job_uid_range else None
    except ValueError as exc:
        return _fail(f"agent: --job-uid-range: {exc}")
    try:
        etcd = _etcd_options(args)
        settings = AgentSettings(
            etcd=etcd,
            node_name=args.node_name,
            prefix=args.prefix,
            nproc_per_node=args.nproc_per_node,
            work_dir=Path(args.work_dir).resolve(),
            rdzv_host=args.rdzv_host,
            socket_ifname=args.socket_ifname,
            health_port=args.health_port,
            spare=bool(args.spare),
            logs_port=args.logs_port,
            logs_host=args.logs_host,
            lease_ttl=timedelta(seconds=args.lease_ttl),
            job_uid_range=uids,
            job_owner=args.job_owner or None,
            python=args.python or sys.executable,
        )
        _check_etcd(etcd)
        agent = create_agent(settings)
        agent.register()
    except ConfigError as exc:
        return _fail(str(exc))
    except (EtcdError, AgentError) as exc:
        return _fail(f"agent: {_first_line(exc)}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.run(stop)
    return 0


# -- client commands ---------------------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> ApiClient:
    token = _env(ENV_TOKEN)
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
        return _fail("resize: give --min, --max or both")
    with _client(args) as api:
        job = api.resize(args.id, args.min, args.max)
    spec = job["spec"]
    print(f"{job['id']}: min_nodes {spec['min_nodes']}, max_nodes {spec['max_nodes']} (state {job['state']}, "
          f"{len(job['nodes'])} node(s) now)")  # fmt: skip
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
        return _fail(f"cannot write {args.output}: {exc.strerror or exc}")
    print(f"{args.id}: {len(trace.get('traceEvents', []))} trace events written to {args.output} "
          "(open it in https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr)  # fmt: skip
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
        if job["state"] in _TERMINAL:
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

    def client_cmd(name: str, fn: Callable[[argparse.Namespace], int], help: str,
                   under: Any = None) -> argparse.ArgumentParser:  # fmt: skip
        p = (under or sub).add_parser(name, help=help)
        _add(p, "--server", ENV_SERVER, "controller URL", "http://127.0.0.1:8080")
        _add(p, "--token-file", ENV_TOKEN_FILE, f"file holding the API bearer token (or set {ENV_TOKEN})")
        p.add_argument("--token", action=_NoTokenOnCommandLine, help=argparse.SUPPRESS)
        p.set_defaults(fn=fn)
        return p

    p = sub.add_parser("controller", help="run the REST controller (one or more replicas)")
    _add_etcd_flags(p)
    _add(p, "--host", ENV_HOST, default="0.0.0.0")
    _add(p, "--port", ENV_PORT, default="8080", type=int)
    _add(p, "--tokens-file", ENV_TOKENS_FILE,
         "YAML/JSON {tokens: [{token, role: admin|user|read, name}]}; none: auth off")  # fmt: skip
    _add(p, "--checkpoint-root", ENV_CHECKPOINT_ROOT,
         "jobs' checkpoints must lie below this URL; default <root>/<job id>")  # fmt: skip
    _add(p, "--leader-ttl", ENV_LEADER_TTL, "leader lease TTL, seconds", "5", type=float)
    _add(p, "--job-retention", ENV_JOB_RETENTION, "finished jobs (with their events) are deleted this many seconds "
         "after they end", str(7 * 24 * 3600), type=float)  # fmt: skip
    _add(p, "--quotas", ENV_QUOTAS_FILE, "YAML/JSON node quotas {users: {NAME: N}, queues: {QUEUE: N}, "
         "default_user: N, limits: {default: L, users: {NAME: L}}} (L: what user tokens submit: max_priority, queues, "
         "max_pending); none: no quotas")  # fmt: skip
    p.add_argument("--insecure", action="store_true", default=_env(ENV_INSECURE, "") or False,
                   help=f"serve a non-loopback --host without --tokens-file: anyone reaching it is admin "
                   f"({ENV_INSECURE})")  # fmt: skip
    p.set_defaults(fn=cmd_controller)

    p = sub.add_parser("agent", help="run a node agent (one per node)")
    _add_etcd_flags(p)
    _add(p, "--node-name", contract.NODE_NAME, "unique node name")
    _add(p, "--nproc-per-node", ENV_NPROC_PER_NODE, "worker slots of this node", "1", type=int)
    _add(p, "--work-dir", ENV_WORK_DIR, "where job logs go", "etrain-work")
    _add(p, "--rdzv-host", ENV_RDZV_HOST, "address other nodes reach this node's workers at")
    _add(p, "--socket-ifname", ENV_SOCKET_IFNAME, "network interface of the workers' collectives: their "
         "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless the job's env sets them")  # fmt: skip
    _add(p, "--health-port", ENV_HEALTH_PORT, "serve GET /healthz on this port; 0: off", "0", type=int)
    p.add_argument("--spare", action="store_true", default=_env(ENV_SPARE, "") not in ("", "0", "false"),
                   help="a hot spare: held back for jobs that lost a node, which it joins first; keeps a zygote "
                   f"with torch imported for their workers ({ENV_SPARE})")  # fmt: skip
    _add(p, "--logs-port", ENV_LOGS_PORT, "serve the jobs' logs to the controller (etrain logs) on this port; 0: off",
         "0", type=int)  # fmt: skip
    _add(p, "--logs-host", ENV_LOGS_HOST, "address the logs port binds", "0.0.0.0")
    _add(p, "--lease-ttl", ENV_LEASE_TTL, "node lease TTL, seconds: how fast a dead node is noticed", "10",
         type=float)  # fmt: skip
    _add(p, "--job-uid-range", ENV_JOB_UID_RANGE, "LOW-HIGH: run each job as a uid and gid of its own from this range "
         "(needs root or CAP_SETUID/SETGID/CHOWN/KILL)")  # fmt: skip
    _add(p, "--python", ENV_PYTHON, "the interpreter torchrun and the workers run on (default: the agent's)")
    _add(p, "--job-owner", ENV_JOB_OWNER, "run only this user's jobs (a token's name); for an agent that cannot "
         "switch uid")  # fmt: skip
    p.set_defaults(fn=cmd_agent)

    p = client_cmd("submit", cmd_submit, "submit a job file (YAML/JSON)")
    p.add_argument("file")
    p.add_argument("--follow", action="store_true", help="then follow it")
    p = client_cmd("list", cmd_list, "list jobs")
    p.add_argument("--state", choices=sorted(["pending", "running", "recovering", *_TERMINAL]))
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
    for action, text in (("cordon", "place no new job on the node (its jobs stay)"),
                         ("drain", "cordon the node and move its jobs off (planned scale-down)"),
                         ("uncordon", "take back a cordon or drain: the node takes new jobs again")):  # fmt: skip
        p = client_cmd(action, cmd_node, text, under=node_sub)
        p.add_argument("name", metavar="NODE")
        p.add_argument("--reason", help="why (shown with the node)")
        p.add_argument("--json", action="store_true", help="print the node as JSON")

    p = sub.add_parser("demo", help="local cluster demo: etcd, controller, 3 agents, a job, an agent killed")
    p.add_argument("--workdir", default=".demo", help="where etcd data, logs and checkpoints go")
    p.add_argument(
        "--keep", action="store_true", help="leave the cluster running at the end (Ctrl-C stops it)"
    )
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fn: Callable[[argparse.Namespace], int] = args.fn
    try:
        return fn(args)
    except ApiError as exc:
        return _fail(str(exc), 3 if exc.status else 2)
    except EtcdConnectionError as exc:
        return _fail(_first_line(exc))
    except ConfigError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
