"""A site domain for the real-tokenizer tests (named in a config as `bpe_domains:make_domain`).

`digits`: chat-message prompts ("Reply with a number."), up to 4 tokens per action, reward 1
when the action holds a digit; a miss gets a feedback turn and one more try (reward 1/2). With
an 8k byte-level BPE vocabulary an untrained model holds a digit in ~10% of its actions, which
is what a group-relative policy gradient needs to climb from.
"""

from __future__ import annotations

from hpcrl.rl.domains import ActionSpec, Domain, Environment, StepResult, Task


class DigitsEnv(Environment):
    def __init__(self, task: Task):
        self.task, self.turn = task, 0

    def reset(self):
        self.turn = 0
        return self.task.prompt

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if any(c.isdigit() for c in action):
            return StepResult("", 1.0 / self.turn, True, {})
        if self.turn >= 2:
            return StepResult("", 0.0, True, {})
        return StepResult(f"No digits in {action!r}. A number, please:", 0.0, False, {})


class DigitsDomain(Domain):
    def __init__(self, name: str):
        self.name = name
        self.action = ActionSpec(max_tokens=6)

    def task(self, index: int) -> Task:
        topic = ("apples", "cars", "days", "ßtraße", "日本")[index % 5]
        messages = ({"role": "user", "content": f"How many {topic}? Reply with a number."},)
        return Task(self.name, str(index), messages, {})

    def make_env(self, task, executor=None):
        return DigitsEnv(task)


def make_domain(name: str) -> Domain:
    return DigitsDomain(name)
