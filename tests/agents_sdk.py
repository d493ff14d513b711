"""The OpenAI Agents SDK as a client, as shipped: one agent with one function tool, on the SDK's
chat or Responses model, run against a tandem gateway (tracing off: it would export to OpenAI)."""

from __future__ import annotations

import asyncio


def run_agent(url: str, model_name: str, api: str, tool, **settings):
    """Runs an agent whose only tool is ``tool`` (a plain function, made a function tool here) on
    ``"Weather in Paris?"``, stopping at the first tool call (two turns at most); its result."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(model=model_name,
                                                                                    openai_client=client)
    agent = Agent(name="weather", instructions="Use the tool.", tools=[function_tool(tool)], model=model,
                  model_settings=ModelSettings(**settings), tool_use_behavior="stop_on_first_tool")
    return asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=2))
