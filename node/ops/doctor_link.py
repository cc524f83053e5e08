"""`doctor`'s link check: the bytes a round of the swarm moves per node, the join's download, the
rates they need at the swarm's round length (node/rounds/traffic.py), and whether this
machine's link carries them.

The round's length is H × a step's seconds: declared (`--step-seconds`) or estimated here by
timing one micro-batch's forward and backward of the manifest's model on the training device,
times the micro-batches of a step (the optimizer step left out). The link's rates are
declared (`--uplink-mbit`, `--downlink-mbit`), or measured by a timed transfer with the first
bootstrap peer that answers one (p2p/probe.py: the uplink, and a lower bound of the downlink);
without either the finding gives the numbers and judges nothing. A swarm whose exchange the link
cannot carry even at the least the protocol allows is a failure, one the protocol absorbs
(pairing less often, compressing harder) a warning; on a measured link, whose few megabytes
are a rough sample and whose downlink only a lower bound, a warning either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from node.config.manifest import Manifest
from node.rounds.traffic import DEFAULT_MEMBERS, judge_link, link_need, mbit, round_traffic

VERDICT_LEVELS = {"ok": "ok", "slower": "warn", "too_slow": "fail"}


@dataclass(frozen=True)
class LinkOptions:
    """What the operator declares: None where doctor measures or estimates it."""

    step_seconds: float | None = None
    uplink_mbit: float | None = None
    downlink_mbit: float | None = None
    members: int = DEFAULT_MEMBERS


def vocab_of(manifest: Manifest) -> int:
    return manifest.model.vocab_size or manifest.data.vocab_size or 256


def estimate_step_seconds(manifest: Manifest) -> tuple[float, str]:
    """(seconds, where they come from) of one training step on this machine's device."""
    import torch

    from node.train.model import build_model
    from node.train.trainer import pick_device
    device = pick_device(manifest.train.device)
    train, seq_len, vocab = manifest.train, manifest.data.seq_len, vocab_of(manifest)
    model = build_model(manifest.model, vocab, device)
    tokens = torch.randint(vocab, (train.micro_batch_size, seq_len + 1), device=device)
    micro_batches = max(1, train.tokens_per_step // (train.micro_batch_size * seq_len))
    timings = []
    for _ in range(2):  # the first pays for allocation and kernel choice
        started = time.perf_counter()
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - started)
    return micro_batches * timings[-1], f"estimated on this machine's {device.type}"


async def probe_members(host, manifest: Manifest, identity, peers: list[str],
                        connect_timeout_s: float):
    """A finding holding the measurement (or None): a timed transfer with the first of `peers`
    (multiaddrs) that is reachable and answers one, through a transport started for it on `host`."""
    from node.ops.doctor import LinkProbeFinding
    from node.rounds.message_sizes import transport_limits
    from p2p.errors import P2PError
    from p2p.streams import Transport
    try:  # a model that cannot fit this machine is the messages check's failure
        wire, transfer = transport_limits(manifest, vocab_of(manifest))
        transport = Transport(host.p2p, identity, swarm=manifest.swarm.id, manifest=manifest.digest,
                              wire_limits=wire, limits=transfer)
        await transport.start()
    except P2PError as error:
        measured, failures = None, [str(error)]
    else:
        try:
            measured, failures = await _measure_first(host, transport, peers, connect_timeout_s)
        finally:
            await transport.stop()
    if measured is None:
        why = "; ".join(failures)[:400]
        return LinkProbeFinding("link probe", "warn", f"this machine's link was not measured: no member answered "
                                                      f"a timed transfer ({why}); pass --uplink-mbit and "
                                                      f"--downlink-mbit to judge it.")
    rates = f"{mbit(measured.up_bps)} up, at least {mbit(measured.down_bps_at_least)} down"
    return LinkProbeFinding("link probe", "ok", f"a timed transfer of {measured.nbytes / 1e6:.1f} MB each way "
                                                f"with member {measured.peer[-8:]}: {rates}.", measured)


async def _measure_first(host, transport, peers: list[str], connect_timeout_s: float):
    """(the first measurement among `peers`, or None; why each before it failed)."""
    from hivemind.utils.multiaddr import Multiaddr

    from p2p.errors import P2PError
    from p2p.probe import measure_link
    failures = []
    for text in peers:
        peer = Multiaddr(text)["p2p"]
        if await host.reconnect([text], timeout_s=connect_timeout_s) == 0:
            failures.append(f"{peer[-8:]}: not reachable")
            continue
        try:
            return await measure_link(transport, peer), failures
        except P2PError as error:
            failures.append(f"{peer[-8:]}: {error}")
    return None, failures


def check_link(manifest: Manifest, options: LinkOptions, measured=None):
    """One finding: the round's bytes and the rates they need, judged against the declared link
    or, without one, the `measured` one (p2p/probe.py LinkMeasurement)."""
    from node.ops.doctor import Finding

    if options.step_seconds is not None:
        step, source = options.step_seconds, "declared"
    else:
        step, source = estimate_step_seconds(manifest)
    traffic = round_traffic(manifest, vocab_of(manifest), options.members)
    need = link_need(traffic, manifest.protocol.inner_steps * step)
    members = f", {traffic.members} members" if traffic.protocol == "dilocox" else ""
    rounds = f"rounds of {manifest.protocol.inner_steps} steps of {step:.2f} s ({source}){members}"
    join = (f"a late joiner downloads {traffic.join_bytes / 1e6:.1f} MB of state ({mbit(need.join_bps)} "
            f"to fetch it within a round)")
    declared = options.uplink_mbit is not None and options.downlink_mbit is not None
    if not declared and measured is None:
        return Finding("link", "ok", f"at {rounds}: a round moves {traffic.up_bytes / 1e6:.1f} MB up and "
                                     f"{traffic.down_bytes / 1e6:.1f} MB down per node ({traffic.what}), "
                                     f"which needs {mbit(need.up_bps)} up and {mbit(need.down_bps)} down, "
                                     f"and {join}; pass --uplink-mbit and --downlink-mbit to check "
                                     f"this machine's link against them.")
    if declared:
        up, down, link = options.uplink_mbit * 1e6, options.downlink_mbit * 1e6, ""
    else:
        up, down = measured.up_bps, measured.down_bps_at_least
        link = f"this link ({mbit(up)} up, at least {mbit(down)} down, measured)"
    verdict = judge_link(traffic, need, up, down, manifest.swarm.id, link=link)
    level = VERDICT_LEVELS[verdict.level]
    if not declared and level == "fail":  # a rough sample, a lower bound
        level = "warn"
    return Finding("link", level,
                   f"{verdict.sentence[:-1]}, at {rounds}; {join}, {8 * traffic.join_bytes / down:.0f} s "
                   f"at {mbit(down)}.")
