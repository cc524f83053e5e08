"""Swarm manifests: what every member of a swarm must agree on, in configs/swarms/<id>.toml.

A manifest fixes the model, the data recipe, the inner optimizer, the protocol and its
hyper-parameters, the bootstrap peers and admission. Its digest travels in every message header:
a peer on another manifest is refused, and `differences` names the fields that differ.
Manifests are validated by the same typed machinery as run configs (node/config/schema.py).

The digest (`Manifest.agreed`, then BLAKE2b-128 of its canonical JSON) covers what members agree
on and nothing else, so two members on adjacent releases with the same file agree:
- the swarm protocol's schema version, "<protocol>/<n>" (`SCHEMA_VERSIONS`), and
- the values the swarm's own protocol reads (all sections but the network, the swarm's
  description, node-local train keys, and the other protocol's keys, `READ_ONLY_BY`) that differ
  from that protocol's defaults; data.path too is left out where the shards are pinned by digest.
A default is thus part of the schema version: changing one of a protocol's defaults changes
what its manifests that leave the key out compute, so it bumps that protocol's schema version
(tests/unit/test_manifest_digest.py pins each version's defaults and fails otherwise). Adding a
key with a default leaves every existing manifest's digest as it was, unless the file sets it to
another value; a key the other protocol alone reads never enters this protocol's digest.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from node.config.schema import (CONFIG_DIR, ConfigError, DataConfig, ModelConfig, TrainConfig,
                         build_config, read_toml, spec, to_toml)

SWARM_DIR = CONFIG_DIR / "swarms"
SWARM_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
# How one machine runs, not what the swarm computes: members may differ in these.
# protocol.wire_dtype; the quantized ones are node/rounds/wire_tensors.py QUANTIZED_BITS
WIRE_DTYPE_CHOICES = ("bf16", "fp16", "fp32", "int8", "int4")
NODE_LOCAL_TRAIN_KEYS = ("threads", "device", "log_every", "checkpoint_every", "eval_every",
                         "eval_batches", "min_step_seconds", "activation_checkpointing",
                         "compile", "precision", "micro_batch_probe")


@dataclass
class SwarmSection:
    id: str = spec("local", "the swarm's name: lowercase letters, digits, '-' and '_'")
    description: str = spec("", "one line for humans")


@dataclass
class ProtocolSection:
    name: str = spec("noloco", "the outer protocol", choices=("noloco", "dilocox"))
    inner_steps: int = spec(50, "H: inner steps per round", min=1, max=1_000_000)
    # NoLoCo (docs/protocols.md §1)
    momentum: float = spec(0.5, "NoLoCo α", min=0.0, max=1.0)
    progress_weight: float = spec(0.7, "NoLoCo β", min=0.0, max=10.0, min_exclusive=True)
    consensus_weight: float = spec(0.7, "NoLoCo γ", min=0.0, max=10.0)
    timing: str = spec("overlap", "overlap: use the pair formed during a round at its end; "
                       "blocking: wait for a pair after the round", choices=("overlap", "blocking"))
    max_staleness: int = spec(2, "largest round difference between partners", min=0, max=1000)
    pair_deadline_s: float = spec(60.0, "blocking timing: longest wait for a partner",
                                  min=0.0, max=3600.0, min_exclusive=True)
    # a node whose swaps outlast its rounds pairs less often (node/rounds/noloco/pacing.py)
    max_swap_rounds: int = spec(4, "overlap timing: the most rounds a swap may take; a node whose "
                                "swaps take longer than a round pairs once every few rounds, at "
                                "most this many, and a snapshot landing later is dropped",
                                min=1, max=64)
    # int8/int4: blockwise absmax in blocks of 64 with fp32 scales (node/rounds/wire_tensors.py).
    # int4, rounded stochastically, is the default: it ended -0.34% to +0.73% against φ and Δ in
    # bf16 in every cell of the N x H grid (benchmarks/NOTEBOOK.md, "NoLoCo against DiLoCo and
    # local-only"), at 10.7-12.4x fewer bytes than DiLoCo's fp32 ring (int8: 5.6-6.6x); a θ is a
    # whole state, not a delta, so its rounding does not accumulate from round to round
    wire_dtype: str = spec("int4", "how NoLoCo snapshots travel: int4 (default) or int8, "
                           "quantized in blocks of 64 with one fp32 scale each (1.0625 or 0.5625 "
                           "bytes a parameter, lossy), or bf16, fp16 or fp32 (2, 2 or 4)",
                           choices=WIRE_DTYPE_CHOICES)
    # a sender's choice; receivers decode alike. Stochastic rounding is unbiased: to nearest, a
    # θ that barely moves is pulled to the same code round after round (benchmarks/NOTEBOOK.md,
    # "NoLoCo against DiLoCo and local-only": int4 θ ended 1.5% above int8 rounded to nearest,
    # +0.31% rounded stochastically)
    wire_rounding: str = spec("stochastic", "how a quantized wire_dtype rounds a snapshot: "
                              "stochastic (default; q = floor(x/s*L + u), u uniform in [0, 1): "
                              "unbiased, from each node's own random generator) or nearest",
                              choices=("nearest", "stochastic"))
    # θ alone is exact only when β = γ (protocol/noloco.py theta_only_snapshot); half the bytes
    snapshot: str = spec("theta", "what a NoLoCo snapshot sends: theta, the fast weights alone "
                         "(needs progress_weight = consensus_weight), or phi_delta, φ and Δ "
                         "(twice the bytes; needed when they differ)",
                         choices=("theta", "phi_delta"))
    # DiLoCoX (docs/protocols.md §3)
    outer_lr: float = spec(0.7, "DiLoCoX outer learning rate η", min=0.0, max=10.0,
                           min_exclusive=True)
    # 0.6, not DiLoCo's 0.9: with delay 1 a linear model's iteration diverges at μ = 0.9
    # (protocol/dilocox.py). 0.6 took 1.7 points off 0.3 at 8 replicas (benchmarks/NOTEBOOK.md,
    # "DiLoCoX against DiLoCo and local-only"); with 0.3, rank 4 at 8 bits and the step at the
    # round's end, the defaults ended above local-only on three of the six held-out settings
    # (benchmarks/RESULTS.md, "The shipped defaults on settings nobody tuned them on")
    outer_momentum: float = spec(0.6, "DiLoCoX outer Nesterov momentum μ", min=0.0, max=1.0)
    delay: int = spec(1, "DiLoCoX: 1 applies round r's messages at the end of round r+1; 0 waits",
                      choices=(0, 1))
    codec: str = spec("lowrank", "DiLoCoX pseudo-gradient codec",
                      choices=("lowrank", "topk", "blockwise", "bf16", "fp16", "identity"))
    # rank 8 at 4 bits: about the bytes of rank 4 at 8 bits; 1.7522 against rank 4 at 4 bits'
    # 1.8084 at 8 replicas, H 25 (benchmarks/NOTEBOOK.md, "DiLoCoX against DiLoCo and
    # local-only", the ladder with 4 power iterations)
    rank: int = spec(8, "DiLoCoX starting rank of the low-rank codec", min=1, max=4096)
    bits: int = spec(4, "DiLoCoX quantization bits", choices=(4, 8))
    # the sender's compute alone: a receiver decodes P·Qᵀ whatever the iterations that found it.
    # 4, not PowerSGD's 1: at the same bytes 1.8071 against 1.8534 at 8 replicas (two seeds),
    # 2.0629 against 2.0843 in a committee at 32 (benchmarks/NOTEBOOK.md, "DiLoCoX against DiLoCo
    # and local-only")
    power_iterations: int = spec(4, "DiLoCoX low-rank codec: power iterations an encode takes "
                                 "from last round's subspace (more keep more of each message "
                                 "at the same bytes)", min=1, max=16)
    # topk: SparseLoCo's production point, 64 of every 4096 (1.6%), 2-bit values (protocol/codecs/topk.py)
    topk_k: int = spec(64, "DiLoCoX topk codec: entries sent per chunk (starting value)",
                       min=1, max=65536)
    topk_chunk: int = spec(4096, "DiLoCoX topk codec: elements per chunk", min=1, max=65536)
    topk_bits: int = spec(2, "DiLoCoX topk codec: bits per value (a sign and bits - 1 of "
                          "magnitude)", choices=(2, 4, 8))
    overlap: str = spec("half", "DiLoCoX with delay 1: how much of a node's own round in flight "
                        "its next round starts from: half (λ = 1/2) or eager (the share its "
                        "message will have in the outer step; protocol/dilocox.py)",
                        choices=("half", "eager"))
    # on: most of the delay's cost goes (benchmarks/NOTEBOOK.md, "pilots of the codec, the
    # overlap and the outer step"), and the grid's best ran with it
    apply_on_arrival: bool = spec(True, "DiLoCoX with delay 1: take the outer step as soon as "
                                  "every member's message of the last round is here, shifting "
                                  "the weights mid-round, rather than at the round's end")
    residual_decay: float = spec(1.0, "DiLoCoX error feedback e ← β·e + Δ: β (1 keeps every "
                                 "unsent value; SparseLoCo uses 0.95)", min=0.0, max=1.0,
                                 min_exclusive=True)
    # on: it cost the honest swarm nothing measurable (-0.38% at 8 replicas, two seeds) and its
    # norms are summed alike on every CPU (protocol/tensors.py squared_norm)
    clip_to_median: bool = spec(True, "DiLoCoX: scale each message down to the median norm of "
                                "its round's messages before averaging")
    # off by default: with it on, a node restarted after a SIGKILL never held the survivors' φ
    # again (tests/integration/test_fault_points.py, measured when the check was added)
    noise_filter: bool = spec(False, "DiLoCoX: leave out of the mean a sender whose message looks "
                              "like noise against the others of its round (contributions.noise_ratio)")
    # the adaptive controller (protocol/controller.py, node/rounds/dilocox/adapt.py)
    controller: bool = spec(False, "DiLoCoX: adapt the codec's strength (topk k, lowrank rank) and "
                            "bits each round to the energy kept and the link's send time, "
                            "starting at a quarter of rank or topk_k")
    controller_energy_target: float = spec(0.8, "DiLoCoX controller: energy kept below this "
                                           "raises the strength", min=0.0, max=1.0, min_exclusive=True)
    controller_energy_high: float = spec(0.95, "DiLoCoX controller: energy kept above this lowers "
                                         "the strength", min=0.0, max=1.0, min_exclusive=True)
    # 0.5, not 0.8: a slow member's downlink carries every member's message, and at 0.8 it had
    # no room left for member records and state downloads (benchmarks/NOTEBOOK.md, "Steps paced to
    # an emulated accelerator")
    controller_send_budget: float = spec(0.5, "DiLoCoX controller: the share of a round's compute "
                                         "a send may take before it compresses harder",
                                         min=0.0, max=100.0, min_exclusive=True)
    max_density: float = spec(0.0625, "DiLoCoX topk codec: messages sending more than this share "
                              "of a chunk (k / chunk) are refused", min=0.0, max=1.0,
                              min_exclusive=True)
    fan_out: int = spec(32, "DiLoCoX: most peers a message is sent to", min=1, max=4096)
    # a committee per round (protocol/committee.py): a node's bytes per round stay about this
    # many messages whatever the swarm's size, where every member sending sends N − 1 copies;
    # swarms of up to 8 all send. With a tenure of 8, rank 4 at 4 bits: 1.9896 at 32 replicas
    # and 1.9816 at 64 (2 seeds each), below local-only, at 56-60x fewer bytes than an fp32 ring
    # averaged over draws (benchmarks/NOTEBOOK.md, "DiLoCoX at 32 and 64 replicas")
    senders: int = spec(8, "DiLoCoX: about this many members send their message in a round, "
                        "drawn from peer id and round (0: every member, every round); the "
                        "others' rounds wait for their next message as kept_decay says",
                        min=0, max=4096)
    # 8: a member's error feedback acts in consecutive rounds; at 32 / 64 replicas a fresh draw
    # each round ended 2.0629 / 2.1140, a tenure of 4 2.0280 / 2.0384, of 8 2.0024 / 1.9813,
    # local-only 2.0175 (benchmarks/NOTEBOOK.md, "DiLoCoX at 32 and 64 replicas")
    senders_tenure: int = spec(8, "DiLoCoX with a committee (senders > 0): rounds in a row a "
                               "member drawn sends, from one draw", min=1, max=64)
    # 0: a round's work that waited outside the committee was stale by the time it was sent, and
    # at 32 replicas and 8 senders it cost more than it gave: 2.1000 fresh only, 2.1891 at 0.5,
    # 2.4415 at 1, local-only 2.2528 (identity code; benchmarks/NOTEBOOK.md, "DiLoCoX at 32
    # replicas")
    kept_decay: float = spec(0.0, "DiLoCoX with a committee (senders > 0): what a round kept "
                             "outside the committee still weighs in the member's next message, "
                             "per round waited (0: only the fresh round is sent; 1: all of it)",
                             min=0.0, max=1.0)
    message_deadline_s: float = spec(120.0, "DiLoCoX: a message later than this is dropped",
                                     min=0.0, max=3600.0, min_exclusive=True)
    # every transfer's rate bound (p2p/progress.py): swarm-wide, so that no member cuts another
    # whose link the swarm declared good enough
    min_link_mbit_s: float = spec(1.0, "the slowest link (Mbit/s, each way) a member may have: a "
                                  "transfer is given up when even at this rate its remaining bytes "
                                  "could not arrive by the time its round can use them (a swap, a "
                                  "push, a relay fetch, a state download); one that keeps moving at "
                                  "this rate is never cut", min=0.0, max=1e6, min_exclusive=True)


@dataclass
class NetworkSection:
    bootstrap_peers: list[str] = spec([], "multiaddrs of DHT nodes to join through")


@dataclass
class AdmissionSection:
    mode: str = spec("open", "open: anyone may join; allowlist: only the keys below",
                     choices=("open", "allowlist"))
    public_keys: list[str] = spec([], "allowed members' peer ids (12D3KooW...)")
    # The Sybil lever of open swarms (node/daemon/newcomers.py; measured in benchmarks/NOTEBOOK.md).
    new_members_per_hour: float = spec(0.0, "at most this many identities a node has never seen "
                                       "become eligible partners per hour, after its first view "
                                       "of the swarm (0: no limit)", min=0.0, max=1e6)


@dataclass
class ContributionSection:
    max_norm_ratio: float = spec(10.0, "refuse a contribution whose norm exceeds this multiple "
                                 "of the node's own", min=1.0, max=1e6)
    # Off by default: it refuses honest peers once training plateaus (node/rounds/contributions.py).
    # It compares a partner's progress Δ with the node's own, so it needs protocol.snapshot =
    # "phi_delta": a θ-only snapshot carries no Δ, and a manifest asking for both is refused.
    min_alignment_sigmas: float = spec(0.0, "NoLoCo: refuse a snapshot whose progress Δ has a "
                                       "cosine with the node's own below this many standard "
                                       "deviations of random noise (0: off; refuses honest "
                                       "peers at a plateau; needs protocol.snapshot = "
                                       "phi_delta)", min=0.0, max=1e4)
    # The plausible-noise check (node/rounds/noise_check.py): measured in benchmarks/NOTEBOOK.md
    # ("The plausible-noise adversary: a defence").
    noise_ratio: float = spec(0.1, "refuse a contribution whose magnitudes follow this node's own "
                              "progress less than this fraction of the median of the swarm's "
                              "recent contributions, or no better than random noise (0: off)",
                              min=0.0, max=1.0)
    # How far one NoLoCo pairing may pull a node (protocol/pull_bound.py): a partner's θ further
    # from the node's own than these multiples of m (the lower median of its other recent
    # partners' latest distances, at least its own progress norm) is clipped to pull_clip_ratio·m, or refused past
    # pull_refuse_ratio·m. Measured in benchmarks/RESULTS.md ("What does an adversary cost").
    pull_clip_ratio: float = spec(2.0, "NoLoCo θ snapshots: clip a partner's θ to this multiple of "
                                  "the median distance of other recent partners (at least this node's "
                                  "own progress norm) from this node's θ (0: off)", min=0.0, max=1e6)
    pull_refuse_ratio: float = spec(5.0, "NoLoCo θ snapshots: refuse a partner's θ further than "
                                    "this multiple of that median distance (at least "
                                    "pull_clip_ratio)", min=1.0, max=1e6)
    ban_after: int = spec(3, "refused contributions before a peer is banned", min=1, max=1000)
    ban_seconds: float = spec(600.0, "how long a ban lasts", min=0.0, max=1e7)


@dataclass
class Manifest:
    swarm: SwarmSection = field(default_factory=SwarmSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    protocol: ProtocolSection = field(default_factory=ProtocolSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    admission: AdmissionSection = field(default_factory=AdmissionSection)
    contributions: ContributionSection = field(default_factory=ContributionSection)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def defaults(self) -> dict[str, Any]:
        """`to_dict()` of a manifest of the same section types with every key at its default."""
        return {f.name: asdict(type(getattr(self, f.name))()) for f in fields(self)}

    def agreed(self) -> dict[str, Any]:
        """What every member must share (the module's rule): {"schema": "<protocol>/<n>", and per
        section the keys the protocol reads whose values differ from its defaults}."""
        name = self.protocol.name
        values, defaults = read_by(name, self.to_dict()), read_by(name, self.defaults())
        if values["data"].get("shards_digest"):  # the content is pinned: where it lies is local
            del values["data"]["path"], defaults["data"]["path"]
        agreed: dict[str, Any] = {"schema": schema_tag(name)}
        for section, keys in values.items():
            changed = {key: value for key, value in keys.items() if value != defaults[section][key]}
            if changed:
                agreed[section] = changed
        return agreed

    @property
    def digest(self) -> str:
        return digest_of(self.agreed())


# ---------------------------------------------------------------- what the digest covers
# A protocol's schema version: bump it when one of the defaults it reads changes (module doc).
SCHEMA_VERSIONS = {"noloco": 1, "dilocox": 2}
# Keys of a section one protocol alone reads; every key not named here is read by both, so a
# new key enters both protocols' digests (when a file sets it) until it is named here.
READ_ONLY_BY: dict[str, dict[str, tuple[str, ...]]] = {
    "noloco": {
        "protocol": ("momentum", "progress_weight", "consensus_weight", "timing", "pair_deadline_s",
                     "max_swap_rounds", "wire_dtype", "wire_rounding", "snapshot"),
        "contributions": ("min_alignment_sigmas",),
    },
    "dilocox": {
        "protocol": ("outer_lr", "outer_momentum", "delay", "codec", "rank", "bits", "power_iterations",
                     "topk_k", "topk_chunk", "topk_bits", "overlap", "apply_on_arrival",
                     "residual_decay", "clip_to_median", "noise_filter", "controller",
                     "controller_energy_target", "controller_energy_high", "controller_send_budget",
                     "max_density", "fan_out", "senders", "senders_tenure", "kept_decay",
                     "message_deadline_s"),
    },
}
NOT_AGREED = {"swarm": ("description",), "train": NODE_LOCAL_TRAIN_KEYS}  # and the network section


def schema_tag(protocol: str) -> str:
    return f"{protocol}/{SCHEMA_VERSIONS[protocol]}"


def read_by(protocol: str, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The sections and keys of a manifest's `to_dict()` that `protocol` reads and members agree on."""
    others = [READ_ONLY_BY[other] for other in READ_ONLY_BY if other != protocol]
    skipped = {section: set(NOT_AGREED.get(section, ())).union(*(o.get(section, ()) for o in others))
               for section in values}
    return {section: {key: value for key, value in keys.items() if key not in skipped[section]}
            for section, keys in values.items() if section != "network"}


