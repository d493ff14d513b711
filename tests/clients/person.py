"""The structured result the client tests ask for: bounded fields, so that any model ends it.
Pydantic only: the client scripts in their own virtualenvs import it too."""

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    member: bool
