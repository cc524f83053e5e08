"""The simulator (node/simulator/): every method on a very small model, a few rounds each."""

import copy
import math
from collections import Counter

import pytest
import torch

from node.config.schema import load_config
from node.data.corpus import load_corpus, stream_seed
from node.simulator import Simulation, SimulationError, SimulationSettings
from node.simulator.exchange import InMemoryExchange, ring_allreduce_bytes
from node.rounds.dilocox.payload import encode_message
from node.rounds.noloco.payload import encode_snapshot, snapshot_bytes
from node.simulator.replica import weight_spread
from node.train.trainer import InnerTrainer
from protocol.tensors import weights_digest
from protocol.vote import winning_digest

VERY_SMALL = ["model.dim=32", "model.n_heads=2", "model.n_layers=1", "model.ffn_hidden=64",
              "data.seq_len=32", "train.micro_batch_size=4", "train.tokens_per_step=128",
              "train.warmup_steps=2", "train.eval_batches=2", "train.lr=1e-2", "train.threads=1"]
INITIAL_LOSS = math.log(256)  # a byte vocabulary at random initialisation


@pytest.fixture(scope="module")
def config():
    return load_config(overrides=VERY_SMALL)


@pytest.fixture(scope="module")
def corpus(config):
    return load_corpus(config.data)


def simulate(config, corpus, protocol, **settings):
    settings = {"workers": 4, "inner_steps": 8, "rounds": 3, **settings}
    simulation = Simulation(SimulationSettings(protocol, **settings), config, corpus)
    return simulation, simulation.run()


def model_elements(simulation):
    return sum(t.numel() for t in simulation.method.replicas[0].trainer.named_parameters().values())


# ---------------------------------------------------------------------------- byte accounting
@pytest.mark.parametrize("elements, workers", [(10, 1), (10, 2), (1001, 3), (1869504, 8), (7, 8)])
def test_ring_allreduce_sends_two_n_minus_one_over_n_of_the_vector(elements, workers):
    sent = ring_allreduce_bytes(elements, 4, workers)
    assert len(sent) == workers
    assert sum(sent) == 2 * (workers - 1) * elements * 4  # mean: exactly 2(N-1)/N x bytes
    assert max(sent) - min(sent) <= 2 * 4                 # uneven chunks differ by an element


def test_exchange_delivers_by_time_and_counts_losses():
    exchange = InMemoryExchange(["a", "b"], latency_steps=5, drop_probability=0.5, seed=1)
    results = [exchange.send("a", "b", "t", 0, i, 10) for i in range(200)]
    assert exchange.bytes_sent == {"a": 2000, "b": 0}
    assert exchange.counters.messages_dropped == results.count(False) and 60 < results.count(False) < 140
    assert exchange.collect("b", "t") == []                  # in transit
    exchange.compute(5)
    assert [e.payload for e in exchange.collect("b", "t")] == [i for i, ok in enumerate(results) if ok]
    with pytest.raises(ValueError, match="distinct replicas"):
        exchange.send("a", "a", "t", 0, None, 1)


# ---------------------------------------------------------------------------- baselines
def test_data_parallel_matches_train_step_and_keeps_replicas_identical(config, corpus):
    one, result = simulate(config, corpus, "data-parallel", workers=1, inner_steps=4, rounds=1)
    cfg = copy.deepcopy(one.config)
    reference = InnerTrainer(cfg.model, cfg.train, corpus, cfg.data.seq_len,
                             stream_seed(b"replica-0", 0), torch.device("cpu"))
    for _ in range(4):
        reference.train_step()
    ours = one.method.replicas[0].trainer.named_parameters()
    assert all(torch.equal(ours[n], p) for n, p in reference.named_parameters().items())

    three, result = simulate(config, corpus, "data-parallel", workers=3, inner_steps=4, rounds=2)
    assert result.final.weight_spread == 0.0
    assert len({weights_digest(w) for w in three.method.replica_weights()}) == 1
    per_step = ring_allreduce_bytes(model_elements(three), 4, 3)
    assert three.method.exchange.bytes_sent == {f"replica-{i}": 8 * per_step[i] for i in range(3)}
    assert result.final_val_loss < INITIAL_LOSS - 1.0