def canonical_json(agreed: dict[str, Any]) -> str:
    return json.dumps(agreed, sort_keys=True, separators=(",", ":"))


def digest_of(agreed: dict[str, Any]) -> str:
    """The manifest digest of an `agreed()` dict (ours, or one a peer published)."""
    return hashlib.blake2b(canonical_json(agreed).encode(), digest_size=16).hexdigest()


def _with_defaults(agreed: dict[str, Any]) -> dict[str, Any]:
    """An `agreed()` dict with the keys left out at their defaults filled in, where it is of
    one of this release's schema versions (otherwise as it is: its defaults are unknown here)."""
    tag = agreed.get("schema")
    protocol = next((name for name in SCHEMA_VERSIONS if schema_tag(name) == tag), None)
    if protocol is None:
        return agreed
    full: dict[str, Any] = read_by(protocol, Manifest().defaults())
    for section, keys in agreed.items():
        full[section] = {**full[section], **keys} if isinstance(keys, dict) and section in full else keys
    return full


def check_snapshot(protocol: ProtocolSection, contributions: ContributionSection) -> None:
    """NoLoCo's protocol.snapshot against the keys it depends on; ConfigError in one sentence.

    "theta" sends θ alone, which is exact only with β = γ, and carries no progress Δ for the
    alignment check to compare; "phi_delta" fits every setting. The pull bound's refusal
    ratio may not lie below its clipping ratio.
    """
    if 0 < contributions.pull_refuse_ratio < contributions.pull_clip_ratio:
        raise ConfigError(f"manifest key 'contributions.pull_refuse_ratio' = "
                          f"{contributions.pull_refuse_ratio} is below pull_clip_ratio = "
                          f"{contributions.pull_clip_ratio}: a partner would be refused before "
                          f"it could be clipped; raise it to at least pull_clip_ratio")
    if protocol.name != "noloco" or protocol.snapshot != "theta":
        return
    if protocol.progress_weight != protocol.consensus_weight:
        raise ConfigError(f"manifest key 'protocol.snapshot' = 'theta' needs progress_weight = "
                          f"consensus_weight, but they are {protocol.progress_weight} and "
                          f"{protocol.consensus_weight}: set protocol.snapshot = 'phi_delta'")
    if contributions.min_alignment_sigmas > 0:
        raise ConfigError("manifest key 'contributions.min_alignment_sigmas' > 0 compares a "
                          "partner's progress Δ, which protocol.snapshot = 'theta' does not send: "
                          "set protocol.snapshot = 'phi_delta' or min_alignment_sigmas = 0")


