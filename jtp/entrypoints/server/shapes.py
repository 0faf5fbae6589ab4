"""Request shapes checked with pydantic (the Anthropic Messages and OpenAI Responses bodies): the
most specific problem becomes a 400 naming the field's path, as the hand-checked OpenAI bodies do."""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic

from jtp.entrypoints.server.errors import APIError

Body = TypeVar("Body", bound="Shape")


class Shape(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore")  # fields this server does not use pass, as clients expect


def parse_body(shape: type[Body], body: Any) -> Body:
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return shape.model_validate(body)
    except pydantic.ValidationError as e:
        # A union's value fails once per branch: the deepest failure is the branch the client meant
        # (an unsupported image source, not "content.str: Input should be a valid string").
        first = max(e.errors(), key=lambda error: len(error["loc"]))
        # without pydantic's union-branch labels ("list[union[TextBlock,...]]"), which name no field
        where = ".".join(str(p) for p in first["loc"] if "[" not in str(p))
        raise APIError(f"{where}: {first['msg']}", param=str(first["loc"][0]) if first["loc"] else None) from None
