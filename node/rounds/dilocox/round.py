"""DiLoCoX's end of a round, in the training thread or beside it (node/daemon/worker.py); the
math is protocol/dilocox.py (docs/protocols.md §3).

At the end of round r: Δ = (round start) − θ, c = C(Δ + e) (error feedback inside
protocol/dilocox.py), hand c to the link, which sends it to the round's group in the background
(with a committee, protocol/committee.py, only in the rounds this node is drawn for: in the
others Δ is kept, `keep`, and the next message carries it as `kept_decay` says); then take the group's messages of round r − delay (with delay = 1
they travelled during round r, so this rarely waits), check each, apply the outer step, and
publish the digest of the new φ.
Every node applies the same messages in the same order, so φ stays identical; a node whose
digest disagrees with the majority replays its steps since its last agreed state over the
majority's messages (`_replayed`: the link hands it the majority's senders of each step and the
messages it lacked, kilobytes), or else re-downloads φ and m from a majority peer (the link
arranges either), and adopts the result before its next outer step.

With `apply_on_arrival` (delay 1), the outer step of round r − 1's messages is taken as soon as
all of them are here (checked before each inner step of round r, `between_steps`), and θ is shifted by
what the step moved the round's start; the round's end then only publishes the digest. The
messages, their order and φ are the same; the node's weights see the group's work a few steps
after it was sent instead of a round later. With `controller`, node/rounds/dilocox/adapt.py
sets the codec's strength and bits for the next round after each message is encoded.

What travels is encoded in node/rounds/dilocox/payload.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from node.config.manifest import ContributionSection, ProtocolSection
from node.events import RoundShortened
from node.rounds.contributions import ContributionRefused, check_contribution, global_norm
from node.rounds.dilocox import payload
from node.rounds.dilocox.adapt import CompressionAdapter
from node.rounds.dilocox.link import (REPLAY_ROUNDS, DiLoCoXLink, Download, GroupMessage, Refused,
                                      Rejoined, Replay, ReplayFailed, Stepped, SwarmState, is_behind)
from node.rounds.policy import RoundOutcome
from node.train.trainer import InnerTrainer
from protocol.codecs import Codec, get_codec
from protocol.diloco import DiLoCoHyperParameters
from protocol.dilocox import DiLoCoX, DiLoCoXHyperParameters, PseudoGradientMessage, ReceiveOutcome
from protocol.errors import ProtocolError
from protocol.tensors import difference, fp32_clone, shift_in_place, weights_digest

log = logging.getLogger("lowcomm.dilocox")


@dataclass(frozen=True)
class DiLoCoXOutcome(RoundOutcome):
    applied_round: int | None     # the round whose messages the outer step applied
    group: list[str]              # their senders, this node included
    sent_bytes: int               # our message's codec payload
    resyncs: int                  # running total of φ re-downloaded from the majority
    energy_kept: dict[str, float]  # low-rank, top-k: the share of each tensor's energy our message kept
    late: int                     # running total of messages that came after their round
    compression: dict | None = None  # the controller's choice for the next round (adapt.py); None: off
    stepped_mid_round: bool = False  # apply_on_arrival took the outer step before the round's end
    caught_up_to: int | None = None  # fell behind: took the swarm's state, trains this round next
    # of network_wait_seconds, the wait for members still training the round: this node ran
    # ahead of them (a round's end beside training holds training as long: node/daemon/worker.py)
    ran_ahead_seconds: float = 0.0
    replays: int = 0              # running total of steps replayed over the majority's messages

    @property
    def partners(self) -> list[str]:
        return list(self.group)


def codec_for(config: ProtocolSection) -> Codec:
    """The manifest's pseudo-gradient codec, with the parameters it takes."""
    parameters = {"lowrank": {"rank": config.rank, "bits": config.bits,
                              "iterations": config.power_iterations},
                  "topk": {"k": config.topk_k, "chunk": config.topk_chunk, "bits": config.topk_bits},
                  "blockwise": {"bits": config.bits}}.get(config.codec, {})
    return get_codec(config.codec, **parameters)


