"""A test-only entry point that runs a real `lowcomm-node` daemon with one misbehaviour patched in.

    python -m tests.adversary --kind nan -- join --manifest m.toml --data-dir d ...

The product has no adversary switch: this wrapper monkeypatches the node's own functions before
calling `node.cli.main`, so everything else (identity, DHT, signed streams, training) is the real
daemon. Kinds:

- nan, inf:   every NoLoCo snapshot it offers carries NaN (or +Inf) in its progress Δ;
- scale:      its Δ is multiplied by 1000 (a poisoned or runaway update);
- noise:      its Δ is replaced by Gaussian noise of the same per-tensor norm (NoLoCo: in its
              snapshot; DiLoCoX: before compression, so with any codec);
- theta-random, theta-negate, theta-target: its NoLoCo snapshot's θ is replaced (`corrupt_theta`):
              by random weights of θ's norm, tensor by tensor; by −θ; or by θ plus a push
              towards a fixed other model (random weights of θ's per-tensor norms, drawn once
              from a fixed seed) of TARGET_PUSH times the pull bound's floor f (its progress
              norm plus the wire's rounding: protocol/pull_bound.py), so that the default
              bound clips it and never refuses it: the most a partner can pull unpunished;
  theta-sideways: the same push with its part along each of θ's own tensors taken out, so that
              it moves no tensor's norm (the radial part the bound judges) and only the distance
              bounds it: an adversary that knows the rule;
- replay:     after each message it sends a peer, it sends that peer the very first signed
              message of the same kind again (same nonce, same signature: a byte-exact replay);
- stall:      it keeps opening streams to every member and never writes a byte on them;
- flood:      publishes GHOSTS fake members (fresh keys, validly signed, "ready" in the current
              round, at dead addresses), and forged tombstones of the real members (signed
              with its own key under their subkeys);
- swap-kill:  SIGKILLs itself (and so its p2pd) halfway through the first frame of its first
              NoLoCo snapshot on the wire: a kill mid-swap;
- push-kill:  the same, in its first DiLoCoX pseudo-gradient message: a kill mid-DiLoCoX send;
- serve-kill: the same, in the first outer state it serves a late joiner: a kill mid-transfer;
- ckpt-kill:  SIGKILLs itself halfway through writing its N-th checkpoint file
              (N = LOWCOMM_TEST_KILL_AT_CHECKPOINT, default 2): a kill at a named point;
- state-poison: the NoLoCo state it serves late joiners holds φ x SCALE, and the φ digest it
              announces in its member record is that state's (a poisoned state whose digest
              matches its own signed announcement);
- state-round:  its member record, its announcements and the state it serves claim rounds
              10^6 beyond its real ones;
- equivocate: DiLoCoX: signs two versions of each round's message (the second compresses half
              its pseudo-gradient: a valid message that moves φ elsewhere) and pushes one to the
              first half of its group by peer id, the other to the second half;
- future:     DiLoCoX: its member record claims rounds 10^9 beyond its real ones, and in place of
              each round's message it pushes a validly signed one of the round 10^9 later;
- slow-members: not an adversary, a fault of its DHT: its member lookups answer "no member"
              for the first SLOW_MEMBERS_S seconds (LOWCOMM_TEST_SLOW_MEMBERS_S), as a DHT slow
              to show the records already stored, or split at start, does; then the truth;
- split:      not an adversary, a fault of its inbox: DiLoCoX: its outer step of round
              SPLIT_ROUND (LOWCOMM_TEST_SPLIT_ROUND) leaves out the message of the first other
              member (by peer id) that came, as a node that got that message after it closed
              the round does: the message reached the rest of the swarm, and this node's φ
              leaves theirs until the repair (a replay, or a download) brings it back;
- unlisted:   skips its own allowlist check (node.daemon.join.check_admission), so that in an
              allowlist swarm it joins with a key the manifest does not list: the members'
              refusal is what stops it.

What the adversary does is logged on stderr with the prefix "adversary:" so tests can wait on it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

log = logging.getLogger("lowcomm.adversary")
THETA_KINDS = ("theta-random", "theta-negate", "theta-target", "theta-sideways")
KINDS = ("nan", "inf", "scale", "noise", *THETA_KINDS, "slow-members", "replay", "stall", "flood",
         "ckpt-kill", "swap-kill", "push-kill", "serve-kill", "unlisted", "state-poison",
         "state-round", "equivocate", "future", "split")
GHOSTS = 30          # fake members a flooding node publishes
SCALE = 1000.0
STALL_STREAMS = 20   # more than TransferLimits.max_streams_per_peer (16)
ROUND_LIE = 10 ** 6
FUTURE = 10 ** 9
TARGET_SEED = 1234
SLOW_MEMBERS_S = 10.0
SPLIT_ROUND = 2


def target_push() -> float:
    """theta-target's ‖push‖ / f: below the default refusal ratio, above its clipping ratio."""
    from node.config.manifest import ContributionSection

    default = ContributionSection()
    return (default.pull_clip_ratio + default.pull_refuse_ratio) / 2


