"""Dial-back: can this daemon be reached? (``[network] reachability = "auto"``)

A daemon set to ``auto`` asks a gateway it is connected to (one with ``relay_service``)
to open a TCP connection back to it, at the port it announces, on the address the gateway
sees it at (``DialBackRequest`` on PROTOCOL_DIALBACK, members only). Reached: it is
public, and announces only its own addresses. Not reached (a NAT, a firewall, an announced
port nothing listens on): it is private - it announces only its ``/p2p-circuit``
addresses, so nobody wastes a dial on an address out of reach, and its large updates come
spliced by the gateway (fabricd/_splice.py). It asks again every RECHECK_SECONDS, and
at once when the answer was not had (no gateway answered).

The gateway dials the requester's observed address only, never one the request names (a
member cannot point it at a third party), at most once per member per
MIN_INTERVAL_SECONDS, and only opens and closes the connection. It is AutoNAT v1's idea
(py-libp2p's ``libp2p/host/autonat`` dials the addresses a peer lists and needs an
identify-fed peerstore), in the membership's terms.
"""

from __future__ import annotations

import time

import trio
from libp2p.abc import IHost, INetStream

from fabricd._bounded import BoundedDict
from fabricd._sender import open_stream
from fabricd._streams import close_quietly, read_message_exact, remote_peer, write_message
from fedcore.logs import get_logger
from proto.ids import PROTOCOL_DIALBACK
from proto.messages import DialBackRequest, DialBackResult

log = get_logger("fabricd.dialback")

DIAL_SECONDS = 3.0
ASK_SECONDS = DIAL_SECONDS + 5.0
RECHECK_SECONDS = 300.0
#: a member is dialled back at most once in this long
MIN_INTERVAL_SECONDS = 10.0
FRAME_LIMIT = 4096
MAX_MEMBERS = 4096


class DialBackService:
    """The gateway's side (module docstring)."""

    def __init__(self, host: IHost) -> None:
        self.host = host
        #: member -> when it was last dialled back
        self.last: BoundedDict[str, float] = BoundedDict(MAX_MEMBERS)
        self.counts = dict.fromkeys(("dialbacks_reached", "dialbacks_failed", "dialbacks_refused"), 0)

    def register(self, guard: object) -> None:
        self.host.set_stream_handler(PROTOCOL_DIALBACK, guard("dialback", self._handle, self._refuse))  # type: ignore[operator, arg-type]

    async def _refuse(self, stream: INetStream, reason: str) -> None:
        self.counts["dialbacks_refused"] += 1
        await write_message(stream, DialBackResult(reachable=False, address="", reason=reason))

    async def _handle(self, stream: INetStream) -> None:
        member = remote_peer(stream)
        try:
            with trio.fail_after(DIAL_SECONDS):
                req = await read_message_exact(stream, FRAME_LIMIT)
            observed = stream.get_remote_address()
            now = time.monotonic()
            if not isinstance(req, DialBackRequest):
                await self._refuse(stream, f"expected DialBackRequest, got {req.TYPE}")
            elif observed is None:
                await self._refuse(stream, "asked over a relayed link: there is no address to dial back")
            elif now - self.last.get(member, -MIN_INTERVAL_SECONDS) < MIN_INTERVAL_SECONDS:
                await self._refuse(stream, f"busy: one dial-back per member every {MIN_INTERVAL_SECONDS:g} s")
            else:
                self.last[member] = now
                await write_message(stream, await self._dial(str(observed[0]), req.port))
        except trio.TooSlowError:
            log.info("dialback.refused", peer=member, reason=f"no DialBackRequest within {DIAL_SECONDS:g} s")
        finally:
            await close_quietly(stream)

    async def _dial(self, ip: str, port: int) -> DialBackResult:
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        try:
            with trio.fail_after(DIAL_SECONDS):
                conn = await trio.open_tcp_stream(ip, port)
            await conn.aclose()
        except (OSError, trio.TooSlowError) as exc:
            self.counts["dialbacks_failed"] += 1
            cause: BaseException = exc
            while isinstance(cause.__cause__, BaseException):  # trio: "all attempts ... failed"
                cause = cause.__cause__
                if isinstance(cause, BaseExceptionGroup) and cause.exceptions:
                    cause = cause.exceptions[-1]   # the last address tried: its own error
            why = f"no TCP connection in {DIAL_SECONDS:g} s" if isinstance(exc, trio.TooSlowError) else \
                f"{type(cause).__name__}: {cause}"
            return DialBackResult(reachable=False, address=address, reason=why)
        self.counts["dialbacks_reached"] += 1
        return DialBackResult(reachable=True, address=address, reason="")


async def ask(host: IHost, gateway: str, port: int) -> DialBackResult | None:
    """The answer of ``gateway`` to "dial me back at ``port``", or None if none was had
    (no such service there, a broken stream, a refusal: then nothing is known)."""
    try:
        with trio.fail_after(ASK_SECONDS):
            stream = await open_stream(host, gateway, PROTOCOL_DIALBACK, attempts=1)
            try:
                await write_message(stream, DialBackRequest(port=port))
                result = await read_message_exact(stream, FRAME_LIMIT)
            finally:
                await close_quietly(stream)
    except Exception as exc:  # noqa: BLE001 - no answer is no verdict: asked again later
        log.info("dialback.unanswered", gateway=gateway, reason=f"{type(exc).__name__}: {exc}")
        return None
    if not isinstance(result, DialBackResult) or (not result.reachable and not result.address):
        log.info("dialback.unanswered", gateway=gateway,
                 reason=result.reason if isinstance(result, DialBackResult) else result.TYPE)
        return None
    return result
