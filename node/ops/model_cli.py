"""The data and model commands: `prepare-data`, `export`, `generate` and `perplexity`.

Each parses, checks, then hands off to node/data/prepare.py, node/ops/export.py or
node/ops/generate.py. They need the `hf` extra (tokenizers, safetensors); the daemon does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from node.config.schema import ConfigError


class RichProgress:
    """prepare-data's progress bar (on stderr), one bar per phase; plain lines off a terminal."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description:<20}"), BarColumn(),
                                 DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=self.console, disable=not self.console.is_terminal)
        self.task = None

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def start(self, phase: str, total: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, completed=self.progress.tasks[self.task].total)
        self.task = self.progress.add_task(phase, total=total)
        if not self.console.is_terminal:
            print(f"prepare-data: {phase} ({total:,} bytes)", file=sys.stderr, flush=True)

    def advance(self, amount: int) -> None:
        self.progress.advance(self.task, amount)


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from node.data.prepare import PrepareSettings, prepare
    from node.data.sources import SourceSpec
    if args.stdlib and (args.input or args.json_field):
        raise ConfigError("--stdlib reads the embedded corpus: give it without --input and "
                          "--json-field")
    settings = PrepareSettings(
        out=Path(args.out), tokenizer=Path(args.tokenizer) if args.tokenizer else None,
        sources=SourceSpec(tuple(Path(p) for p in args.input), args.json_field, args.stdlib),
        vocab_size=args.vocab_size, dtype=args.dtype, val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens)
    try:
        with RichProgress() as progress:
            index = prepare(settings, progress)
    except KeyboardInterrupt:
        print("lowcomm-node: prepare-data interrupted; the shards written so far are kept: run "
              "the same command again to resume", file=sys.stderr)
        return 130
    splits = index["splits"]
    tokens = {s: sum(e["tokens"] for e in splits[s]["shards"]) for s in splits}
    tok = index["tokenizer"]
    print(f"prepared {args.out}: {tokens['train']:,} train / {tokens['val']:,} validation tokens "
          f"in {len(splits['train']['shards'])} + {len(splits['val']['shards'])} {index['dtype']} "
          f"shards, vocabulary {tok['vocab_size']:,}")
    print(f"tokenizer digest {tok['digest']}\nshards digest    {index['shards_digest']}")
    print(f"pin them in a swarm: lowcomm-node init-swarm --id ID --data {args.out} "
          f"(sets data.source, path, token_dtype, vocab_size and both digests)")
    return 0


def _model_source(args: argparse.Namespace):
    from node.config.manifest import find_manifest, load_manifest
    from node.ops.model_source import ModelSource, load_model_source
    manifest = None
    if args.swarm or args.manifest:
        if args.swarm and args.manifest:
            raise ConfigError("give --swarm ID or --manifest PATH, not both")
        manifest = load_manifest(args.manifest or find_manifest(args.swarm))

    def path(name: str) -> Path | None:
        return Path(getattr(args, name)) if getattr(args, name, None) else None

    return load_model_source(ModelSource(
        checkpoint=path("checkpoint"), data_dir=path("data_dir"), export=path("export"),
        manifest=manifest, weights=args.weights, tokenizer=path("tokenizer")))


def cmd_export(args: argparse.Namespace) -> int:
    from node.ops.export import export_model
    loaded = _model_source(args)
    out = export_model(loaded, Path(args.out), args.dtype, args.force)
    print(f"exported {loaded.description} to {out} ({args.dtype}); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from node.ops.generate import SamplingSettings, sample
    from node.ops.model_source import load_source_tokenizer
    loaded = _model_source(args)
    tokenizer = load_source_tokenizer(loaded)
    prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    settings = SamplingSettings(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    if settings.temperature < 0 or settings.top_k < 0 or settings.max_new_tokens < 1:
        raise ConfigError("--temperature and --top-k must be >= 0 and --max-new-tokens >= 1")
    new = sample(loaded.build(), prompt, settings)
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=False))
    return 0


def cmd_perplexity(args: argparse.Namespace) -> int:
    from node.ops.generate import held_out_ids, perplexity
    from node.ops.model_source import load_source_tokenizer
    loaded = _model_source(args)
    tokenizer = load_source_tokenizer(loaded)
    ids = held_out_ids(Path(args.file), tokenizer, loaded.vocab_size)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    context = args.context or (loaded.data.seq_len if loaded.data else loaded.model_cfg.max_seq_len)
    result = perplexity(loaded.build(), ids, context)
    if args.json:
        print(json.dumps({"file": args.file, "tokens": result.tokens, "context": context,
                          "mean_nll": result.mean_nll, "perplexity": result.perplexity}))
    else:
        print(f"{args.file}: perplexity {result.perplexity:.3f} (mean loss {result.mean_nll:.4f} "
              f"nats/token over {result.tokens:,} tokens, context {context})")
    return 0


