"""The first problem pydantic found in a settings model, as a setting's error message names it."""

from __future__ import annotations

from pydantic import ValidationError


def first_problem(error: ValidationError) -> tuple[str, str]:
    """The field of the first problem ("" for the model as a whole) and what is wrong with it; a
    validator's own words lose pydantic's "Value error, " prefix."""
    problem = error.errors()[0]
    field = str(problem["loc"][0]) if problem["loc"] else ""
    return field, problem["msg"].removeprefix("Value error, ")
