"""`python -m dllm_operator render -f cr.yaml [--format yaml|compose]` and `... run` (the operator)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from dllm_contract import logs
from dllm_operator.api import KIND, SpecInvalid, parse
from dllm_operator.config import ConfigInvalid, OperatorConfig
from dllm_operator.render import render_all
from dllm_operator.render.compose import render_compose


def load_resources(stream: TextIO) -> list[dict[str, Any]]:
    """The DisaggregatedLLM documents of a YAML stream (other kinds, e.g. an HPA, are skipped)."""
    documents = [doc for doc in yaml.safe_load_all(stream) if doc]
    return [doc for doc in documents if isinstance(doc, dict) and doc.get("kind") == KIND]


def render_text(documents: list[dict[str, Any]], output_format: str, config: OperatorConfig) -> str:
    """Everything, or nothing: one invalid resource raises SpecInvalid before any output exists."""
    parsed = [parse(doc) for doc in documents]
    if output_format == "compose":
        return "".join(render_compose(cr, config) for cr in parsed)
    manifests = [m for cr in parsed for m in render_all(cr, config)]
    return yaml.safe_dump_all(manifests, sort_keys=False, width=120)


def render_command(args: argparse.Namespace) -> int:
    source = sys.stdin if args.file == "-" else Path(args.file).open()  # noqa: SIM115 (closed below)
    with source:
        try:
            documents = load_resources(source)
        except yaml.YAMLError as error:
            print(f"{args.file}: not valid YAML: {error}", file=sys.stderr)
            return 2
    if not documents:
        print(f"{args.file}: no {KIND} resource found", file=sys.stderr)
        return 2
    try:
        config = OperatorConfig.from_env()
    except ConfigInvalid as invalid:
        print(f"operator configuration: {invalid}", file=sys.stderr)
        return 2
    try:
        text = render_text(documents, args.format, config)
    except SpecInvalid as invalid:
        for field_error in invalid.errors:
            print(f"{args.file}: {field_error}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dllm_operator")
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="print the child objects of a DisaggregatedLLM file")
    render.add_argument("-f", "--file", required=True, help="a YAML file, or - for stdin")
    render.add_argument("--format", choices=["yaml", "compose"], default="yaml")
    run = sub.add_parser("run", help="run the operator")
    run.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable); default: DLLM_WATCH_NAMESPACES or all",
    )
    run.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    run.add_argument("--health-port", type=int, default=8080, help="/healthz and /metrics port")
    run.add_argument("--health-host", default="0.0.0.0")
    run.add_argument(
        "--no-leader-elect",
        dest="leader_elect",
        action="store_false",
        help="act without holding the leader Lease (one replica only)",
    )
    run.add_argument(
        "--lease-namespace",
        default="",
        help="namespace of the leader Lease (default: "
        "POD_NAMESPACE, else the first watched namespace, else default)",
    )
    run.add_argument("--lease-name", default="dllm-operator")
    run.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then KUBECONFIG)"
    )
    run.add_argument(logs.LOG_LEVEL_FLAG, default="", help=logs.LEVEL_HELP)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "render":
        return render_command(args)
    from dllm_operator.runner import run_operator  # kopf is only imported for `run`

    return run_operator(args)
