"""A dense test reward: the fraction of a response's characters that are digits (groups almost never tie, so a
step has non-zero advantages and the weights move)."""


async def digits(sample) -> float:
    return sum(c.isdigit() for c in sample.response) / max(1, len(sample.response))
