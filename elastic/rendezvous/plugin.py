"""``torchrun --rdzv-backend=etcd-v3``: the handler factory registered in the ``torchrun.handlers`` group.

The entry point itself is :func:`elastic.rendezvous.entry.plugin` (a module that imports nothing from
torch, see there), which returns a function calling :func:`create_handler`.

Options come from ``--rdzv-endpoint`` (``host:port[,host:port...]``) and ``--rdzv-conf`` (see the README
table; parsed by :func:`elastic.contract.rendezvous.parse`).

``--rdzv-conf recovery=live`` builds :class:`~elastic.rendezvous.live_handler.LiveRendezvousHandler` instead
(each agent runs its own node's workers; the workers form the job-wide group themselves) and exports the
live group's variables to the workers (:func:`live_worker_environ`).

An elastic job (``--nnodes=MIN:MAX`` with MIN < MAX) with torchrun's default ``--max-restarts=0`` is lost whole at
its first failure: a node's loss fails its peers' workers, and an agent with no restart left exits. The handler
warns once, as it is created, when torchrun runs so (:func:`torchrun_max_restarts`: torch gives the handler only
its ``RendezvousParameters``, which do not carry ``max_restarts``; the agent that has it is built after the
handler, so the value is read from torchrun's own command line, parsed by torchrun's own parser).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import weakref
from collections.abc import Mapping, Sequence

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)

from elastic import compat
from elastic.contract.env import ETCD_ENDPOINTS, ETCD_PASSWORD_FILE, ETCD_VARIABLES, LiveEnv, WorkerEnv
from elastic.contract.recovery import RecoveryMode
from elastic.contract.rendezvous import (
    DEFAULT_KEY_PREFIX,
    RECOVERY_MODES,
    RendezvousConf,
    ignored_keys_given,
)
from elastic.contract.rendezvous import parse as parse_conf
from elastic.etcd import EtcdConfig, EtcdConnectionError, create_client
from elastic.etcd.config import EtcdOptions, read_password_file
from elastic.rendezvous.agent_hooks import run_agent_start_hooks
from elastic.rendezvous.etcd_v3_handler import EtcdV3RendezvousHandler, HandlerSettings
from elastic.rendezvous.live_handler import LiveRendezvousHandler
from elastic.rendezvous.protocol import RendezvousKeys, RoundRules

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "RECOVERY_MODES",
    "EtcdV3RendezvousHandler",
    "LiveRendezvousHandler",
    "create_handler",
    "etcd_config_from_params",
    "etcd_options_from_params",
    "live_worker_environ",
    "recovery_mode",
    "rendezvous_conf",
    "torchrun_max_restarts",
]


def rendezvous_conf(params: RendezvousParameters) -> RendezvousConf:
    """The ``--rdzv-conf`` of a torchrun invocation, typed (a ValueError naming a bad key)."""
    return parse_conf(params.config)


def etcd_options_from_params(params: RendezvousParameters) -> EtcdOptions:
    """The etcd connection of a torchrun invocation as named (files unread)."""
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint is required for the etcd-v3 backend (host:port[,host:port...])")
    conf = rendezvous_conf(params)
    return EtcdOptions(
        endpoints=params.endpoint,
        ca_cert=conf.ca_cert,
        cert=conf.cert,
        cert_key=conf.cert_key,
        user=conf.user,
        password_file=conf.password_file,
        password=conf.password,
        request_timeout=conf.request_timeout,
        op_timeout=conf.op_timeout,
        connect_timeout=conf.connect_timeout,
    )


def etcd_config_from_params(params: RendezvousParameters) -> EtcdConfig:
    """The etcd connection settings of a torchrun invocation (``password_file`` wins over ``password``)."""
    options = etcd_options_from_params(params)
    if options.password_file:
        try:
            options = dataclasses.replace(options, password=read_password_file(options.password_file))
        except ValueError as exc:
            raise ValueError(f"--rdzv-conf password_file: {exc}") from exc
    return options.config()


def recovery_mode(params: RendezvousParameters) -> str:
    """``--rdzv-conf recovery``: one of :data:`RECOVERY_MODES` (a ValueError naming them otherwise)."""
    return rendezvous_conf(params).recovery.value


def live_worker_environ(
    params: RendezvousParameters, keys: RendezvousKeys, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What an agent in live recovery exports to its workers: the live group (``ETRAIN_LIVE_PREFIX`` =
    ``keys.live``, ``ETRAIN_LIVE_NODES`` = ``min:max``), and the rendezvous' etcd connection as the
    ``ETRAIN_ETCD_*`` variables unless ``env`` (default: this process's environment) already names one
    (``ETRAIN_ETCD_ENDPOINTS``, as the job service sets it).

    Files go as absolute paths, a password only as its file: an inline ``password`` with a ``user`` is a
    ValueError (the workers could not authenticate)."""
    env = os.environ if env is None else env
    out = LiveEnv(keys.live, params.min_nodes, params.max_nodes).to_environ()
    if env.get(ETCD_ENDPOINTS):
        return out
    options = etcd_options_from_params(params)
    if options.user and not options.password_file:
        raise ValueError(
            "--rdzv-conf recovery=live needs password_file (not password) with user: the workers connect to "
            f"etcd themselves and read the password from that file ({ETCD_PASSWORD_FILE})"
        )
    worker_etcd = WorkerEnv(etcd=dataclasses.replace(options, password=None)).to_environ()
    out.update({name: value for name, value in worker_etcd.items() if name in ETCD_VARIABLES})
    return out


