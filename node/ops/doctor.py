"""`lowcomm-node doctor`: the check a volunteer runs before joining a swarm.

Each finding is one sentence, and says what to do when something is wrong. Checks, in order:
Python and torch, the training device, the manifest and its digest, free disk for two
checkpoints, the swarm's largest message against the transport and this machine's memory,
p2pd's start (timed, on loopback), then a real start of this node's network parts as `join`
would (bootstrap, the dial-back reachability check, relay slots), each bootstrap peer on its
own, the clock against theirs, a timed transfer with one of them, and last the bytes a round
moves and the link rate they need, judged against the declared or measured link
(node/ops/doctor_link.py). The exit code is 0 only when no finding is a failure,
that is when `join` would get in. Nothing is written to the data directory: the check runs under
a throwaway identity.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config.manifest import Manifest
from node.ops.doctor_link import LinkOptions, probe_members

CHECKPOINT_BYTES_PER_PARAM = 24  # θ, AdamW's two moments, the outer φ and momentum, with margin
CLOCK_FAIL_S = 300.0             # peers refuse messages stamped more than 300 s off (WireLimits)


@dataclass
class Finding:
    check: str
    level: str   # "ok", "warn" or "fail"
    text: str    # one sentence; when not ok, it says what to do

    def line(self) -> str:
        return f"{self.level.upper():5} {self.check:13} {self.text}"


@dataclass
class LinkProbeFinding(Finding):
    measured: Any = None  # p2p/probe.py LinkMeasurement; None when no member answered a probe


@dataclass
class DoctorOptions:
    data_dir: Path
    listen: list[str]
    peers: list[str]            # --peer, added to the manifest's bootstrap peers
    reachability: str = "auto"
    p2pd_timeout_s: float = 15.0
    peer_timeout_s: float = 10.0
    link: LinkOptions = LinkOptions()


def check_python_and_torch() -> Finding:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info < (3, 11):
        return Finding("python", "fail", f"Python {version} is too old: install Python 3.11 or newer.")
    try:
        import torch
    except ImportError:
        return Finding("python", "fail", f"Python {version} has no torch: install it "
                                         f"(pip install torch) in this environment.")
    return Finding("python", "ok", f"Python {version} with torch {torch.__version__}.")


def check_device(manifest: Manifest) -> Finding:
    import torch

    from node.train.accelerator import device_precision
    from node.train.trainer import pick_device
    try:
        device = pick_device(manifest.train.device)
        precision = device_precision(device, manifest.train.precision)
    except (RuntimeError, ValueError) as error:
        return Finding("device", "fail", f"{error}.")
    use = device_use_text(precision.describe(), manifest.train.compile, device.type)
    if device.type == "cuda":
        return Finding("device", "ok", f"training runs on {device} ({torch.cuda.get_device_name(device)}), {use}.")
    note = "" if manifest.train.device == "cpu" else " (no GPU found: training will be slow)"
    return Finding("device", "ok" if device.type != "cpu" or not note else "warn",
                   f"training runs on {device}{note}, {use}.")


def device_use_text(precision: str, compile_setting: str, device_type: str) -> str:
    """The precision and why, and whether the model will be compiled, in one clause."""
    from node.train.accelerator import eager_reason

    eager = eager_reason(compile_setting, device_type)
    compiled = f"eager ({eager})" if eager else f"compiled (train.compile = {compile_setting})"
    return f"in {precision}, {compiled}"


def check_manifest(manifest: Manifest, peers: list[str]) -> Finding:
    described = f"swarm {manifest.swarm.id!r}, {manifest.protocol.name}, manifest digest {manifest.digest[:16]}"
    if not [*manifest.network.bootstrap_peers, *peers]:
        return Finding("manifest", "warn", f"{described} names no bootstrap peer, so this node would start "
                                           f"a swarm of its own: to join one, pass --peer MULTIADDR.")
    return Finding("manifest", "ok", f"{described}.")


def checkpoint_bytes(manifest: Manifest) -> int:
    """About the size of one checkpoint, from the model's parameter count (built on `meta`)."""
    from node.train.model import build_model

    vocab = manifest.model.vocab_size or manifest.data.vocab_size or 256
    model = build_model(manifest.model, vocab, "meta")
    return CHECKPOINT_BYTES_PER_PARAM * sum(p.numel() for p in model.parameters())


