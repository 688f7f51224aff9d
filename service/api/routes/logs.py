"""``GET /v1/jobs/{id}/logs``: a job's torchrun logs, read from the node agents that wrote them and streamed through.

Each agent started with ``--logs-port`` serves its jobs' logs (:mod:`service.agent.logs`) and publishes where, with a
bearer token of its own, in its node registration (``logs_url``, ``logs_token``: the API never shows the token).
This route finds the nodes, asks their agents, and streams the answers on as ``text/plain``:

* ``node=N``: that node's log as it is (the agent's newest generation of the job unless ``generation`` is given).
* without ``node``: every node of the job's current (or, once it ended, last) generation, or of ``generation``,
  each section headed ``==> node-a (generation 3) <==``. Which nodes ran a generation is taken from the job's
  status, its nodes' assignments and reports and its world-size history; when none of them names a node (an
  old generation, a job that ended before its workers reported) every live node is asked and those without the
  log are left out.
* ``follow=true``: what is appended too, until the torchruns of that generation end (and the client may leave
  any time). With several nodes the lines are interleaved as they come, each prefixed ``[node-a] ``.
* ``tail=N``: each node's log from ``N`` bytes before its end (default 1 MiB), starting at a whole line.

A user token on its own job, or an admin token: a read token gets 403 (logs hold whatever the workers print, and
the job's details withhold the log tail of ``last_error`` from read tokens too). Each agent is asked only at the
address rebuilt from the checked parts of its ``logs_url`` (:func:`~service.core.models.checked_logs_url`: http(s),
one of the node's registered hosts, a numeric port, nothing else) and this route's fixed path: a node record that
names anything else gets a 502 naming the node and nothing is sent to it. Errors: 404 unknown job (or no such log),
503 node offline or its agent unreachable, 409 its agent serves no logs (no ``--logs-port``), 502 the agent
answered an error (of whose body only the first :data:`ERROR_BODY_BYTES` are read, within
:data:`ERROR_BODY_TIMEOUT`). With several nodes, a node that cannot be read gets a note in its section instead, and
the request fails only when none can.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import quote

import anyio
import httpx
from fastapi import APIRouter, Depends, HTTPException, Query, status
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.auth import Principal, check_owner, require_read
from service.api.deps import get_store
from service.core.config import Role
from service.core.models import NODE_NAME_PATTERN, NodeInfo, checked_logs_url
from service.core.store import ServiceStore

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_TAIL",
    "ERROR_BODY_BYTES",
    "ERROR_BODY_TIMEOUT",
    "READ_ONLY_REFUSAL",
    "READ_TIMEOUT",
    "generation_header",
    "router",
]

router = APIRouter(prefix="/v1", tags=["jobs"])

#: bytes of each node's log sent from before its end when the request names no ``tail``
DEFAULT_TAIL = 1 << 20
#: seconds to connect to an agent, and to wait for its answer's head (also with ``follow``) and, without ``follow``,
#: for each piece of its body
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 30.0
#: bytes of an agent's error answer read (for the message, cut to 300 characters) and the seconds spent on them
ERROR_BODY_BYTES = 4096
ERROR_BODY_TIMEOUT = 5.0
_GENERATION = re.compile(r"[0-9]{1,10}")  # ASCII digits only: str.isdigit (and \d) also take '²' and '٣'
_MAX_GENERATION = 2**31
_MAX_LINE = 64 * 1024  # a longer line (a progress bar's carriage returns) is passed on in pieces when following
_TEXT = "text/plain; charset=utf-8"
#: the 403 a read token gets
READ_ONLY_REFUSAL = (
    "job logs hold whatever the workers print, so read tokens cannot read them (job details "
    "withhold the workers' log tail from read tokens too): use the job owner's or an admin "
    "token"
)


async def _may_read_logs(principal: Annotated[Principal, Depends(require_read)]) -> Principal:
    """User tokens (their own jobs: :func:`job_logs` checks) and admin tokens (and auth off) read logs; a read token
    gets 403 with :data:`READ_ONLY_REFUSAL`."""
    if principal.role == Role.READ:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, detail=f"token {principal.name!r} is read-only: {READ_ONLY_REFUSAL}"
        )
    return principal


@dataclass(frozen=True)
class _Source:
    node: str
    generation: int | None  # None: the agent's newest
    info: NodeInfo | None  # None: offline
    known: bool  # the job ran there (else asked on the off chance: a missing log is no news)


@dataclass
class _Opened:
    source: _Source
    response: httpx.Response | None = None
    generation: int | None = None
    problem: tuple[int, str] | None = None  # (HTTP status for the caller, message)


def _plan(
    store: ServiceStore, job_id: str, node: str | None, generation: int | None
) -> tuple[list[_Source], int | None]:
    """The nodes to ask and the generation shown (the store's reads, off the event loop)."""
    entry = store.get_job(job_id)
    if entry is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no job {job_id!r}")
    nodes, assigned = store.list_nodes()
    live = {n.name: n for n in nodes}
    if node is not None:
        return [_Source(node, generation, live.get(node), True)], generation
    st = entry.status
    gen = generation or st.generation
    if gen < 1:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"job {job_id} has no logs yet: it has not run on a node")
    ran: set[str] = set()
    if gen == st.generation:
        ran |= set(st.nodes) | {n for n, jobs in assigned.items() if job_id in jobs}
    ran |= {r.node for r in store.reports(job_id).values() if r.generation == gen}
    ran |= {n for change in st.world_size_history if change.generation == gen for n in change.nodes}
    if ran:
        return [_Source(n, gen, live.get(n), True) for n in sorted(ran)], gen
    return [_Source(n.name, gen, n, False) for n in nodes], gen