def corrupt_theta(kind: str, theta: dict, floor: float, target: dict) -> dict:
    """The θ a `kind` adversary sends in place of its `theta` (see the module docstring);
    `target` (theta-target) is filled on first use and reused: the same model every round."""
    import torch

    if kind == "theta-negate":
        return {name: -t for name, t in theta.items()}
    if kind == "theta-random":
        out = {}
        for name, t in theta.items():
            z = torch.randn_like(t)
            out[name] = z * (t.norm() / z.norm().clamp_min(1e-12))
        return out
    if not target:
        generator = torch.Generator().manual_seed(TARGET_SEED)
        for name, t in theta.items():
            z = torch.randn(t.shape, generator=generator)
            target[name] = z * (t.norm() / z.norm().clamp_min(1e-12))
    push = {name: target[name] - t for name, t in theta.items()}
    if kind == "theta-sideways":  # each tensor's push less its part along that tensor
        push = {name: p - (p * theta[name]).sum() / theta[name].pow(2).sum().clamp_min(1e-30)
                * theta[name] for name, p in push.items()}
    push_norm = float(sum(p.pow(2).sum() for p in push.values())) ** 0.5
    scale = target_push() * floor / max(push_norm, 1e-12)
    return {name: t + scale * push[name] for name, t in theta.items()}


def _theta_adversary(kind: str) -> None:
    from node.rounds.noloco import payload as noloco_payload

    honest, target = noloco_payload.encode_snapshot, {}

    def encode_snapshot(snapshot, wire_dtype, layout, rounding=None):
        from node.rounds.wire_tensors import rounding_error_norm
        from protocol.pull_bound import distance

        theta = snapshot.fast_weights()
        floor = distance(theta, snapshot.slow_weights) + rounding_error_norm(theta, wire_dtype)
        bad = corrupt_theta(kind, theta, floor, target)
        delta = {name: bad[name] - snapshot.slow_weights[name].float() for name in bad}
        log.warning("adversary: offering a %s snapshot", kind)
        return honest(dataclasses.replace(snapshot, local_progress=delta), wire_dtype, layout,
                      rounding)

    noloco_payload.encode_snapshot = encode_snapshot


