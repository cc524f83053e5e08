"""Real trainers over scripted links, for the unit tests of NoLoCoRound and DiLoCoXRound
(node/rounds/).

A scripted link (a fake, named as such: the real links are the daemon's exchanges, tested in
tests/integration, and the simulator's, tested in test_simulator.py) hands the round exactly
the partner snapshot or group messages a test chooses, and records what the round sent,
announced and refused. Messages are encoded by the rounds' own payload modules. `config` and
`corpus` are module-scoped fixtures: a test module imports them to use them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from node.config.manifest import ContributionSection, ProtocolSection
from node.config.schema import load_config
from node.data.corpus import load_corpus
from node.rounds.dilocox.consensus import NOTHING_AGREED
from node.rounds.dilocox.link import (Agreement, Collected, Download, GroupMessage, Rejoined, Replay,
                                      ReplayFailed, SendCosts, Stepped, SwarmState)
from node.rounds.dilocox.round import DiLoCoXRound
from node.rounds.noloco import payload as noloco_payload
from node.rounds.noloco.round import NoLoCoRound, PartnerSnapshot
from node.simulator.exchange import InMemoryMessage
from node.train.trainer import InnerTrainer

TINY = ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "model.ffn_hidden=64",
        "data.seq_len=32", "train.micro_batch_size=2", "train.tokens_per_step=64",
        "train.warmup_steps=1", "train.eval_batches=1", "train.lr=1e-2", "train.steps=40"]
H = 3


@pytest.fixture(scope="module")
def config():
    return load_config(overrides=TINY)


@pytest.fixture(scope="module")
def corpus(config):
    return load_corpus(config.data)


def trainer(config, corpus, stream: int) -> InnerTrainer:
    return InnerTrainer(config.model, config.train, corpus, config.data.seq_len, stream,
                        torch.device("cpu"))


def train_round(trainer: InnerTrainer, policy, round_index: int) -> list:
    """What the worker does within a round: between_steps before each step; the events."""
    events = []
    for _ in range(H):
        events.append(policy.between_steps(round_index))
        trainer.train_step()
    return [e for e in events if e is not None]


def received(round_index: int, tensors: list) -> InMemoryMessage:
    return InMemoryMessage(round_index, tensors)


class ScriptedNoLoCoLink:
    """A fake NoLoCoLink: a partner snapshot lands when the test says so."""

    def __init__(self):
        self.waiting: dict[int, PartnerSnapshot] = {}
        self.offered: list[tuple[int, list, float]] = []
        self.refusals: list[tuple[str, str]] = []
        self.catch_up: int | None = None
        self.swarm: object | None = None  # what swarm_state answers (a JoinState, or None)
        self.asked_state: list[int] = []  # the rounds whose end asked for the swarm's state

    def partner_landed(self) -> bool:
        return any(self.waiting.values())  # None: a pair formed, its snapshot not landed yet

    def take_partner(self, round_index: int) -> PartnerSnapshot | None:
        """The oldest snapshot waiting for a pair of `round_index` or before (one landing late)."""
        landed = [r for r, snapshot in self.waiting.items() if r <= round_index and snapshot]
        if not landed:
            return None
        pair_round = min(landed)
        return dataclasses.replace(self.waiting.pop(pair_round), pair_round=pair_round)

    def pending_pair_rounds(self) -> set[int]:
        return set(self.waiting)

    def finish_round(self, round_index, snapshot, wait_s, next_round=None):
        self.offered.append((round_index, snapshot, wait_s))
        return self.waiting.pop(round_index, None) if wait_s else None

    def catch_up_round(self, round_index: int) -> int | None:
        return self.catch_up

    def swarm_state(self, reference: dict, from_round: int):
        self.asked_state.append(from_round - 1)
        return self.swarm

    def refused(self, peer: str, reason: str, sentence: str) -> None:
        self.refusals.append((peer, reason))


def noloco(config, corpus, timing: str, stream: int = 1, snapshot: str = "theta",
           wire_dtype: str = "bf16"):
    section = ProtocolSection(timing=timing, inner_steps=H, pair_deadline_s=5.0, snapshot=snapshot,
                              wire_dtype=wire_dtype)
    link = ScriptedNoLoCoLink()
    model = trainer(config, corpus, stream)
    return NoLoCoRound(section, ContributionSection(), model, link), link, model


def partner_of(config, corpus, round_index: int, wire_dtype: str = "fp32",
               layout: str = "theta") -> tuple:
    """Another node's round: its snapshot as it would arrive (in `layout`), and as it was."""
    policy, _, model = noloco(config, corpus, "blocking", stream=2)
    for r in range(round_index + 1):
        train_round(model, policy, r)
        snapshot = policy.outer.snapshot(model.named_parameters())
        if r < round_index:
            policy.end_round(r)
    message = received(round_index, noloco_payload.encode_snapshot(snapshot, wire_dtype, layout))
    return PartnerSnapshot("partner", round_index, message), snapshot