class DiLoCoXRound:
    def __init__(self, config: ProtocolSection, contributions: ContributionSection,
                 trainer: InnerTrainer, node_id: str, link: DiLoCoXLink, codec: Codec | None = None):
        """`codec`: the manifest's (codec_for) unless given; the simulator passes one whose
        decodings are shared by its replicas."""
        self.config, self.contributions = config, contributions
        self.trainer, self.link = trainer, link
        self.codec = codec if codec is not None else codec_for(config)
        # Nesterov needs momentum; μ = 0 is plain SGD on the mean pseudo-gradient.
        outer = DiLoCoHyperParameters(config.outer_lr, config.outer_momentum,
                                      nesterov=config.outer_momentum > 0)
        # the simulator wraps the node's codec to share decodings: the controller adapts the node's own
        self.adapter = CompressionAdapter(config, getattr(self.codec, "inner", self.codec)) \
            if config.controller else None
        self.outer = DiLoCoX(trainer.host_parameters(),
                             self.codec, node_id, DiLoCoXHyperParameters(
                                 outer=outer, delay=config.delay, overlap=config.overlap,
                                 residual_decay=config.residual_decay,
                                 kept_decay=config.kept_decay,
                                 clip_to_median=config.clip_to_median,
                                 noise_ratio=contributions.noise_ratio if config.noise_filter else 0.0))
        # the parameters' names and shapes (meta tensors, no memory): what a peer's message is
        # checked against, read without touching the trainer (end_round_beside's thread)
        self.layout = {name: torch.empty(p.shape, device="meta")
                       for name, p in trainer.named_parameters().items()}
        self.resyncs = 0
        self.replays = 0
        self.own_norm = 0.0  # of our last Δ: what peers' messages are checked against
        self.lock = threading.Lock()  # held while φ and m change; exports take it too
        self.state_round, self.phi_digest = -1, weights_digest(self.outer.slow_weights)
        # The last two post-step states: a diverged peer asks for the round it compared, and we
        # may have finished another round by the time its request arrives.
        self.history: deque = deque(maxlen=2)
        # Where a replay starts (`_replayed`): the last state known agreed, and the messages each
        # step since applied (compressed, at most REPLAY_ROUNDS steps). The initial φ is every
        # node's (one seed), so the first steps can be replayed too.
        self.agreed: tuple[int, dict] | None = (-1, {"phi": self.outer.slow_weights,
                                                     "momentum": self.outer.momentum})
        # The agreed state before it (one more φ and m held): where a replay starts when one from
        # `agreed` did not give the majority's φ (a check counts its round agreed on the votes
        # that came, and the majority's chain may have left that state since).
        self.agreed_before: tuple[int, dict] | None = None
        self.step_log: dict[int, dict[str, PseudoGradientMessage]] = {}
        # our own messages of the last REPLAY_ROUNDS rounds: a catch-up replays steps we never
        # took, and the swarm's may have applied them
        self.own_sent: dict[int, PseudoGradientMessage] = {}
        self.stepped_round = -1  # the last round whose outer step was taken (mid-round or at its end)
        self.early_refused: list[str] = []  # refusals of a mid-round step, reported at the round's end
        # False from the first change of a round's end (or of a step mid-round) until it is
        # whole; a call that raised leaves it False: the worker then writes no checkpoint
        self.consistent = True

    def between_steps(self, round_index: int) -> RoundShortened | None:
        """With `apply_on_arrival` (delay 1): once every message of round r − 1 is here (the
        link says so without waiting), take the outer step now instead of at the round's end,
        and shift θ by what that moved the round's start (φ's step, and our own message leaving
        f): the rest of the round trains on the group's work, so the delay costs the messages'
        travel time rather than a round. Δ at the round's end is still this round's progress
        alone (it is measured from the shifted start).

        A node that fell a round behind its swarm (`link.swarm_round`, which the loop keeps
        fresh: no call to it) ends the round at the next step instead: the steps it skips were the ones that would have made its message late."""
        self._apply_on_arrival(round_index)
        return self._shorten_if_behind(round_index)

    def _apply_on_arrival(self, round_index: int) -> None:
        target = round_index - self.outer.hyper.delay
        if not self.config.apply_on_arrival or self.outer.hyper.delay == 0 or target < 0 \
                or self.stepped_round >= round_index:
            return
        arrived = self.link.take_if_complete(target)
        if arrived is None:
            return
        agreement = self.link.resync(round_index, 0.0)
        self.consistent = False
        before = self.outer.round_start_weights()
        _, self.early_refused = self._take_step(round_index, arrived, agreement)
        shift_in_place(self.trainer.named_parameters(),
                       difference(self.outer.round_start_weights(), before))
        self.consistent = True

    def _shorten_if_behind(self, round_index: int) -> RoundShortened | None:
        last_step = (round_index + 1) * self.config.inner_steps  # the step that ends the round
        skipped = last_step - 1 - self.trainer.step
        if skipped <= 0 or not is_behind(round_index, self.link.swarm_round):
            return None
        self.trainer.start_at(last_step - 1)
        return RoundShortened(round=round_index, skipped_steps=skipped)

    def end_round(self, round_index: int) -> DiLoCoXOutcome:
        outcome, start, next_round = self._end(round_index, self.trainer.host_parameters())
        self.trainer.load_parameters(start)
        if next_round is not None:
            self.trainer.start_at(next_round * self.config.inner_steps)
        self.consistent = True
        return outcome

    def end_round_beside(self, round_index: int, fast_weights: dict[str, torch.Tensor]
                         ) -> tuple[DiLoCoXOutcome, dict[str, torch.Tensor], int | None]:
        """The round's end in a thread beside training (node/daemon/worker.py, `--round-end
        beside`), from θ as it was when round `round_index` ended (host tensors): the same
        message, outer step and φ as `end_round`, without touching the trainer. Returns the
        outcome, what θ must be shifted by (the next round's start minus `fast_weights`: the
        steps trained meanwhile keep their progress) and the swarm's round if it caught up."""
        outcome, start, next_round = self._end(round_index, fast_weights)
        self.consistent = True  # the worker holds its checkpoint until θ is shifted
        return outcome, difference(start, fast_weights), next_round

    def _end(self, round_index: int, fast_weights: dict[str, torch.Tensor]
             ) -> tuple[DiLoCoXOutcome, dict[str, torch.Tensor], int | None]:
        """Send this round's message, take the outer step that is due, follow the swarm if this
        node fell behind it; returns (outcome, where θ starts the next round, the swarm's round
        if caught up). The trainer is not touched."""
        self.consistent = False
        delta = self.outer.pseudo_gradient(fast_weights)
        self.own_norm = global_norm(delta)
        self.own_sent = {r: m for r, m in self.own_sent.items() if r > round_index - REPLAY_ROUNDS}
        own, compression = None, None
        if self.link.in_committee(round_index):
            own = self.outer.compress(delta, round_index)
            self.own_sent[round_index] = own
            self.link.send_round(round_index, payload.encode_message(own))
            costs = self.link.costs()
            compression = self.adapter.after_send(own, costs.send_ratio, costs.shared_ratio) \
                if self.adapter else None
        else:  # not in this round's committee: our next message carries what kept_decay keeps
            self.outer.keep(delta, round_index)
        early = self.stepped_round == round_index
        step, refused, waited, ahead = self._apply_group(round_index)
        start = self.outer.round_start_weights()  # φ minus our own round still in flight
        refused, self.early_refused = self.early_refused + refused, []
        digest = self.phi_digest  # this round's φ; a catch-up replaces it for the next
        caught = self.link.catch_up(round_index, self.outer.slow_weights)
        next_round = None
        if caught is not None and (state := self._swarm_state(caught, refused)) is not None:
            self._adopt_state(state, caught.state_round)
            self.link.report(Rejoined(round_index + 1, caught))
            next_round, self.state_round, start = caught.next_round, caught.state_round, state["phi"]
        outcome = DiLoCoXOutcome(
            phi_digest=digest, refused=refused, network_wait_seconds=waited,
            applied_round=step.applied_round if step else None,
            group=list(step.senders) if step else [], sent_bytes=own.size_bytes if own else 0,
            resyncs=self.resyncs, energy_kept=own.energy_kept if own else {},
            late=self.outer.counters.late,
            compression=compression, stepped_mid_round=early, caught_up_to=next_round,
            ran_ahead_seconds=ahead, replays=self.replays)
        return outcome, start, next_round

    def finish(self, round_index: int) -> None:
        """Applies what is still owed when training stops before round `round_index` (delay 1:
        the last round's messages), without training or sending: the simulator's last outer
        step, so that its final weights hold every round's work."""
        self._apply_group(round_index)
        self.trainer.load_parameters(self.outer.round_start_weights())

    def _apply_group(self, round_index: int):
        """Collects round `round_index − delay` and takes the outer step (unless `between_steps`
        took it already: then a message that came since is late) and announces φ's digest.
        Returns (the outer step's record, refusals, seconds waited, of them for members still
        in the round)."""
        target = round_index - self.outer.hyper.delay
        waited = time.monotonic()  # what the training thread waits on the network this round
        collected = self.link.collect(target, self.config.message_deadline_s) if target >= 0 else None
        arrived = collected.messages if collected else []
        ahead = collected.ran_ahead_s if collected else 0.0
        refused: list[str] = []
        if self.stepped_round < round_index:
            agreement = self.link.resync(round_index, self.config.message_deadline_s)
            waited = time.monotonic() - waited
            _, refused = self._take_step(round_index, arrived, agreement)
        else:
            waited = time.monotonic() - waited
            self.outer.counters.late += len(arrived)
        step = self.outer.last_step
        # a step with nothing due (the first round, delay 1) applied nothing: round -1, no one
        applied = (-1 if step.applied_round is None else step.applied_round,
                   tuple(sorted(self.outer.last_messages))) if step is not None else None
        self.link.report(Stepped(round_index, self.phi_digest, applied))
        return step, refused, waited, ahead

    def _take_step(self, round_index: int, arrived: list[GroupMessage], agreement):
        """Checks each message against our own last Δ, adopts the repair `agreement` brings (our
        φ of the last round, or of one before it, left the majority's), takes the outer step of
        `round_index` and keeps its state for peers that ask. Returns (record, refusals)."""
        refused: list[str] = []
        for item in arrived:
            self._admit(item, refused)
        with self.lock:
            self._note_agreed(agreement.agreed)
            repair = agreement.resync
            if repair is not None and (state := self._repaired(repair, refused)) is not None \
                    and self._adopt_round(repair.round, state, round_index - 1):
                self._count(repair)
            phi = self.outer.outer_step(round_index)
            digest = weights_digest(phi)
            self.state_round, self.phi_digest, self.stepped_round = round_index, digest, round_index
            self.history.append((round_index, {"phi": phi, "momentum": self.outer.momentum}, digest))
            self.step_log[round_index] = self.outer.last_messages
            first_agreed = (self.agreed_before or self.agreed or (round_index,))[0]
            oldest = max(round_index - REPLAY_ROUNDS, first_agreed)
            self.step_log = {r: m for r, m in self.step_log.items() if r > oldest}
        for sender in self.outer.last_step.left_out:  # every node leaves out the same ones
            sentence = (f"DiLoCoX pseudo-gradient from {sender} of round "
                        f"{self.outer.last_step.applied_round} looks like noise: its magnitudes "
                        f"follow the other senders' less than {self.contributions.noise_ratio:g}x "
                        f"the median sender's; left out of the mean")
            refused.append(sentence)
            self.link.report(Refused(sender, "noise", sentence))
        return self.outer.last_step, refused

    def _swarm_state(self, caught: SwarmState, refused: list) -> dict | None:
        """{"phi", "momentum"} of a catch-up (`_repaired`); None, and we stay where we are, if
        the repair does not hold."""
        with self.lock:
            if isinstance(caught.state, Replay):
                self._note_agreed(caught.state.since)  # the recipe starts at a round found agreed
            state = self._repaired(caught.state, refused)
        if state is None:
            return None
        self._count(caught.state)
        return {"phi": state["slow_weights"], "momentum": state["momentum"]}

    def _repaired(self, repair: Replay | Download, refused: list) -> dict | None:
        """The one repair path of our φ, for a step's resync and a catch-up alike: the
        majority's φ and m ({"slow_weights", "momentum"}) after `repair.round`, a Replay rebuilt
        here from our agreed state and kept only if it gives the majority's digest
        (`_replayed`), a Download (its digest checked by the loop) checked as a contribution of
        its source; None when it does not hold."""
        if isinstance(repair, Replay):
            return self._replayed(repair, refused)
        if not self._resync_usable(repair):
            return None
        return {"slow_weights": repair.phi, "momentum": repair.momentum}

    def _count(self, repair: Replay | Download) -> None:
        if isinstance(repair, Replay):
            self.replays += 1
        else:
            self.resyncs += 1

    def _note_agreed(self, round_index: int) -> None:
        """The link found our φ of `round_index` the majority's: it is where a replay starts,
        if we still hold it."""
        if self.agreed is not None and round_index <= self.agreed[0]:
            return
        held = next((groups for r, groups, _ in self.history if r == round_index), None)
        if held is not None:
            self.agreed_before, self.agreed = self.agreed, (round_index, held)

    def _replayed(self, recipe: Replay, refused: list) -> dict | None:
        """φ and m after round `recipe.round` as the majority holds them, rebuilt from our
        agreed state of round `recipe.since` by each step since over the majority's senders'
        messages (ours where our step applied the same sender's, our own as we sent it, else the
        fetched copy, checked as any contribution), kept only if the last digest is the
        majority's. None (the node stays off, `ReplayFailed`) when that state or a message is
        missing, a copy is refused, or the digest differs; after a digest that differs the next
        replay starts from the agreed state before it, and with none the state is downloaded."""
        # steps up to our agreed state are ours already (a replay adopted since the link knew)
        steps = [step for step in recipe.steps if self.agreed and step[0] > self.agreed[0]]
        if self.agreed is not None and self.agreed[0] >= recipe.since and not steps:
            return None  # a replay adopted since covers it
        if self.agreed is None or self.agreed[0] < recipe.since:
            log.info("round %d: our agreed state is of round %s, the replay's from round %d: no "
                     "replay", recipe.round, self.agreed and self.agreed[0], recipe.since)
            self.link.report(ReplayFailed(recipe, self.agreed[0] if self.agreed else None))
            return None
        groups = self.agreed[1]
        state = {"slow_weights": groups["phi"], "momentum": groups["momentum"]}
        replayed_steps = {}
        for step, target, senders in steps:
            ours, messages = self.step_log.get(step, {}), {}
            for sender in senders:
                copy = recipe.messages.get((target, sender))
                if sender in ours:
                    messages[sender] = ours[sender]
                elif sender == self.outer.node_id and target in self.own_sent:
                    messages[sender] = self.own_sent[target]  # a step we did not take (catch-up)
                elif copy is not None and (checked := self._checked(
                        GroupMessage(sender, target, copy), refused)) is not None:
                    messages[sender] = checked
                else:
                    log.info("round %d: the message of %s of round %d to replay it is missing or "
                             "refused", recipe.round, sender[-8:], target)
                    self.link.report(ReplayFailed(recipe, self.agreed[0]))  # another holder may have it
                    return None
            state = self.outer.replay(state, messages)
            replayed_steps[step] = messages
        if weights_digest(state["slow_weights"]) != recipe.digest:
            # either a holder's records were wrong or our state of that round was not the
            # majority's after all (its check counted the votes that came first): a replay from
            # it can never heal the second, so the next one starts from the agreed state before
            # it, and with none the next divergence downloads the state
            self.agreed, self.agreed_before = self.agreed_before, None
            log.warning("round %d replayed over the majority's messages of %d steps does not give "
                        "its φ %s: %s", recipe.round, len(steps), recipe.digest[:12],
                        f"the next replay starts from our φ of round {self.agreed[0]}"
                        if self.agreed else "the state will be downloaded")
            self.link.report(ReplayFailed(recipe, self.agreed[0] if self.agreed else None))
            return None
        self.step_log.update(replayed_steps)
        return state

    def _adopt_round(self, round_index: int, state: dict, now: int | None = None) -> bool:
        """Our φ and m after `round_index` become `state`, the majority's (a replay's digest was
        checked here, a resync's by the link): in the outer state, in the history (a peer asking
        for that round is served it), and as the agreed state later replays start from.
        With `now` later than `round_index` (the check that found our φ off came a round or more
        late: a node ahead of its members hears their votes only at their round's end), our own
        steps after it are replayed over `state` with the messages they applied, and the result
        is our state after `now`; False, and nothing changes, if one of those steps is not held."""
        now = round_index if now is None else now
        current = state
        for step in range(round_index + 1, now + 1):
            if step not in self.step_log:
                log.info("round %d: the majority's φ of round %d came, but our step of round %d "
                         "is not held to replay over it", now, round_index, step)
                return False
            current = self.outer.replay(current, self.step_log[step])
        # the steps after `round_index` are ours, not verified: a later replay starts before them
        verified = {"phi": fp32_clone(state["slow_weights"]),
                    "momentum": fp32_clone(state["momentum"])} if now > round_index else None
        self.outer.adopt_outer_state(current)
        # copies held by the outer state, not a received buffer's views
        adopted = {"phi": self.outer.slow_weights, "momentum": self.outer.momentum}
        digest = weights_digest(adopted["phi"])
        self.history = deque(((r, adopted, digest) if r == now else (r, groups, d)
                              for r, groups, d in self.history), maxlen=2)
        self.agreed_before, self.agreed = self.agreed, (round_index, verified or adopted)
        return True

    def _resync_usable(self, resync: Download) -> bool:
        """A resync state is checked as a contribution is (our layout, finite values, norms within
        max_norm_ratio of our φ's): the majority's digest proves agreement, not health."""
        own = self.outer.slow_weights
        own_norm = global_norm(own)
        try:
            for group, tensors in (("slow_weights", resync.phi), ("momentum", resync.momentum)):
                check_contribution(resync.source, tensors, own, own_norm,
                                   self.contributions.max_norm_ratio, f"the resync's {group}")
        except ContributionRefused as exc:
            self.link.report(Refused(resync.source, exc.reason, str(exc)))
            return False
        return True

    def _admit(self, item: GroupMessage, refused: list) -> ReceiveOutcome | None:
        message = self._checked(item, refused)
        if message is None:
            return None
        try:
            return self.outer.receive(message)
        except (ProtocolError, ValueError) as exc:
            self._refuse(item.peer, exc, refused)
            return None

    def _checked(self, item: GroupMessage, refused: list) -> PseudoGradientMessage | None:
        """A peer's message decoded and checked against the manifest's density bound, our
        layout and our own last Δ's norm; None (refused, counted against its author) if not."""
        try:
            message = payload.decode_message(item.peer, item.round_index, item.message)
            payload.check_density(message, self.config.max_density)
            params = self.layout  # names and shapes only
            decoded = {n: self.codec.decode(e.description, e.payload,
                                            max_elements=max(params[n].numel(), 1))
                       for n, e in message.tensors.items() if n in params}
            # a message carrying n rounds of its sender's work may be as large as they weigh
            weight = self.outer.hyper.carried_weight(message.rounds)
            check_contribution(item.peer, decoded, params, self.own_norm * weight,
                               self.contributions.max_norm_ratio, "DiLoCoX pseudo-gradient")
            return message
        except (ContributionRefused, ProtocolError, ValueError) as exc:
            self._refuse(item.peer, exc, refused)
            return None

    def _refuse(self, peer: str, exc: Exception, refused: list) -> None:
        refused.append(f"{peer}: {exc}")
        self.link.report(Refused(peer, getattr(exc, "reason", "malformed"), str(exc)))

    def export_state(self, round_index: int | None = None) -> tuple[int, dict, str]:
        """(round, {"phi": φ, "momentum": m}, digest of φ) after `round_index` if still held,
        else the latest: for a late joiner or a diverged peer's resync."""
        with self.lock:
            return next((held for held in self.history if held[0] == round_index), None) or \
                (self.state_round, {"phi": self.outer.slow_weights, "momentum": self.outer.momentum},
                 self.phi_digest)

    def state_version(self, round_index: int | None = None) -> tuple[int, str]:
        held_round, _, digest = self.export_state(round_index)  # no copy: what it would serve
        return held_round, digest

    def adopt(self, groups: dict, state_round: int | None = None) -> None:
        """A late joiner takes the swarm's φ and m (after `state_round`, if known), and θ = φ."""
        self._adopt_state(groups, state_round)
        self.trainer.load_parameters(groups["phi"])

    def _adopt_state(self, groups: dict, state_round: int | None) -> None:
        """The swarm's state replaces ours and is our agreed state: the steps after it, if their
        φ leaves the majority's, are replayed from it (a late joiner's first round often lacks
        messages sent before its members knew of it)."""
        with self.lock:
            self.outer.adopt_outer_state({"slow_weights": groups["phi"],
                                          "momentum": groups["momentum"]}, rejoin=True)
            self.phi_digest = weights_digest(groups["phi"])
            # copies held by the outer state, not the received buffer's views
            adopted = {"phi": self.outer.slow_weights, "momentum": self.outer.momentum}
            known = type(state_round) is int
            self.history = deque([(state_round, adopted, self.phi_digest)] if known else [], maxlen=2)
            self.agreed, self.step_log = ((state_round, adopted) if known else None), {}
            self.agreed_before = None

    def state_dict(self) -> dict[str, Any]:
        return {"dilocox": self.outer.state_dict(), "resyncs": self.resyncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["dilocox"])
        self.resyncs = int(state["resyncs"])
        # a resumed φ is not known agreed: a resync heals it
        self.agreed, self.agreed_before, self.step_log = None, None, {}
