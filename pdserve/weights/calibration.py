"""The default calibration text of `pdserve quantize`: short, varied, written for pdserve.

Static activation scales are the largest |input| each linear layer sees, so the text should
reach the ranges of real use: prose, dialogue, lists, numbers, code, and chat-formatted turns
(an instruct model's inputs start with its template's special tokens, whose activations are
often the largest of all). `calibration_sequences` wraps the chat turns in the model's own
template when it has one.
"""
from __future__ import annotations

PROSE = [
    "The lighthouse keeper climbed the stairs every evening at six. There were one hundred and "
    "twelve steps, and he counted them aloud, because the counting kept his mind from the wind. "
    "At the top he trimmed the wick, polished the great lens with a soft cloth, and wrote the "
    "weather in a small green book: wind from the north-east, sea rough, two ships passing.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The light "
    "reactions happen in the thylakoid membranes, where chlorophyll absorbs mostly red and blue "
    "light; the Calvin cycle, in the stroma, fixes carbon with the help of the enzyme RuBisCO.",
    "Quarterly results: revenue rose 8.4% to $1.27 billion, operating margin was 14.9%, and the "
    "company repurchased 3,250,000 shares. Guidance for the full year (fiscal 2025) is unchanged "
    "at $5.10 to $5.35 per share.",
    "\"Are you coming with us?\" asked Mara.\n\"Only as far as the bridge,\" said Tom. \"After "
    "that the road is too steep for the cart, and I promised my mother I would be home by dark.\"",
    "Shopping list:\n1. flour (2 kg)\n2. eggs, a dozen\n3. butter\n4. apples - the green ones\n"
    "5. coffee beans\nRemember: the shop closes at 18:30 on Saturdays.",
    "def mean(values):\n    \"\"\"Return the arithmetic mean of a non-empty list.\"\"\"\n"
    "    if not values:\n        raise ValueError(\"empty list\")\n    return sum(values) / len(values)\n\n"
    "print(mean([3, 5, 7, 11]))  # 6.5",
    "In 1969 the first crewed landing on the Moon took place; in 1989 the Berlin Wall fell; "
    "water boils at 100 degrees Celsius at sea level, and the speed of light is about "
    "299,792 kilometres per second.",
    "Les enfants jouaient dans le jardin pendant que leur grand-mère préparait une tarte aux "
    "pommes. Der Zug nach München fährt um halb acht. El mercado abre temprano los domingos.",
]

CHATS = [
    ("What is the boiling point of water in Fahrenheit?",
     "At sea level, water boils at 212 degrees Fahrenheit (100 degrees Celsius)."),
    ("Write a haiku about autumn.",
     "Red leaves drift and fall,\ncool wind hums through empty trees,\nthe year exhales slow."),
    ("Give me three tips for learning a new language.",
     "1. Practise a little every day.\n2. Speak early, even with mistakes.\n"
     "3. Read and listen to things you enjoy."),
    ("How do I reverse a list in Python?",
     "Use `items.reverse()` to reverse it in place, or `items[::-1]` for a reversed copy."),
]


def calibration_sequences(tokenizer=None) -> list[str]:
    """The calibration texts, each run as its own sequence; chat turns templated if possible."""
    texts = list(PROSE)
    for question, answer in CHATS:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if tokenizer is not None and tokenizer.chat_templates:
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
        else:
            texts.append(f"{question}\n{answer}")
    return texts
