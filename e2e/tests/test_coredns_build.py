"""The real node's CoreDNS links exactly the plugins its Corefile uses (e2e/cluster/coredns/main.go).

A directive whose plugin is not linked stops CoreDNS at start ("unknown directive"), and Service names
stop resolving in every pod; this says which one long before the node tier would.
"""

from __future__ import annotations

import re
from pathlib import Path

from e2e.cluster.nodeconfig import COREFILE

MAIN_GO = Path(__file__).resolve().parents[1] / "cluster" / "coredns" / "main.go"


def corefile_directives(corefile: str) -> set[str]:
    """The first word of each line directly inside a server block (nested blocks are a plugin's options)."""
    directives: set[str] = set()
    depth = 0
    for line in corefile.splitlines():
        words = line.split()
        if depth == 1 and words and words[0] != "}":
            directives.add(words[0])
        depth += line.count("{") - line.count("}")
    return directives


def linked_plugins(main_go: str) -> set[str]:
    return set(re.findall(r'"github\.com/coredns/coredns/plugin/(\w+)"', main_go))


def test_the_corefile_parser_sees_each_directive_once_and_no_option() -> None:
    corefile = ".:53 {\n    errors\n    kubernetes cluster.local {\n        pods insecure\n    }\n}\n"
    assert corefile_directives(corefile) == {"errors", "kubernetes"}


def test_coredns_links_each_plugin_the_corefile_names_and_no_other() -> None:
    assert linked_plugins(MAIN_GO.read_text()) == corefile_directives(COREFILE)