def test_diloco_replicas_share_phi_and_send_a_ring_allreduce_per_round(config, corpus):
    simulation, result = simulate(config, corpus, "diloco", outer_momentum=0.3)
    assert all(r.weight_spread == 0.0 for r in result.records)
    assert len({weights_digest(w) for w in simulation.method.replica_weights()}) == 1
    per_round = ring_allreduce_bytes(model_elements(simulation), 4, 4)
    assert result.final.bytes_sent_per_replica == 3 * sum(per_round) / 4
    assert result.final.bytes_sent_per_replica == pytest.approx(3 * 2 * 3 / 4 * 4 * model_elements(simulation))
    assert result.final_val_loss < result.records[0].val_loss_mean < INITIAL_LOSS


def test_local_only_sends_nothing_and_replicas_drift_apart(config, corpus):
    _, result = simulate(config, corpus, "local")
    assert result.final.bytes_sent_per_replica == 0 and result.final.messages_sent == 0
    assert result.final.weight_spread > result.records[0].weight_spread > 0
    assert result.final_val_loss < INITIAL_LOSS - 1.0


# ---------------------------------------------------------------------------- DiLoCoX
def test_dilocox_delay_zero_identity_codec_is_exactly_diloco(config, corpus):
    diloco, diloco_result = simulate(config, corpus, "diloco", outer_momentum=0.3)
    # clipping off: DiLoCo's mean scales no one down
    dilocox, dilocox_result = simulate(config, corpus, "dilocox", delay=0, codec="identity",
                                       outer_momentum=0.3, protocol_values={"clip_to_median": False})
    for ours, theirs in zip(diloco.method.replica_weights(), dilocox.method.replica_weights()):
        assert weights_digest(ours) == weights_digest(theirs)
    assert [r.val_loss_mean for r in diloco_result.records] == [r.val_loss_mean for r in dilocox_result.records]


def message_bytes(policy, trainer) -> int:
    """What one of a replica's DiLoCoX messages weighs on the wire (its round's payload)."""
    outer = policy.outer
    message = outer.compress(outer.pseudo_gradient(trainer.named_parameters()), 99)
    return sum(t.data.nbytes for t in encode_message(message))


@pytest.mark.parametrize("codec", [{"codec": "lowrank", "rank": 2},
                                   {"codec": "topk", "protocol_values": {"overlap": "eager"}},
                                   {"codec": "topk", "protocol_values": {"apply_on_arrival": True}}])
def test_dilocox_counts_exact_message_sizes_and_compresses(config, corpus, codec):
    simulation, result = simulate(config, corpus, "dilocox", delay=1, outer_momentum=0.3, **codec)
    method = simulation.method
    phis = {weights_digest(p.outer.slow_weights) for p in method.rounds.values()}
    size = message_bytes(method.rounds["replica-0"], method.replicas[0].trainer)
    digests_per_round = 16 * 3
    expected = 3 * (3 * size + digests_per_round) + digests_per_round  # + the final flush's
    assert result.final.bytes_sent_per_replica == expected
    assert 3 * size < model_elements(simulation) * 4 / 3  # well under an fp32 broadcast
    assert len(phis) == 1  # one φ
    assert result.final.resyncs == 0
    # each replica trains φ minus its own compression residual (protocol/dilocox.py)
    assert result.final.weight_spread > 0
    assert result.final_val_loss < INITIAL_LOSS - 0.5


