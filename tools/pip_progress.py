"""Filters `pip install --progress-bar raw` into a log a person can follow in CI.

pip prints nothing while a large wheel (torch, vllm) downloads when stdout is not a terminal; its raw
mode prints every chunk instead. This keeps each package's name and size, and one line per quarter of
a download that takes long enough to matter, so a cold install shows life without flooding the log.
"""

import re
import sys

_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_KEEP = ("Downloading", "Installing", "Successfully", "ERROR", "error:")
_BIG = 20 << 20


def main() -> None:
    shown = -1
    for raw in sys.stdin:
        line = raw.rstrip()
        match = _PROGRESS.match(line)
        if match:
            done, total = int(match.group(1)), int(match.group(2))
            quarter = 4 * done // total if total else 4
            if total >= _BIG and quarter > shown:
                shown = quarter
                print(f"    {done >> 20} of {total >> 20} MiB", flush=True)
            continue
        if line.lstrip().startswith(_KEEP):
            shown = -1
            print(f"  {line.strip()}", flush=True)


if __name__ == "__main__":
    main()
