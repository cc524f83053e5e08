"""lowcomm's network layer: identity, p2pd + DHT host, swarm membership, signed streams.

Modules, each with one job (import them directly; this package imports nothing eagerly):

    identity    NodeIdentity (the Ed25519 key file), peer id <-> public key, signatures
    host        P2PHost: p2pd and a DHTNode in the caller's (uv)loop; clean shutdown
    records     OwnerOnlyValidator (DHT subkey = peer id, value signed by it), MemberRecord
    membership  Membership: heartbeat, TTL, tombstone on leave, peers()
    wire        the signed frame format and every header check (pure)
    messages    OutgoingMessage / OutgoingTensor / ReceivedMessage (bytes, numpy views)
    streams     Transport: push, swap, request over parallel hivemind binary streams
    framing, sending, assembly   the stream machinery behind Transport
    progress    when a transfer ends: done, stalled, or unable to finish by its need-by at the
                swarm's minimum link rate (never at a fixed time)
    limits      WireLimits (bounds per message), TransferLimits, InflightLedger
    replay      ReplayGuard;  counters  TransportCounters;  errors  Reason and exceptions

The daemon's order of use: NodeIdentity.load_or_create -> P2PHost.start -> Membership(...).start()
and Transport(...).start() -> exchanges -> Membership.leave() -> Transport.stop() -> P2PHost.shutdown().
"""
