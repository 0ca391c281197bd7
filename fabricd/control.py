"""Control requests on /fedpilot/control/1.0.0: a request/response relay between bridge clients.

A bridge client sends ``ControlSend(request_id, target_cluster, body)``; this daemon opens
a control stream to the target's daemon with ``ControlRequest(request_id, body)``; that
daemon gives a ``ControlDelivery`` (with the sender's verified cluster id, peer id and
certificate role) to a local client, whose ``ControlReply`` travels back as
``ControlResponse`` and reaches the sender as ``ControlResult``. No local client means
a clear refusal, never a silent drop.

A routing matrix over 4 MiB comes as ``job.plan.part`` bodies (each signed and capped like
any other) and a ``job.plan`` naming them by sha256; both daemons keep the parts the
executor accepted (`PlanAssembly`, a few jobs at most) to learn the placement from the
plan, and refuse nothing on their behalf: the executor checks the digest.

Every body is a signed envelope addressed to one cluster (fabricd.signing). A job is
owned by the scheduler that sent its ``job.start`` here; job messages for it from any
other signer are refused (``JobOwners``; every ``job.*``, ``round.*`` and ``node.*`` kind,
so a new kind such as ``job.profile`` is owner-checked without a list to extend). Replies
travel back on the stream the request came in on, so no peer can answer for another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetStream

from fabricd._bounded import BoundedDict
from fabricd._sender import open_stream
from fabricd._streams import (
    FrameTooSlow,
    close_quietly,
    end_stream,
    read_message_exact,
    read_message_floored,
    remote_peer,
    write_message,
)
from fabricd.admission import Placements, RateFloor
from fabricd.membership import Membership
from fabricd.metrics import UNWIRED, DaemonMetrics
from fabricd.signing import is_job_message
from fedcore.logs import get_logger
from proto.certs import Certificate
from proto.control import JobPlan, JobPlanPart, PlanAssembly, parse_control
from proto.errors import InvalidMessage, ProtocolError, WrongRole
from proto.ids import MAX_MESSAGE_BYTES, PROTOCOL_CONTROL
from proto.messages import ControlRequest, ControlResponse

log = get_logger("fabricd.control")

CONTROL_LIMIT = MAX_MESSAGE_BYTES + 1024
#: jobs whose owner is remembered (oldest forgotten first)
MAX_OWNED_JOBS = 4096
#: jobs whose large plan's parts are held (each at most proto.control.MAX_PLAN_BYTES)
MAX_ASSEMBLING_JOBS = 4
#: tries to open a control stream (each may dial: bounded by the dial budget)
OPEN_ATTEMPTS = 4


class ControlSink(Protocol):
    async def control(self, request_id: str, from_cluster: str, from_peer: str, from_role: str,
                      body: dict[str, Any]) -> tuple[bool, dict[str, Any], str]:
        """Deliver a control request locally and return (ok, body, reason) of the reply."""


Seal = Callable[[dict[str, Any], str], dict[str, Any]]  # (body, audience cluster)
Unseal = Callable[[dict[str, Any], str], tuple[Certificate, dict[str, Any]]]


class JobOwners:
    """Which scheduler (by peer id) owns which job on this cluster.

    The first ``job.start`` for a job id makes its signer the owner; every job message
    (``job.*``, ``round.*``, ``node.*``) for that job must come from the owner. A job
    with no owner here (never started, or over: its last executor left) has nothing to
    steer; the bridge refuses its messages unless an executor for it is attached.
    """

    def __init__(self, limit: int = MAX_OWNED_JOBS) -> None:
        self._owners: BoundedDict[str, tuple[str, str]] = BoundedDict(limit)

    def forget(self, job_id: str) -> None:
        self._owners.pop(job_id, None)

    def owner(self, job_id: str) -> tuple[str, str] | None:
        return self._owners.get(job_id)

    def check(self, body: dict[str, Any], signer: Certificate) -> None:
        """Raise WrongRole/InvalidMessage unless ``signer`` may send ``body``."""
        if not is_job_message(body):
            return
        kind, job_id = body.get("kind"), body.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise InvalidMessage(f"{kind} without a job_id")
        owner = self._owners.get(job_id)
        if owner is not None and owner[0] != signer.peer_id:
            raise WrongRole(f"job {job_id!r} is owned by scheduler peer {owner[0]} (cluster {owner[1]}); "
                            f"{kind} from peer {signer.peer_id} (cluster {signer.cluster_id}) refused")
        if owner is None and kind == "job.start":
            self._owners[job_id] = (signer.peer_id, signer.cluster_id)


class ControlService:
    """`seal` signs every outgoing body; `unseal(body, sender_peer)` verifies every incoming
    one (see fabricd.signing) and raises ProtocolError with the reason to refuse it."""

    def __init__(self, host: IHost, membership: Membership, sink: ControlSink, *,
                 timeout: float = 30.0, seal: Seal | None = None,
                 unseal: Unseal | None = None, cluster_id: str = "",
                 placements: Placements | None = None, min_rate: float = 256 * 1024) -> None:
        self.host = host
        self.min_rate = min_rate
        self.m = membership
        self.sink = sink
        self.timeout = timeout
        self.seal = seal
        self.unseal = unseal
        self.cluster_id = cluster_id
        self.served = 0
        self.refused = 0
        self.owners = JobOwners()
        self.placements = placements if placements is not None else Placements()
        self.metrics: DaemonMetrics = UNWIRED
        #: parts of large plans: relayed to the local executor, and sent by this daemon
        self._parts_in: BoundedDict[str, PlanAssembly] = BoundedDict(MAX_ASSEMBLING_JOBS)
        self._parts_out: BoundedDict[str, PlanAssembly] = BoundedDict(MAX_ASSEMBLING_JOBS)

    def register(self) -> None:
        self.host.set_stream_handler(
            PROTOCOL_CONTROL,  # type: ignore[arg-type]
            self.m.guard("control", self._handle, on_refuse=self._refuse),
        )

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        await write_message(stream, ControlResponse(request_id="unknown", ok=False, body={}, reason=reason))

    async def _reply_error(self, stream: INetStream, peer: str, request_id: str, reason: str) -> None:
        self.refused += 1
        log.warning("control.rejected", peer=peer, request_id=request_id, reason=reason)
        await write_message(stream, ControlResponse(request_id=request_id, ok=False, body={}, reason=reason))
        await end_stream(stream)

    async def _handle(self, stream: INetStream) -> None:
        peer = remote_peer(stream)
        cert = self.m.member_certificate(peer)
        try:
            # the request must keep the minimum rate after a short grace (no slow-loris)
            msg = await read_message_floored(stream, CONTROL_LIMIT, RateFloor(self.min_rate))
        except (ProtocolError, EOFError, trio.TooSlowError) as exc:
            if isinstance(exc, FrameTooSlow):
                self.metrics.stream_cut("control")
            await self._reply_error(stream, peer, "unknown", f"bad control frame: {type(exc).__name__}: {exc}")
            return
        if not isinstance(msg, ControlRequest):
            await self._reply_error(stream, peer, "unknown", f"expected ControlRequest, got {msg.TYPE}")
            return
        if cert is None:
            await self._reply_error(stream, peer, msg.request_id, "not a member")
            return
        body = msg.body
        if self.unseal is not None:
            try:
                cert, body = self.unseal(msg.body, peer)
                self.owners.check(body, cert)
            except ProtocolError as exc:
                await self._reply_error(stream, peer, msg.request_id,
                                        f"rejected by cluster {self.cluster_id}: {exc}")
                return
        request = body
        with trio.move_on_after(self.timeout) as scope:
            ok, body, reason = await self.sink.control(
                msg.request_id, cert.cluster_id, peer, cert.role, request)
        if scope.cancelled_caught:
            ok, body, reason = False, {}, f"no reply from the local client within {self.timeout:.0f} s"
        if ok and is_job_message(request):
            self._learn(request, cert.cluster_id)
        self.served += 1
        log.info("control.served", peer=peer, cluster=cert.cluster_id, request_id=msg.request_id, ok=ok,
                 reason=reason)
        await write_message(stream, ControlResponse(request_id=msg.request_id, ok=ok, body=body, reason=reason))
        await end_stream(stream)

    def _learn(self, body: dict[str, Any], scheduler_cluster: str) -> None:
        """Keep the routing matrix of each owner-checked job.plan the executor accepted
        (and which scheduler's cluster sent it: it may stream checkpointed states back)."""
        job_id = str(body.get("job_id"))
        kind = body.get("kind")
        if kind == JobPlanPart.TYPE:
            _hold_part(self._parts_in, job_id, body)
        elif kind == JobPlan.TYPE:
            routing = _plan_routing(job_id, body, self._parts_in)
            if routing is not None:
                self.placements.learn(job_id, routing, owner=scheduler_cluster)
                self._parts_in.pop(job_id, None)
        elif kind == "job.stop":
            self.placements.forget(job_id)
            self._parts_in.pop(job_id, None)

    async def send(self, peer_id: str, request_id: str, body: dict[str, Any], *,
                   audience: str) -> ControlResponse:
        """Send one control request to the daemon of cluster ``audience`` and return its response."""
        request = body
        if self.seal is not None:
            body = self.seal(body, audience)
        await self.m.wait_verdict(peer_id)
        # retried: a link just lost (its relay gone) is redialled, through another relay
        stream = await open_stream(self.host, peer_id, PROTOCOL_CONTROL, attempts=OPEN_ATTEMPTS)
        try:
            await write_message(stream, ControlRequest(request_id=request_id, body=body))
            with trio.fail_after(self.timeout + 5):
                msg = await read_message_exact(stream, CONTROL_LIMIT)
        finally:
            await close_quietly(stream)
        if not isinstance(msg, ControlResponse):
            raise ProtocolError(f"expected ControlResponse from {peer_id}, got {msg.TYPE}")
        kind, job_id = request.get("kind"), str(request.get("job_id"))
        if msg.ok and kind == JobPlanPart.TYPE:
            _hold_part(self._parts_out, job_id, request)
        elif msg.ok and kind == JobPlan.TYPE:
            # this daemon is the job's scheduler: the plan's clusters may stream models back
            routing = _plan_routing(job_id, request, self._parts_out)
            if routing is not None:
                self.placements.sent(job_id, routing)
        elif kind == "job.stop":
            self._parts_out.pop(job_id, None)
        return msg


def _hold_part(held: BoundedDict[str, PlanAssembly], job_id: str, body: dict[str, Any]) -> None:
    """Keep a job.plan.part an executor accepted, for the job.plan that names it."""
    try:
        part = parse_control(body)
    except ProtocolError as exc:
        log.warning("plan.part_unreadable", job=job_id, reason=str(exc))
        return
    if isinstance(part, JobPlanPart):
        assembly = held.get(job_id)
        if assembly is None:
            held[job_id] = assembly = PlanAssembly()
        assembly.add(part)


def _plan_routing(job_id: str, body: dict[str, Any],
                  held: BoundedDict[str, PlanAssembly]) -> bytes | None:
    """The routing matrix's bytes of an accepted job.plan: inline, or its parts joined
    (None, logged, if they are not here or do not hash to its routing_sha256)."""
    routing = body.get("routing")
    if isinstance(routing, bytes):
        return routing
    try:
        plan = parse_control(body)
        assert isinstance(plan, JobPlan)
        if plan.routing_sha256 is None or plan.routing_size is None:
            return None
        assembly = held.get(job_id)
        if assembly is None:
            raise InvalidMessage(f"none of the parts of plan {plan.routing_sha256[:16]}... "
                                 "passed through this daemon")
        return assembly.take(plan.routing_sha256, plan.routing_size)
    except ProtocolError as exc:
        log.warning("placement.unreadable", job=job_id, reason=str(exc))
        return None
