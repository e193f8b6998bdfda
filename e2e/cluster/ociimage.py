"""Writes a single-layer OCI image archive (an OCI image layout in a tar) from local files, no registry.

`ctr -n k8s.io images import` reads it and names the image by the index's io.containerd.image.name.
    python3 ociimage.py OUT.tar NAME --file SRC:PATH_IN_IMAGE ... --entrypoint /prog [--arg A ...]
Standard library only: build.sh runs it with any python3. Output is deterministic (mtime 0, root owner).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import tarfile
from pathlib import Path

MEDIA = "application/vnd.oci.image"


def _info(name: str, size: int, mode: int, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type, info.mtime = size, mode, kind, 0
    return info


def layer_tar(files: list[tuple[Path, str]]) -> bytes:
    """A layer holding each source file at its path (mode 0755) plus empty /etc and /tmp."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory, mode in (("etc", 0o755), ("tmp", 0o1777)):
            tar.addfile(_info(directory + "/", 0, mode, tarfile.DIRTYPE))
        for source, target in files:
            data = source.read_bytes()
            tar.addfile(_info(target.lstrip("/"), len(data), 0o755), io.BytesIO(data))
    return out.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tar.addfile(_info(f"blobs/sha256/{digest[7:]}", len(data), 0o644), io.BytesIO(data))
    return digest


def write_image(out: Path, name: str, files: list[tuple[Path, str]], entrypoint: list[str]) -> None:
    layer = layer_tar(files)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
        tar.addfile(_info("oci-layout", len(layout), 0o644), io.BytesIO(layout))
        layer_digest, config_digest = _blob(tar, layer), _blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": f"{MEDIA}.manifest.v1+json",
            "config": {
                "mediaType": f"{MEDIA}.config.v1+json",
                "digest": config_digest,
                "size": len(config_bytes),
            },
            "layers": [{"mediaType": f"{MEDIA}.layer.v1.tar", "digest": layer_digest, "size": len(layer)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "mediaType": f"{MEDIA}.index.v1+json",
            "manifests": [{
                "mediaType": f"{MEDIA}.manifest.v1+json", "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": name,
                                "org.opencontainers.image.ref.name": name.rpartition(":")[2]},
            }],
        }  # fmt: skip
        index_bytes = json.dumps(index, sort_keys=True).encode()
        tar.addfile(_info("index.json", len(index_bytes), 0o644), io.BytesIO(index_bytes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path)
    parser.add_argument("name", help="full image name, e.g. localhost/dllm/pause:1")
    parser.add_argument("--file", action="append", default=[], help="SRC:PATH_IN_IMAGE")
    parser.add_argument("--entrypoint", required=True)
    parser.add_argument("--arg", action="append", default=[], help="appended to the entrypoint")
    args = parser.parse_args(argv)
    files = [(Path(src), dst) for src, _, dst in (spec.rpartition(":") for spec in args.file)]
    write_image(args.out, args.name, files, [args.entrypoint, *args.arg])


if __name__ == "__main__":
    main()
