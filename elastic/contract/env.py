"""The worker environment contract: every ``ETRAIN_*`` variable the project passes to training processes.

The job service's node agent writes :class:`WorkerEnv` into the environment of torchrun (and so of every
worker) with :meth:`WorkerEnv.apply`; the library reads it back with :meth:`WorkerEnv.from_environ`. Outside
the service (plain torchrun, tests) :attr:`WorkerEnv.job` is None and a user may set the few variables
that make sense alone (``ETRAIN_JOB_ID``, ``ETRAIN_CHECKPOINT_URL``, ``ETRAIN_LOCAL_SNAPSHOT_EVERY``).

Variables, by who sets them:

- the node agent, for a job's workers (all of these or none): :data:`JOB_NAME`, :data:`GENERATION`,
  :data:`NODE_NAME`, :data:`PROGRESS_KEY`, :data:`LR_POLICY` (JSON of :meth:`elastic.contract.lr.LRPolicy.reference`),
  :data:`MIN_NODES`, :data:`MAX_NODES`;
- the node agent, or a user: :data:`JOB_ID` (the job's identity across torchrun runs: it keys node-local
  snapshots), :data:`CHECKPOINT_URL`, :data:`LOCAL_SNAPSHOT_EVERY` (0: off), and the etcd
  connection of progress reports :data:`ETCD_ENDPOINTS`, :data:`ETCD_CA_CERT`, :data:`ETCD_CERT`,
  :data:`ETCD_KEY`, :data:`ETCD_USER`, :data:`ETCD_PASSWORD_FILE` (files, never the password itself; the
  ``etrain`` CLI reads the same names as defaults of its ``--etcd*`` flags);
- the ``etcd-v3`` rendezvous handler in live mode (``--rdzv-conf recovery=live``), for the workers it starts,
  or a user: :data:`LIVE_PREFIX` (the etcd prefix of the job's live group, see :mod:`elastic.live`) and
  :data:`LIVE_NODES` (``MIN:MAX`` nodes), with the ``ETRAIN_ETCD_*`` connection above when the user set none;
- a user, to tune the library: :data:`LOCAL_SNAPSHOT_DIR` (``elastic.checkpoint.tiers``), :data:`PREFORK`,
  :data:`PREFORK_PRELOAD`, :data:`PREFORK_DIR` (``elastic.prefork``); the service's agent, for a warm job
  (``elastic.prefork``): :data:`PREFORK_OWNER`, and unless it is a hot spare :data:`PREFORK_KEY` and
  :data:`PREFORK_GRACE` (the job's own zygote on that node, which forks its torchrun and its workers);
- ``elastic.prefork`` itself, for the worker it forks: :data:`PREFORK_CLIENT` (the client's pid).

torchrun's own variables, which every worker it starts has (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_RUN_ID``), are read through :class:`TorchrunEnv`; :meth:`TorchrunEnv.launched` tells a process
torchrun (or a launcher setting torch's ``env://`` variables) started from a plain ``python train.py`` (none of
them set: a world of one) and from a half-set environment (an error naming what is missing).

This module imports nothing heavy (no torch, no etcd client): ``elastic.prefork`` reads its names here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from elastic.contract.lr import LRPolicy

if TYPE_CHECKING:
    from elastic.etcd.config import EtcdOptions

__all__ = [
    "AGENT_WRITTEN",
    "CHECKPOINT_KEY",
    "CHECKPOINT_KEY_FILE",
    "CHECKPOINT_URL",
    "ETCD_CA_CERT",
    "ETCD_CERT",
    "ETCD_ENDPOINTS",
    "ETCD_KEY",
    "ETCD_PASSWORD_FILE",
    "ETCD_USER",
    "ETCD_VARIABLES",
    "GENERATION",
    "HOST_MALLOC",
    "JOB_ID",
    "JOB_NAME",
    "LIVE_NODES",
    "LIVE_PREFIX",
    "LOCAL_SNAPSHOT_DIR",
    "LOCAL_SNAPSHOT_EVERY",
    "LR_POLICY",
    "MAX_NODES",
    "MIN_NODES",
    "NODE_NAME",
    "PORT_RANGE",
    "PREFIX",
    "PREFORK",
    "PREFORK_CLIENT",
    "PREFORK_DIR",
    "PREFORK_GRACE",
    "PREFORK_KEY",
    "PREFORK_OWNER",
    "PREFORK_PRELOAD",
    "PROGRESS_KEY",
    "TORCHRUN_GROUP_RANK",
    "TORCHRUN_LOCAL_RANK",
    "TORCHRUN_LOCAL_WORLD_SIZE",
    "TORCHRUN_MASTER_ADDR",
    "TORCHRUN_MASTER_PORT",
    "TORCHRUN_PREFIX",
    "TORCHRUN_RANK",
    "TORCHRUN_RESTART_COUNT",
    "TORCHRUN_ROLE_RANK",
    "TORCHRUN_RUN_ID",
    "TORCHRUN_WORKER_VARIABLES",
    "TORCHRUN_WORLD_SIZE",
    "JobEnv",
    "LiveEnv",
    "TorchrunEnv",
    "WorkerEnv",
    "WorkerEnvError",
    "parse_lr_policy",
]

#: Every variable of the project starts with it (the job service reserves it in a job's ``env``).
PREFIX = "ETRAIN_"
# -- the job service's description of a worker's job (written by the node agent, all or none) ------------
JOB_NAME = "ETRAIN_JOB_NAME"
GENERATION = "ETRAIN_GENERATION"
NODE_NAME = "ETRAIN_NODE_NAME"  # the service's name of the worker's node (also the agent's --node-name)
PROGRESS_KEY = "ETRAIN_PROGRESS_KEY"
LR_POLICY = "ETRAIN_LR_POLICY"
MIN_NODES = "ETRAIN_MIN_NODES"
MAX_NODES = "ETRAIN_MAX_NODES"
# -- written by the node agent, or set by a user ------------------------------------------------------------
JOB_ID = "ETRAIN_JOB_ID"
CHECKPOINT_URL = "ETRAIN_CHECKPOINT_URL"
CHECKPOINT_KEY = "ETRAIN_CHECKPOINT_KEY"  # hex HMAC key of the job's snapshot manifests (CheckpointOptions)
# a file holding that key in hex (what the service's agent writes: a secret belongs in a file of the job's uid,
# never in an environment)
CHECKPOINT_KEY_FILE = "ETRAIN_CHECKPOINT_KEY_FILE"
LOCAL_SNAPSHOT_EVERY = "ETRAIN_LOCAL_SNAPSHOT_EVERY"
ETCD_ENDPOINTS = "ETRAIN_ETCD_ENDPOINTS"
ETCD_CA_CERT = "ETRAIN_ETCD_CA_CERT"
ETCD_CERT = "ETRAIN_ETCD_CERT"
ETCD_KEY = "ETRAIN_ETCD_KEY"
ETCD_USER = "ETRAIN_ETCD_USER"
ETCD_PASSWORD_FILE = "ETRAIN_ETCD_PASSWORD_FILE"
# -- the live group of live recovery (written by the etcd-v3 handler with recovery=live, or by a user) -------
LIVE_PREFIX = "ETRAIN_LIVE_PREFIX"
LIVE_NODES = "ETRAIN_LIVE_NODES"  # "MIN:MAX" nodes of the job (each with $LOCAL_WORLD_SIZE workers)
# -- the library's own settings ---------------------------------------------------------------------------
LOCAL_SNAPSHOT_DIR = "ETRAIN_LOCAL_SNAPSHOT_DIR"
PREFORK = "ETRAIN_PREFORK"
PREFORK_PRELOAD = "ETRAIN_PREFORK_PRELOAD"
PREFORK_DIR = "ETRAIN_PREFORK_DIR"
# the pid whose zygote the workers fork from (a node agent: a hot spare's keeps one warm between jobs, any other
# one per warm job); unset: the worker's torchrun agent
PREFORK_OWNER = "ETRAIN_PREFORK_OWNER"
# which of its owner's zygotes (a node agent's: the job's id); unset: the owner's only one
PREFORK_KEY = "ETRAIN_PREFORK_KEY"
# seconds a zygote whose owner died waits for its children to end before it kills them (the node agent's stop
# grace: a dead agent's torchrun gets SIGTERM and stops its workers as it would have); unset: none
PREFORK_GRACE = "ETRAIN_PREFORK_GRACE"
PREFORK_CLIENT = "ETRAIN_PREFORK_CLIENT"
# "0": the loop leaves glibc's malloc thresholds as they are (elastic.train.host_malloc); unset or "1": it sets them
HOST_MALLOC = "ETRAIN_HOST_MALLOC"
# "LOW-HIGH": the ports the local test servers take (elastic.testing.ports; each parallel test worker has its own)
PORT_RANGE = "ETRAIN_PORT_RANGE"
# -- torchrun's own, for each worker it starts (read only) -------------------------------------------------
TORCHRUN_RANK = "RANK"  # the worker's rank in torchrun's world (node-local under live recovery)
TORCHRUN_WORLD_SIZE = "WORLD_SIZE"
TORCHRUN_LOCAL_RANK = "LOCAL_RANK"
TORCHRUN_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
TORCHRUN_GROUP_RANK = "GROUP_RANK"  # the node's rank in the round
TORCHRUN_MASTER_ADDR = "MASTER_ADDR"  # where the process group's store is (torch's env://)
TORCHRUN_MASTER_PORT = "MASTER_PORT"
TORCHRUN_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHRUN_ROLE_RANK = "ROLE_RANK"  # the worker's rank among its role's workers (not read here)
#: torchrun's own prefix: it sets more than the two named above (TORCHELASTIC_MAX_RESTARTS, ...)
TORCHRUN_PREFIX = "TORCHELASTIC_"

#: what torch's ``env://`` needs to join a process group (torchrun sets them all, and LOCAL_RANK ... besides)
_GROUP_VARIABLES = (TORCHRUN_RANK, TORCHRUN_WORLD_SIZE, TORCHRUN_MASTER_ADDR, TORCHRUN_MASTER_PORT)
#: any of these set: a launcher started this process (a half-set environment is an error, never a world of one)
_LAUNCH_VARIABLES = (*_GROUP_VARIABLES, TORCHRUN_LOCAL_RANK, TORCHRUN_LOCAL_WORLD_SIZE, TORCHRUN_GROUP_RANK)
#: What torchrun sets for each worker, by name (and every ``TORCHRUN_PREFIX`` variable): a job spec may not set them.
TORCHRUN_WORKER_VARIABLES = (*_LAUNCH_VARIABLES, TORCHRUN_ROLE_RANK)
_JOB_VARIABLES = (JOB_NAME, GENERATION, NODE_NAME, PROGRESS_KEY, LR_POLICY, MIN_NODES, MAX_NODES)
#: The etcd connection (files and a user, never a password), as the workers read it (:attr:`WorkerEnv.etcd`).
ETCD_VARIABLES = (ETCD_ENDPOINTS, ETCD_CA_CERT, ETCD_CERT, ETCD_KEY, ETCD_USER, ETCD_PASSWORD_FILE)
#: Every variable :meth:`WorkerEnv.apply` owns: inherited values of these never reach the workers.
AGENT_WRITTEN = frozenset(
    (
        *_JOB_VARIABLES,
        JOB_ID,
        CHECKPOINT_URL,
        CHECKPOINT_KEY,
        CHECKPOINT_KEY_FILE,
        LOCAL_SNAPSHOT_EVERY,
        *ETCD_VARIABLES,
    )
)

_T = TypeVar("_T")


class WorkerEnvError(ValueError):
    """A worker environment that breaks the contract; the message is one line naming the variable."""


def parse_lr_policy(raw: str) -> LRPolicy:
    """The LR policy in ``ETRAIN_LR_POLICY``: the JSON of :meth:`LRPolicy.reference` (the one shape the job
    service writes and checkpoints keep)."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return LRPolicy.from_reference(data)
    except KeyError as exc:
        raise WorkerEnvError(f"{LR_POLICY} has no {exc.args[0]!r}: {raw!r}") from None
    except (ValueError, TypeError) as exc:
        raise WorkerEnvError(f"{LR_POLICY} is not an LR policy ({exc}): {raw!r}") from None


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise WorkerEnvError(f"{name} must be a whole number, got {raw!r}") from None


