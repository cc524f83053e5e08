"""lowcomm's node: the daemon that joins protocol/ (the math) to p2p/ (the network), and its tools.

Rooms, one concern each (import modules directly; this package imports nothing eagerly):

    cli.py           `lowcomm-node`: every subcommand parses, validates, then hands off
    config/          schema (typed config sections), manifest (what a swarm agrees on),
                     settings (how this machine runs its node; every daemon timeout, named)
    data/            corpus: the bytes or tokens, and each node's batch stream; prepare-data:
                     sources (documents), tokenizer, prepare (the pipeline), shards (the
                     prepared directory, its digests and the manifest's pins on them)
    train/           model, trainer (the inner loop), accelerator (precision, compilation and the
                     micro-batch a device fits), checkpoint, standalone (`train`: alone)
    rounds/          what happens every H steps, shared by the daemon and the simulator:
                     policy (the round's interface), noloco/ and dilocox/ (round.py in the
                     training thread, payload.py on the wire, exchange.py on the event loop),
                     contributions (checks and bans), state (the state late joiners download, its
                     layout and shared export), state_fetch (downloading it range by range),
                     swarm (the running node as an exchange sees it), wire_tensors
    daemon/          a node's life, a file per phase: join (admission.py, join.py, and
                     state_quorum.py: which state a late joiner adopts), run (run.py,
                     worker.py: the training thread, state_serving.py: our state served from
                     one export a round), leave (leave.py); daemon.py wires them;
                     members.py (the member cache, eligible peers, our announced φ)
    ops/             what the operator sees: status (the schema), status_feed (its numbers),
                     status_view, control socket, telemetry, monitor, preemption, local_swarm;
                     model_cli (prepare-data, export, generate, perplexity), model_source,
                     export and hf_layout (transformers' Llama), generate (sampling, perplexity)
    simulator/       N replicas in one process, driving the same round classes over memory
    events.py        every event a node reports, typed, and the bus to its subscribers
    loop.py          background tasks (errors counted) and the training thread's bridge to the loop
    data_dir.py      the data directory's layout, and the metrics log

Where things happen:
- a NoLoCo round: node/daemon/worker.py ends it -> node/rounds/noloco/round.py (NoLoCoRound:
  snapshot, outer step, the partner's correction) -> payload.py (the snapshot on the wire) ->
  exchange.py (pairing, the swap; protocol/matching.py) -> back in round.py: the partner's
  snapshot checked (node/rounds/contributions.py) and applied (protocol/noloco.py);
- a message is verified twice: its signature, digest and bounds by p2p/streams.py before it is
  read, its contents by node/rounds/contributions.py before they are used;
- each number of the status view: node/ops/status_feed.py (the table at its top).
"""