# ---------------------------------------------------------------------- poisoned tensors
def _poison(kind: str):
    import torch

    from node.rounds.noloco import payload as noloco_payload

    honest = noloco_payload.encode_snapshot

    def corrupt(delta: dict) -> dict:
        out = {}
        for name, t in delta.items():
            if kind == "nan":
                out[name] = torch.full_like(t, float("nan"))
            elif kind == "inf":
                out[name] = torch.full_like(t, float("inf"))
            elif kind == "scale":
                out[name] = t * SCALE
            else:  # noise of the same norm, tensor by tensor
                noise = torch.randn_like(t)
                out[name] = noise * (t.norm() / noise.norm().clamp_min(1e-12))
        return out

    def encode_snapshot(snapshot, wire_dtype, layout, rounding=None):
        bad = dataclasses.replace(snapshot, local_progress=corrupt(snapshot.local_progress))
        log.warning("adversary: offering a %s snapshot", kind)
        return honest(bad, wire_dtype, layout, rounding)  # θ = φ + the corrupted Δ, or φ and it

    noloco_payload.encode_snapshot = encode_snapshot

    if kind == "noise":  # DiLoCoX, any codec: noise of Δ's norm goes into the compression
        from protocol import dilocox

        honest_compress = dilocox.DiLoCoX.compress

        def compress(self, delta, round_index):
            log.warning("adversary: compressing noise in place of the pseudo-gradient")
            return honest_compress(self, corrupt(dict(delta)), round_index)
        dilocox.DiLoCoX.compress = compress

    if kind in ("nan", "inf", "scale"):  # DiLoCoX with the bf16 codec: poison its payloads
        from node.rounds.dilocox import payload as dilocox_payload

        honest_message = dilocox_payload.encode_message

        def encode_message(message):
            tensors = {}
            for name, encoded in message.tensors.items():
                if encoded.description.get("codec") != "bf16":
                    raise SystemExit("adversary: DiLoCoX poisoning needs protocol.codec = 'bf16'")
                values = torch.frombuffer(bytearray(encoded.payload), dtype=torch.bfloat16)
                bad = corrupt({name: values.float()})[name].to(torch.bfloat16)
                tensors[name] = dataclasses.replace(encoded,
                                                    payload=bad.view(torch.uint8).numpy().tobytes())
            log.warning("adversary: sending a %s pseudo-gradient", kind)
            return honest_message(dataclasses.replace(message, tensors=tensors))

        dilocox_payload.encode_message = encode_message


# ---------------------------------------------------------------------- a slow DHT
def _slow_members() -> None:
    import time

    from p2p.membership import Membership

    honest, slow_s = Membership.peers, float(os.environ.get("LOWCOMM_TEST_SLOW_MEMBERS_S",
                                                           SLOW_MEMBERS_S))
    first: list[float] = []

    async def peers(self, include_self=False, timeout_s=10.0):
        first.append(first[0] if first else time.monotonic())
        answer = await honest(self, include_self, timeout_s)
        if time.monotonic() - first[0] < slow_s:
            log.warning("adversary: member lookup answered no member (%d stored)", len(answer))
            return {}
        return answer

    Membership.peers = peers


# ---------------------------------------------------------------------- lying state servers
def _lie_about_state(kind: str) -> None:
    from node.daemon import members
    from node.rounds.noloco import round as noloco_round

    honest_export, honest_digest = noloco_round.NoLoCoRound.export_state, noloco_round.weights_digest

    def scaled(phi: dict) -> dict:
        return {name: t * SCALE for name, t in phi.items()}

    if kind == "state-poison":
        # every φ digest the round computes (and so announces) is that of the poisoned state
        noloco_round.weights_digest = lambda phi: honest_digest(scaled(phi))

    def export_state(self, round_index=None):
        state_round, groups, digest = honest_export(self, round_index)
        if kind == "state-poison":
            log.warning("adversary: serving a state with phi x %g under its announced digest", SCALE)
            return state_round, {"phi": scaled(groups["phi"]), "momentum": groups["momentum"]}, digest
        log.warning("adversary: serving a state that claims round %d", state_round + ROUND_LIE)
        return state_round + ROUND_LIE, groups, digest
    noloco_round.NoLoCoRound.export_state = export_state

    if kind == "state-round":
        honest_update = members.MemberCache.update

        def update(self, **fields):
            if "round" in fields:
                fields["round"] += ROUND_LIE
            extra = fields.get("extra")
            if extra:
                fields["extra"] = {k: v + ROUND_LIE if k in ("phi_round", "phi_prev_round")
                                   and type(v) is int and v >= 0 else v for k, v in extra.items()}
            return honest_update(self, **fields)
        members.MemberCache.update = update