def test_dilocox_lost_messages_are_counted_and_phi_is_resynchronised(config, corpus):
    """A replica that missed a message ends its round on another φ; the consensus check gives
    it the majority's φ and m, which it adopts before its next outer step (as in the daemon)."""
    settings = SimulationSettings("dilocox", workers=4, inner_steps=8, rounds=5, drop_probability=0.3,
                                  codec="bf16", outer_momentum=0.3)
    simulation = Simulation(settings, config, corpus)
    rounds = simulation.method.rounds
    after = []  # after each round: each replica's (φ digest, resyncs so far)
    result = simulation.run(lambda record: after.append(
        {name: (p.phi_digest, p.resyncs) for name, p in rounds.items()}))
    assert result.final.messages_dropped > 0
    assert result.final.messages_dropped == simulation.method.exchange.counters.messages_dropped
    assert result.final.resyncs > 0                 # some replica missed a message and diverged
    for previous, now in zip(after, after[1:-1]):   # (the last record holds the final flush)
        majority = winning_digest(Counter(digest for digest, _ in previous.values()))
        for name, (digest, resyncs) in previous.items():
            # a replica off the majority's φ adopts it in the next round, and only then
            assert now[name][1] == resyncs + (digest != majority), (name, after)


def test_dilocox_messages_slower_than_a_round_are_late(config, corpus):
    _, result = simulate(config, corpus, "dilocox", latency_steps=9, delay=1, codec="bf16")
    assert result.final.messages_late > 0 and result.final.messages_dropped == 0


# ---------------------------------------------------------------------------- NoLoCo
def test_noloco_pairs_vary_losses_fall_and_snapshot_bytes_are_exact(config, corpus):
    simulation, result = simulate(config, corpus, "noloco", rounds=6, timing="blocking",
                                  wire_dtype="bf16")
    pairings = {tuple(map(tuple, r.pairs)) for r in result.records}
    assert len(pairings) >= 2                                  # partners vary over rounds
    assert all(len(r.pairs) == 2 for r in result.records)      # 4 replicas: 2 pairs a round
    policy = simulation.method.rounds["replica-0"]
    snapshot = sum(t.data.nbytes for t in encode_snapshot(policy.outer.snapshot(
        simulation.method.replicas[0].trainer.named_parameters()), "bf16", "theta"))
    assert snapshot == 2 * model_elements(simulation)          # θ alone in bf16 (β = γ)
    assert result.final.bytes_sent_per_replica == 6 * snapshot
    assert result.final.local_updates == 0 and result.final.idle_steps == 0
    assert 0 < result.final.weight_spread < 0.5                # own φ each, kept close
    assert result.final_val_loss < result.records[0].val_loss_mean < INITIAL_LOSS


@pytest.mark.parametrize("wire_dtype", ["int8", "int4"])
def test_noloco_quantized_snapshots_count_their_real_bytes_and_train(config, corpus, wire_dtype):
    simulation, result = simulate(config, corpus, "noloco", rounds=3, timing="blocking",
                                  wire_dtype=wire_dtype)
    shapes = {n: tuple(t.shape) for n, t in
              simulation.method.replicas[0].trainer.named_parameters().items()}
    snapshot = snapshot_bytes(shapes, wire_dtype, "theta")
    per_parameter = {"int8": 1.0625, "int4": 0.5625}[wire_dtype]  # + 4 bytes a short block
    assert per_parameter <= snapshot / model_elements(simulation) < per_parameter + 0.01
    assert result.final.bytes_sent_per_replica == 3 * snapshot
    assert result.final.local_updates == 0 and simulation.method.network.refused == Counter()
    assert result.final_val_loss < result.records[0].val_loss_mean < INITIAL_LOSS


def simulated_protocol(argv: list[str], protocol_values: dict | None = None):
    """The [protocol] section `lowcomm-node simulate --protocol noloco ARGV` builds, with
    `protocol_values` as `--set protocol.KEY=VALUE` would give them."""
    import argparse

    from node.simulator.cli import add_simulate_command, settings_from_args
    parser = argparse.ArgumentParser().add_subparsers()
    add_simulate_command(parser)
    args = parser.choices["simulate"].parse_args(["--protocol", "noloco", "--rounds", "1", *argv])
    return settings_from_args(args, 100, protocol_values or {}).sections()[0]