def check_topk(protocol: ProtocolSection) -> None:
    """The topk codec's k must fit its chunk and the density bound every member decodes to."""
    if protocol.topk_k > protocol.topk_chunk or protocol.topk_k > protocol.max_density * protocol.topk_chunk:
        raise ConfigError(f"manifest key 'protocol.topk_k' = {protocol.topk_k} exceeds "
                          f"min(topk_chunk, max_density * topk_chunk) = "
                          f"{min(protocol.topk_chunk, protocol.max_density * protocol.topk_chunk):g}: "
                          "lower topk_k or raise max_density")


def _validate(manifest: Manifest) -> Manifest:
    check_snapshot(manifest.protocol, manifest.contributions)
    check_topk(manifest.protocol)
    if not SWARM_ID.match(manifest.swarm.id):
        raise ConfigError(f"manifest key 'swarm.id' = {manifest.swarm.id!r} is not a valid "
                          f"swarm id: use lowercase letters, digits, '-' and '_' (1-63 chars)")
    if manifest.admission.mode == "allowlist" and not manifest.admission.public_keys:
        raise ConfigError("manifest key 'admission.public_keys' is empty but admission.mode = "
                          "'allowlist': list the members' peer ids or use mode = 'open'")
    return manifest


def load_manifest(path: str | Path, overrides: dict[str, Any] | None = None) -> Manifest:
    return _validate(build_config([read_toml(Path(path)), overrides or {}], Manifest))


