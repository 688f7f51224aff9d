"""``etrain controller``, ``etrain agent`` and ``etrain etcd-bootstrap``: the commands that run the service.

The etcd connection and the node name come from the variables the agent passes to workers
(:mod:`elastic.contract.env`), so that one set of variables serves both; the rest are the CLI's own.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from elastic import compat
from elastic.contract import env as contract
from elastic.etcd import EtcdError, check_reachable
from elastic.etcd.config import CONNECT_TIMEOUT, EtcdOptions, read_password_file
from service.cli.common import add_flag, env_or, fail, first_line, setup_logging
from service.core.config import AgentSettings, ConfigError, Settings, UidRange, load_quotas, load_tokens
from service.core.keys import DEFAULT_PREFIX
from service.core.view import Quotas, ReconcileConfig

__all__ = ["add_server_commands"]

# The variables that give flags their defaults: the CLI's own here; the etcd connection and the node name
# are the names the agent passes to workers (elastic.contract.env), so that one set of variables serves both.
ENV_ETCD_CONNECT_TIMEOUT = "ETRAIN_ETCD_CONNECT_TIMEOUT"
ENV_PREFIX = "ETRAIN_PREFIX"
ENV_LOG_LEVEL = "ETRAIN_LOG_LEVEL"
ENV_ETCD_AGENT_USER = "ETRAIN_ETCD_AGENT_USER"
ENV_ETCD_AGENT_PASSWORD_FILE = "ETRAIN_ETCD_AGENT_PASSWORD_FILE"
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
ENV_JOB_TMP_DIRS = "ETRAIN_JOB_TMP_DIRS"
ENV_INSECURE = "ETRAIN_INSECURE"
ENV_JOB_RETENTION = "ETRAIN_JOB_RETENTION"
ENV_QUOTAS_FILE = "ETRAIN_QUOTAS_FILE"


def _add_etcd_flags(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--etcd", contract.ETCD_ENDPOINTS, "etcd endpoints host:port,...")
    add_flag(p, "--etcd-ca-cert", contract.ETCD_CA_CERT, "CA bundle")
    add_flag(p, "--etcd-cert", contract.ETCD_CERT, "client certificate")
    add_flag(p, "--etcd-key", contract.ETCD_KEY, "client key")
    add_flag(p, "--etcd-user", contract.ETCD_USER, "etcd user")
    add_flag(p, "--etcd-password-file", contract.ETCD_PASSWORD_FILE, "file holding the etcd password")
    add_flag(
        p,
        "--etcd-connect-timeout",
        ENV_ETCD_CONNECT_TIMEOUT,
        "seconds to wait for etcd at start-up",
        f"{CONNECT_TIMEOUT.total_seconds():g}",
        type=float,
    )
    add_flag(p, "--prefix", ENV_PREFIX, "etcd key prefix", DEFAULT_PREFIX)
    add_flag(p, "--log-level", ENV_LOG_LEVEL, default="info")


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

    setup_logging(args.log_level)
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
        return fail(str(exc))
    except EtcdError as exc:
        return fail(f"controller: {first_line(exc)}")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        lifespan="on",
    )
    return 0


def cmd_etcd_bootstrap(args: argparse.Namespace) -> int:
    from service.controller.etcd_bootstrap import (
        ROOT,
        AuthBootstrap,
        bootstrap_etcd_auth,
        node_password,
        node_principal,
    )

    setup_logging(args.log_level)
    try:
        if (args.etcd_user or ROOT) != ROOT:
            raise ConfigError(f"etcd-bootstrap: --etcd-user must be {ROOT!r} (its password file is root's password)")
        nodes, removed = args.node or [], args.remove_node or []
        if not args.etcd_password_file or not (args.agent_password_file or nodes or removed):
            raise ConfigError(
                "etcd-bootstrap: give --etcd-password-file (root's) and the agents' users: --node NAME "
                "(one user per node, its password in --node-password-dir) or the shared "
                "--agent-password-file"
            )
        if nodes and not args.node_password_dir:
            raise ConfigError("etcd-bootstrap: --node needs --node-password-dir (each node's password file there)")
        args.etcd_user = ROOT
        config = _etcd_options(args).config()
        assert config.password is not None
        plan = AuthBootstrap(
            root_password=config.password,
            agent_user=args.agent_user if args.agent_password_file else None,
            agent_password=read_password_file(args.agent_password_file) if args.agent_password_file else None,
            prefix=args.prefix,
            nodes=tuple((name, node_password(Path(args.node_password_dir), name)) for name in nodes),
            remove_nodes=tuple(removed),
            prune_nodes=args.prune_nodes,
        )
        outcome = bootstrap_etcd_auth(config, plan)
    except (ConfigError, ValueError, OSError) as exc:
        return fail(str(exc))
    except EtcdError as exc:
        return fail(first_line(exc))
    users = [ROOT, *([plan.agent_user] if plan.agent_user else []), *(node_principal(n) for n, _ in plan.nodes)]
    print(
        f"etcd authentication {outcome.value}: users {' and '.join(repr(u) for u in users)}"
        + (f"; removed {', '.join(node_principal(n) for n in removed)}" if removed else "")
    )
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from service.agent.node import AgentError, create_agent

    setup_logging(args.log_level)
    if not args.node_name:
        return fail(f"agent: --node-name (or {contract.NODE_NAME}) is required")
    try:
        compat.check_torch_once()  # the torch its torchrun runs on: refuse a node that could not train
    except compat.TorchCompatError as exc:
        return fail(f"agent: {exc}")
    try:
        uids = UidRange.parse(args.job_uid_range) if args.job_uid_range else None
    except ValueError as exc:
        return fail(f"agent: --job-uid-range: {exc}")
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
            job_tmp_dirs=tuple(Path(d) for d in args.job_tmp_dirs.split(",") if d),
            python=args.python or sys.executable,
        )
        _check_etcd(etcd)
        agent = create_agent(settings)
        agent.register()
    except ConfigError as exc:
        return fail(str(exc))
    except (EtcdError, AgentError) as exc:
        return fail(f"agent: {first_line(exc)}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.run(stop)
    return 0


def add_server_commands(sub: Any) -> None:
    """The server commands, added to the ``etrain`` parser's subcommands ``sub``."""
    p = sub.add_parser("controller", help="run the REST controller (one or more replicas)")
    _add_etcd_flags(p)
    add_flag(p, "--host", ENV_HOST, default="0.0.0.0")
    add_flag(p, "--port", ENV_PORT, default="8080", type=int)
    add_flag(
        p,
        "--tokens-file",
        ENV_TOKENS_FILE,
        "YAML/JSON {tokens: [{token, role: admin|user|read, name}]}; none: auth off",
    )
    add_flag(
        p,
        "--checkpoint-root",
        ENV_CHECKPOINT_ROOT,
        "jobs' checkpoints must lie below this URL; default <root>/<job id>",
    )
    add_flag(p, "--leader-ttl", ENV_LEADER_TTL, "leader lease TTL, seconds", "5", type=float)
    add_flag(
        p,
        "--job-retention",
        ENV_JOB_RETENTION,
        "finished jobs (with their events) are deleted this many seconds after they end",
        str(7 * 24 * 3600),
        type=float,
    )
    add_flag(
        p,
        "--quotas",
        ENV_QUOTAS_FILE,
        "YAML/JSON node quotas {users: {NAME: N}, queues: {QUEUE: N}, "
        "default_user: N, limits: {default: L, users: {NAME: L}}} (L: what user tokens submit: max_priority, queues, "
        "max_pending, max_jobs; a user token's unset ones: max_priority 0, no queues, max_jobs 1000); none: no node "
        "quotas, and those defaults",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=env_or(ENV_INSECURE, "") or False,
        help=f"serve a non-loopback --host without --tokens-file: anyone reaching it is admin ({ENV_INSECURE})",
    )
    p.set_defaults(fn=cmd_controller)

    p = sub.add_parser("agent", help="run a node agent (one per node)")
    _add_etcd_flags(p)
    add_flag(p, "--node-name", contract.NODE_NAME, "unique node name")
    add_flag(p, "--nproc-per-node", ENV_NPROC_PER_NODE, "worker slots of this node", "1", type=int)
    add_flag(p, "--work-dir", ENV_WORK_DIR, "where job logs go", "etrain-work")
    add_flag(p, "--rdzv-host", ENV_RDZV_HOST, "address other nodes reach this node's workers at")
    add_flag(
        p,
        "--socket-ifname",
        ENV_SOCKET_IFNAME,
        "network interface of the workers' collectives: their "
        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless the job's env sets them",
    )
    add_flag(p, "--health-port", ENV_HEALTH_PORT, "serve GET /healthz on this port; 0: off", "0", type=int)
    p.add_argument(
        "--spare",
        action="store_true",
        default=env_or(ENV_SPARE, "") not in ("", "0", "false"),
        help="a hot spare: held back for jobs that lost a node, which it joins first; keeps a zygote "
        f"with torch imported for their workers ({ENV_SPARE})",
    )
    add_flag(
        p,
        "--logs-port",
        ENV_LOGS_PORT,
        "serve the jobs' logs to the controller (etrain logs) on this port; 0: off",
        "0",
        type=int,
    )
    add_flag(p, "--logs-host", ENV_LOGS_HOST, "address the logs port binds", "0.0.0.0")
    add_flag(
        p, "--lease-ttl", ENV_LEASE_TTL, "node lease TTL, seconds: how fast a dead node is noticed", "10", type=float
    )
    add_flag(
        p,
        "--job-uid-range",
        ENV_JOB_UID_RANGE,
        "LOW-HIGH: run each job as a uid and gid of its own from this range "
        "(needs root or CAP_SETUID/SETGID/CHOWN/KILL)",
    )
    add_flag(
        p,
        "--job-tmp-dirs",
        ENV_JOB_TMP_DIRS,
        "with --job-uid-range: comma-separated directories where the "
        "files a released job uid owns at the top are deleted",
        "/tmp,/var/tmp,/dev/shm",
    )
    add_flag(p, "--python", ENV_PYTHON, "the interpreter torchrun and the workers run on (default: the agent's)")
    add_flag(
        p,
        "--job-owner",
        ENV_JOB_OWNER,
        "run only this user's jobs (a token's name); for an agent that cannot switch uid",
    )
    p.set_defaults(fn=cmd_agent)

    p = sub.add_parser(
        "etcd-bootstrap",
        help="make etcd's root and agent users, then turn etcd authentication on "
        "(idempotent; the chart's controller pod runs it first)",
    )
    _add_etcd_flags(p)
    add_flag(
        p,
        "--agent-user",
        ENV_ETCD_AGENT_USER,
        "the shared agents' etcd user (the former way: it reads every job's secrets; prefer --node)",
        "etrain-agent",
    )
    add_flag(
        p,
        "--agent-password-file",
        ENV_ETCD_AGENT_PASSWORD_FILE,
        "file holding the shared agents' etcd password (none: no shared user)",
    )
    p.add_argument(
        "--node",
        action="append",
        metavar="NAME",
        help="make (or confirm) the etcd user etrain-node-NAME "
        "of that node's agent, which reaches only its node's keys; repeat for each node",
    )
    p.add_argument(
        "--node-password-dir",
        metavar="DIR",
        help="each --node's password file, DIR/NAME: read if it "
        "exists, else a random one is written there (0600) for the node's agent (--etcd-password-file)",
    )
    p.add_argument(
        "--remove-node",
        action="append",
        metavar="NAME",
        help="delete the etcd user and role of a node "
        "that left the cluster (its tokens stop working at once); repeatable",
    )
    p.add_argument(
        "--prune-nodes",
        action="store_true",
        help="also delete every node's etcd user that no --node names "
        "(an etcd of this service alone: the chart's, whose agents are listed in full)",
    )
    p.set_defaults(fn=cmd_etcd_bootstrap)
