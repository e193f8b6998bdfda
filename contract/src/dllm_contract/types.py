"""Annotated field types that the contract, the operator's API and the router's messages share."""

from typing import Annotated

from pydantic import Field

Port = Annotated[int, Field(ge=1, le=65535)]