# ---------------------------------------------------------------------- replayed messages
def _replay() -> None:
    import contextvars

    from p2p import streams
    from p2p.errors import P2PError

    original_plan, original_call = streams.SendPlan, streams.Transport._call
    first: dict[tuple, object] = {}
    replaying = contextvars.ContextVar("replaying", default=False)

    def send_plan(identity, *, recipient, message, mode, **kwargs):
        key = (recipient, message.kind, mode)
        if replaying.get() and key in first:
            return first[key]   # the old plan: same nonce, timestamp, frames, signatures
        plan = original_plan(identity, recipient=recipient, message=message, mode=mode, **kwargs)
        first.setdefault(key, plan)
        return plan

    async def replay(transport, peer, message, mode, streams_, timeout):
        replaying.set(True)
        try:
            await original_call(transport, peer, message, mode, streams_, timeout, None, 0)
            log.warning("adversary: replay of %r to %s was ACCEPTED", message.kind, peer)
        except P2PError as exc:
            reason = getattr(exc, "reason", None)
            log.warning("adversary: replay of %r to %s refused: %s", message.kind, peer,
                        reason.name if reason is not None else exc)

    async def call(self, peer, message, mode, streams_, timeout, accept_round, expected):
        try:
            return await original_call(self, peer, message, mode, streams_, timeout, accept_round,
                                       expected)
        finally:
            if (peer.to_bytes(), message.kind, mode) in first:
                asyncio.get_running_loop().create_task(
                    replay(self, peer, message, mode, streams_, timeout))

    streams.SendPlan = send_plan
    streams.Transport._call = call


# ---------------------------------------------------------------------- streams never finished
def _stall() -> None:
    from hivemind.p2p import PeerID

    from node.daemon import members
    from p2p import streams

    caches = []
    original_start = members.MemberCache.start

    async def start(self):
        await original_start(self)
        caches.append(self)

    members.MemberCache.start = start
    original_transport_start = streams.Transport.start

    async def transport_start(self):
        await original_transport_start(self)
        asyncio.get_running_loop().create_task(attack(self))

    async def attack(transport):
        held: dict[str, list] = {}
        announced = set()
        while True:
            await asyncio.sleep(0.5)
            if not caches:
                continue
            for record in caches[0].peers():
                open_ = [w for w in held.get(record.peer_id, []) if not w.is_closing()]
                held[record.peer_id] = open_
                for _ in range(STALL_STREAMS - len(open_)):
                    try:
                        _, _reader, writer = await asyncio.wait_for(
                            transport.p2p.call_binary_stream_handler(
                                PeerID.from_base58(record.peer_id), transport.protocol), 5)
                    except Exception as exc:  # noqa: BLE001 (refused, busy: try again later)
                        log.info("adversary: stream to %s not opened: %s", record.peer_id, exc)
                        break
                    open_.append(writer)
                if len(open_) >= 16 and record.peer_id not in announced:
                    announced.add(record.peer_id)
                    log.warning("adversary: holding %d silent streams to %s", len(open_),
                                record.peer_id)

    streams.Transport.start = transport_start