def check_messages(manifest: Manifest) -> Finding:
    """The swarm's largest message against the transport and this machine's memory, as `join`
    checks it at start (node/rounds/message_sizes.py)."""
    from node.rounds.message_sizes import transport_limits
    from p2p.errors import LimitsError

    try:
        wire, _ = transport_limits(manifest, manifest.model.vocab_size or manifest.data.vocab_size or 256)
    except LimitsError as error:
        return Finding("messages", "fail", f"{error}.")
    return Finding("messages", "ok", f"the swarm's largest message ({wire.max_message_bytes / 1e9:.2f} GB, "
                                     f"{wire.max_tensors} tensors) fits the transport and this machine.")


def check_disk(manifest: Manifest, data_dir: Path) -> Finding:
    need = 2 * checkpoint_bytes(manifest)
    where = data_dir
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        return Finding("disk", "fail", f"{where} has {free / 2**30:.2f} GiB free but two checkpoints of this "
                                       f"model need about {need / 2**30:.2f} GiB: free space or choose "
                                       f"another --data-dir.")
    return Finding("disk", "ok", f"{free / 2**30:.1f} GiB free in {where}; two checkpoints need about "
                                 f"{need / 2**30:.2f} GiB.")


def check_link_safely(manifest: Manifest, options: LinkOptions, measured=None) -> Finding:
    from node.ops.doctor_link import check_link
    try:
        return check_link(manifest, options, measured)
    except (RuntimeError, ValueError, MemoryError) as error:  # a step that cannot run here
        return Finding("link", "warn", f"the round's length could not be estimated ({error}): "
                                       f"pass --step-seconds.")


async def check_p2pd(identity_path: str, timeout_s: float) -> Finding:
    from p2p.host import shutdown_p2p, start_p2pd
    from p2p.errors import HostError

    started = time.monotonic()
    try:
        p2p = await start_p2pd(identity_path=identity_path, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=None, nat_port_map=False, check_if_identity_free=False,
                                startup_timeout=timeout_s)
    except HostError as error:
        return Finding("p2pd", "fail", str(error))
    took = time.monotonic() - started
    await shutdown_p2p(p2p)
    level = "ok" if took < timeout_s / 3 else "warn"
    advice = "" if level == "ok" else f": close to its {timeout_s:.0f} s limit, raise it with --p2pd-timeout"
    return Finding("p2pd", level, f"p2pd started in {took:.2f} s{advice}.")


async def check_network(manifest: Manifest, options: DoctorOptions, identity) -> list[Finding]:
    """Starts the node's network parts as `join` would, then looks at each bootstrap peer."""
    from p2p.errors import HostError
    from p2p.host import P2PHost, check_peer_maddrs
    from p2p.reachability import ReachabilityOptions

    try:
        peers = check_peer_maddrs([*options.peers, *manifest.network.bootstrap_peers])
    except HostError as error:
        return [Finding("bootstrap", "fail", str(error))]
    try:
        host = await P2PHost.start(identity, host_maddrs=options.listen, initial_peers=peers,
                                   startup_timeout_s=options.p2pd_timeout_s,
                                   reachability=ReachabilityOptions(options.reachability))
    except HostError as error:
        return [Finding("bootstrap", "fail", str(error))]
    try:
        found = host.reachability
        findings = [reachability_finding(found)]
        if found.mode == "private":
            relays = found.relays()
            findings.append(Finding("relay", "ok" if found.relay_addrs else "warn",
                                    f"{len(relays)} relay reservation(s) ({', '.join(r[-8:] for r in relays)}): "
                                    f"members behind other NATs reach this node through {found.relay_addrs[0]}."
                                    if found.relay_addrs else
                                    "no relay reservation: members behind other NATs cannot reach this node; "
                                    "ask the swarm's operator for a public member that runs this version."))
        findings += await _check_peers(host, peers, options.peer_timeout_s)
        return [*findings, await probe_members(host, manifest, identity, peers, options.peer_timeout_s)]
    finally:
        await host.shutdown()


def reachability_finding(found) -> Finding:
    if found.mode == "local":
        return Finding("reachability", "warn", f"{found.line()}: only nodes on this machine can reach it; "
                                               f"listen on a real interface (--listen) to join others.")
    if found.dropped_announce:
        return Finding("reachability", "warn", f"{found.line()}: --announce {found.dropped_announce[0]} did "
                                               f"not answer; forward that port on your router.")
    return Finding("reachability", "ok", f"{found.line()}.")


