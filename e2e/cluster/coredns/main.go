// Command coredns is CoreDNS with only the plugins the real node's Corefile uses (e2e/cluster/nodeconfig.py):
// the release build links every plugin, cloud providers' SDKs included, which took most of its build time.
// The plugins register themselves when imported; coremain reads the Corefile and runs the server.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() { coremain.Run() }