async def _open(client: httpx.AsyncClient, job_id: str, src: _Source, tail_bytes: int, follow: bool) -> _Opened:
    """Ask one agent; the answer's body is left to stream."""
    out = _Opened(src)
    info, node = src.info, src.node
    if info is None:
        out.problem = (503, f"node {node} is offline (no agent is registered under that name): its logs cannot be read")
        return out
    if not info.logs_url or not info.logs_token:
        out.problem = (
            409,
            f"the agent of node {node} does not serve job logs: start it with --logs-port (ETRAIN_LOGS_PORT)",
        )
        return out
    try:
        base = checked_logs_url(info)
    except ValueError as exc:
        out.problem = (502, f"node {node} published a logs_url that is refused ({exc}): nothing was sent to it")
        return out
    params: dict[str, Any] = {"tail": tail_bytes}
    if src.generation is not None:
        params["generation"] = src.generation
    if follow:
        params["follow"] = 1
    try:
        # the body is passed on as it comes (aiter_raw): so ask for it uncompressed
        request = client.build_request(
            "GET",
            f"{base}/jobs/{quote(job_id, safe='')}/logs",
            params=params,
            headers={"Authorization": f"Bearer {info.logs_token}", "Accept-Encoding": "identity"},
        )
        # the answer's head within READ_TIMEOUT, also when following (the client's read timeout is off then)
        with anyio.fail_after(READ_TIMEOUT):
            resp = await client.send(request, stream=True)
    except (httpx.HTTPError, httpx.InvalidURL, TimeoutError) as exc:
        why = str(exc) or type(exc).__name__
        out.problem = (503, f"cannot reach the agent of node {node} at {base}: {why}")
        return out
    if resp.status_code == 200:
        out.response = resp
        out.generation = generation_header(resp.headers.get("x-etrain-generation"), src.generation)
        return out
    text = (await _error_text(resp)).decode(errors="replace").strip()[:300]
    if resp.status_code == 404:
        which = f"generation {src.generation}" if src.generation is not None else "any generation"
        out.problem = (404, f"node {node} has no log of job {job_id} ({which})")
    elif resp.status_code == 401:
        out.problem = (502, f"the agent of node {node} refused the controller's token (did it just restart? retry)")
    else:
        out.problem = (502, f"the agent of node {node} answered HTTP {resp.status_code}: {text}")
    return out


