"""TrainingWorker (node/daemon/worker.py): the training thread's order of work, with a real trainer
and a scripted round (a fake RoundPolicy that records when it is called)."""

from __future__ import annotations

import dataclasses
import threading
import time

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
    ran_ahead_seconds: float = 0.0  # what DiLoCoX's outcome carries (a round's end beside reads it)

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


class BesideRound(ScriptedRound):
    """A scripted round that also ends beside training: records the thread it ran in, holds
    round 0's end until released, and shifts θ by SHIFT."""

    SHIFT = 1000.0

    def __init__(self, trainer: InnerTrainer, fail_at: int | None = None,
                 catch_up_to: int | None = None, ran_ahead: float = 0.0):
        super().__init__(trainer, fail_at)
        self.release, self.threads, self.catch_up_to = threading.Event(), [], catch_up_to
        self.ran_ahead = ran_ahead  # round 0's end reports it waited this long for members behind

    def end_round_beside(self, round_index: int, theta: dict):
        self.calls.append(("beside", round_index, self.trainer.step))
        self.threads.append(threading.current_thread().name)
        if round_index == 0:
            assert self.release.wait(30)
        if round_index == self.fail_at:
            raise ValueError("the outer step failed")
        shift = {name: torch.full_like(t, self.SHIFT) for name, t in theta.items()}
        ahead = self.ran_ahead if round_index == 0 else 0.0
        return Outcome(phi_digest=f"phi{round_index}", refused=[], network_wait_seconds=ahead,
                       ran_ahead_seconds=ahead), shift, self.catch_up_to if round_index == 0 else None


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(load_config().data)


def run(corpus, overrides=(), total=2 * H, fail_at=None, stop_at_step=None, beside=False,
        catch_up_to=None, ran_ahead=0.0, step_times=None):
    """`step_times`: a dict filled with each step's monotonic time of completion."""
    config = load_config(overrides=[*TINY, *overrides])
    trainer = InnerTrainer(config.model, config.train, corpus, config.data.seq_len, 1,
                           torch.device("cpu"))
    policy = BesideRound(trainer, fail_at, catch_up_to, ran_ahead) if beside \
        else ScriptedRound(trainer, fail_at)
    events, saved = [], []

    def publish(event) -> None:
        events.append(event)
        if isinstance(event, StepDone) and step_times is not None:
            step_times[event.step] = time.monotonic()
        if isinstance(event, StepDone) and event.step == stop_at_step:
            worker.request_stop()
        if beside and catch_up_to is None and isinstance(event, StepDone) and event.step == H + 1:
            policy.release.set()  # round 0's end finishes during round 1's first step
            while worker.beside is not None and not worker.beside.future.done():
                time.sleep(0.001)
        if beside and catch_up_to is not None and isinstance(event, StepDone) \
                and event.step == 2 * H:
            policy.release.set()  # round 0's end is awaited at round 1's end
    worker = TrainingWorker(config.train, H, trainer, policy, total_steps=total, publish=publish,
                            save_checkpoint=lambda: saved.append(trainer.step),
                            peers_alive=lambda: 5, round_end_beside=beside)
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


def test_a_round_end_beside_runs_off_the_training_thread_and_shifts_theta_when_done(corpus):
    worker, policy, events, saved = run(corpus, ["train.checkpoint_every=3"], total=3 * H,
                                        beside=True)
    assert worker.error is None and set(policy.threads) == {"lowcomm-round-end_0"}
    # round 0's end ran beside step 4 (no between_steps while it ran) and was applied before
    # step 5's; every round's end was reported in order, each once
    calls = [(c[0], c[1]) for c in policy.calls]
    assert calls.index(("beside", 0)) < calls.index(("between", 1))
    betweens = [c[2] for c in policy.calls if c[0] == "between"]
    assert 3 not in betweens and 4 in betweens
    rounds = [e for e in events if isinstance(e, RoundEnded)]
    assert [(e.round, e.step, e.outcome.phi_digest) for e in rounds] == \
        [(0, 3, "phi0"), (1, 6, "phi1"), (2, 9, "phi2")]
    # each round's checkpoint once its end is applied (round 1's: whenever it finished), the
    # last round's end before the final one
    assert saved[0] == 4 and saved[2:] == [9, 9] and len(saved) == 4
    # θ moved by SHIFT at each of the three round ends (training moves it by far less)
    mean = torch.cat([p.detach().reshape(-1) for p in worker.trainer.model.parameters()]).mean()
    assert 2.9 * BesideRound.SHIFT < float(mean) < 3.1 * BesideRound.SHIFT


