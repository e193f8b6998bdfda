"""Annotated field types that the contract, the operator's API and the router's messages share."""

from typing import Annotated

from pydantic import Field, StringConstraints

Port = Annotated[int, Field(ge=1, le=65535)]
PositiveInt = Annotated[int, Field(ge=1)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonEmpty = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
