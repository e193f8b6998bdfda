"""The engine paths the trust tests knock on (NEW-3): vLLM's routes in and beyond /v1, and one no vLLM
has yet. Each must ask for the engine key; only GET /health and /metrics stay open, for probes."""

from __future__ import annotations

ENGINE_PATHS: list[tuple[str, str]] = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/pooling"),
    ("POST", "/score"),
    ("POST", "/classify"),
    ("POST", "/rerank"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/load_lora_adapter"),
    ("GET", "/version"),
    ("GET", "/no-such-route-yet"),
]
OPEN_PATHS = ("/health", "/metrics")
WRONG_KEY = "0" * 64

# Run inside a pod (the router's image has Python): argv = base URL, key ("" for none), then
# "METHOD PATH" items; prints {item: status or the error's type} as JSON.
STATUS_SCRIPT = """\
import json, sys, urllib.error, urllib.request
base, key, out = sys.argv[1], sys.argv[2], {}
for item in sys.argv[3:]:
    method, path = item.split(" ", 1)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    data = b'{"model": "tiny-llama", "prompt": "hi"}' if method == "POST" else None
    request = urllib.request.Request(base + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            out[item] = answer.status
    except urllib.error.HTTPError as error:
        out[item] = error.code
    except OSError as error:
        out[item] = type(error).__name__
print(json.dumps(out))
"""

# Run inside a pod: connect to argv[1]:argv[2], send a JSON "offer" as the side channel's first bytes
# (no hello), read until the close; prints what came back and whether the peer closed.
FORGED_OFFER_SCRIPT = """\
import json, socket, sys
offer = json.dumps({"type": "offer", "transfer_id": "forged", "spans": [[0, 1 << 30]]}).encode()
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10) as sock:
    sock.sendall(len(offer).to_bytes(4, "big") + offer)
    got, closed = b"", False
    try:
        while chunk := sock.recv(65536):
            got += chunk
        closed = True
    except TimeoutError:
        pass
    except OSError:  # reset: closed too
        closed = True
print(json.dumps({"answer": got.decode("latin-1"), "closed": closed}))
"""
