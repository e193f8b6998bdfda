"""API-server messages lose the values they quote before they reach Events or status (review L6)."""

from __future__ import annotations

import pytest

from dllm_operator.redact import REDACTED, redact_values


@pytest.mark.parametrize(
    ("message", "secret"),
    [
        (
            (
                'StatefulSet.apps "x" is invalid: spec.template.spec.containers[0].env[3].value: '
                'Invalid value: "hunter2-\\"quoted\\"": must be no more than 63 characters'
            ),
            'hunter2-\\"quoted\\"',
        ),
        (
            'spec.template.spec.restartPolicy: Unsupported value: "Sometimes": supported values: "Always"',
            "Sometimes",
        ),
        ("spec.replicas: Invalid value: -3: must be greater than or equal to 0", "-3"),
        ('metadata.labels: Invalid value: "tok=abc": a valid label must be ...', "tok=abc"),
    ],
)
def test_quoted_values_are_redacted_and_the_field_path_stays(message: str, secret: str) -> None:
    redacted = redact_values(message)
    assert secret not in redacted
    assert REDACTED in redacted
    assert redacted.split(":", 1)[0] == message.split(":", 1)[0]


def test_a_message_without_values_is_unchanged() -> None:
    message = 'Service "x-router" is invalid: spec.ports: Required value'
    assert redact_values(message) == message
