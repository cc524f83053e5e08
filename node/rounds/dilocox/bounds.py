"""How far ahead a DiLoCoX member's word may reach: messages, reports and member records that
name a round beyond `ceiling` are refused with one sentence (a record's claim is left out of the
rounds a collect waits for), so that no honest node waits on, stores or asks for what a member
claims of rounds it cannot be in now. Beyond `round_bound(ceiling)` (4x it, plus 16: the bound
a late join holds records to, node/rounds/state.py) the claim is a lie no honest member can
tell, and each such message, and each such new claim of a record, strikes the member
(node/rounds/contributions.py BanList). Between the two a node far behind (it stalled, and
catches up) may hear of honest rounds it cannot use yet: refused, struck not.

The ceiling is the round a majority of the settled members and we reached (a minority of liars
cannot raise it: node/rounds/state.py `agreed_round`), or our own round if later, plus
AHEAD_ROUNDS. An honest member is never that far ahead: the rounds a majority reached bound it
(a node CATCH_UP_LAG rounds behind them takes the swarm's state, catch_up.py), and a node
ahead of its members waits for them (exchange.py), so honest rounds stay within a round or two
of one another; the slack covers member records that lag on a slow link.

A push's payload has its own bound: at most the largest DiLoCoX message the manifest's codec
allows (node/rounds/message_sizes.py, `Swarm.message_bytes`), refused TOO_LARGE before it is
read. Together with one message a member and round (exchange.py), what one member can make a
node hold in its inbox and relay store is bounded by (REPLAY_ROUNDS + AHEAD_ROUNDS) such messages.
"""

from __future__ import annotations

from collections.abc import Callable

from node.rounds.dilocox.link import CATCH_UP_LAG
from node.rounds.state import majority, round_bound, settled
from node.rounds.swarm import Swarm
from p2p.errors import Reason, Refusal
from p2p.records import MemberRecord

AHEAD_ROUNDS = CATCH_UP_LAG + 2
MAX_TRACKED = 1024


class RoundBound:
    """The furthest round a member may name, and the refusals beyond it."""

    def __init__(self, swarm: Swarm, own_round: Callable[[], int]):
        """`own_round()`: the round this node trains (about: the bound has slack)."""
        self.swarm, self.own_round = swarm, own_round
        self._claims: dict[str, int] = {}  # member -> the last implausible round its record claimed

    def ceiling(self) -> int:
        own = self.own_round()
        rounds = sorted([r.round for r in settled(self.swarm.members.eligible())] + [own],
                        reverse=True)
        return max(rounds[majority(len(rounds)) - 1], own) + AHEAD_ROUNDS

    def check(self, sender: str, round_index: int) -> None:
        """Refuses (REFUSED) a message of `sender` naming a round past the ceiling, and strikes
        the sender when no honest member can be in that round."""
        ceiling = self.ceiling()
        if round_index <= ceiling:
            return
        if round_index > round_bound(ceiling):
            sentence = (f"{sender} sent a message of round {round_index}, beyond round "
                        f"{round_bound(ceiling)}, the furthest any honest member can be in now")
            self.swarm.refuse(sender, "far_round", sentence)
        else:
            sentence = (f"{sender} sent a message of round {round_index}, beyond round {ceiling}, "
                        f"the furthest this node takes now")
        raise Refusal(Reason.REFUSED, sentence)

    def plausible(self, records: list[MemberRecord]) -> list[MemberRecord]:
        """`records` less those claiming a round past the ceiling; each new claim beyond any
        honest round strikes its member once (a claim kept is not struck again)."""
        ceiling = self.ceiling()
        kept = []
        for record in records:
            if record.round <= ceiling:
                kept.append(record)
            elif record.round > round_bound(ceiling) and self._claims.get(record.peer_id) != record.round:
                self._claims[record.peer_id] = record.round
                if len(self._claims) > MAX_TRACKED:
                    del self._claims[next(iter(self._claims))]
                self.swarm.bans.refuse(
                    record.peer_id, "far_round", f"member {record.peer_id} claims round "
                    f"{record.round} in its record, beyond round {round_bound(ceiling)}, the "
                    f"furthest any honest member can be in now: not waited for", self.swarm.transport.ban,
                    counted_elsewhere=False)
        return kept