def manifest_from_dict(values: dict[str, Any]) -> Manifest:
    """A manifest received from a peer: validated exactly like a file."""
    if not isinstance(values, dict):
        raise ConfigError(f"a manifest must be a table of sections, got {type(values).__name__}")
    return _validate(build_config([values], Manifest))


def find_manifest(swarm_id: str) -> Path:
    """configs/swarms/<id>.toml, or a sentence saying which swarms exist."""
    path = SWARM_DIR / f"{swarm_id}.toml"
    if not SWARM_ID.match(swarm_id) or not path.is_file():
        known = ", ".join(sorted(p.stem for p in SWARM_DIR.glob("*.toml"))) or "none"
        raise ConfigError(f"no manifest for swarm '{swarm_id}' in {SWARM_DIR} (known: {known}): "
                          f"use --manifest PATH for a private swarm, or `lowcomm-node init-swarm`")
    return path


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The dotted names of fields whose values differ between two `agreed()` dicts, defaults
    filled in, e.g. ['protocol.inner_steps (50 here vs 20 there)'] (and 'schema' first where
    the schema versions differ)."""
    return _dict_differences(_with_defaults(ours), _with_defaults(theirs), "")


def _dict_differences(ours: dict[str, Any], theirs: dict[str, Any], prefix: str) -> list[str]:
    found = []
    for key in sorted(set(ours) | set(theirs), key=lambda key: (key != "schema", key)):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found.extend(_dict_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            found.append(f"{prefix}{key} ({a!r} here vs {b!r} there)")
    return found


def write_manifest(manifest: Manifest, path: Path) -> Path:
    _validate(manifest)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# Swarm manifest for '{manifest.swarm.id}'. Every member must use the same values\n"
              f"# (bootstrap peers excepted); digest {manifest.digest}.\n\n")
    path.write_text(header + to_toml(manifest.to_dict()), encoding="utf-8")
    return path
