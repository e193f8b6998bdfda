"""API-server error text without the values it quotes (review L6).

An invalid object's error quotes the offending value ("env[0].value: Invalid value: \\"s3cr3t\\": ..."),
and the operator copies such messages into Events and status, which more people can read than the CR.
The field path and the reason stay; the quoted value goes.
"""

from __future__ import annotations

import re

REDACTED = "(redacted)"
# A reason the API server follows with the value, then the value: a JSON string or a bare token.
_QUOTED_VALUE = re.compile(
    r"(?P<reason>(?:Invalid|Unsupported|Duplicate|Forbidden|Not found) value: )"
    r"(?P<value>\"(?:[^\"\\]|\\.)*\"|[^\s:,]+)"
)


def redact_values(message: str) -> str:
    return _QUOTED_VALUE.sub(lambda match: match.group("reason") + REDACTED, message)
