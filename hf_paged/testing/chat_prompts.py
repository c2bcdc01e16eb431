"""Chat prompts for the demo model (``entrypoints/demo_model.py``): the demo, the real-model tests
and the CPU benchmark ask the same questions.

``QUESTIONS`` are 32 short user turns; ``chat_ids`` wraps each in the model's chat template
(SmolLM2's ChatML with its default system turn), giving prompts of about 30 to 300 tokens: some
questions carry a paragraph to work on, so the lengths spread as a real batch's do.
"""

from __future__ import annotations

_PARAGRAPH = (
    "The river town grew up around a stone bridge built in the twelfth century. Merchants "
    "crossed it with wool and salt, and a market square formed on the northern bank. In the "
    "eighteenth century a canal linked the river to the coal fields, and mills rose along the "
    "water. When the railway arrived the canal fell quiet, and today its towpath is a walking "
    "trail that passes the old lock keeper's cottage, now a small museum of local history."
)
_RECIPE = (
    "Mix two cups of flour with a teaspoon of salt. Add one cup of warm water and a spoon of "
    "olive oil, and knead for ten minutes until the dough is smooth. Cover it and let it rest "
    "for an hour. Divide it into four balls, roll each one thin, and cook them one at a time in "
    "a hot dry pan for about a minute on each side, until brown spots appear."
)

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is in one sentence.",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "How do plants make their food?",
    "Name three planets in our solar system.",
    "Why is the sky blue?",
    "Write a short thank-you note to a teacher.",
    "What does a computer's CPU do?",
    "Suggest a name for a friendly robot.",
    "How many days are there in a leap year?",
    "What is photosynthesis? Answer briefly.",
    "Give an example of a renewable energy source.",
    "What is 12 times 11?",
    "Describe the color green to someone who has never seen it.",
    f"Summarize this paragraph in one sentence:\n\n{_PARAGRAPH}",
    f"Repeat this paragraph word for word:\n\n{_PARAGRAPH}",
    f"List the steps of this recipe as a numbered list:\n\n{_RECIPE}",
    f"What is this text about?\n\n{_RECIPE}",
    f"Translate the first sentence of this paragraph into simple English:\n\n{_PARAGRAPH}",
    f"Write a title for this paragraph:\n\n{_PARAGRAPH}\n\n{_RECIPE}",
    "Tell me a fun fact about octopuses.",
    "What should I pack for a day at the beach?",
    "How do you say hello in Spanish?",
    "Write a Python function that returns the square of a number.",
    "What is the boiling point of water at sea level?",
    "Give me a synonym for 'happy'.",
    "Why do we have seasons on Earth?",
    f"Rewrite this recipe for a child:\n\n{_RECIPE}",
    f"Which century is the bridge in this paragraph from?\n\n{_PARAGRAPH}",
    f"Repeat this text, then add one sentence of your own:\n\n{_PARAGRAPH}\n\n{_RECIPE}",
)

# a copy-heavy request: prompt lookup proposes from the prompt, and the answer is the prompt
COPY_QUESTION = f"Repeat this paragraph word for word:\n\n{_PARAGRAPH}"


def chat_text(tokenizer, question: str) -> str:
    """``question`` as one user turn in the model's chat template, ready for the answer."""
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_ids(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    """The token ids of each question in the chat template (no padding)."""
    return [tokenizer(chat_text(tokenizer, q), add_special_tokens=False)["input_ids"]
            for q in questions]  # fmt: skip