def test_quantized_wire_dtypes_reach_the_simulator_by_flag_and_by_set():
    assert simulated_protocol(["--wire-dtype", "int4"]).wire_dtype == "int4"
    assert simulated_protocol([], {"wire_dtype": "int4"}).wire_dtype == "int4"  # --set protocol.
    with pytest.raises(SimulationError, match="choose one of bf16, fp16, fp32, int8, int4"):
        SimulationSettings("noloco", wire_dtype="int2").validated()


def test_noloco_overlap_uses_last_rounds_snapshots_and_never_waits(config, corpus):
    _, result = simulate(config, corpus, "noloco", rounds=3, latency_steps=5, timing="overlap")
    assert result.records[0].local_updates == 4   # round 0: no earlier snapshot anywhere
    assert result.final.local_updates == 4 and result.records[-2].idle_steps == 0
    assert result.final.idle_steps == 5  # only the final flush waits, after training
    _, too_slow = simulate(config, corpus, "noloco", rounds=3, latency_steps=9, timing="overlap")
    assert too_slow.final.messages_late == 8 and too_slow.final.local_updates == 12


def test_noloco_overlap_without_latency_computes_what_blocking_does(config, corpus):
    """The pair's update, applied as a correction at the next round's first step boundary,
    lands where blocking's update does, up to rounding; and the pairs are the same.

    Compared after one pair update, where rounding is not amplified: the two paths compute the
    same fp32 sums in another order (overlap: φ + local step, then + the correction; blocking: φ
    + the pair's step), each ending in an addition rounded at the scale of the weights, so they
    may differ by a few units in the last place of the largest weight (measured: one, with
    torch's AVX512, AVX2 and default kernels, ATEN_CPU_CAPABILITY). Training on from there is
    not compared: AdamW's normalised steps amplify that one ulp to 9e-5 (default), 1.7e-4 (AVX2)
    or 3.4e-4 (AVX512) within three more rounds, which compares the CPUs, not the timings."""
    overlap, _ = simulate(config, corpus, "noloco", timing="overlap", rounds=1)
    blocking, _ = simulate(config, corpus, "noloco", timing="blocking", rounds=1)
    ours, theirs = overlap.method.replica_weights(), blocking.method.replica_weights()
    largest = max(float(t.abs().max()) for weights in theirs for t in weights.values())
    few_ulps = 4 * torch.finfo(torch.float32).eps * largest
    for our_weights, their_weights in zip(ours, theirs):
        for name, tensor in our_weights.items():
            torch.testing.assert_close(tensor, their_weights[name], atol=few_ulps, rtol=0)
    assert overlap.method.network.pair_history == blocking.method.network.pair_history
    overlap, _ = simulate(config, corpus, "noloco", timing="overlap", rounds=4)
    blocking, _ = simulate(config, corpus, "noloco", timing="blocking", rounds=4)
    assert overlap.method.network.pair_history == blocking.method.network.pair_history


def test_noloco_blocking_waits_up_to_the_deadline_and_counts_losses(config, corpus):
    _, waits = simulate(config, corpus, "noloco", timing="blocking", latency_steps=3)
    assert waits.final.idle_steps == 3 * 3 and waits.final.local_updates == 0
    _, misses = simulate(config, corpus, "noloco", timing="blocking", latency_steps=9, deadline_steps=2)
    assert misses.final.idle_steps == 3 * 2 and misses.final.local_updates == 12
    assert misses.final.messages_late == 12
    _, lossy = simulate(config, corpus, "noloco", timing="blocking", drop_probability=0.4, rounds=4)
    dropped = lossy.final.messages_dropped
    assert dropped > 0 and lossy.final.local_updates == dropped  # each loss: one local update


