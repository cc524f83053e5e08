"""A DiLoCoX node rounds behind its swarm takes the swarm's state, the event loop's side.

A node CATCH_UP_LAG or more rounds behind the round a majority of its members reached (it
stalled, its link is slow, or it resumed from a stale view of the swarm) has every message
refused as stale, and its consensus checks find no vote for the rounds they compare: nothing
else brings it back. In the background (the training thread never waits for it) it gets the
swarm's φ and m of the round before the swarm's, which the training thread takes at a later
round's end, training on from the swarm's round:
- by replay, when its last agreed round is at most REPLAY_ROUNDS back: a holder's records of
  the swarm's steps since then and the messages it lacks (replay.py), which the training thread
  replays from its agreed state and keeps only if the result has the digest that most members
  announcing one hold for that round, two at least (node/rounds/dilocox/round.py `_replayed`);
- otherwise, or when no such recipe can be had, by download, as a late joiner does (the
  daemon's StateAdoption: a majority's digest, the state checked as a contribution).
A replay moves the steps' messages (a compressed message a sender and step); a download moves
φ and m in fp32 (8 bytes a parameter), which a slow link may never finish.

Invariants:
- one catch-up at a time; a try that failed is repeated CATCH_UP_LAG rounds later, not every
  round;
- the exchange moves to the swarm's round only once the training thread adopted the state
  (`DiLoCoXExchange.rejoin`): a replay whose digest differs leaves the node where it was, and
  its next try CATCH_UP_LAG rounds later replays again while the window allows, then downloads.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from node.rounds.dilocox.link import CATCH_UP_LAG, Download, SwarmState
from node.rounds.dilocox.replay import StepReplay
from node.rounds.state import StateLayout, agreed_round, phi_holders
from node.rounds.state_fetch import download_bound_s
from node.rounds.swarm import Swarm, failure_sentence
from protocol.vote import winning_digest

log = logging.getLogger("lowcomm.dilocox")


class SwarmCatchUp:
    """The catch-up of one node: tried at a round's end, taken at a later one."""

    def __init__(self, swarm: Swarm, replay: StepReplay):
        self.swarm, self.replay, self.members = swarm, replay, swarm.members
        self.next_try = 0  # the first round whose end may try (one try a lag)
        self.task: asyncio.Task | None = None  # the swarm's state, on its way

    def poll(self, round_index: int, agreed: int, reference: dict) -> SwarmState | None:
        """At the end of `round_index`: the swarm's state if one came and we are still behind
        it; else None, after starting a try when we are CATCH_UP_LAG or more rounds behind.
        `agreed`: our last round whose φ a check found the majority's (a replay starts there);
        `reference`: our φ, what a downloaded state is checked against."""
        task = self.task
        if task is not None and task.done():
            self.task = None
            got = None if task.cancelled() else task.result()  # _take raises nothing
            if got is None or got.next_round <= round_index + 1:
                return None  # no state, or we are no longer behind it
            return got
        swarm_round = agreed_round(self.members.eligible())
        if task is None and swarm_round - (round_index + 1) >= CATCH_UP_LAG \
                and round_index >= self.next_try and self.swarm.adopt_state is not None:
            self.next_try = round_index + CATCH_UP_LAG  # a failed try is repeated, not each round
            # a copy: the training thread goes on changing φ while the download runs (rare: a
            # node only copies its φ when it has fallen behind)
            own_phi = {name: tensor.detach().clone() for name, tensor in reference.items()}
            self.task = self.swarm.tasks.spawn(
                self._take(own_phi, agreed, swarm_round - round_index - 1, swarm_round),
                "dilocox catch-up")
        return None

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})

    async def _take(self, reference: dict, agreed: int, behind: int, swarm_round: int
                    ) -> SwarmState | None:
        log.info("%d rounds behind the swarm (round %d): taking its state", behind, swarm_round)
        return await self._replay(agreed, swarm_round) \
            or await self._download(reference, behind, swarm_round)

    async def _replay(self, agreed: int, swarm_round: int) -> SwarmState | None:
        """The recipe of the swarm's steps from our agreed round to its φ of the round before
        `swarm_round`, if that is at most REPLAY_ROUNDS steps and the φ is agreed."""
        target = swarm_round - 1
        if (held := self._agreed_phi(target)) is None:
            return None
        digest, holders = held
        recipe = await self.replay.recipe(target, agreed, digest, holders)
        if recipe is None:
            return None
        return SwarmState(swarm_round, target, recipe, recipe.source, digest)

    def _agreed_phi(self, round_index: int) -> tuple[str, list[str]] | None:
        """(the φ digest of `round_index` held by two or more members and by most of those
        announcing one, its holders), or None."""
        holders = phi_holders(self.members.eligible(), round_index)
        if not holders:
            return None
        digest = winning_digest(Counter({d: len(peers) for d, peers in holders.items()}))
        count = len(holders[digest])
        if count < 2 or 2 * count <= sum(len(peers) for peers in holders.values()):
            return None
        return digest, holders[digest]

    async def _download(self, reference: dict, behind: int, swarm_round: int) -> SwarmState | None:
        timeouts = self.swarm.timeouts  # what the adoption's downloads may take, at the slowest link
        budget = timeouts.state_download_attempts * download_bound_s(StateLayout.of(reference), self.swarm.transfer_limits) \
            + timeouts.state_announce_wait_s
        try:
            joined = await asyncio.wait_for(self.swarm.adopt_state(reference), timeout=budget)
        except Exception as exc:  # no state agreed, a download failed: train on, try again later
            log.warning("%d rounds behind the swarm (round %d), and could not take its state: %s",
                        behind, swarm_round, failure_sentence(exc))
            return None
        state_round = int(joined.meta.get("phi_round", joined.round_index - 1))
        state = Download(state_round, joined.tensors["phi"], joined.tensors["momentum"], joined.source)
        return SwarmState(joined.round_index, state_round, state, joined.source, joined.meta.get("phi"))
