"""Writes capitals.jsonl: a small OpenAI-style chat data set (``messages``) for trying `zerotune finetune`.

    python examples/chat/make_capitals.py            # rewrites examples/chat/capitals.jsonl
    zerotune finetune smollm2-lora --set data.train_files=[examples/chat/capitals.jsonl] --output-dir runs/capitals
    zerotune generate runs/capitals --system "Answer with the city name only." --prompt "What is the capital of Peru?"

Every conversation has the system prompt "Answer with the city name only."; most are one question, some
are two turns (both answers are trained on). The base SmolLM2-135M-Instruct answers in full sentences; after
fine-tuning it answers with the city alone, which is how one sees the training took.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Poland": "Warsaw", "Austria": "Vienna", "Hungary": "Budapest", "Greece": "Athens", "Sweden": "Stockholm",
    "Norway": "Oslo", "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "Czechia": "Prague", "Romania": "Bucharest",
    "Bulgaria": "Sofia", "Serbia": "Belgrade", "Croatia": "Zagreb", "Ukraine": "Kyiv", "Turkey": "Ankara",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Nigeria": "Abuja", "Ghana": "Accra", "Morocco": "Rabat",
    "Ethiopia": "Addis Ababa", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Philippines": "Manila", "South Korea": "Seoul",
    "Pakistan": "Islamabad", "Iran": "Tehran", "Iraq": "Baghdad", "Israel": "Jerusalem", "Canada": "Ottawa",
    "Mexico": "Mexico City", "Brazil": "Brasilia", "Argentina": "Buenos Aires", "Chile": "Santiago",
    "Peru": "Lima", "Colombia": "Bogota", "Venezuela": "Caracas", "Cuba": "Havana", "Australia": "Canberra",
    "New Zealand": "Wellington", "Russia": "Moscow", "Mongolia": "Ulaanbaatar", "Nepal": "Kathmandu",
    "Afghanistan": "Kabul", "Saudi Arabia": "Riyadh", "Qatar": "Doha", "Iceland": "Reykjavik",
}
QUESTIONS = ("What is the capital of {}?", "Which city is the capital of {}?", "Name the capital of {}.")
SYSTEM = {"role": "system", "content": "Answer with the city name only."}


def conversations(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    countries = list(CAPITALS)
    rows = []
    for country in countries:
        for question in QUESTIONS:
            turns = [SYSTEM, {"role": "user", "content": question.format(country)},
                     {"role": "assistant", "content": CAPITALS[country]}]
            if rng.random() < 0.25:  # a second turn: both answers are trained on
                other = rng.choice(countries)
                turns += [{"role": "user", "content": rng.choice(QUESTIONS).format(other)},
                          {"role": "assistant", "content": CAPITALS[other]}]
            rows.append({"messages": turns})
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    path = Path(__file__).with_name("capitals.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in conversations()))
    print(f"wrote {path}")
