"""Command line of the local control plane + real node (make cluster-up / cluster-down / cluster-env)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from e2e.cluster import controlplane as cp
from e2e.cluster import node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start (or reuse) the control plane")
    up.add_argument("--nodes", type=int, default=2, help="fake GPU nodes (default 2)")
    sub.add_parser("down", help="stop everything, free every port")
    sub.add_parser("env", help="print shell exports (KUBECONFIG, PATH); never builds or starts")
    sub.add_parser("status", help="which components run")
    load = sub.add_parser(
        "load-image", help="import an OCI or docker archive into the real node's containerd"
    )
    load.add_argument("archive", help="archive path, or - to stream it from stdin")
    restart = sub.add_parser("restart", help="restart one component")
    restart.add_argument("component", choices=cp.COMPONENTS)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            cp.up(args.nodes)
        elif args.command == "down":
            cp.down()
        elif args.command == "env":
            sys.stdout.write(cp.env_exports())
        elif args.command == "status":
            layout = cp.Layout.from_env()
            for component in cp.COMPONENTS:
                state = "running" if component in cp.running_components(layout) else "stopped"
                print(f"{component:24} {state}")
            for component in node.COMPONENTS:
                pid = cp.read_pid(layout, component)
                print(f"{component:24} {'running' if pid and cp.pid_alive(pid) else 'stopped'}")
        elif args.command == "load-image":
            sys.stdout.write(node.load_image(None if args.archive == "-" else Path(args.archive)))
        else:
            cp.restart_component(cp.Layout.from_env(), args.component)
    except cp.ClusterError as error:
        print(f"cluster: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
