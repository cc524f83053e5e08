"""A DiLoCoX node's own messages on their way: each round's message pushed to the round's group
in the background, tried again when a push broke, and the link's cost measured for the adaptive
controller (`costs`, node/rounds/dilocox/adapt.py).

`send_round` and `costs` run on the training thread, `_send_all` on the event loop; the
values they share are plain numbers and tuples or dicts replaced whole, never changed in place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from node.events import SendFailed, Sent
from node.rounds.dilocox.link import SendCosts
from node.rounds.swarm import Swarm, failure_sentence
from p2p.errors import Reason, RemoteRefused, TransferFailed, TransferTimeout
from p2p.messages import OutgoingMessage
from p2p.progress import NeedBy

log = logging.getLogger("lowcomm.dilocox")
PGRAD = "dilocox.pgrad"
# The controller reads the link's cost as the worst of this many last sends: each message goes
# to every member, so a slow member's downlink carries all of them, and one send whose copies
# did not overlap there says too little of it.
LINK_MEMORY = 4
# A push that broke (stalled, reset, ended early, a dial that failed) is tried again within its
# need-by, this many times in all (its receiver waits for the message of a member that finished
# the round). A refusal (STALE_ROUND: it came too late) is final.
SEND_TRIES = 3
RETRY_PAUSE_S = 1.0


class RoundSender:
    def __init__(self, swarm: Swarm, group: Callable[[], list[str]],
                 sign: Callable[[OutgoingMessage], None], *, clock: Callable[[], float] = time.monotonic,
                 keep: Callable[[OutgoingMessage], None] = lambda message: None):
        """`group()`: whom a round's message goes to; `sign(message)`: our origin signature;
        `clock()`: seconds, read from either thread; `keep(message)`: the signed message, on
        the loop before it is pushed (the relay's store serves it)."""
        self.swarm, self.group, self.sign, self.clock = swarm, group, sign, clock
        self.keep = keep
        self._send_called_at: float | None = None  # training thread: the last send_round
        self._send_called_round = -1  # ... and its round (a committee skips rounds between them)
        self._round_durations: tuple[float, ...] = ()  # one round, from the last send_round calls
        self._handed_bytes = 0                      # training thread: the last message handed over
        self._sends_in_flight: dict[int, tuple[float, int]] = {}  # loop: round -> (started, bytes)
        self._link_costs: tuple[float, ...] = ()  # loop: seconds per byte of the last sends
        # loop: of the last sends, the seconds per byte the slowest receiver took beyond the
        # fastest, times the senders its downlink carries a message from (`shared_ratio`)
        self._shared_costs: tuple[float, ...] = ()

    @property
    def last_round_s(self) -> float:
        """Seconds between our last two messages: one of our rounds (0 before the second)."""
        return self._round_durations[-1] if self._round_durations else 0.0

    # ------------------------------------------------------------------ training thread side
    def send_round(self, round_index: int, tensors: list) -> None:
        now = self.clock()
        if self._send_called_at is not None:
            rounds = max(1, round_index - self._send_called_round)
            self._round_durations = (*self._round_durations,
                                     (now - self._send_called_at) / rounds)[-LINK_MEMORY:]
        self._send_called_at, self._send_called_round = now, round_index
        message = OutgoingMessage(PGRAD, round_index, tensors)
        self.sign(message)
        self._handed_bytes = message.total_bytes
        self.swarm.bridge.spawn(f"dilocox send of round {round_index}", self._send_all,
                                round_index, message, transfer=True)

    def costs(self) -> SendCosts:
        """Of the message just handed over, over the shortest of our last rounds (a round
        stretched by a wait on the network is not compute):
        - send_ratio: the seconds it will take to send to its whole group: the link's seconds
          per message byte, the worst of the last LINK_MEMORY finished sends and any send in
          flight slower already, times its bytes (the controller judges the message just
          encoded, not the one measured); None before a send and a round were measured;
        - shared_ratio: what the busiest receiver's downlink would take for every member's
          message of its size (protocol/controller.py's r_s: it holds the controller's moves
          up, never forces one down): a receiver that took our push longer than the fastest
          did is slower on its side, and every member sends it a message a round. The worst of
          the last LINK_MEMORY sends; 0 before one reached two receivers. A node whose own
          uplink is the bottleneck reads less: its pushes share that uplink and end closer
          together."""
        now, in_flight = self.clock(), self._sends_in_flight
        rates = [(now - started) / size for started, size in in_flight.values() if size]
        return SendCosts(self._per_round([*rates, *self._link_costs]),
                         self._per_round(self._shared_costs) or 0.0)

    def _per_round(self, costs) -> float | None:
        """The worst of `costs` (seconds per byte) for the message just handed over, over the
        shortest of our last rounds; None without a cost or a round measured."""
        if not costs or not self._round_durations:
            return None
        return max(costs) * self._handed_bytes / min(self._round_durations)

    # ------------------------------------------------------------------ loop side
    async def _send_all(self, round_index: int, message: OutgoingMessage) -> None:
        self.keep(message)
        group = self.group()
        started = self.clock()
        self._sends_in_flight = {**self._sends_in_flight, round_index: (started, message.total_bytes)}

        failed: list[str] = []
        took: dict[str, float] = {}  # receiver -> seconds its push took, for those that arrived

        # the copies share our uplink: at the swarm's minimum link rate they take this long in all
        # (p2p/progress.py ends a push that stalls, or could not finish by then)
        limits = self.swarm.transport.limits
        need_by_s = limits.need_by_s(message.total_bytes * max(1, len(group)))
        give_up_at = started + need_by_s
        why = (f"the {need_by_s:.0f} s that {len(group)} copies of it take at the swarm's minimum "
               f"link rate of {limits.min_rate_bytes_per_s * 8 / 1e6:.3g} Mbit/s")

        async def send(peer: str) -> None:
            for attempt in range(1, SEND_TRIES + 1):
                try:
                    need_by = NeedBy(max(give_up_at - self.clock(), 1e-3), why)
                    await self.swarm.transport.push(peer, message, need_by=need_by)
                    took[peer] = self.clock() - started
                    return
                except Exception as exc:  # whatever broke it, a failed send is counted and logged once
                    if isinstance(exc, RemoteRefused) and exc.reason in (Reason.REPLAYED, Reason.HELD):
                        return  # an earlier try arrived, its answer did not; or a member relayed it
                    broke = isinstance(exc, TransferFailed) and not isinstance(exc, TransferTimeout)
                    if broke and attempt < SEND_TRIES \
                            and give_up_at - self.clock() > 2 * RETRY_PAUSE_S:
                        log.info("round %d to %s, try %d: %s", round_index, peer[-8:], attempt, exc)
                        await asyncio.sleep(RETRY_PAUSE_S)
                        continue
                    failed.append(peer)
                    self.swarm.publish(SendFailed(round=round_index, peer=peer, error=failure_sentence(exc)))
                    return
        await asyncio.gather(*(send(p) for p in group))
        if message.total_bytes:
            measured = (self.clock() - started) / message.total_bytes
            # a send that failed at once (a reset stream, a refusal) says nothing of the link:
            # it may only raise its cost
            if not failed or not self._link_costs or measured > max(self._link_costs):
                self._link_costs = (*self._link_costs, measured)[-LINK_MEMORY:]
            if len(took) >= 2:
                beyond = (max(took.values()) - min(took.values())) / message.total_bytes
                self._shared_costs = (*self._shared_costs, beyond * len(group))[-LINK_MEMORY:]
        self._sends_in_flight = {r: v for r, v in self._sends_in_flight.items() if r != round_index}
        if took and self._round_durations and self.swarm.link_watch is not None:
            self.swarm.link_watch.observe(round_index, moved_bytes=len(took) * message.total_bytes,
                                          seconds=max(took.values()),
                                          round_seconds=min(self._round_durations),
                                          members=len(group) + 1, what="send to its group")
        self.swarm.publish(Sent(round=round_index, group=group, bytes=message.total_bytes))
