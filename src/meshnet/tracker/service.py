"""The tracker's gRPC service: nodes register and heartbeat, clients ask for routes.

Every refusal is a gRPC status with a message naming the problem (INVALID_ARGUMENT for a bad request,
FAILED_PRECONDITION for a protocol mismatch or an incomplete model, ALREADY_EXISTS for a registration
claiming the id of a live node at another address); an unexpected error becomes
INTERNAL with its message, and the tracker keeps serving.

Membership: a node's Register, Heartbeat, Deregister and ReportWork may be signed with its Ed25519 key
(:mod:`meshnet.membership`); a bad signature, a key that does not own the node id, a stale timestamp or
an unsigned message for a node that proved a key is refused UNAUTHENTICATED.

Relay: a node that accepts no inbound connections registers with ``relayed`` set and keeps a ``Relay``
stream open (its first message a signed hello); clients reach it through ``RelayStep`` / ``RelayControl``
(:mod:`meshnet.tracker.relay`). Routing skips a relayed node whose stream is not open.

Ledger: nodes report completed steps (ReportWork), clients delivered tokens (ReportDelivery); both are
stored once per key in the tracker's :class:`~meshnet.ledger.store.Ledger`, read back with GetLedger.

It is served by :func:`meshnet.tracker.server.start_tracker`; the ``meshnet tracker`` command is
:mod:`meshnet.tracker.cli`; its dashboard, :mod:`meshnet.dashboard`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING

import grpc

from meshnet.membership.auth import AuthError, Authenticator
from meshnet.membership.identity import NODE_ID_MAX_CHARS
from meshnet.proto import meshnet_pb2 as pb
from meshnet.proto import meshnet_pb2_grpc as pb_grpc
from meshnet.tracker.activity import ActivityBoard
from meshnet.tracker.manifests import ManifestFull, ManifestNotFound, ManifestRefused, ManifestStore
from meshnet.tracker.node_info import device_dict, info_from_status, like_from_hops, record_from_info
from meshnet.tracker.refusals import Refusal, bounded, rpc
from meshnet.tracker.registry import NodeIdInUse, ProtocolMismatch, Registry, RegistryFull
from meshnet.tracker.relay import RELAY_NODE_METADATA, RelayHub, RelayLimits
from meshnet.tracker.routing import NodeRecord, NoRoute, plan_route
from meshnet.wire.addresses import is_loopback_address, loopback_seen_from_elsewhere
from meshnet.wire.call_problems import abort_call

if TYPE_CHECKING:  # the ledger pulls in SQLAlchemy: imported when a tracker starts, not with the CLI
    from meshnet.ledger.store import Ledger

members_log = logging.getLogger("meshnet.tracker.members")
# Seconds a deregistered node may still report work: its drain (30 s by default) with margin.
_DEPARTED_S = 300.0
# The longest model id or name GetManifest looks up, characters (ids are 64 hex digits; names, a GGUF's
# general.name, are short).
MAX_MODEL_NAME_CHARS = 1024


class TrackerService(pb_grpc.TrackerServicer):
    """The Tracker gRPC service over a :class:`Registry` (thread-safe; one instance serves all calls).

    Args:
        registry: the membership table.
        ledger: where work, deliveries and node keys are stored; default a new in-memory one.
        authenticator: judges node signatures; default one over ``ledger``'s key bindings that accepts
            unsigned messages for ids no key is bound to.
    """

    def __init__(self, registry: Registry, ledger: "Ledger | None" = None,
                 authenticator: Authenticator | None = None):
        self.registry = registry
        if ledger is None:
            from meshnet.ledger.store import Ledger

            ledger = Ledger()
        self.ledger = ledger
        self.auth = authenticator or Authenticator(ledger)
        self._register_lock = threading.Lock()
        # Nodes that deregistered, kept a while so the work they finish while draining is still credited.
        self._departed: dict[str, tuple[NodeRecord, float]] = {}
        self.relays = RelayHub()
        self.relay_limits = RelayLimits()
        self.activity = ActivityBoard()  # clients' sessions, tokens/s and TTFT, for the dashboard
        self.manifests = ManifestStore()
        self.listens_beyond_loopback = False  # set by start_tracker: it serves other machines too
        self.open_to_all = True  # set by start_tracker: False with a join token (RegisterReply tells nodes)

    def _authenticate(self, method: str, node_id: str, message, bind: bool = False) -> None:
        try:
            self.auth.check(node_id, message, bind=bind)
        except AuthError as e:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {e.message}") from None

    @rpc
    def Register(self, request: pb.NodeInfo, context) -> pb.RegisterReply:
        try:
            record = record_from_info(request)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        peer = context.peer() if hasattr(context, "peer") else ""
        for address in () if record.relayed else (record.address, record.data_address):
            # Registered, such a node drew every route to an address other machines cannot dial.
            if address and (why := loopback_seen_from_elsewhere(address, peer)):
                members_log.warning("refused node %s: %s", record.node_id, why)  # its operator may look here
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"Register: node {record.node_id[:40]!r}: {why}")
        # Check, bind and register as one step (under one lock): two keys racing for a new id cannot both
        # win it, and a refused registration (a protocol mismatch, the id held by a live entry) neither
        # leaves an entry behind nor binds the id to its key.
        with self._register_lock:
            self._authenticate("Register", record.node_id, request, bind=True)
            try:
                self.registry.check_admissible(record, request.protocol_major, request.protocol_minor)
                self.auth.bind(record.node_id, request)
                self.registry.register(record, request.protocol_major, request.protocol_minor,
                                       free_memory_bytes=request.free_memory_bytes,
                                       device=device_dict(request) if request.HasField("device") else None,
                                       version=request.version)
            except AuthError as e:
                raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"Register: {e.message}") from None
            except ProtocolMismatch as e:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"Register: {e}") from None
            except NodeIdInUse as e:  # when the entry holding the id expires, if its node is gone
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"Register: {e}", e.expires_in_s) from None
            except RegistryFull as e:
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Register: {e}",
                              self.registry.heartbeat_interval_s) from None
            except ValueError as e:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"Register: {e}") from None
        if self.listens_beyond_loopback and not record.relayed and is_loopback_address(record.address):
            # Taken (it is on this machine), but routes hand it to clients elsewhere, which are refused at it.
            members_log.warning("node %s registered %s, which only this machine can dial, while the tracker serves "
                                "other machines: they cannot reach it (start it with --host 0.0.0.0, with --advertise "
                                "HOST:PORT where others reach it by another address)", record.node_id, record.address)
        return pb.RegisterReply(heartbeat_interval_s=self.registry.heartbeat_interval_s, ttl_s=self.registry.ttl_s,
                                open_to_all=self.open_to_all)

    @rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatReply:
        if not request.node_id:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "Heartbeat: node_id is empty")
        speed = request.decode_tokens_per_s
        if not (speed >= 0 and math.isfinite(speed)):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                           f"Heartbeat: decode_tokens_per_s={speed}; expected a finite number >= 0 (0 = unchanged)")
        if self.registry.get(request.node_id) is None:
            # Nothing to update and nothing revealed: the node registers (and proves its key) again.
            return pb.HeartbeatReply(known=False)
        self._authenticate("Heartbeat", request.node_id, request)
        known = self.registry.heartbeat(request.node_id, request.active_sessions, speed)
        return pb.HeartbeatReply(known=known)

    @rpc
    def Deregister(self, request: pb.NodeRef, context) -> pb.Empty:
        if not request.node_id:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "Deregister: node_id is empty")
        self._authenticate("Deregister", request.node_id, request)
        record = self.registry.get(request.node_id)
        if self.registry.deregister(request.node_id) and record is not None:
            now = time.monotonic()
            with self._register_lock:
                self._departed = {k: v for k, v in self._departed.items() if v[1] > now}
                self._departed[record.node_id] = (record, now + _DEPARTED_S)
        return pb.Empty()

    @rpc
    def GetRoute(self, request: pb.RouteRequest, context) -> pb.Route:
        try:
            self.registry.check_previous_epoch(request.previous_epoch)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"GetRoute: {e}") from None
        # A relayed node is reachable only while its relay stream is open.
        nodes = [n for n in self.registry.routable() if not n.relayed or self.relays.attached(n.node_id)]
        models = sorted({n.model_sha256 for n in nodes})
        model = request.model_sha256
        if not model:
            if not models:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                               "GetRoute: no node is registered, so no model is served yet")
            if len(models) > 1:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                               f"GetRoute: {len(models)} models are served ({', '.join(models)}); "
                               "name one in model_sha256")
            model = models[0]
        try:
            like = like_from_hops(request.prefer_like)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"GetRoute: {e}") from None
        try:  # the nodes this client found down or out of its reach are spared other clients for a while
            hops = plan_route(nodes, model, exclude=frozenset(request.exclude_node_ids), min_n_ctx=request.min_n_ctx,
                              like=like, avoid=self.registry.avoided(request.exclude_node_ids))
        except NoRoute as e:
            message = e.message
            if not any(n.model_sha256 == model for n in nodes):
                message += f"; models served: {', '.join(map(self.manifests.label, models)) or 'none'}"
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"GetRoute: {message}") from None
        if request.opens_session:
            self.registry.granted(h.node_id for h in hops)
        head = hops[0]
        try:
            epoch = self.registry.next_epoch(request.previous_epoch)
        except ValueError as e:  # checked above; a race cannot lower the counter, so only as a guard
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"GetRoute: {e}") from None
        return pb.Route(
            epoch=epoch,
            model=pb.ModelIdentity(sha256=head.model_sha256, architecture=head.architecture, n_layer=head.n_layer),
            hops=[pb.Hop(node_id=h.node_id, address=h.address, data_address=h.data_address, relayed=h.relayed,
                         layers=pb.LayerRange(start=h.layers.start, end=h.layers.end), instance=h.instance,
                         numerics=h.numerics)
                  for h in hops])

    @rpc
    def PublishManifest(self, request: pb.ModelManifest, context) -> pb.Empty:
        if not request.model_id:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "PublishManifest: model_id is empty")
        try:
            self.manifests.publish(request.model_id, request.manifest)
        except ManifestRefused as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"PublishManifest: {e}") from None
        except ManifestFull as e:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"PublishManifest: {e}") from None
        return pb.Empty()

    @rpc
    def GetManifest(self, request: pb.ManifestRequest, context) -> pb.ModelManifest:
        if len(request.model) > MAX_MODEL_NAME_CHARS:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"GetManifest: the model asked for is "
                           f"{len(request.model)} characters long; an id or name has at most {MAX_MODEL_NAME_CHARS}")
        try:
            model_id, blob = self.manifests.get(request.model)
        except ManifestNotFound as e:
            code = grpc.StatusCode.FAILED_PRECONDITION if e.ambiguous else grpc.StatusCode.NOT_FOUND
            raise Refusal(code, f"GetManifest: {e}") from None
        return pb.ModelManifest(model_id=model_id, manifest=blob)

    @rpc
    def ListNodes(self, request: pb.Empty, context) -> pb.NodeList:
        return self.node_list()

    def node_list(self) -> pb.NodeList:
        """Every live node as ListNodes answers (the dashboard reads the same)."""
        return pb.NodeList(nodes=[
            pb.NodeStatus(info=info_from_status(s), active_sessions=s.record.active_sessions,
                          last_heartbeat_age_s=s.last_heartbeat_age_s, signed=self.auth.is_bound(s.record.node_id))
            for s in self.registry.statuses()])

    def relay_attached(self, node_id: str) -> bool:
        """Whether relayed node ``node_id`` has its relay stream open (routing skips it otherwise)."""
        return self.relays.attached(node_id)

    @rpc
    def ReportWork(self, request: pb.WorkReport, context) -> pb.WorkReportReply:
        from meshnet.ledger.store import LedgerError
        from meshnet.ledger.wire import work_records

        if not request.node_id:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "ReportWork: node_id is empty")
        node = self.registry.get(request.node_id)
        if node is None:
            with self._register_lock:
                node, until = self._departed.get(request.node_id, (None, 0.0))
            if node is None or until < time.monotonic():
                return pb.WorkReportReply(known=False)  # the node registers, then resends
        self._authenticate("ReportWork", request.node_id, request)
        try:
            outcome = self.ledger.record_work(work_records(request, node))
        except LedgerError as e:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"ReportWork: {e}; resend later") from None
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"ReportWork: {e}") from None
        return pb.WorkReportReply(known=True, recorded=outcome.recorded, duplicates=outcome.duplicates)

    @rpc
    def ReportDelivery(self, request: pb.DeliveryReport, context) -> pb.DeliveryReportReply:
        from meshnet.ledger.store import LedgerError

        try:
            recorded, duplicates = self.ledger.record_deliveries(
                request.client_id, [(t.session_id, t.position) for t in request.tokens], request.model_sha256)
        except LedgerError as e:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"ReportDelivery: {e}; resend later") from None
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"ReportDelivery: {e}") from None
        return pb.DeliveryReportReply(recorded=recorded, duplicates=duplicates)

    @rpc
    def GetLedger(self, request: pb.Empty, context) -> pb.LedgerReply:
        from meshnet.ledger.store import LedgerError
        from meshnet.ledger.wire import ledger_reply

        try:
            return ledger_reply(self.ledger)
        except LedgerError as e:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"GetLedger: {e}") from None

    @rpc
    def ReportActivity(self, request: pb.ActivityReport, context) -> pb.Empty:
        try:
            self.activity.record(request)
        except ValueError as e:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"ReportActivity: {e}") from None
        return pb.Empty()

    # ---- relay -------------------------------------------------------------------------------------
    def Relay(self, request_iterator, context):
        """A relayed node's stream: check its signed hello, then push calls down until either side ends.

        Refusals: INVALID_ARGUMENT (no hello), UNAUTHENTICATED (unsigned or bad signature),
        FAILED_PRECONDITION (the node is not registered as relayed: register first), UNAVAILABLE (the
        tracker relays as many nodes as :class:`RelayLimits` allows); a stream that has not sent its hello
        within RELAY_READ_S is cancelled.
        """
        with self.relay_limits.stream(context, "Relay") as arrived:
            try:
                first = next(request_iterator)
            except (StopIteration, grpc.RpcError):
                return
            arrived()
            yield from self._relay(first, request_iterator, context)

    def _relay(self, first: pb.RelayUp, request_iterator, context):
        node_id = first.hello.node_id
        if not node_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Relay: the first message must carry the node's hello")
        try:
            signed = self.auth.check(node_id, first.hello)
        except AuthError as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"Relay: {e.message}")
        # Traffic for the node flows here, so only a node that proves its key may attach.
        if not signed:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"Relay: node {node_id!r} sent an unsigned hello")
        record = self.registry.get(node_id)
        if record is None or not record.relayed:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"Relay: node {node_id!r} is not registered as relayed; register with relayed=true first")
        link = self.relays.attach(node_id)

        def pump() -> None:
            try:
                for up in request_iterator:
                    link.answer(up)
            except Exception:  # noqa: BLE001 - the stream broke: same as it ending
                pass
            finally:
                self.relays.detach(link, "relay stream closed")

        context.add_callback(lambda: self.relays.detach(link, "relay stream closed"))
        threading.Thread(target=pump, daemon=True, name=f"relay-{node_id}").start()
        yield pb.RelayDown(kind=pb.RelayDown.ATTACHED)
        while True:
            down = link.outgoing.get()
            if down is None:
                return
            yield down

    @staticmethod
    def _abort_relayed(context, answer) -> None:
        code = grpc.StatusCode.__members__.get(answer.code, grpc.StatusCode.UNKNOWN)
        abort_call(context, code, bounded(answer.message), answer.retry_after_s)

    def RelayStep(self, request_iterator, context):
        """Forward one step's frames to the node named in the ``meshnet-relay-node`` metadata and stream
        back its reply frames. The node's status code is returned unchanged; the tracker's own refusals are
        UNAVAILABLE (the node is not attached, or :class:`RelayLimits` are reached), DEADLINE_EXCEEDED (the
        node did not answer within the call's deadline, RELAY_ANSWER_S at most), and a stream that has not
        sent its frames within RELAY_READ_S is cancelled."""
        node_id = dict(context.invocation_metadata()).get(RELAY_NODE_METADATA, "")
        if not node_id or len(node_id) > NODE_ID_MAX_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"RelayStep: name the node (1 to {NODE_ID_MAX_CHARS} "
                          f"characters) in the {RELAY_NODE_METADATA!r} request metadata")
        if not self.relays.attached(node_id):  # before reading what could not go anywhere
            context.abort(grpc.StatusCode.UNAVAILABLE, f"node {node_id} has no relay stream open")
        with self.relay_limits.stream(context, "RelayStep") as arrived:
            try:
                frames, held = self.relay_limits.read_step(request_iterator, context)
            except grpc.RpcError:
                return  # cancelled (by the caller, or for taking longer than RELAY_READ_S)
            arrived()
            try:
                answer = self.relays.call(node_id, pb.RelayDown(kind=pb.RelayDown.STEP, frames=frames),
                                          self.relay_limits.answer_timeout(context))
            finally:
                self.relay_limits.give_back(held)
            if answer.code != "OK":
                self._abort_relayed(context, answer)
            yield from answer.up.replies

    def RelayControl(self, request: pb.RelayControlRequest, context) -> pb.RelayControlReply:
        """Cancel / release a session on, or ask health / capabilities of, a relayed node. Refusals as
        for :meth:`RelayStep`, with a budget of calls of its own (see :class:`RelayLimits`)."""
        if not request.node_id or len(request.node_id) > NODE_ID_MAX_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"RelayControl: node_id must have 1 to "
                          f"{NODE_ID_MAX_CHARS} characters, got {len(request.node_id)}")
        if request.kind not in (pb.RelayDown.CANCEL, pb.RelayDown.RELEASE, pb.RelayDown.HEALTH,
                                pb.RelayDown.CAPABILITIES):  # an unknown kind was passed on to the node
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "RelayControl: kind must be CANCEL, RELEASE, HEALTH or CAPABILITIES (steps use RelayStep)")
        down = pb.RelayDown(kind=request.kind, session_id=request.session_id, epoch=request.epoch)
        with self.relay_limits.stream(context, "RelayControl") as arrived:
            arrived()  # a unary call: nothing left to read
            answer = self.relays.call(request.node_id, down, self.relay_limits.answer_timeout(context))
        if answer.code != "OK":
            self._abort_relayed(context, answer)
        return pb.RelayControlReply(health=answer.up.health, capabilities=answer.up.capabilities)
