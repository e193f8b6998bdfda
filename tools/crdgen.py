"""Writes crds/disaggregatedllms.disagg.dev.yaml, the CRD users apply, from the typed model
(dllm_operator.crd turns operator/src/dllm_operator/api/ into it). The file is committed, reviewed and
shipped (chart, kubectl); a test fails if it differs from what the model gives. Run: `make crds`.
"""

from __future__ import annotations

from pathlib import Path

from dllm_operator.crd import NAME, render

OUT = Path(__file__).resolve().parents[1] / "crds" / f"{NAME}.yaml"

if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