class RoundThatFailsBetweenSteps(ScriptedRound):
    """A round whose `between_steps` raises at step 4 before changing anything (a loop that no
    longer answers), and that says so through `consistent`."""

    consistent = True

    def between_steps(self, round_index: int):
        if self.trainer.step == 4:
            raise RuntimeError("the event loop did not answer within 30 s")
        return super().between_steps(round_index)


def test_a_thread_that_fails_where_its_state_is_consistent_still_writes_its_checkpoint(corpus):
    config = load_config(overrides=TINY)
    trainer = InnerTrainer(config.model, config.train, corpus, config.data.seq_len, 1,
                           torch.device("cpu"))
    events, saved = [], []
    worker = TrainingWorker(config.train, H, trainer, RoundThatFailsBetweenSteps(trainer),
                            total_steps=3 * H, publish=events.append,
                            save_checkpoint=lambda: saved.append(trainer.step),
                            peers_alive=lambda: 5)
    worker.start()
    worker.join(60)
    assert worker.finished.is_set() and isinstance(worker.error, RuntimeError)
    assert saved == [4] and isinstance(events[-1], Failed)


def test_a_failing_round_end_beside_ends_the_thread(corpus):
    worker, _, events, saved = run(corpus, fail_at=1, total=3 * H, beside=True)
    assert isinstance(worker.error, ValueError)
    assert isinstance(events[-1], Failed) and "the outer step failed" in events[-1].error
    assert not any(isinstance(e, Trained) for e in events)


@pytest.mark.parametrize("ran_ahead", [0.0, 0.5])
def test_a_round_end_beside_that_waited_for_members_behind_holds_training_as_long(corpus,
                                                                                  ran_ahead):
    """Round 0's end, done during step 4, waited 0.5 s for members still in the round: inline
    that wait would have held training, so beside it holds training before step 5 as long
    (without the hold a node ahead drifts further ahead round after round)."""
    times: dict[int, float] = {}
    worker, _, _, _ = run(corpus, total=2 * H, beside=True, ran_ahead=ran_ahead, step_times=times)
    assert worker.error is None
    gap = times[H + 2] - times[H + 1]
    assert ran_ahead <= gap < ran_ahead + 0.4, gap


def test_a_catch_up_in_a_round_end_beside_moves_the_rounds_that_follow(corpus):
    """Round 0's end, awaited only at round 1's end, moves the node to the swarm's round 5: the
    steps of round 1 count in round 5, and the round end started next is round 5's."""
    worker, policy, events, _ = run(corpus, total=7 * H, beside=True, catch_up_to=5)
    assert worker.error is None
    ends = [c[1] for c in policy.calls if c[0] == "beside"]
    assert ends == [0, 5, 6], ends
    assert [e.round for e in events if isinstance(e, RoundEnded)] == [0, 5, 6]


def test_round_end_auto_runs_beside_only_for_dilocox_training_on_cuda():
    from node.daemon.run import round_end_beside
    assert round_end_beside("auto", "dilocox", "cuda")
    assert not round_end_beside("auto", "dilocox", "cpu")
    assert not round_end_beside("auto", "noloco", "cuda")
    assert round_end_beside("beside", "dilocox", "cpu") and not round_end_beside("inline", "dilocox", "cuda")