def generation_header(value: str | None, default: int | None) -> int | None:
    """An agent's ``X-Etrain-Generation``: ASCII digits only (``str.isdigit`` also takes ``'²'``, which ``int``
    refuses), at most :data:`_MAX_GENERATION`; anything else is ignored for ``default``."""
    if value is None or not _GENERATION.fullmatch(value):
        return default
    generation = int(value)
    return generation if generation <= _MAX_GENERATION else default


async def _error_text(resp: httpx.Response) -> bytes:
    """The first :data:`ERROR_BODY_BYTES` of an agent's error answer, read within :data:`ERROR_BODY_TIMEOUT`; the
    rest is never read (the connection is closed): a node answering an error with a huge or endless body costs
    the controller a few KiB and a few seconds at most."""
    got = bytearray()
    try:
        with anyio.move_on_after(ERROR_BODY_TIMEOUT):
            async for chunk in resp.aiter_raw():
                got += chunk[: ERROR_BODY_BYTES - len(got)]
                if len(got) >= ERROR_BODY_BYTES:
                    break
    except httpx.HTTPError:
        pass
    finally:
        await resp.aclose()
    return bytes(got)


async def _close(opened: Sequence[_Opened], client: httpx.AsyncClient) -> None:
    with anyio.CancelScope(shield=True):  # also when the client left and the stream was cancelled
        for o in opened:
            if o.response is not None:
                await o.response.aclose()
        await client.aclose()


def _note(message: str) -> bytes:
    return f"[etrain] {message}\n".encode()


async def _one(o: _Opened, opened: Sequence[_Opened], client: httpx.AsyncClient) -> AsyncIterator[bytes]:
    assert o.response is not None
    try:
        async for chunk in o.response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        yield _note(f"the log stream of node {o.source.node} broke: {str(exc) or type(exc).__name__}")
    finally:
        await _close(opened, client)


async def _sections(opened: Sequence[_Opened], client: httpx.AsyncClient) -> AsyncIterator[bytes]:
    try:
        first = True
        for o in opened:
            if o.response is None and not o.source.known:
                continue
            gen = o.generation if o.generation is not None else o.source.generation
            yield f"{'' if first else chr(10)}==> {o.source.node} (generation {gen}) <==\n".encode()
            first = False
            if o.response is None:
                assert o.problem is not None
                yield _note(o.problem[1])
                continue
            last = b"\n"
            try:
                async for chunk in o.response.aiter_raw():
                    if chunk:
                        last = chunk[-1:]
                        yield chunk
            except httpx.HTTPError as exc:
                yield _note(f"the log stream of node {o.source.node} broke: {str(exc) or type(exc).__name__}")
                last = b"\n"
            if last != b"\n":
                yield b"\n"
            await o.response.aclose()
    finally:
        await _close(opened, client)


async def _interleaved(opened: Sequence[_Opened], client: httpx.AsyncClient) -> AsyncIterator[bytes]:
    """Every node's appended lines as they come, each prefixed with ``[node] ``."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1024)

    async def pump(o: _Opened) -> None:
        assert o.response is not None
        prefix = f"[{o.source.node}] ".encode()
        rest = b""
        end = b""
        try:
            async for chunk in o.response.aiter_raw():
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    await queue.put(prefix + line + b"\n")
                while len(rest) > _MAX_LINE:
                    await queue.put(prefix + rest[:_MAX_LINE] + b"\n")
                    rest = rest[_MAX_LINE:]
        except httpx.HTTPError as exc:
            end = prefix + _note(f"the log stream broke: {str(exc) or type(exc).__name__}")
        await queue.put((prefix + rest + b"\n" if rest else b"") + end)
        await queue.put(None)

    tasks = [asyncio.create_task(pump(o)) for o in opened if o.response is not None]
    try:
        for o in opened:
            if o.problem is not None and o.source.known:
                yield f"[{o.source.node}] ".encode() + _note(o.problem[1])
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif item:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
        await _close(opened, client)


def _failure(opened: Sequence[_Opened], job_id: str, generation: int | None) -> HTTPException:
    """Why nothing could be read at all: the most telling status, every node's reason."""
    problems = [o.problem for o in opened if o.problem is not None and (o.source.known or o.problem[0] != 404)]
    if not problems:
        return HTTPException(
            status.HTTP_404_NOT_FOUND, detail=f"no live node has a log of job {job_id} (generation {generation})"
        )
    codes = {code for code, _ in problems}
    code = next(c for c in (502, 503, 409, 404) if c in codes)
    return HTTPException(code, detail="; ".join(message for _, message in problems))


