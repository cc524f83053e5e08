"""NoLoCo and DiLoCoX over the simulated swarm: every replica runs the daemon's own round class.

Each replica holds a NoLoCoRound or DiLoCoXRound (node/rounds/, built from the manifest sections
of the settings) over an in-memory link (node/simulator/noloco_link.py, dilocox_link.py), and
is driven as the daemon's training thread drives it (node/rounds/policy.py): `between_steps`
before every inner step (NoLoCo's mid-round correction happens there), `end_round` after the
last. So the contribution checks, the overlap correction, the delayed outer step and the
resync of a diverged φ measured here are the code that ships.

A round: the replicas train their H steps one after another (the exchange's clock at each
step), then end the round together (node/simulator/lockstep.py), meeting where their links need
every replica's message. When training stops, what is still owed is settled without training,
so that the final weights hold every round's work, as the collectives' do: NoLoCo overlap's
last pairs correct (the round class's mid-round correction), DiLoCoX delay 1's last messages
are applied (DiLoCoXRound.finish).
"""

from __future__ import annotations

from functools import partial

from node.rounds.dilocox.round import DiLoCoXRound, codec_for
from node.rounds.noloco.round import NoLoCoRound, rounding_seed
from node.simulator.decoding import DecodingCache, SharedDecoding
from node.simulator.dilocox_link import DiLoCoXMemoryNetwork
from node.simulator.lockstep import Lockstep
from node.simulator.methods.base import Method
from node.simulator.noloco_link import NoLoCoMemoryNetwork


class RoundSwarm(Method):
    def __init__(self, settings, replicas, exchange) -> None:
        super().__init__(settings, replicas, exchange)
        protocol, contributions = settings.sections()
        names = [r.name for r in replicas]
        self.lockstep = Lockstep(len(replicas))
        self.decodings = DecodingCache()
        if settings.protocol == "noloco":
            self.network = NoLoCoMemoryNetwork(names, exchange, self.lockstep, settings.timing,
                                               settings.max_staleness, settings.seed,
                                               contributions.ban_after)
            self.rounds = {r.name: NoLoCoRound(protocol, contributions, r.trainer,
                                               self.network.link(r.name),
                                               rounding_seed(settings.seed, r.name))
                           for r in replicas}
        else:
            self.network = DiLoCoXMemoryNetwork(names, exchange, self.lockstep, settings.delay,
                                                protocol.senders, protocol.senders_tenure)
            self.rounds = {r.name: DiLoCoXRound(protocol, contributions, r.trainer, r.name,
                                                self.network.link(r.name),
                                                SharedDecoding(codec_for(protocol), self.decodings))
                           for r in replicas}
            self.network.rounds = self.rounds

    def run_round(self, round_index: int) -> None:
        self.decodings.next_round()
        start, steps = self.exchange.now, self.settings.inner_steps
        losses = []
        for replica in self.replicas:
            policy = self.rounds[replica.name]
            for step in range(steps):
                self.exchange.at(start + step)
                policy.between_steps(round_index)
                losses.append(replica.trainer.train_step().loss)
        self.exchange.at(start + steps)
        self.round_train_losses = losses
        outcomes = self.lockstep.run([partial(self.rounds[r.name].end_round, round_index)
                                      for r in self.replicas])
        self.network.round_ended(round_index)
        self._count(outcomes)

    def finish(self, rounds: int) -> None:
        if self.settings.protocol == "noloco" and self.settings.timing == "overlap":
            self.network.flush()
            for replica in self.replicas:
                self.rounds[replica.name].between_steps(rounds)
        elif self.settings.protocol == "dilocox" and self.settings.delay == 1:
            self.lockstep.run([partial(self.rounds[r.name].finish, rounds) for r in self.replicas])
            self.network.round_ended(rounds, last=True)
            self.counters.phi_digests = self.network.distinct_digests
        self.counters.late_messages = self.network.late
        self.lockstep.close()

    def _count(self, outcomes: list) -> None:
        counters = self.counters
        counters.late_messages = self.network.late
        if self.settings.protocol == "noloco":
            counters.local_updates += sum(o.local_update for o in outcomes)
            counters.pairs_last_round = self.network.pair_history[-1]
            return
        counters.resyncs = sum(o.resyncs for o in outcomes)
        counters.phi_digests = self.network.distinct_digests
        energies = [e for o in outcomes for e in o.energy_kept.values()]
        counters.energy_kept = sum(energies) / len(energies) if energies else None
