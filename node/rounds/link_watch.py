"""Whether this node's link carries the swarm's rounds as configured, from what its exchange
measured; said in one sentence (a `LinkJudged` event: logged, in metrics.jsonl and the status
view) when the verdict changes, so the first time from the first measured exchange on.

The rate is the one the node's own transfers reached: NoLoCo, a snapshot's bytes over the
median seconds of its last swaps (node/rounds/noloco/pacing.py: a swap carries a snapshot each
way at once, so it is the slower of the two directions); DiLoCoX, a round's message to its
group over the seconds that send took (node/rounds/dilocox/sending.py). It is judged against
the bytes the manifest's round moves (node/rounds/traffic.py) at the round's measured length,
with `judge_link`'s three verdicts. What the node does about a slow link is the protocol's
own: NoLoCo pairs once every few rounds (the pacer), DiLoCoX with the controller compresses
harder (node/rounds/dilocox/adapt.py); a transfer that fails is not retried here.
"""

from __future__ import annotations

from collections.abc import Callable

from node.config.manifest import Manifest
from node.events import Event, LinkJudged
from node.rounds.traffic import RoundTraffic, judge_link, link_need, mbit, round_traffic


class LinkWatch:
    def __init__(self, manifest: Manifest, vocab_size: int, publish: Callable[[Event], None]):
        self.manifest, self.vocab_size, self.publish = manifest, vocab_size, publish
        self.level = "ok"
        self._traffic: dict[int, RoundTraffic] = {}

    def traffic(self, members: int) -> RoundTraffic:
        """The manifest's round for a swarm of `members` (sized once per size)."""
        members = max(2, members)
        if members not in self._traffic:
            self._traffic[members] = round_traffic(self.manifest, self.vocab_size, members)
        return self._traffic[members]

    def observe(self, round_index: int, *, moved_bytes: int, seconds: float, round_seconds: float,
                members: int, what: str) -> LinkJudged | None:
        """One measured transfer (`moved_bytes` in `seconds`, of `what`), against rounds of
        `round_seconds`; publishes and returns the verdict when it changed."""
        if moved_bytes <= 0 or seconds <= 0 or round_seconds <= 0:
            return None
        rate = 8 * moved_bytes / seconds
        traffic = self.traffic(members)
        verdict = judge_link(traffic, link_need(traffic, round_seconds), rate, rate, self.manifest.swarm.id,
                             link=f"this node's link, {mbit(rate)} as its last {what} measured it,")
        if verdict.level == self.level:
            return None
        self.level = verdict.level
        event = LinkJudged(round=round_index, level=verdict.level, measured_mbit=rate / 1e6,
                           round_seconds=round_seconds, text=verdict.sentence)
        self.publish(event)
        return event
