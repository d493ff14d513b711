"""Real client libraries, as shipped and with their defaults, against the diffusion model:
LangChain's ``with_structured_output`` (json_schema and function_calling), instructor (TOOLS and
JSON_SCHEMA) and the OpenAI Agents SDK (a function tool with ``tool_choice="required"``, on its
chat and its Responses models) all get valid structured results from a random model, because the
grammar constrains its canvas. Only the diffusion knob that keeps CPU tests short is added.
instructor pins a jiter the newest openai SDK cannot use, so it runs from its own virtualenv
(``make instructor``) as a subprocess: tests/clients/instructor_client.py."""

import json
import subprocess
from typing import Annotated

import pytest
from pydantic import Field

from tests.agents_sdk import run_agent
from tests.clients.person import Person
from tests.integration.stack import REPO

MODEL = "tiny-diffusiongemma"
FAST = {"diffusion": {"max_denoising_steps": 4}}


# Built by `make instructor` (part of `make test`) from constraints/instructor.txt.
INSTRUCTOR_PYTHON = REPO / ".venv-instructor" / "bin" / "python"


def _check(person) -> None:
    assert isinstance(person, Person), person
    assert len(person.name) <= 10 and 0 <= person.age <= 120


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(stack, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=stack.url + "/v1", api_key="unused", max_tokens=400, extra_body=FAST)
    _check(llm.with_structured_output(Person, method=method).invoke("Describe a person."))


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(stack, mode):
    assert INSTRUCTOR_PYTHON.exists(), (f"{INSTRUCTOR_PYTHON} is missing: instructor runs from its own virtualenv; "
                                        "build it with `make instructor` (`make test` does)")
    command = [str(INSTRUCTOR_PYTHON), "-m", "tests.clients.instructor_client", "--base-url", stack.url + "/v1",
               "--model", MODEL, "--mode", mode, "--max-tokens", "400", "--extra-body", json.dumps(FAST)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    _check(Person.model_validate(result["person"]))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_sdk_calls_a_function_tool(stack, api):
    calls = []

    # Bounded arguments, so that any model ends the call.
    def get_weather(city: Annotated[str, Field(max_length=12)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for the next days."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    result = run_agent(stack.url, MODEL, api, get_weather, tool_choice="required", parallel_tool_calls=False,
                       max_tokens=300, extra_body=FAST)
    assert len(calls) >= 1, result
    city, days = calls[0]
    assert isinstance(city, str) and len(city) <= 12 and isinstance(days, int) and 1 <= days <= 7
    assert result.final_output == f"sunny in {city} for {days} days"
    assert json.dumps(result.final_output)