def _source_arguments(parser: argparse.ArgumentParser, export_ok: bool) -> None:
    group = parser.add_argument_group("the model")
    group.add_argument("--checkpoint", metavar="FILE", help="a checkpoint file (ckpt-*.pt)")
    group.add_argument("--data-dir", metavar="DIR", help="a node's data directory: its newest "
                       "readable checkpoint")
    if export_ok:
        group.add_argument("--export", metavar="DIR", help="a directory written by export")
    group.add_argument("--swarm", metavar="ID", help="a swarm node's checkpoint: its manifest "
                       "configs/swarms/<ID>.toml (gives the model's shape)")
    group.add_argument("--manifest", metavar="PATH", help="or its manifest file")
    group.add_argument("--weights", choices=("outer", "theta"), default="outer",
                       help="a swarm node's outer weights φ (NoLoCo's slow weights, DiLoCoX's "
                       "agreed state; default) or its fast weights θ")
    group.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json instead of the one "
                       "the model's data names")


def add_model_commands(sub) -> None:
    prep = sub.add_parser(
        "prepare-data", help="tokenize text files, directories or JSON lines into token shards",
        description="Read text files, directories of them, or JSON lines (--json-field), train "
                    "a byte-level BPE on the training split (--vocab-size) or use a given "
                    "tokenizer.json, and write uint16/uint32 token shards with a train/"
                    "validation split, digests, and dataset.json. Interrupted, it resumes "
                    "where it stopped when run again with the same arguments.")
    prep.add_argument("--input", metavar="PATH", action="append", default=[],
                      help="a text file, a directory of them, or with --json-field a JSON lines "
                      "file (repeatable)")
    prep.add_argument("--stdlib", action="store_true",
                      help="the embedded corpus: this interpreter's standard library source")
    prep.add_argument("--json-field", metavar="FIELD",
                      help="read every input as JSON lines, the text in this field")
    prep.add_argument("--out", required=True, metavar="DIR", help="where the shards go")
    prep.add_argument("--vocab-size", type=int, default=0, metavar="N",
                      help="train a byte-level BPE of N tokens on the inputs' training split")
    prep.add_argument("--tokenizer", metavar="PATH", help="or use this tokenizer.json")
    prep.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                      help="token dtype of the shards (auto: uint16 up to 65,536 tokens)")
    prep.add_argument("--val-fraction", type=float, default=0.02, metavar="F",
                      help="share of documents held out for validation, by key hash (0.02)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24, metavar="N",
                      help="a shard ends at the first document end past N tokens (16,777,216)")
    prep.set_defaults(func=cmd_prepare_data)

    export = sub.add_parser(
        "export", help="write a model as a transformers LlamaForCausalLM directory",
        description="Write a node's weights (its newest checkpoint's φ, or θ) or a checkpoint "
                    "file as a directory transformers loads with AutoModelForCausalLM: "
                    "model.safetensors, config.json and the tokenizer.")
    _source_arguments(export, export_ok=False)
    export.add_argument("--out", required=True, metavar="DIR")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    export.add_argument("--force", action="store_true", help="write into a non-empty --out")
    export.set_defaults(func=cmd_export)

    generate = sub.add_parser(
        "generate", help="sample text from a checkpoint or an export",
        description="Continue a prompt with the model (temperature and top-k sampling).")
    _source_arguments(generate, export_ok=True)
    generate.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    generate.add_argument("--max-new-tokens", type=int, default=100, metavar="N")
    generate.add_argument("--temperature", type=float, default=0.8, metavar="T",
                          help="0 takes the most likely token")
    generate.add_argument("--top-k", type=int, default=50, metavar="K", help="0: no cut")
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(func=cmd_generate)

    ppl = sub.add_parser(
        "perplexity", help="a model's perplexity on a held-out file",
        description="exp(mean negative log-likelihood) of a text file (tokenized with the "
                    "model's tokenizer) or a token shard such as val-00000.bin.")
    _source_arguments(ppl, export_ok=True)
    ppl.add_argument("--file", required=True, metavar="PATH")
    ppl.add_argument("--context", type=int, default=0, metavar="N",
                     help="tokens per window (default: the data's seq_len)")
    ppl.add_argument("--max-tokens", type=int, default=0, metavar="N",
                     help="only the file's first N tokens (default: all)")
    ppl.add_argument("--json", action="store_true", help="print one JSON object")
    ppl.set_defaults(func=cmd_perplexity)
