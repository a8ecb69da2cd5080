"""An agent written against an OpenAI-style chat client, trained by rollover as it is.

`examples/arith_agent.yaml` trains it (`env.name: agent`): each episode calls `retry_agent` with
a client answered by the policy, and the number it returns is the episode's reward. The same
function runs against any OpenAI-compatible server:

    from openai import AsyncOpenAI
    await retry_agent(AsyncOpenAI(base_url="http://localhost:8000/v1", api_key="-"), prompt)
"""

import re


def last_integer(text: str) -> int | None:
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


async def retry_agent(client, prompt, max_attempts: int = 3, attempt_penalty: float = 0.3):
    """Ask the question; on a wrong answer say so and ask again. 1 for a right first answer,
    less `attempt_penalty` per retry, 0 after `max_attempts` wrong ones."""
    messages = [{"role": "user", "content": f"{prompt.text} Answer with just the number."}]
    for attempt in range(max_attempts):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content
        if last_integer(answer) == int(prompt.answer):
            return {"reward": max(0.0, 1.0 - attempt_penalty * attempt), "attempts": attempt + 1}
        feedback = "Please answer with a number." if last_integer(answer) is None else "That is not right. Try again."
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    return {"reward": 0.0, "attempts": max_attempts}