# ---------------------------------------------------------------------------- DiLoCoX
class ScriptedDiLoCoXLink:
    """A fake DiLoCoXLink: the group's messages and a resync state are what the test gives."""

    def __init__(self):
        self.sent: list[tuple[int, list]] = []
        self.inbox: dict[int, list[GroupMessage]] = {}
        self.digests: list[tuple[int, str]] = []
        self.resync_due: dict[int, Replay | Download] = {}  # round -> the repair of our φ after it
        self.refusals: list[tuple[str, str]] = []
        self.ratio: float | None = None  # what costs() reports as the send ratio
        self.catch_ups: dict[int, SwarmState] = {}  # round ended -> the swarm's state
        self.rejoined: list[tuple[int, int]] = []  # (the round we skipped, the swarm's round)
        self.swarm_round = -1  # the round a majority of the swarm reached
        self.applied: dict[int, tuple | None] = {}  # round -> what its step applied (a replay's record)
        self.agreed = -1  # what resync reports: the last round a consensus check agreed
        self.failed: list[tuple[int, int, int | None]] = []  # replays failed: (since, round, start)
        self.drawn = True  # what in_committee reports: everyone sends

    def in_committee(self, round_index: int) -> bool:
        return self.drawn

    def send_round(self, round_index: int, tensors: list) -> None:
        self.sent.append((round_index, tensors))

    def costs(self) -> SendCosts:
        return SendCosts(self.ratio, 0.0)

    def collect(self, round_index: int, wait_s: float) -> Collected:
        return Collected(self.inbox.pop(round_index, []))

    def take_if_complete(self, round_index: int) -> list[GroupMessage] | None:
        return self.inbox.pop(round_index, None)

    def resync(self, round_index: int, wait_s: float) -> Agreement:
        return Agreement(self.agreed, self.resync_due.pop(round_index - 1, None))

    def catch_up(self, round_index: int, reference: dict) -> SwarmState | None:
        state = self.catch_ups.pop(round_index, None)
        return state() if callable(state) else state  # a callable: the swarm moves on meanwhile

    def report(self, note) -> None:
        if isinstance(note, Stepped):
            self.digests.append((note.round, note.digest))
            self.applied[note.round] = note.applied
        elif isinstance(note, ReplayFailed):
            self.failed.append((note.replay.since, note.replay.round, note.start))
            # as the exchange's consensus does
            self.agreed = NOTHING_AGREED if note.start is None else note.start
        elif isinstance(note, Rejoined):
            self.rejoined.append((note.from_round, note.state.next_round))
        else:
            self.refusals.append((note.peer, note.reason))


def dilocox(config, corpus, name: str, stream: int, delay: int = 1):
    section = ProtocolSection(name="dilocox", inner_steps=H, codec="bf16", delay=delay)
    link = ScriptedDiLoCoXLink()
    model = trainer(config, corpus, stream)
    return DiLoCoXRound(section, ContributionSection(), model, name, link), link, model