def _local_every(raw: str) -> int:
    if not (raw.isascii() and raw.isdigit()):
        raise WorkerEnvError(f"{LOCAL_SNAPSHOT_EVERY} must be a number of steps (0: off), got {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class JobEnv:
    """The job service's description of a worker's job (all of it or none is in the environment)."""

    job_name: str
    generation: int
    node_name: str  # the service's name of this worker's node
    progress_key: str  # the etcd key rank 0 reports progress to
    lr_policy: LRPolicy
    min_nodes: int
    max_nodes: int

    def to_environ(self) -> dict[str, str]:
        return {
            JOB_NAME: self.job_name,
            GENERATION: str(self.generation),
            NODE_NAME: self.node_name,
            PROGRESS_KEY: self.progress_key,
            LR_POLICY: json.dumps(self.lr_policy.reference(), sort_keys=True),
            MIN_NODES: str(self.min_nodes),
            MAX_NODES: str(self.max_nodes),
        }

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> JobEnv | None:
        present = [name for name in _JOB_VARIABLES if env.get(name)]
        if not present:
            return None
        missing = [name for name in _JOB_VARIABLES if not env.get(name)]
        if missing:
            raise WorkerEnvError(
                f"incomplete job service environment: {', '.join(present)} set but not {', '.join(missing)}"
            )
        return cls(
            job_name=env[JOB_NAME],
            generation=_int(GENERATION, env[GENERATION]),
            node_name=env[NODE_NAME],
            progress_key=env[PROGRESS_KEY],
            lr_policy=parse_lr_policy(env[LR_POLICY]),
            min_nodes=_int(MIN_NODES, env[MIN_NODES]),
            max_nodes=_int(MAX_NODES, env[MAX_NODES]),
        )


@dataclass(frozen=True)
class LiveEnv:
    """Where a worker in live recovery meets its peers: an etcd prefix of the job's own, and the job's node
    range (the group is founded when ``min_nodes`` nodes' workers registered; at most ``max_nodes``)."""

    prefix: str
    min_nodes: int
    max_nodes: int

    def __post_init__(self) -> None:
        if not self.prefix.endswith("/"):
            raise WorkerEnvError(f"{LIVE_PREFIX} must end with '/', got {self.prefix!r}")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise WorkerEnvError(
                f"{LIVE_NODES} must be MIN:MAX with 1 <= MIN <= MAX, got {self.min_nodes}:{self.max_nodes}"
            )

    def to_environ(self) -> dict[str, str]:
        return {LIVE_PREFIX: self.prefix, LIVE_NODES: f"{self.min_nodes}:{self.max_nodes}"}

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> LiveEnv | None:
        prefix, nodes = env.get(LIVE_PREFIX, ""), env.get(LIVE_NODES, "")
        if not prefix and not nodes:
            return None
        if not prefix or not nodes:
            raise WorkerEnvError(f"{LIVE_PREFIX} and {LIVE_NODES} go together: one is set without the other")
        low, sep, high = nodes.partition(":")
        if not sep:
            low = high = nodes
        return cls(prefix, _int(LIVE_NODES, low), _int(LIVE_NODES, high))


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    return _int(name, raw) if raw else default


@dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells each worker it starts. Outside torchrun (a plain ``python`` run, tests) the
    variables are unset and the defaults describe a world of one worker."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0  # how often torchrun restarted the workers of this run
    run_id: str | None = None  # ``--rdzv-id``

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> TorchrunEnv:
        """Parse ``env`` (default: this process's); an unset or empty variable keeps its default, one that is
        not a whole number is a :class:`WorkerEnvError` naming it."""
        env = os.environ if env is None else env
        return cls(
            rank=_count(env, TORCHRUN_RANK, 0),
            world_size=_count(env, TORCHRUN_WORLD_SIZE, 1),
            local_rank=_count(env, TORCHRUN_LOCAL_RANK, 0),
            local_world_size=_count(env, TORCHRUN_LOCAL_WORLD_SIZE, 1),
            group_rank=_count(env, TORCHRUN_GROUP_RANK, 0),
            restart_count=_count(env, TORCHRUN_RESTART_COUNT, 0),
            run_id=env.get(TORCHRUN_RUN_ID) or None,
        )

    @staticmethod
    def launched(env: Mapping[str, str] | None = None) -> bool:
        """Whether a launcher describes this process's group in ``env`` (default: this process's): True when
        ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are all set (torchrun, or a launcher of
        torch's ``env://``; ``LOCAL_RANK`` and the like may be missing then, and default as in
        :meth:`from_environ`); False when none of torchrun's variables is (a plain ``python train.py``: a world of
        one); otherwise a :class:`WorkerEnvError` naming the variables set and those missing (torch would stop
        at the first it misses, or wait for peers that never come)."""
        env = os.environ if env is None else env
        present = [name for name in _LAUNCH_VARIABLES if env.get(name, "").strip()]
        if not present:
            return False
        missing = [name for name in _GROUP_VARIABLES if not env.get(name, "").strip()]
        if missing:
            raise WorkerEnvError(
                f"incomplete launcher environment: {', '.join(present)} set but not {', '.join(missing)}; run "
                f"under torchrun, or unset {', '.join(present)} to train as a world of one process"
            )
        return True


def _etcd_to_environ(etcd: EtcdOptions) -> dict[str, str]:
    """Files as absolute paths (the workers run in another directory); timeouts and an inline password are
    not passed: a worker with a user reads its password from the file."""
    out = {ETCD_ENDPOINTS: etcd.endpoints}
    for name, path in (
        (ETCD_CA_CERT, etcd.ca_cert),
        (ETCD_CERT, etcd.cert),
        (ETCD_KEY, etcd.cert_key),
        (ETCD_PASSWORD_FILE, etcd.password_file),
    ):
        if path:
            out[name] = str(Path(path).resolve())
    if etcd.user:
        out[ETCD_USER] = etcd.user
    return out


def _etcd_from_environ(env: Mapping[str, str]) -> EtcdOptions | None:
    from elastic.etcd.config import EtcdOptions  # here: the etcd package imports the etcd client

    endpoints = env.get(ETCD_ENDPOINTS)
    if not endpoints:
        extra = [name for name in ETCD_VARIABLES if env.get(name)]
        if extra:
            raise WorkerEnvError(f"{', '.join(extra)} set without {ETCD_ENDPOINTS}")
        return None
    return EtcdOptions(
        endpoints=endpoints,
        ca_cert=env.get(ETCD_CA_CERT) or None,
        cert=env.get(ETCD_CERT) or None,
        cert_key=env.get(ETCD_KEY) or None,
        user=env.get(ETCD_USER) or None,
        password_file=env.get(ETCD_PASSWORD_FILE) or None,
    )


def _hex_key(raw: str) -> bytes:
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise WorkerEnvError(f"{CHECKPOINT_KEY} must be hex") from None
    if len(key) < 16:
        raise WorkerEnvError(f"{CHECKPOINT_KEY} must hold at least 16 bytes")
    return key


def _key_file(path: str) -> bytes:
    try:
        raw = Path(path).read_text().strip()
    except OSError as exc:
        raise WorkerEnvError(f"{CHECKPOINT_KEY_FILE}: cannot read {path}: {exc.strerror or exc}") from None
    return _hex_key(raw)


def _get(env: Mapping[str, str], name: str, parse: Callable[[str], _T]) -> _T | None:
    raw = env.get(name, "").strip()
    return parse(raw) if raw else None


@dataclass(frozen=True)
class WorkerEnv:
    """What the environment tells a worker (see the module docstring). ``etcd``: the connection of progress
    reports, unresolved (its password file is read by :meth:`EtcdOptions.config`)."""

    job: JobEnv | None = None
    job_id: str | None = None  # the service's job id (outlives torchrun runs), or a user's
    checkpoint_url: str | None = None
    local_snapshot_every: int = 0  # node-local snapshots every N steps; 0: off
    etcd: EtcdOptions | None = None
    checkpoint_key: bytes | None = field(default=None, repr=False)  # signs the job's snapshots
    live: LiveEnv | None = None
    # where the key is read from (``ETRAIN_CHECKPOINT_KEY_FILE``): written instead of the key itself
    checkpoint_key_file: str | None = None  # the live group (live recovery), when the handler or a user set one

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        """Parse ``env`` (default: this process's); a :class:`WorkerEnvError` names a variable that is
        missing from the job service's set or holds an invalid value."""
        env = os.environ if env is None else env
        return cls(
            job=JobEnv.from_environ(env),
            job_id=env.get(JOB_ID) or None,
            checkpoint_url=env.get(CHECKPOINT_URL) or None,
            local_snapshot_every=_get(env, LOCAL_SNAPSHOT_EVERY, _local_every) or 0,
            etcd=_etcd_from_environ(env),
            checkpoint_key=_get(env, CHECKPOINT_KEY, _hex_key) or _get(env, CHECKPOINT_KEY_FILE, _key_file),
            live=LiveEnv.from_environ(env),
            checkpoint_key_file=env.get(CHECKPOINT_KEY_FILE) or None,
        )

    def to_environ(self) -> dict[str, str]:
        """The variables of this worker environment (what :meth:`from_environ` reads back)."""
        out = self.job.to_environ() if self.job is not None else {}
        if self.job_id:
            out[JOB_ID] = self.job_id
        if self.checkpoint_url:
            out[CHECKPOINT_URL] = self.checkpoint_url
        out[LOCAL_SNAPSHOT_EVERY] = str(self.local_snapshot_every)
        if self.etcd is not None:
            out.update(_etcd_to_environ(self.etcd))
        if self.checkpoint_key_file:
            out[CHECKPOINT_KEY_FILE] = self.checkpoint_key_file
        elif self.checkpoint_key is not None:
            out[CHECKPOINT_KEY] = self.checkpoint_key.hex()
        if self.live is not None:
            out.update(self.live.to_environ())
        return out

    def apply(self, env: MutableMapping[str, str]) -> None:
        """Write into ``env``, replacing whatever it inherited of :data:`AGENT_WRITTEN`."""
        for name in AGENT_WRITTEN:
            env.pop(name, None)
        env.update(self.to_environ())