def test_weight_spread_is_relative_rms_distance():
    a = {"w": torch.tensor([1.0, 1.0])}
    b = {"w": torch.tensor([3.0, 3.0])}
    assert weight_spread([a, a]) == 0.0
    assert weight_spread([a, b]) == pytest.approx(math.sqrt(2) / math.sqrt(8))


@pytest.mark.parametrize("settings, sentence", [
    ({"protocol": "diloco", "drop_probability": 0.1}, "noloco and dilocox only"),
    ({"protocol": "dilocox", "codec": "blockwise", "rank": 4}, "takes no rank"),
    ({"protocol": "noloco", "timing": "eager"}, "overlap or blocking"),
    ({"protocol": "gossip"}, "unknown"),
    ({"protocol": "local", "workers": 0}, "workers must be"),
    ({"protocol": "noloco", "snapshot": "delta"}, "choose theta or phi_delta"),
])
def test_bad_settings_are_refused_in_one_sentence(settings, sentence):
    with pytest.raises(SimulationError, match=sentence):
        SimulationSettings(**settings).validated()


def test_snapshot_defaults_to_theta_only_where_it_is_exact_and_is_refused_elsewhere():
    sections = lambda **kw: SimulationSettings("noloco", **kw).validated().sections()[0].snapshot
    assert sections() == "theta"
    assert sections(noloco_progress_weight=0.6) == "phi_delta"
    assert sections(protocol_values={"progress_weight": 0.6}) == "phi_delta"
    assert sections(snapshot="phi_delta") == "phi_delta"
    with pytest.raises(SimulationError, match="set protocol.snapshot = 'phi_delta'"):
        SimulationSettings("noloco", noloco_progress_weight=0.6, snapshot="theta").validated()
    assert simulated_protocol(["--snapshot", "phi_delta"]).snapshot == "phi_delta"
    assert simulated_protocol([], {"snapshot": "phi_delta"}).snapshot == "phi_delta"  # --set


def test_shared_decoding_gives_the_codecs_numbers_and_a_private_copy_each():
    from node.simulator.decoding import DecodingCache, SharedDecoding
    from protocol.codecs import get_codec

    cache = DecodingCache()
    first, second = (SharedDecoding(get_codec("lowrank", rank=2), cache) for _ in range(2))
    encoded = first.encode(torch.randn(64, 48), "w")
    plain = get_codec("lowrank").decode(encoded.description, encoded.payload, max_elements=64 * 48)
    a = first.decode(encoded.description, encoded.payload, max_elements=64 * 48)
    b = second.decode(encoded.description, encoded.payload, max_elements=64 * 48)
    assert torch.equal(a, plain) and torch.equal(b, plain) and len(cache.current) == 1
    a.add_(1.0)  # a caller writing into its copy does not reach the others
    assert torch.equal(second.decode(encoded.description, encoded.payload, 64 * 48), plain)
    cache.next_round()
    cache.next_round()
    assert cache.get(next(iter(cache.previous), None)) is None and not cache.current


def test_shared_decoding_hands_every_codec_method_to_the_node_codec():
    """A method of Codec the wrapper does not override would run the base class's on the
    wrapper (track: a no-op) instead of the node's codec, and the simulator would measure a
    protocol the daemon does not run."""
    import inspect

    from node.simulator.decoding import SharedDecoding
    from protocol.codecs.base import Codec

    public = {name for name, member in inspect.getmembers(Codec, inspect.isfunction)
              if not name.startswith("_")}
    assert public <= set(vars(SharedDecoding)), sorted(public - set(vars(SharedDecoding)))


def test_human_bytes_keeps_three_digits_without_exponents():
    from node.simulator.report import human_bytes

    assert [human_bytes(x) for x in (0, 1536, 1000 * 1024, 99.8 * 1024**2, 9.75 * 1024**3)] == \
        ["0 B", "1.5 KiB", "1000 KiB", "99.8 MiB", "9.75 GiB"]
