"""What agents and frameworks built on the OpenAI API do, against the real server and model:
LangChain (chat, streaming, structured output, tool calls), LiteLLM (its `openai/` provider,
streamed and not) and the OpenAI Agents SDK (an agent loop that calls a function tool and
answers from its result)."""
import pydantic

MODEL = "smol"
KEY = "unused"


class City(pydantic.BaseModel):
    name: str
    country: str


def test_langchain_chat_stream_structured_output_and_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=KEY, temperature=0, max_tokens=24)
    reply = llm.invoke("What is the capital of Germany?")
    assert reply.content and reply.response_metadata["finish_reason"] in ("stop", "length")
    assert "".join(c.content for c in llm.stream("Say hello.")) != ""
    city = llm.with_structured_output(City).invoke("Name a city in France.")
    assert isinstance(city, City) and city.name

    @tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    assert isinstance(called.tool_calls[0]["args"].get("city"), str)


def test_litellm_openai_provider(server):
    import litellm

    kw = dict(model="openai/" + MODEL, api_base=server.url + "/v1", api_key=KEY, temperature=0, max_tokens=16,
              messages=[{"role": "user", "content": "Say hello."}])
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw))
    assert streamed == text


def test_openai_agents_sdk_tool_loop(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from agents import set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY))
    agent = Agent(name="weather", instructions="Answer with the tool's result.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64),
                  reset_tool_choice=True)
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4, run_config=RunConfig(tracing_disabled=True))
    # Turn 1 called the tool (forced), turn 2 sent its result back (an assistant message with
    # `content: null` and `tool_calls`, then a `tool` message) and got a final answer.
    assert calls, result
    assert isinstance(result.final_output, str) and result.final_output