@router.get(
    "/jobs/{job_id}/logs",
    summary="A job's torchrun logs, streamed from the node agents",
    description="Without `node`: every node of the job's current (or last) generation, or of `generation`, each "
    "section headed `==> node (generation G) <==`; with `follow=true` the nodes' new lines interleaved, each "
    "prefixed `[node] `, until their torchruns end. With `node`: that node's log as it is (its newest generation "
    "of the job unless `generation` is given). Agents serve logs only when started with `--logs-port`.",
    response_class=StreamingResponse,
    responses={
        200: {"description": "the log text", "content": {"text/plain": {}}},
        404: {"description": "no job with this id, or no such log"},
        409: {"description": "the node's agent serves no logs (started without --logs-port)"},
        502: {"description": "the node's agent answered with an error, or its node record names a refused logs_url"},
        403: {"description": "a read token, or a user token on another user's job"},
        503: {"description": "the node is offline or its agent unreachable"},
    },
)
async def job_logs(
    job_id: str,
    principal: Annotated[Principal, Depends(_may_read_logs)],
    store: Annotated[ServiceStore, Depends(get_store)],
    node: Annotated[str | None, Query(pattern=NODE_NAME_PATTERN, description="only this node's log")] = None,
    generation: Annotated[int | None, Query(ge=1, le=2**31, description="default: current (or last)")] = None,
    follow: Annotated[bool, Query(description="keep streaming until the torchruns end")] = False,
    tail: Annotated[int, Query(ge=0, le=2**40, description="bytes of each log from before its end")] = DEFAULT_TAIL,
) -> StreamingResponse:
    entry = await run_in_threadpool(store.get_job, job_id)
    if entry is not None:  # (an unknown job: 404 from _plan)
        check_owner(principal, job_id, entry.record.submitted_by, "read the logs of")
    sources, gen = await run_in_threadpool(_plan, store, job_id, node, generation)
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None if follow else READ_TIMEOUT, connect=CONNECT_TIMEOUT),
        follow_redirects=False,
        trust_env=False,
    )  # only the checked address, no proxy
    opened: list[_Opened] = []
    try:
        opened = list(await asyncio.gather(*(_open(client, job_id, s, tail, follow) for s in sources)))
    finally:
        if not opened:
            await client.aclose()
    readable = [o for o in opened if o.response is not None]
    if not readable:
        await _close(opened, client)
        if node is not None:
            assert opened[0].problem is not None
            code, message = opened[0].problem
            raise HTTPException(code, detail=message)
        raise _failure(opened, job_id, gen)
    if node is not None:
        [o] = opened
        headers = {"X-Etrain-Node": node, "Cache-Control": "no-store"}
        if o.generation is not None:
            headers["X-Etrain-Generation"] = str(o.generation)
        return StreamingResponse(_one(o, opened, client), media_type=_TEXT, headers=headers)
    headers = {"X-Etrain-Generation": str(gen), "Cache-Control": "no-store"}
    body = _interleaved(opened, client) if follow else _sections(opened, client)
    return StreamingResponse(body, media_type=_TEXT, headers=headers)