def _running_under_torchrun_cli() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return os.path.basename(sys.argv[0]) == "torchrun" or getattr(spec, "name", "") == "torch.distributed.run"


#: ``__main__`` of a torchrun agent: the ``torchrun`` script's or ``python -m torch.distributed.run``'s, or stock
#: torchrun forked from a prefork zygote (:mod:`elastic.prefork.torchrun`)
_TORCHRUN_MAINS = ("torch.distributed.run", "elastic.prefork.torchrun")


def torchrun_max_restarts(argv: Sequence[str] | None = None) -> int | None:
    """torchrun's ``--max-restarts`` in this agent (``argv``, default ``sys.argv``: torchrun's command line, which
    its own parser reads again, ``PET_MAX_RESTARTS`` included), or None where this process is not a torchrun agent
    run from its command line (a handler made in a test, a launcher calling ``elastic_launch``)."""
    if argv is None:
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        if os.path.basename(sys.argv[0]) != "torchrun" and getattr(spec, "name", "") not in _TORCHRUN_MAINS:
            return None
        argv = sys.argv
    from torch.distributed.run import get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(list(argv[1:]))
    except (SystemExit, ValueError):  # not torchrun's command line after all
        return None
    return int(args.max_restarts)


def _warn_if_one_failure_ends_the_job(params: RendezvousParameters, live: bool) -> None:
    if params.min_nodes >= params.max_nodes or torchrun_max_restarts() != 0:
        return
    what = "this node leaves the job" if live else "a lost node fails its peers' workers too, so the whole job ends"
    logger.warning(
        "etcd-v3 rendezvous: --max-restarts=0 (torchrun's default) with --nnodes=%d:%d: the first failure ends "
        "this agent (%s); pass --max-restarts=N (e.g. 3) for the job to survive failures",
        params.min_nodes,
        params.max_nodes,
        what,
    )


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the ``etcd-v3`` rendezvous handler for one torchrun agent.

    Fails fast, with one line naming the endpoints, when etcd cannot be reached within
    ``connect_timeout``.
    """
    compat.disable_shared_rdzv_store()  # before torch's agent reads it (see there)
    conf = rendezvous_conf(params)
    live = conf.recovery is RecoveryMode.LIVE
    _warn_if_one_failure_ends_the_job(params, live)
    keys = RendezvousKeys.of(conf.key_prefix, params.run_id)
    # checked before etcd is reached; exported once the handler is up
    worker_env = live_worker_environ(params, keys) if live else {}
    for key in ignored_keys_given(params.config):
        logger.info("--rdzv-conf %s is not used by the etcd-v3 rendezvous (liveness comes from leases)", key)

    try:
        compat.check_torch()
    except compat.TorchCompatError as exc:
        if _running_under_torchrun_cli():
            raise SystemExit(f"error: {exc}") from exc
        raise
    config = etcd_config_from_params(params)
    client = create_client(config)
    try:
        client.ping(timeout=config.connect_timeout)
    except EtcdConnectionError as exc:
        client.close()
        message = (
            f"etcd-v3 rendezvous: etcd unreachable at {client.endpoints_label} "
            f"(connect_timeout={config.connect_timeout.total_seconds():g}s)"
        )
        if _running_under_torchrun_cli():
            # torchrun would print a long traceback for an exception: exit with one line instead.
            raise SystemExit(f"error: {message}") from exc
        raise RendezvousConnectionError(message) from exc

    if worker_env:
        # torchrun's workers inherit the agent's environment
        os.environ.update(worker_env)
        logger.info("live recovery: the workers meet under %s", keys.live)
    if _running_under_torchrun_cli():
        run_agent_start_hooks(sys.argv)  # e.g. the prefork zygote (see elastic.rendezvous.agent_hooks)
    settings = HandlerSettings(
        rules=RoundRules(params.min_nodes, params.max_nodes, conf.last_call_timeout),
        node_ttl=conf.node_ttl,
        state_ttl=conf.state_ttl,
        join_timeout=conf.join_timeout,
        store_timeout=conf.store_timeout,
        min_wake_interval=conf.min_wake_interval,
    )
    handler: EtcdV3RendezvousHandler | LiveRendezvousHandler
    if live:
        handler = LiveRendezvousHandler(client, params.run_id, keys, settings, local_addr=params.local_addr)
    else:
        handler = EtcdV3RendezvousHandler(client, params.run_id, keys, settings, local_addr=params.local_addr)
    # the client lives as long as its handler (queries such as is_closed() still read etcd after shutdown()):
    # a process that makes and drops handlers, as a test does, leaks no gRPC channel that keeps reconnecting
    weakref.finalize(handler, client.close)
    handler.register()
    return handler