# ---------------------------------------------------------------------- a kill inside a write
def _checkpoint_kill() -> None:
    import builtins

    from node.train import checkpoint

    target = int(os.environ.get("LOWCOMM_TEST_KILL_AT_CHECKPOINT", "2"))
    saves = 0

    class HalfWriter:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def write(self, data):
            # half the checkpoint reaches the disk, then the process dies: a torn write
            self.file.write(data[: len(data) // 2])
            self.file.flush()
            os.fsync(self.file.fileno())
            log.warning("adversary: SIGKILL inside checkpoint write %d", saves)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    def open_(path, mode="r", *args, **kwargs):
        nonlocal saves
        file = builtins.open(path, mode, *args, **kwargs)  # noqa: SIM115 (returned)
        if "w" in mode and ".tmp-" in str(path):
            saves += 1
            if saves == target:
                return HalfWriter(file)
        return file

    checkpoint.open = open_  # module global: shadows the builtin only in node/train/checkpoint.py


def _flood() -> None:
    import time

    from node.daemon import members
    from p2p import records
    from p2p.identity import NodeIdentity
    from p2p.records import MemberRecord

    ghosts = {}
    original_sign = records.OwnerOnlyValidator.sign_value

    def sign_value(self, record):
        owner = records._owner_of(record.subkey)
        if record.key in self._protected and owner in ghosts:  # a ghost signs its own record
            identity = ghosts[owner]
            return (record.value + identity.sign(records._record_signing_input(record, record.value))
                    + records.SIGNED_MARKER)
        return original_sign(self, record)

    records.OwnerOnlyValidator.sign_value = sign_value
    original_start = members.MemberCache.start

    async def start(self):
        await original_start(self)
        asyncio.get_running_loop().create_task(flood(self))

    async def flood(cache):
        membership = cache.membership
        dht, key, me = membership.host.dht, membership.key, membership.record
        for _ in range(GHOSTS):
            identity = NodeIdentity.generate()
            ghosts[identity.peer_id.to_base58()] = identity
        stored = forged = 0
        while True:
            now = time.time()
            rnd = max([r.round for r in cache.peers()] + [me.round])
            for ghost in ghosts:
                record = MemberRecord(ghost, (f"/ip4/127.0.0.1/tcp/9/p2p/{ghost}",), me.protocol,
                                      me.manifest, rnd, "ready", 1e6, {}, now)
                stored += bool(await dht.store(key, record.to_value(), now + 30, subkey=ghost))
            for real in cache.peers():
                if real.peer_id in ghosts:
                    continue
                tomb = MemberRecord(real.peer_id, real.addrs, real.protocol, real.manifest,
                                    real.round, "left", 0.0, {}, now)
                forged += bool(await dht.store(key, tomb.to_value(), now + 60,
                                               subkey=real.peer_id))
            log.warning("adversary: flood stored %d ghost records, %d forged tombstones accepted",
                        stored, forged)
            await asyncio.sleep(2.0)

    members.MemberCache.start = start


# ---------------------------------------------------------------------- DiLoCoX messages
def _dilocox_lies(kind: str) -> None:
    from node.daemon import members
    from node.rounds.dilocox import payload, sending
    from p2p.messages import OutgoingMessage
    from protocol import dilocox

    async def push_all(sender, pushes) -> None:
        async def push(peer, message):
            try:
                await sender.swarm.transport.push(peer, message)  # bounded by its bytes (p2p/progress.py)
            except Exception as exc:  # noqa: BLE001 (refused, banned: what the test reads)
                log.warning("adversary: round %d to %s refused: %s", message.round, peer, exc)
        await asyncio.gather(*(push(peer, message) for peer, message in pushes))

    twins: dict[int, list] = {}  # round -> the second version's tensors
    honest_compress = dilocox.DiLoCoX.compress

    def compress(self, delta, round_index):
        last = self.last_compressed_round
        half = honest_compress(self, {name: t * 0.5 for name, t in delta.items()}, round_index)
        twins[round_index] = payload.encode_message(half)
        self.last_compressed_round = last  # the round once more: the version it applies itself
        return honest_compress(self, delta, round_index)

    async def equivocate(self, round_index, message):
        group = sorted(self.group())
        twin = OutgoingMessage(message.kind, round_index, twins.pop(round_index))
        self.sign(twin)
        half = group[: len(group) // 2]
        log.warning("adversary: round %d: one version to %s, another to %s", round_index,
                    half, group[len(half):])
        await push_all(self, [(p, message if p in half else twin) for p in group])

    async def far_future(self, round_index, message):
        far = OutgoingMessage(message.kind, round_index + FUTURE, list(message.tensors))
        self.sign(far)
        log.warning("adversary: pushing a message of round %d", far.round)
        await push_all(self, [(p, far) for p in self.group()])

    if kind == "equivocate":
        dilocox.DiLoCoX.compress = compress
        sending.RoundSender._send_all = equivocate
        return
    sending.RoundSender._send_all = far_future
    honest_update = members.MemberCache.update

    def update(self, **fields):
        if "round" in fields:
            fields["round"] += FUTURE
        return honest_update(self, **fields)
    members.MemberCache.update = update


def _split() -> None:
    from node.rounds.dilocox import exchange

    split_round = int(os.environ.get("LOWCOMM_TEST_SPLIT_ROUND", SPLIT_ROUND))
    honest_collect = exchange.DiLoCoXExchange._collect

    async def collect(self, round_index, wait_s):
        got = await honest_collect(self, round_index, wait_s)
        others = sorted(g.peer for g in got if g.peer != self.peer_id)
        if round_index != split_round or not others:
            return got
        log.warning("adversary: round %d: the message of %s left out of the step", round_index,
                    others[0])
        return [g for g in got if g.peer != others[0]]
    exchange.DiLoCoXExchange._collect = collect


# kind -> (message kind on the wire, what the log says): a SIGKILL halfway through the first
# frame of the first such message this node writes
KILL_MID_SEND = {"swap-kill": ("noloco.snapshot", "SIGKILL mid-swap"),
                 "push-kill": ("dilocox.pgrad", "SIGKILL mid-DiLoCoX send"),
                 "serve-kill": ("state", "SIGKILL mid late-join transfer")}


def _kill_mid_send(wire_kind: str, label: str) -> None:
    from p2p import serving, streams

    original = streams.send_stream_frames

    async def send_stream_frames(io, plan, stream, executor, stop=None):
        if plan.kind == wire_kind and plan.total:
            async def write_views(views, chunk_bytes):
                first = views[0]
                await io.write(bytes(first[: len(first) // 2]))
                log.warning("adversary: %s (half a frame sent)", label)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
            io.write_views = write_views
        return await original(io, plan, stream, executor, stop)

    # both halves of the transport write frames: requests and pushes (streams), replies (serving)
    streams.send_stream_frames = serving.send_stream_frames = send_stream_frames


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m tests.adversary")
    parser.add_argument("--kind", choices=KINDS, required=True)
    args = parser.parse_args(ours)
    if args.kind in ("nan", "inf", "scale", "noise"):
        _poison(args.kind)
    elif args.kind in THETA_KINDS:
        _theta_adversary(args.kind)
    elif args.kind == "slow-members":
        _slow_members()
    elif args.kind == "replay":
        _replay()
    elif args.kind == "stall":
        _stall()
    elif args.kind == "flood":
        _flood()
    elif args.kind in KILL_MID_SEND:
        _kill_mid_send(*KILL_MID_SEND[args.kind])
    elif args.kind == "ckpt-kill":
        _checkpoint_kill()
    elif args.kind in ("state-poison", "state-round"):
        _lie_about_state(args.kind)
    elif args.kind in ("equivocate", "future"):
        _dilocox_lies(args.kind)
    elif args.kind == "split":
        _split()
    elif args.kind == "unlisted":
        from node.daemon import daemon
        daemon.check_admission = lambda manifest, peer_id: log.warning(
            "adversary: skipping the allowlist check for %s", peer_id)
    from node.cli import main as node_main
    return node_main(rest)


if __name__ == "__main__":
    sys.exit(main())
