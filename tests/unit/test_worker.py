"""TrainingWorker (node/daemon/worker.py): the training thread's order of work, with a real trainer
and a scripted round (a fake RoundPolicy that records when it is called)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from node.config.schema import load_config
from node.data.corpus import load_corpus
from node.daemon.worker import TrainingWorker
from node.events import Checkpointed, Failed, PairCorrected, RoundEnded, StepDone, Stopping, Trained
from node.rounds.policy import RoundOutcome
from node.train.trainer import InnerTrainer

TINY = ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "model.ffn_hidden=64",
        "data.seq_len=32", "train.micro_batch_size=2", "train.tokens_per_step=64",
        "train.warmup_steps=1", "train.eval_batches=1", "train.steps=40"]
H = 3


@dataclasses.dataclass(frozen=True)
class Outcome(RoundOutcome):
    @property
    def partners(self) -> list[str]:
        return []


class ScriptedRound:
    """A fake RoundPolicy: records (call, round, trainer step); between_steps reports an event
    at the second step of every round; `fail_at` raises in that round's end."""

    def __init__(self, trainer: InnerTrainer, fail_at: int | None = None):
        self.trainer, self.fail_at, self.calls = trainer, fail_at, []

    def between_steps(self, round_index: int):
        self.calls.append(("between", round_index, self.trainer.step))
        if self.trainer.step % H == 1:
            return PairCorrected(round=round_index - 1, phi_digest="d", partner="p",
                                 phi_before="c", shift=1.0)
        return None

    def end_round(self, round_index: int) -> Outcome:
        self.calls.append(("end", round_index, self.trainer.step))
        if round_index == self.fail_at:
            raise ValueError("the outer step failed")
        return Outcome(phi_digest=f"phi{round_index}", refused=[], network_wait_seconds=0.0)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config().data)


def run(corpus, overrides=(), total=2 * H, fail_at=None, stop_at_step=None):
    config = load_config(overrides=[*TINY, *overrides])
    trainer = InnerTrainer(config.model, config.train, corpus, config.data.seq_len, 1,
                           torch.device("cpu"))
    policy, events, saved = ScriptedRound(trainer, fail_at), [], []

    def publish(event) -> None:
        events.append(event)
        if isinstance(event, StepDone) and event.step == stop_at_step:
            worker.request_stop()
    worker = TrainingWorker(config.train, H, trainer, policy, total_steps=total, publish=publish,
                            save_checkpoint=lambda: saved.append(trainer.step),
                            peers_alive=lambda: 5)
    worker.start()
    worker.join(60)
    assert worker.finished.is_set()
    return worker, policy, events, saved


def test_rounds_run_between_steps_before_every_step_and_end_after_the_last(corpus):
    worker, policy, events, saved = run(corpus, ["train.eval_every=6", "train.checkpoint_every=3"])
    expected = []
    for r in range(2):
        expected += [("between", r, r * H + k) for k in range(H)] + [("end", r, (r + 1) * H)]
    assert policy.calls == expected
    rounds = [e for e in events if isinstance(e, RoundEnded)]
    assert [(e.round, e.step, e.outcome.phi_digest, e.peers_alive) for e in rounds] == \
        [(0, 3, "phi0", 5), (1, 6, "phi1", 5)]
    assert rounds[0].val_loss is None and rounds[1].val_loss is not None  # every 6 steps: 2 rounds
    assert "val_loss" not in rounds[0].record() and rounds[1].record()["phi_digest"] == "phi1"
    assert [e.step for e in events if isinstance(e, StepDone)] == list(range(1, 7))
    assert sum(isinstance(e, PairCorrected) for e in events) == 2  # what between_steps reported
    assert saved == [3, 6, 6]  # every round (checkpoint_every = H), and at the end
    assert isinstance(events[-1], Trained) and events[-1].step == 6 and worker.error is None


def test_a_stop_request_ends_after_the_step_in_progress_with_a_checkpoint(corpus):
    _, policy, events, saved = run(corpus, total=4 * H, stop_at_step=4)
    assert [c for c in policy.calls if c[0] == "end"] == [("end", 0, 3)]
    stops = [e for e in events if isinstance(e, Stopping)]
    assert len(stops) == 1 and stops[0].step == 4 and stops[0].signal is None
    assert saved == [4] and isinstance(events[-1], Trained) and events[-1].step == 4
    assert not any(isinstance(e, Checkpointed) for e in events)  # the daemon's save reports it


def test_a_failing_round_is_reported_and_ends_the_thread(corpus):
    worker, _, events, saved = run(corpus, fail_at=1)
    assert isinstance(worker.error, ValueError)
    assert isinstance(events[-1], Failed) and "the outer step failed" in events[-1].error
    assert saved == [] and not any(isinstance(e, Trained) for e in events)