async def _check_peers(host, peers: list[str], timeout_s: float) -> list[Finding]:
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    from p2p.reachability import ask_dial_back
    findings, offsets = [], []
    for text in peers:
        peer = PeerID.from_base58(Multiaddr(text)["p2p"])
        if await host.reconnect([text], timeout_s=timeout_s) == 0:
            findings.append(Finding("bootstrap", "fail" if len(peers) == 1 else "warn",
                                    f"bootstrap peer {text} did not answer within {timeout_s:.0f} s: it is down "
                                    f"or its address is wrong; ask the swarm's operator for a live one."))
            continue
        findings.append(Finding("bootstrap", "ok", f"bootstrap peer {text} answers."))
        try:
            answer = await ask_dial_back(host.p2p, peer, [], timeout_s)
        except Exception:
            continue  # an older member: no clock to compare
        if answer.clock_offset_s is not None:
            offsets.append((abs(answer.clock_offset_s), answer.clock_offset_s, str(peer)[-8:]))
    if not [f for f in findings if f.level == "ok"]:
        findings.append(Finding("bootstrap", "fail", "no bootstrap peer answered: this node cannot join; "
                                                     "check the addresses with the swarm's operator."))
    findings.append(clock_finding([(offset, text) for _, offset, text in offsets]))
    return findings


def clock_finding(offsets: list[tuple[float, str]], member_ttl_s: float | None = None) -> Finding:
    """The clock against the peers': `offsets` holds (the peer's clock minus ours, the peer's
    name) as the dial-back measured them. Membership tolerates skews up to its skew tolerance
    (p2p/membership.py: a member's record lives `ttl` + that tolerance in the DHT); this warns
    from a third of that lifetime on, and fails where membership or the wire would refuse us."""
    from node.config.settings import NodeSettings
    from p2p.membership import CLOCK_SKEW_TOLERANCE_S

    if not offsets:
        return Finding("clock", "warn", "no peer told its time: the clock was not compared; "
                                        "keep it synchronised (NTP).")
    ttl_s = NodeSettings.member_ttl_s if member_ttl_s is None else member_ttl_s
    warn_s, fail_s = (ttl_s + CLOCK_SKEW_TOLERANCE_S) / 3, min(CLOCK_SKEW_TOLERANCE_S, CLOCK_FAIL_S)
    offset, peer = max(offsets, key=lambda found: abs(found[0]))
    level = "ok" if abs(offset) < warn_s else "warn" if abs(offset) < fail_s else "fail"
    advice = {"ok": "",
              "warn": f": set the clock (NTP); members drift out of each other's view beyond "
                      f"{fail_s:.0f} s",
              "fail": f": set the clock (NTP); peers drop the member records, or refuse the messages, "
                      f"of a node {fail_s:.0f} s off"}[level]
    return Finding("clock", level, f"this clock differs from peer {peer}'s by {-offset:+.2f} s{advice}.")


async def run_doctor(manifest: Manifest, options: DoctorOptions) -> list[Finding]:
    from p2p.identity import NodeIdentity

    findings = [check_python_and_torch()]
    if findings[0].level == "fail":
        return findings
    messages = check_messages(manifest)
    findings += [check_device(manifest), check_manifest(manifest, options.peers),
                 check_disk(manifest, options.data_dir), messages]
    with tempfile.TemporaryDirectory(prefix="lowcomm-doctor-") as scratch:
        identity = NodeIdentity.generate()
        identity.save(Path(scratch) / "identity.key")
        p2pd = await check_p2pd(str(identity.path), options.p2pd_timeout_s)
        findings.append(p2pd)
        if p2pd.level != "fail" and findings[2].level == "ok":  # with peers to check against
            findings += await check_network(manifest, options, identity)
    if messages.level != "fail":  # the model fits this machine: its rounds can be sized
        measured = next((f.measured for f in findings if isinstance(f, LinkProbeFinding)), None)
        findings.append(check_link_safely(manifest, options.link, measured))
    return findings


def report(findings: list[Finding], swarm: str) -> tuple[str, int]:
    """The printed report and the exit code (0 only when nothing failed)."""
    failed = [f for f in findings if f.level == "fail"]
    verdict = (f"this node can join swarm {swarm!r}." if not failed else
               f"this node cannot join swarm {swarm!r}: fix the {len(failed)} failure(s) above.")
    return "\n".join([*(f.line() for f in findings), verdict]), 1 if failed else 0


def run_and_report(manifest: Manifest, options: DoctorOptions) -> int:
    from p2p.host import run_event_loop

    text, code = report(run_event_loop(run_doctor(manifest, options)), manifest.swarm.id)
    print(text)
    return code
